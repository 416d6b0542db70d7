"""pytest plugin: GPU memory budgets, GPU leak checks and autograd-graph leak checks.

Installed with memviz (entry point ``pytest11``); nothing to enable::

    @pytest.mark.memviz(peak="2 GiB")     # fail if the test's GPU peak exceeds 2 GiB
    @pytest.mark.memviz(leaks=True)       # fail if GPU memory it allocated outlives it
    @pytest.mark.memviz(leaks=True, own_code=True)  # ... counting only the test file's own lines
    @pytest.mark.memviz(leaks=True, filter_fn=lambda a: a.size > 1 << 20)  # you choose what counts
    @pytest.mark.no_graph_leak            # fail if an autograd graph made in it stays reachable

    def test_x(memviz_tracker): ...       # the test's memviz Tracker

    pytest --memviz                       # track every test, print a table at the end
    pytest --memviz-report=mem.json       # ... and write per-test peaks and leaks as JSON

``peak=`` and ``leaks=`` need GPU capture. Where it is unavailable (no GPU,
no usable CUPTI, another profiler holding CUPTI) the test still runs and passes
or fails on its own assertions; only those memviz checks are left out, and the
terminal summary (and ``--memviz-report``) lists them with the reason and what
to do. ``no_graph_leak`` needs only PyTorch and works on CPU tensors.

Which leaks count (``leaks=``): by default every allocation made during the
test's call that is still alive after it. ``own_code=True`` (or the ini
setting ``memviz_own_code = true`` for every marked test) counts only those
whose user frame (``Allocation.user_frame``, the innermost non-library line)
lies in the test's own file, so caches that other modules fill do not fail the
test; ``filter_fn=`` (a function of a memviz ``Allocation``, returning True to
count it) decides instead of either.

How it measures: a tracker runs from the start of the test's setup to the end
of its call. Before it starts, PyTorch's cached blocks are returned to the
driver, so the test's tensors show up as driver allocations; the peak is the
driver-level peak (with PyTorch's caching allocator: the memory its pool took).
After the call, ``gc.collect()`` runs and PyTorch's cache is emptied again;
device memory allocated during the call that is still live is a leak.

A test with ``peak=``/``leaks=`` (or any test under ``--memviz``) that starts
its own ``memviz.track()`` gets a tracker nested in the plugin's (its own
window of the same capture); the ``memviz_tracker`` fixture gives the
plugin's tracker itself.

Cost when no marker or option is used: nothing per test (the per-test hooks
are registered only when a collected test asks for them).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import pytest

__all__ = ["memviz_tracker"]

_RUNNER = "memviz-runner"
_NO_CAPTURE_TODO = ("run them on a machine with an NVIDIA GPU and CUPTI (or point MEMVIZ_CUPTI_LIBRARY "
                    "at a libcupti) to check their GPU memory; the tests' own assertions ran here")
_FAILED_FIRST = ("the test failed, so memviz did not judge its memory", "fix the test's own failure first")
_SKIPPED_ITSELF = ("the test skipped itself, so memviz did not judge its memory",
                   "nothing, unless the test should not skip here")
_PLAN = pytest.StashKey["_Plan"]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("memviz", "GPU memory (memviz)")
    group.addoption("--memviz", action="store_true", default=False,
                    help="track every test's GPU memory with memviz and print a table of peaks "
                         "and leaks at the end")
    group.addoption("--memviz-report", metavar="PATH", default=None,
                    help="write every test's GPU peak, top lines and leaks to PATH as JSON "
                         "(tracks every test, like --memviz)")
    parser.addini("memviz_own_code", type="bool", default=False,
                  help="memviz: count a @pytest.mark.memviz(leaks=...) leak only when the test file's own "
                       "lines allocated it (the marker's own_code= and filter_fn= override this)")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "memviz(peak=None, leaks=False, own_code=False, filter_fn=None): fail the test if "
                   "its GPU peak exceeds `peak` (e.g. '2 GiB') or if GPU memory it allocated is still "
                   "alive after it returns (leaks=True, or a size to tolerate). own_code=True counts only "
                   "leaks made by the test file's own lines; filter_fn(allocation) -> bool decides "
                   "instead. Without GPU capture the test still runs and these checks are listed as not "
                   "run, with the reason")
    config.addinivalue_line(
        "markers", "no_graph_leak: fail the test if an autograd graph created inside it is still "
                   "reachable after it returns (works on CPU; needs PyTorch)")
    if config.getoption("memviz", False) or config.getoption("memviz_report", None):
        config.pluginmanager.register(_Runner(config, every_test=True), _RUNNER)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    if config.pluginmanager.has_plugin(_RUNNER):
        return
    for item in items:
        if item.get_closest_marker("memviz") is not None or item.get_closest_marker("no_graph_leak") is not None:
            config.pluginmanager.register(_Runner(config, every_test=False), _RUNNER)
            return


@pytest.fixture
def memviz_tracker(request):
    """The memviz Tracker of this test: the one a memviz marker or --memviz
    started, else a new ``memviz.track()`` running for the test."""
    plan = request.node.stash.get(_PLAN, None)
    if plan is not None and plan.tracker is not None:
        yield plan.tracker
        return
    from memviz.tracker import track

    with track() as t:
        yield t


class _Plan:
    """What the plugin does for one test, and what it found."""

    def __init__(self) -> None:
        self.peak: Optional[int] = None
        self.peak_text = ""
        self.leaks: Optional[int] = None  # bytes tolerated; None: no leak check
        self.leaks_text = ""
        self.own_code = False
        self.filter_fn: Optional[Callable[[Any], bool]] = None
        self.graph = False
        self.record = False
        self.where = ""  # "test_x.py:12": the marker's line (or the test's)
        self.test_files: frozenset = frozenset()
        self.tracker = None
        self.call_start_ns = 0
        self.seq = None
        self.recorder = None
        self.saved_mark = 0
        self.function = None
        self.failures: List[str] = []
        self.checks_run: List[str] = []
        self.checks_skipped: List[Dict[str, str]] = []
        self.gpu_skipped = False
        self.not_judged = _FAILED_FIRST  # why the checks were not judged, when the call did not pass
        self.result: Dict[str, Any] = {}

    @property
    def gpu(self) -> bool:
        return self.peak is not None or self.leaks is not None

    def gpu_checks(self) -> List[str]:
        """The GPU checks asked for, as written in the marker."""
        out = []
        if self.peak is not None:
            out.append(f"peak={self.peak_text}")
        if self.leaks is not None:
            out.append(f"leaks={self.leaks_text}")
        return out

    def marker_text(self) -> str:
        """The marker as written, and its line: ``@pytest.mark.memviz(peak='1 GiB') at t.py:3``."""
        parts = self.gpu_checks()
        if self.leaks is not None and self.filter_fn is not None:
            parts.append("filter_fn=...")
        elif self.leaks is not None and self.own_code:
            parts.append("own_code=True")
        return f"@pytest.mark.memviz({', '.join(parts)}) at {self.where}"

    def skip(self, checks: List[str], reason: str, what_to_do: str) -> None:
        """Leave ``checks`` out (the test itself still runs), saying why."""
        for check in checks:
            self.checks_skipped.append({"check": check, "where": self.where,
                                        "reason": reason, "what_to_do": what_to_do})

    def skip_gpu(self, reason: str, what_to_do: str) -> None:
        if not self.gpu_skipped:
            self.gpu_skipped = True
            self.skip(self.gpu_checks(), reason, what_to_do)


def _marker_where(item) -> str:
    """``file:line`` of the test's memviz marker, else of the test itself
    (relative to pytest's rootdir, as pytest names tests)."""
    import linecache

    rel, line0 = item.location[0], item.location[1]
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is None or line0 is None:
        return f"{rel}:{(line0 or 0) + 1}" if line0 is not None else rel
    first = code.co_firstlineno  # the first decorator's line (Python 3.8+)
    for n in range(first, first + 50):
        text = linecache.getline(code.co_filename, n).strip()
        if "mark.memviz" in text:
            return f"{rel}:{n}"
        if not text or text.startswith(("def ", "async def ")):
            break
    return f"{rel}:{line0 + 1}"


def _test_files(item) -> frozenset:
    """Real paths of the test's own code: its file (and where its function is defined)."""
    import os

    files = set()
    for name in (str(getattr(item, "path", "") or ""),
                 getattr(getattr(getattr(item, "function", None), "__code__", None), "co_filename", "")):
        if name and not name.startswith("<"):
            files.add(os.path.realpath(name))
    return frozenset(files)


_KEYWORDS = ("peak", "leaks", "own_code", "filter_fn")


def _marker_plan(item, own_code_default: bool = False) -> _Plan:
    from memviz._units import parse_size

    plan = _Plan()
    m = item.get_closest_marker("memviz")
    if m is not None:
        plan.where = _marker_where(item)
        at = f" (marker at {plan.where})"

        def mistake(text: str) -> None:
            pytest.fail(text, pytrace=False)

        usage = ("use @pytest.mark.memviz(peak='2 GiB') and/or @pytest.mark.memviz(leaks=True) "
                 "(with own_code=True or filter_fn=... to choose which leaks count)")
        unknown = sorted(set(m.kwargs) - set(_KEYWORDS))
        if m.args or unknown:
            mistake(f"@pytest.mark.memviz takes the keywords peak=, leaks=, own_code= and filter_fn= "
                    f"only, got {', '.join([repr(a) for a in m.args] + [k + '=' for k in unknown])}{at}; "
                    f"{usage}.")
        if m.kwargs.get("peak") is not None:
            try:
                plan.peak = parse_size(m.kwargs["peak"])
            except (TypeError, ValueError) as e:
                mistake(f"@pytest.mark.memviz(peak={m.kwargs['peak']!r}): {e}{at}. Write the budget as "
                        f"a size such as peak='2 GiB' or a number of bytes.")
            plan.peak_text = repr(m.kwargs["peak"])
        leaks = m.kwargs.get("leaks", False)
        if leaks is True:
            plan.leaks, plan.leaks_text = 0, "True"
        elif leaks not in (False, None):
            try:
                plan.leaks = parse_size(leaks)
            except (TypeError, ValueError) as e:
                mistake(f"@pytest.mark.memviz(leaks={leaks!r}) takes True or a size to tolerate "
                        f"(e.g. '1 MiB'): {e}{at}.")
            plan.leaks_text = repr(leaks)
        own_code = m.kwargs.get("own_code", None)
        filter_fn = m.kwargs.get("filter_fn", None)
        if own_code is not None and not isinstance(own_code, bool):
            mistake(f"@pytest.mark.memviz: own_code= takes True or False, got {own_code!r}{at}; "
                    f"own_code=True counts only leaks made by the test file's own lines.")
        if filter_fn is not None and not callable(filter_fn):
            mistake(f"@pytest.mark.memviz: filter_fn= takes a function of a memviz Allocation returning "
                    f"True to count it as a leak, got {filter_fn!r}{at}; e.g. "
                    f"filter_fn=lambda a: a.size >= 1 << 20.")
        if (own_code is not None or filter_fn is not None) and plan.leaks is None:
            mistake(f"@pytest.mark.memviz: own_code= and filter_fn= choose which leaks count; add "
                    f"leaks=True{at}, or drop them.")
        if own_code is not None and filter_fn is not None:
            mistake(f"@pytest.mark.memviz: filter_fn= decides alone which leaks count, so own_code= has "
                    f"no effect beside it{at}; drop own_code=, and test "
                    f"a.user_frame.filename in filter_fn if you need the file.")
        plan.own_code = own_code if own_code is not None else own_code_default
        plan.filter_fn = filter_fn
        if plan.peak is None and plan.leaks is None:
            mistake(f"@pytest.mark.memviz without peak= or leaks= checks nothing{at}; {usage}.")
        plan.test_files = _test_files(item)
    plan.graph = item.get_closest_marker("no_graph_leak") is not None
    return plan


def _torch_release() -> None:
    """Return PyTorch's cached device (and pinned host) blocks to the driver."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        host = getattr(torch._C, "_host_emptyCache", None)
        if host is not None:
            host()
    except Exception:  # noqa: BLE001 - measuring must not break the test
        pass


class _Runner:
    """The per-test hooks; registered only when a test or an option asks."""

    not_run: Any = ()  # (the instance's list, from __init__)
    _capture_todo = _NO_CAPTURE_TODO

    def __init__(self, config, every_test: bool) -> None:
        self.config = config
        self.every_test = every_test
        self.results: List[Dict[str, Any]] = []
        self.not_run: List[Dict[str, str]] = []  # every test's checks_skipped, with its nodeid
        self._capture: Optional[tuple] = None
        self._capture_todo = _NO_CAPTURE_TODO

    # -- capture availability ------------------------------------------------

    def capture(self) -> tuple:
        """(available, reason) of GPU capture, asked once per session."""
        if self._capture is None:
            import os

            from memviz.capture import cupti as _capture
            from memviz._errors import CaptureUnavailable

            present, why = _capture.gpu_present()
            if not os.environ.get(_capture.ENV_LIBRARY) and not present:
                self._capture = (False, why)
            else:
                try:
                    _capture.load()
                    self._capture = (True, "")
                except CaptureUnavailable as e:
                    self._capture = (False, e.reason)
                    self._capture_todo = e.hint
                except Exception as e:  # noqa: BLE001
                    self._capture = (False, f"{type(e).__name__}: {e}")
        return self._capture

    def pytest_report_header(self, config):
        if self.every_test:
            ok, why = self.capture()
            return "memviz: tracking every test's GPU memory" if ok else \
                (f"memviz: GPU capture unavailable ({why}); tests run, per-test GPU numbers will be "
                 f"empty. What to do: {self._capture_todo}")
        return None

    # -- setup: decide, start ---------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        plan = _marker_plan(item, own_code_default=bool(self.config.getini("memviz_own_code")))
        plan.record = self.every_test
        if not (plan.gpu or plan.graph or plan.record):
            return
        item.stash[_PLAN] = plan
        if plan.gpu and not self.capture()[0]:
            plan.skip_gpu(f"GPU capture is unavailable here: {self.capture()[1]}", self._capture_todo)
        if plan.graph:
            try:
                import torch  # noqa: F401
            except ImportError:
                pytest.skip("memviz: @pytest.mark.no_graph_leak needs PyTorch, which is not installed "
                            "(pip install torch).")
        if (plan.gpu and not plan.gpu_skipped) or (plan.record and self.capture()[0]):
            self._start(item, plan)

    def _start(self, item, plan: _Plan) -> None:
        from memviz._errors import AlreadyTracking, CaptureConflict, CaptureUnavailable
        from memviz.tracker import track

        _torch_release()
        try:
            # No PyTorch integration: its categories cost a heap scan per snapshot,
            # and budgets and leaks need only the lines.
            plan.tracker = track(torch=False).start()
            if plan.gpu and not plan.tracker.gpu_enabled:
                why = plan.tracker.gpu_off_reason
                plan.tracker.stop()
                plan.tracker = None
                plan.skip_gpu(f"the test's tracker does not capture GPU allocations: {why}",
                              "let the tracker memviz starts for the test capture: stop a tracker started "
                              "with gpu=False around the tests, or run them in a process not fork()ed "
                              "from one that tracks")
        except AlreadyTracking as e:
            if plan.gpu:
                pytest.fail(f"memviz: {', '.join(plan.gpu_checks())} (marker at {plan.where}) needs its "
                            f"own tracker, but {e} What to do: stop the other tracker before this test, "
                            f"or drop the marker and check the other tracker's numbers directly.",
                            pytrace=False)
        except CaptureUnavailable as e:
            plan.skip_gpu(f"memviz cannot capture GPU allocations: {e.reason.rstrip('.')}", e.hint)
        except CaptureConflict as e:
            reason, _, todo = str(e).partition(" What to do: ")
            plan.skip_gpu(reason.rstrip(), todo or "stop the other profiler before the test")

    # -- call: measure and check ---------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        plan = item.stash.get(_PLAN, None)
        if plan is None:
            yield
            return
        plan.call_start_ns = time.monotonic_ns()
        plan.function = getattr(item, "function", None)
        if plan.graph:
            from memviz.torch.graph import GraphRecorder

            plan.seq = GraphRecorder.autograd_mark()
            plan.recorder = GraphRecorder().start()
            plan.saved_mark = plan.recorder.mark()
        outcome = yield
        passed = outcome.excinfo is None
        plan.not_judged = _SKIPPED_ITSELF if not passed and issubclass(
            outcome.excinfo[0], pytest.skip.Exception) else _FAILED_FIRST
        if plan.recorder is not None:
            plan.recorder.stop()
        if (plan.tracker is not None and plan.tracker.running) or (plan.graph and passed):
            gc.collect()
        if plan.tracker is not None and plan.tracker.running:
            _torch_release()
            self._gpu_checks(plan, passed)
        elif plan.gpu and not plan.gpu_skipped:
            plan.skip_gpu("memviz's tracker for this test was stopped before the test returned",
                          "leave the memviz_tracker fixture's tracker running; start your own "
                          "memviz.track() inside the test to measure a part of it")
        if plan.graph and passed:
            plan.checks_run.append("no_graph_leak")
            self._graph_check(plan)
        elif plan.graph:
            plan.skip(["no_graph_leak"], *plan.not_judged)

    def _gpu_checks(self, plan: _Plan, passed: bool) -> None:
        import os

        from memviz.model.snapshot import Snapshot
        from memviz._units import format_size

        t = plan.tracker
        live = [a for a in t.snapshot_raw().allocations
                if a.timestamp_ns >= plan.call_start_ns and a.device >= 0 and a.kind != "static"]
        t.stop()
        totals = t.totals()
        devs = {d: v["peak"] for d, v in totals.items() if d >= 0}
        dev = max(devs, key=devs.get) if devs else None
        peak = devs.get(dev, 0) if dev is not None else 0
        top = t.peak_snapshot(dev).statistics("lineno")[:5] if dev is not None else []
        counted, ignored, filter_error = self._which_leaks(plan, live)

        def by_line(allocs):
            return Snapshot(allocs, frame_filter=t.frame_filter).statistics("lineno")[:5] if allocs else []

        leak_stats, ignored_stats = by_line(counted), by_line(ignored)
        leaked = sum(a.size for a in counted)
        rule = ("filter_fn" if plan.filter_fn is not None else "own_code" if plan.own_code else "all") \
            if plan.leaks is not None else "all"
        plan.result = {"peak_bytes": peak, "peak_device": dev, "leaked_bytes": leaked,
                       "leaked_count": len(counted),
                       "top_lines": [{"line": str(s.key), "bytes": s.size} for s in top],
                       "leak_lines": [{"line": str(s.key), "bytes": s.size} for s in leak_stats],
                       "leak_filter": rule,
                       "not_counted_bytes": sum(a.size for a in ignored),
                       "not_counted_count": len(ignored),
                       "not_counted_lines": [{"line": str(s.key), "bytes": s.size} for s in ignored_stats]}
        if not passed:
            plan.skip(plan.gpu_checks(), *plan.not_judged)
            return
        plan.checks_run.extend(plan.gpu_checks())
        marker = plan.marker_text()
        if plan.peak is not None and peak > plan.peak:
            lines = "\n".join(f"    {s}" for s in top) or "    (no Python line recorded)"
            plan.failures.append(
                f"memviz: GPU peak {format_size(peak)} on cuda:{dev} exceeds the budget of "
                f"{format_size(plan.peak)} ({marker}).\n"
                f"  Top lines at the peak:\n{lines}\n"
                f"  What to do: make the test use less GPU memory at those lines (smaller inputs, "
                f"free temporaries sooner) or raise its budget at {plan.where}.")
        if filter_error is not None:
            plan.failures.append(filter_error)
        elif plan.leaks is not None and leaked > plan.leaks:
            lines = "\n".join(f"    {s}" for s in leak_stats)
            tol = f", {format_size(plan.leaks)} tolerated" if plan.leaks else ""
            counted_by = {"filter_fn": "counted by filter_fn",
                          "own_code": "counting what the test file's own lines allocated",
                          "all": "counting every allocation made during the test"}[rule]
            text = (f"memviz: the test left {format_size(leaked)} of GPU memory it allocated alive after "
                    f"it returned and gc ran ({len(counted)} allocation(s); {counted_by}{tol}; "
                    f"{marker}).\n"
                    f"  Still alive, by line:\n{lines}\n")
            if ignored:
                why = {"filter_fn": "filter_fn returned False",
                       "own_code": "made outside " + (" and ".join(sorted(
                           {os.path.basename(f) for f in plan.test_files})) or "the test file")}[rule]
                text += (f"  Not counted ({why}): {format_size(sum(a.size for a in ignored))} in "
                         f"{len(ignored)} allocation(s), by line:\n"
                         + "\n".join(f"    {s}" for s in ignored_stats) + "\n")
            text += ("  What to do: drop the references that keep it (module globals, caches, class "
                     "attributes) or free it before the test ends")
            if rule == "own_code" and ignored:
                text += ("; if memory made outside the test file is the test's doing too, count it "
                         f"with own_code=False or choose with filter_fn= at {plan.where}")
            elif rule == "filter_fn":
                text += f"; or make filter_fn (at {plan.where}) return False for memory that may stay"
            else:
                text += (f"; if it is a cache another module keeps on purpose, count only the test "
                         f"file's own lines with own_code=True, tolerate a size (leaks='1 MiB') or "
                         f"choose with filter_fn= at {plan.where}")
            plan.failures.append(text + ".")

    @staticmethod
    def _which_leaks(plan: _Plan, live: list) -> tuple:
        """(counted, not counted, error message or None) of the allocations still alive."""
        import os

        from memviz._units import format_size

        if plan.leaks is None:
            return live, [], None
        if plan.filter_fn is not None:
            counted, ignored = [], []
            for a in live:
                try:
                    verdict = plan.filter_fn(a)
                    problem = None if isinstance(verdict, bool) else f"returned {verdict!r}"
                except Exception as e:  # noqa: BLE001 - the user's function: report it, don't crash
                    verdict, problem = False, f"raised {type(e).__name__}: {e}"
                if problem is not None:
                    return live, [], (
                        f"memviz: the leak check's filter_fn {problem} for the allocation made at "
                        f"{a.traceback} ({format_size(a.size)}; marker at {plan.where}).\n"
                        f"  What to do: make filter_fn take a memviz Allocation (a.size, a.user_frame, "
                        f"a.traceback, a.kind) and return True to count it as a leak, False to ignore it.")
                (counted if verdict else ignored).append(a)
            return counted, ignored, None
        if not plan.own_code:
            return live, [], None
        counted, ignored = [], []
        real: Dict[str, str] = {}
        for a in live:
            frame = a.user_frame
            if frame is None:  # no Python frame (autograd's threads): memviz cannot tell, so it counts
                counted.append(a)
                continue
            path = real.get(frame.filename)
            if path is None:
                path = real[frame.filename] = os.path.realpath(frame.filename)
            (counted if path in plan.test_files else ignored).append(a)
        return counted, ignored, None

    def _graph_check(self, plan: _Plan) -> None:
        from memviz._units import format_size
        from memviz.torch.graph import GraphRecorder, holders

        roots = GraphRecorder.roots_since(plan.seq, limit=1000)
        if not roots:
            plan.result["graph_leak"] = False
            return
        saved = plan.recorder.resident_since(plan.saved_mark)
        nbytes = sum(r.nbytes for r in saved)
        code = getattr(getattr(plan, "function", None), "__code__", None)
        body = [ln for _, _, ln in code.co_lines() if ln] if code is not None else []
        near = (code.co_filename, max(body)) if body else None  # a line inside the test
        found = holders(roots[-1], exclude=[roots], near=near)
        found.sort(key=lambda h: h.location is None)
        del roots
        by_line: Dict[str, int] = {}
        for r in saved:
            key = f"{r.line.filename}:{r.line.lineno}" if r.line else "<no Python frame>"
            by_line[key] = by_line.get(key, 0) + r.nbytes
        holder = found[0] if found else None
        where = (f"held by {holder.description}" + (f", kept at {holder.location}" if holder.location else "")
                 if holder else "held by an object memviz could not name")
        saved_lines = "\n".join(f"    {loc}: {format_size(b)}" for loc, b in
                                sorted(by_line.items(), key=lambda kv: -kv[1])[:5])
        plan.result.update(graph_leak=True, graph_bytes=nbytes,
                           graph_holder=holder.description if holder else None,
                           graph_kept_at=holder.location if holder else None)
        plan.failures.append(
            f"memviz: an autograd graph created in this test is still reachable after it returned: "
            f"{where}; it holds {format_size(nbytes)} of tensors saved for backward.\n"
            + (f"  Saved by:\n{saved_lines}\n" if saved_lines else "")
            + "  What to do: keep loss.item() or loss.detach() instead of the tensor (and evaluate "
              "under torch.no_grad()), so the graph is freed.")

    # -- reporting -----------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when != "call":
            if call.when == "teardown":
                self._finish(item, outcome.get_result())
            return
        plan = item.stash.get(_PLAN, None)
        if plan is not None and plan.failures:
            rep = outcome.get_result()
            rep.outcome = "failed"
            from memviz._units import escape_surrogates  # file names that are not UTF-8
            rep.longrepr = escape_surrogates("\n\n".join(plan.failures))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item) -> None:
        plan = item.stash.get(_PLAN, None)
        if plan is not None and plan.tracker is not None and plan.tracker.running:
            plan.tracker.stop()  # setup failed before the call

    def _finish(self, item, rep) -> None:
        plan = item.stash.get(_PLAN, None)
        if plan is None:
            return
        for skipped in plan.checks_skipped:
            self.not_run.append(dict(skipped, nodeid=item.nodeid))
        if plan.record:
            row = {"nodeid": item.nodeid, "failed_checks": len(plan.failures),
                   "checks_run": list(plan.checks_run), "checks_skipped": list(plan.checks_skipped)}
            row.update(plan.result)
            self.results.append(row)
        plan.tracker = plan.recorder = plan.function = plan.filter_fn = None

    def pytest_terminal_summary(self, terminalreporter) -> None:
        from memviz._units import escape_surrogates, format_size

        def write_line(text: str) -> None:  # test ids and file names that are not UTF-8
            terminalreporter.write_line(escape_surrogates(text))

        self._summary_not_run(terminalreporter, write_line)
        if not self.every_test:
            return
        terminalreporter.write_sep("=", "memviz: GPU memory per test")
        ok, why = self.capture()
        if not ok:
            write_line(f"GPU capture was unavailable: {why}")
            write_line(f"What to do: {self._capture_todo}")
            return
        rows = sorted((r for r in self.results if "peak_bytes" in r), key=lambda r: -r["peak_bytes"])
        write_line(f"{'peak':>10}  {'leaked':>10}  test (top line at the peak)")
        for r in rows[:20]:
            top = f"  ({r['top_lines'][0]['line']})" if r.get("top_lines") else ""
            write_line(f"{format_size(r['peak_bytes']):>10}  {format_size(r['leaked_bytes']):>10}  "
                       f"{r['nodeid']}{top}")
        if len(rows) > 20:
            write_line(f"... {len(rows) - 20} more tests (see --memviz-report=PATH for all)")
        path = self.config.getoption("memviz_report", None)
        if path:
            write_line(f"memviz: per-test report written to {path}")

    def _summary_not_run(self, terminalreporter, write_line) -> None:
        """The tests whose memviz checks were left out, grouped by why."""
        # A failed (or self-skipped) test's checks were not judged either (the report says so),
        # but its own outcome is what to read: the summary lists the checks this run cannot give.
        not_run = [s for s in self.not_run
                   if (s["reason"], s["what_to_do"]) not in (_FAILED_FIRST, _SKIPPED_ITSELF)]
        if not not_run:
            return
        groups: Dict[tuple, Dict[tuple, List[str]]] = {}
        for s in not_run:
            tests = groups.setdefault((s["reason"], s["what_to_do"]), {})
            tests.setdefault((s["nodeid"], s["where"]), []).append(s["check"])
        terminalreporter.write_sep("=", "memviz: checks not run (the tests themselves ran)")
        for (reason, todo), tests in groups.items():
            for (nodeid, where), checks in list(tests.items())[:20]:
                write_line(f"{nodeid}: {', '.join(checks)} (marker at {where})")
            if len(tests) > 20:
                write_line(f"... and {len(tests) - 20} more tests (see --memviz-report=PATH for all)")
            write_line(f"  why: {reason}")
            write_line(f"  what to do: {todo}")

    def pytest_sessionfinish(self, session) -> None:
        path = self.config.getoption("memviz_report", None)
        if not path:
            return
        ok, why = self.capture()
        data = {"capture_available": ok, "capture_reason": why or None, "tests": self.results}
        from memviz._errors import OutputError
        from memviz._outputs import write_output

        try:  # through a temporary file renamed over the path
            write_output(path, json.dumps(data, indent=1), "the --memviz-report file")
        except OutputError as e:
            raise pytest.UsageError(f"memviz: cannot write --memviz-report={path!r} ({e.reason}); "
                                    f"pass a path in a writable directory") from e
