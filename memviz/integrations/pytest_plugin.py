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
to do. ``no_graph_leak`` needs only PyTorch and works on CPU tensors; without
PyTorch the test runs and the check is listed as not run.

Which leaks count (``leaks=``): by default every allocation made during the
test's call that is still alive after it. ``own_code=True`` (or the ini
setting ``memviz_own_code = true`` for every marked test) counts only those
whose line (``Allocation.user_frame``, the innermost non-library line; for
backward allocations made with no Python frames, the forward line that made
their autograd node, as the reports show them) lies in the test's own file,
so caches that other modules fill do not fail the test; ``filter_fn=`` (a
function of a memviz ``Allocation``, returning True to count it) decides
instead of either.

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

This module is what pytest loads (the ``pytest11`` entry point, or
``-p memviz.integrations.pytest_plugin``): the options, the markers, the
fixture and the per-test hooks. What a test's markers ask for is read in
memviz.integrations.pytest_plan, the checks are made in
memviz.integrations.pytest_checks. Imports those and the floors below
memviz.integrations (docs/architecture.md).
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any, Dict, List, Optional

import pytest

from memviz.integrations.pytest_checks import gpu_checks, graph_check, threads_running_before, torch_release
from memviz.integrations.pytest_plan import FAILED_FIRST, SKIPPED_ITSELF, Plan, marker_plan

__all__ = ["memviz_tracker"]

_RUNNER = "memviz-runner"
_NO_CAPTURE_TODO = ("run them on a machine with an NVIDIA GPU and CUPTI (or point MEMVIZ_CUPTI_LIBRARY "
                    "at a libcupti) to check their GPU memory; the tests' own assertions ran here")
_PLAN = pytest.StashKey[Plan]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("memviz", "GPU memory (memviz)")
    group.addoption("--memviz", action="store_true", default=False,
                    help="track every test's GPU memory with memviz and print a table of peaks "
                         "and leaks at the end")
    group.addoption("--most-allocations", metavar="N", type=int, default=20,
                    help="with --memviz: list the N tests with the highest GPU peaks at the end "
                         "(default 20; 0: every test), as pytest-memray's option")
    group.addoption("--memviz-report", metavar="PATH", default=None,
                    help="write every test's GPU peak, top lines and leaks to PATH as JSON "
                         "(tracks every test, like --memviz)")
    parser.addini("memviz_own_code", type="bool", default=False,
                  help="memviz: count a @pytest.mark.memviz(leaks=...) leak only when the test file's own "
                       "lines allocated it (the marker's own_code= and filter_fn= override this)")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "memviz(peak=None, leaks=False, own_code=False, filter_fn=None, warmups=0): fail the "
                   "test if its GPU peak exceeds `peak` (e.g. '2 GiB'; '24 MB' is 24 * 1024**2 bytes, as "
                   "pytest-memray reads it) or if GPU memory it allocated is still alive after it returns "
                   "(leaks=True, or a size to tolerate). own_code=True counts only leaks made by the test "
                   "file's own lines; filter_fn(allocation) -> bool decides instead; warmups=N runs the "
                   "test N times first, unmeasured. Without GPU capture the test still runs and these "
                   "checks are listed as not run, with the reason")
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


