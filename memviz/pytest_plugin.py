"""pytest plugin: GPU memory budgets, GPU leak checks and autograd-graph leak checks.

Installed with memviz (entry point ``pytest11``); nothing to enable::

    @pytest.mark.memviz(peak="2 GiB")     # fail if the test's GPU peak exceeds 2 GiB
    @pytest.mark.memviz(leaks=True)       # fail if GPU memory it allocated outlives it
    @pytest.mark.no_graph_leak            # fail if an autograd graph made in it stays reachable

    def test_x(memviz_tracker): ...       # the test's memviz Tracker

    pytest --memviz                       # track every test, print a table at the end
    pytest --memviz-report=mem.json       # ... and write per-test peaks and leaks as JSON

``peak=`` and ``leaks=`` need GPU capture: where it is unavailable (no GPU,
no usable CUPTI) those tests are *skipped* with the reason, never passed.
``no_graph_leak`` needs only PyTorch and works on CPU tensors.

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
from typing import Any, Dict, List, Optional

import pytest

__all__ = ["memviz_tracker"]

_RUNNER = "memviz-runner"
_PLAN = pytest.StashKey["_Plan"]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("memviz", "GPU memory (memviz)")
    group.addoption("--memviz", action="store_true", default=False,
                    help="track every test's GPU memory with memviz and print a table of peaks "
                         "and leaks at the end")
    group.addoption("--memviz-report", metavar="PATH", default=None,
                    help="write every test's GPU peak, top lines and leaks to PATH as JSON "
                         "(tracks every test, like --memviz)")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "memviz(peak=None, leaks=False): fail the test if its GPU peak exceeds `peak` "
                   "(e.g. '2 GiB') or if GPU memory it allocated is still alive after it returns "
                   "(leaks=True, or a size to tolerate); skipped with the reason where memviz cannot "
                   "capture GPU allocations")
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
    import memviz

    with memviz.track() as t:
        yield t


class _Plan:
    """What the plugin does for one test, and what it found."""

    def __init__(self) -> None:
        self.peak: Optional[int] = None
        self.peak_text = ""
        self.leaks: Optional[int] = None  # bytes tolerated; None: no leak check
        self.graph = False
        self.record = False
        self.tracker = None
        self.call_start_ns = 0
        self.seq = None
        self.recorder = None
        self.saved_mark = 0
        self.function = None
        self.failures: List[str] = []
        self.result: Dict[str, Any] = {}

    @property
    def gpu(self) -> bool:
        return self.peak is not None or self.leaks is not None


def _marker_plan(item) -> _Plan:
    from ._units import parse_size

    plan = _Plan()
    m = item.get_closest_marker("memviz")
    if m is not None:
        usage = "use @pytest.mark.memviz(peak='2 GiB') and/or @pytest.mark.memviz(leaks=True)"
        unknown = sorted(set(m.kwargs) - {"peak", "leaks"})
        if m.args or unknown:
            pytest.fail(f"@pytest.mark.memviz takes the keywords peak= and leaks= only, got "
                        f"{', '.join([repr(a) for a in m.args] + [k + '=' for k in unknown])}; {usage}.",
                        pytrace=False)
        if m.kwargs.get("peak") is not None:
            try:
                plan.peak = parse_size(m.kwargs["peak"])
            except (TypeError, ValueError) as e:
                pytest.fail(f"@pytest.mark.memviz(peak={m.kwargs['peak']!r}): {e}", pytrace=False)
            plan.peak_text = repr(m.kwargs["peak"])
        leaks = m.kwargs.get("leaks", False)
        if leaks is True:
            plan.leaks = 0
        elif leaks not in (False, None):
            try:
                plan.leaks = parse_size(leaks)
            except (TypeError, ValueError) as e:
                pytest.fail(f"@pytest.mark.memviz(leaks={leaks!r}) takes True or a size to tolerate "
                            f"(e.g. '1 MiB'): {e}", pytrace=False)
        if plan.peak is None and plan.leaks is None:
            pytest.fail(f"@pytest.mark.memviz without peak= or leaks= checks nothing; {usage}.",
                        pytrace=False)
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

    def __init__(self, config, every_test: bool) -> None:
        self.config = config
        self.every_test = every_test
        self.results: List[Dict[str, Any]] = []
        self._capture: Optional[tuple] = None

    # -- capture availability ------------------------------------------------

    def capture(self) -> tuple:
        """(available, reason) of GPU capture, asked once per session."""
        if self._capture is None:
            import os

            from . import _capture
            from ._errors import CaptureUnavailable

            present, why = _capture.gpu_present()
            if not os.environ.get(_capture.ENV_LIBRARY) and not present:
                self._capture = (False, why)
            else:
                try:
                    _capture.load()
                    self._capture = (True, "")
                except CaptureUnavailable as e:
                    self._capture = (False, e.reason)
                except Exception as e:  # noqa: BLE001
                    self._capture = (False, f"{type(e).__name__}: {e}")
        return self._capture

    def pytest_report_header(self, config):
        if self.every_test:
            ok, why = self.capture()
            return "memviz: tracking every test's GPU memory" if ok else \
                f"memviz: GPU capture unavailable ({why}); per-test GPU numbers will be empty"
        return None

    # -- setup: decide, skip, start ---------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        plan = _marker_plan(item)
        plan.record = self.every_test
        if not (plan.gpu or plan.graph or plan.record):
            return
        item.stash[_PLAN] = plan
        if plan.gpu and not self.capture()[0]:
            pytest.skip(f"memviz: this test's GPU memory check ({self._what(plan)}) needs GPU capture, "
                        f"which is unavailable here: {self.capture()[1]}. Run it on a machine with an "
                        f"NVIDIA GPU and CUPTI, or set MEMVIZ_CUPTI_LIBRARY.")
        if plan.graph:
            try:
                import torch  # noqa: F401
            except ImportError:
                pytest.skip("memviz: @pytest.mark.no_graph_leak needs PyTorch, which is not installed "
                            "(pip install torch).")
        if plan.gpu or (plan.record and self.capture()[0]):
            self._start(item, plan)

    def _what(self, plan: _Plan) -> str:
        parts = []
        if plan.peak is not None:
            parts.append(f"peak={plan.peak_text}")
        if plan.leaks is not None:
            parts.append("leaks=True" if plan.leaks == 0 else f"leaks={plan.leaks}")
        return ", ".join(parts)

    def _start(self, item, plan: _Plan) -> None:
        import memviz

        _torch_release()
        try:
            # No PyTorch integration: its categories cost a heap scan per snapshot,
            # and budgets and leaks need only the lines.
            plan.tracker = memviz.track(torch=False).start()
            if plan.gpu and not plan.tracker.gpu_enabled:
                why = plan.tracker.gpu_off_reason
                plan.tracker.stop()
                plan.tracker = None
                pytest.skip(f"memviz: this test's GPU memory check ({self._what(plan)}) needs GPU "
                            f"capture, which is unavailable here: {why}.")
        except memviz.AlreadyTracking as e:
            if plan.gpu:
                pytest.fail(f"memviz: {self._what(plan)} needs its own tracker, but {e} "
                            f"Stop the other tracker, or drop the marker and use it directly.",
                            pytrace=False)
        except (memviz.CaptureUnavailable, memviz.CaptureConflict) as e:
            if plan.gpu:
                pytest.skip(f"memviz: this test's GPU memory check ({self._what(plan)}) cannot capture: {e}")

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
            from .torch.graph import GraphRecorder

            plan.seq = GraphRecorder.autograd_mark()
            plan.recorder = GraphRecorder().start()
            plan.saved_mark = plan.recorder.mark()
        outcome = yield
        passed = outcome.excinfo is None
        if plan.recorder is not None:
            plan.recorder.stop()
        if (plan.tracker is not None and plan.tracker.running) or (plan.graph and passed):
            gc.collect()
        if plan.tracker is not None and plan.tracker.running:
            _torch_release()
            self._gpu_checks(plan, passed)
        if plan.graph and passed:
            self._graph_check(plan)

    def _gpu_checks(self, plan: _Plan, passed: bool) -> None:
        from ._units import format_size

        t = plan.tracker
        live = [a for a in t.snapshot_raw().allocations
                if a.timestamp_ns >= plan.call_start_ns and a.device >= 0 and a.kind != "static"]
        t.stop()
        totals = t.totals()
        devs = {d: v["peak"] for d, v in totals.items() if d >= 0}
        dev = max(devs, key=devs.get) if devs else None
        peak = devs.get(dev, 0) if dev is not None else 0
        top = t.peak_snapshot(dev).statistics("lineno")[:5] if dev is not None else []
        leaked = sum(a.size for a in live)
        from ._snapshot import Snapshot

        leak_stats = Snapshot(live, frame_filter=t.frame_filter).statistics("lineno")[:5] if live else []
        plan.result = {"peak_bytes": peak, "peak_device": dev, "leaked_bytes": leaked,
                       "leaked_count": len(live),
                       "top_lines": [{"line": str(s.key), "bytes": s.size} for s in top],
                       "leak_lines": [{"line": str(s.key), "bytes": s.size} for s in leak_stats]}
        if not passed:
            return
        if plan.peak is not None and peak > plan.peak:
            lines = "\n".join(f"    {s}" for s in top) or "    (no Python line recorded)"
            plan.failures.append(
                f"memviz: GPU peak {format_size(peak)} on cuda:{dev} exceeds the budget of "
                f"{format_size(plan.peak)} (@pytest.mark.memviz(peak={plan.peak_text})).\n"
                f"  Top lines at the peak:\n{lines}\n"
                f"  What to do: make the test use less GPU memory (smaller inputs, free temporaries "
                f"sooner) or raise its budget.")
        if plan.leaks is not None and leaked > plan.leaks:
            lines = "\n".join(f"    {s}" for s in leak_stats)
            tol = f" (tolerated: {format_size(plan.leaks)})" if plan.leaks else ""
            plan.failures.append(
                f"memviz: the test left {format_size(leaked)} of GPU memory it allocated alive after "
                f"it returned and gc ran ({len(live)} allocation(s)){tol}.\n"
                f"  Still alive, by line:\n{lines}\n"
                f"  What to do: drop the references that keep it (module globals, caches, class "
                f"attributes) or free it before the test ends.")

    def _graph_check(self, plan: _Plan) -> None:
        from ._units import format_size
        from .torch.graph import GraphRecorder, holders

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
            from ._units import escape_surrogates  # file names that are not UTF-8
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
        if plan.record:
            row = {"nodeid": item.nodeid, "failed_checks": len(plan.failures)}
            row.update(plan.result)
            self.results.append(row)
        plan.tracker = plan.recorder = plan.function = None

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.every_test:
            return
        from ._units import escape_surrogates, format_size

        def write_line(text: str) -> None:  # test ids and file names that are not UTF-8
            terminalreporter.write_line(escape_surrogates(text))

        terminalreporter.write_sep("=", "memviz: GPU memory per test")
        ok, why = self.capture()
        if not ok:
            write_line(f"GPU capture was unavailable: {why}")
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

    def pytest_sessionfinish(self, session) -> None:
        path = self.config.getoption("memviz_report", None)
        if not path:
            return
        ok, why = self.capture()
        data = {"capture_available": ok, "capture_reason": why or None, "tests": self.results}
        from ._errors import OutputError
        from ._outputs import write_output

        try:  # through a temporary file renamed over the path
            write_output(path, json.dumps(data, indent=1), "the --memviz-report file")
        except OutputError as e:
            raise pytest.UsageError(f"memviz: cannot write --memviz-report={path!r} ({e.reason}); "
                                    f"pass a path in a writable directory") from e