def _expected_to_fail(item):
    """The test's xfail mark as pytest evaluated it, where a failure of the
    test is expected (a memviz check failing counts as the test failing:
    XFAIL, as pytest reports a test that raised); None otherwise: no mark,
    ``--runxfail``, or ``raises=`` naming the exceptions expected (a memviz
    check raises none of them)."""
    try:
        from _pytest.skipping import xfailed_key
    except ImportError:  # a pytest without it: memviz's failure stands
        return None
    xfailed = item.stash.get(xfailed_key, None)
    if xfailed is None or getattr(item.config.option, "runxfail", False):
        return None
    if getattr(xfailed, "raises", None) is not None:
        return None
    return xfailed


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

            from memviz._errors import CaptureUnavailable
            from memviz.capture import cupti as _capture

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
        plan = marker_plan(item, own_code_default=bool(self.config.getini("memviz_own_code")))
        plan.record = self.every_test
        if not (plan.gpu or plan.graph or plan.record):
            return
        item.stash[_PLAN] = plan
        if plan.gpu and not self.capture()[0]:
            plan.skip_gpu(f"GPU capture is unavailable here: {self.capture()[1]}", self._capture_todo)
        if plan.graph:
            try:
                import torch  # noqa: F401
            except ImportError:  # no autograd graph can be made: the test runs, the check is listed
                plan.graph = False
                plan.skip(["no_graph_leak"], "PyTorch is not installed, and no_graph_leak looks for "
                          "its autograd graphs", "pip install torch to check this test for graph leaks")
        if (plan.gpu and not plan.gpu_skipped) or (plan.record and self.capture()[0]):
            self._start(item, plan)

    def _start(self, item, plan: Plan) -> None:
        from memviz._errors import AlreadyTracking, CaptureConflict, CaptureUnavailable
        from memviz.tracker import track

        torch_release()
        try:
            # No PyTorch integration: its categories cost a heap scan per snapshot,
            # and budgets and leaks need only the lines.
            # cupti=True: without the PyTorch integration CUPTI is the only way to see
            # GPU memory, so a CUPTI held by another tool is a conflict, said below.
            plan.tracker = track(torch=False, cupti=True).start()
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
            reason, _, _todo = str(e).partition(" What to do: ")
            plan.skip_gpu(reason.rstrip(), "stop the other profiler before the test, or run the test in a "
                                           "process of its own: the test's checks need CUPTI, which that "
                                           "tool holds")

    # -- call: measure and check ---------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        plan = item.stash.get(_PLAN, None)
        if plan is None:
            yield
            return
        if plan.warmups:  # pytest-memray's warmups: caches filled once are not leaks
            for _ in range(plan.warmups):
                try:
                    item.runtest()
                except (Exception, pytest.skip.Exception, pytest.fail.Exception):
                    break  # the measured run below says what is wrong
                except BaseException:  # Ctrl-C: the session ends; the test's tracker with it
                    if plan.tracker is not None and plan.tracker.running:
                        plan.tracker.stop()
                    raise
            gc.collect()
            if plan.tracker is not None and plan.tracker.running:
                plan.tracker.reset_peak()  # the peak is the measured run's
        plan.call_start_ns = time.monotonic_ns()
        plan.threads_before = threads_running_before()
        plan.function = getattr(item, "function", None)
        if plan.graph:
            from memviz.torch.graph import GraphRecorder

            plan.seq = GraphRecorder.autograd_mark()
            plan.recorder = GraphRecorder().start()
            plan.saved_mark = plan.recorder.mark()
        outcome = yield
        passed = outcome.excinfo is None
        plan.not_judged = SKIPPED_ITSELF if not passed and issubclass(
            outcome.excinfo[0], pytest.skip.Exception) else FAILED_FIRST
        if plan.recorder is not None:
            plan.recorder.stop()
        if (plan.tracker is not None and plan.tracker.running) or (plan.graph and passed):
            gc.collect()
        if plan.tracker is not None and plan.tracker.running:
            torch_release()
            gpu_checks(plan, passed)
        elif plan.gpu and not plan.gpu_skipped:
            plan.skip_gpu("memviz's tracker for this test was stopped before the test returned",
                          "leave the memviz_tracker fixture's tracker running; start your own "
                          "memviz.track() inside the test to measure a part of it")
        if plan.graph and passed:
            plan.checks_run.append("no_graph_leak")
            graph_check(plan)
        elif plan.graph:
            plan.skip(["no_graph_leak"], *plan.not_judged)

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
            from memviz._units import escape_controls  # file names that are not UTF-8, controls
            rep.longrepr = escape_controls("\n\n".join(plan.failures))
            xfailed = _expected_to_fail(item)
            if xfailed is not None:  # as pytest does for a test that raised: XFAIL
                rep.outcome, rep.wasxfail = "skipped", xfailed.reason
            else:
                rep.outcome = "failed"
                if hasattr(rep, "wasxfail"):  # an XPASS that memviz fails
                    del rep.wasxfail

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
        from memviz._units import escape_controls, format_size

        def write_line(text: str) -> None:  # test ids and file names: not UTF-8, controls
            terminalreporter.write_line(escape_controls(text))

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
        most = self.config.getoption("most_allocations", 20)
        most = len(rows) if most is None or most <= 0 else most
        write_line(f"{'peak':>10}  {'leaked':>10}  test (top line at the peak)")
        for r in rows[:most]:
            top = f"  ({r['top_lines'][0]['line']})" if r.get("top_lines") else ""
            write_line(f"{format_size(r['peak_bytes']):>10}  {format_size(r['leaked_bytes']):>10}  "
                       f"{r['nodeid']}{top}")
        if len(rows) > most:
            write_line(f"... {len(rows) - most} more tests (--most-allocations 0 lists all; "
                       "--memviz-report=PATH writes them all)")
        path = self.config.getoption("memviz_report", None)
        if path:
            write_line(f"memviz: per-test report written to {path}")

    def _summary_not_run(self, terminalreporter, write_line) -> None:
        """The tests whose memviz checks were left out, grouped by why."""
        # A failed (or self-skipped) test's checks were not judged either (the report says so),
        # but its own outcome is what to read: the summary lists the checks this run cannot give.
        not_run = [s for s in self.not_run
                   if (s["reason"], s["what_to_do"]) not in (FAILED_FIRST, SKIPPED_ITSELF)]
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
        from memviz._output_files import write_output

        try:  # through a temporary file renamed over the path
            write_output(path, json.dumps(data, indent=1), "the --memviz-report file")
        except OutputError as e:
            raise pytest.UsageError(f"memviz: cannot write --memviz-report={path!r} ({e.reason}); "
                                    f"pass a path in a writable directory") from e
