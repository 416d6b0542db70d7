"""What the pytest plugin measures and judges for one test: the GPU peak
against ``peak=``, the allocations still alive after the call against
``leaks=`` (all of them, the test file's own with ``own_code=``, or those
``filter_fn=`` counts), and an autograd graph still reachable
(``no_graph_leak``). Each check writes its figures to ``plan.result`` and
its failure, a message saying what to do, to ``plan.failures``.

The hooks that call these are in memviz.integrations.pytest_plugin; the
plan they fill, in memviz.integrations.pytest_plan. Imports those and the
floors below memviz.integrations (docs/architecture.md).
"""

from __future__ import annotations

import os
import sys
from typing import Dict

from memviz._units import format_size
from memviz.integrations.pytest_plan import Plan
from memviz.model.lines import line_frame, where

__all__ = ["torch_release", "gpu_checks", "which_leaks", "graph_check", "threads_running_before"]


def threads_running_before() -> frozenset:
    """Native ids of the Python threads (threading.Thread objects, not the
    calling one, not foreign threads Python only named) running now: what
    they allocate during a test is not the test's leak. A background thread
    an earlier test started (a prefetcher whose buffers are in flight) failed
    a test that freed everything it made."""
    import threading

    me = threading.current_thread()
    dummy = getattr(threading, "_DummyThread", ())
    return frozenset(t.native_id for t in threading.enumerate()
                     if t is not me and not isinstance(t, dummy) and t.native_id is not None)


def torch_release() -> None:
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


def gpu_checks(plan: Plan, passed: bool) -> None:
    from memviz.model.snapshot import Snapshot

    t = plan.tracker
    live = [a for a in t.snapshot_raw().allocations
            if a.timestamp_ns >= plan.call_start_ns and a.device >= 0 and a.kind != "static"]
    # made on a thread that was running before the test began: not the test's to answer for
    before = [a for a in live if a.thread is not None and a.thread.native_id in plan.threads_before]
    if before:
        live = [a for a in live if not (a.thread is not None and a.thread.native_id in plan.threads_before)]
    t.stop()
    totals = t.totals()
    devs = {d: v["peak"] for d, v in totals.items() if d >= 0}
    dev = max(devs, key=devs.get) if devs else None
    peak = devs.get(dev, 0) if dev is not None else 0
    top = t.peak_snapshot(dev).statistics("lineno")[:5] if dev is not None else []
    counted, ignored, filter_error = which_leaks(plan, live)

    def by_line(allocs):
        return Snapshot(allocs, frame_filter=t.frame_filter).statistics("lineno")[:5] if allocs else []

    leak_stats, ignored_stats, before_stats = by_line(counted), by_line(ignored), by_line(before)
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
                   "not_counted_lines": [{"line": str(s.key), "bytes": s.size} for s in ignored_stats],
                   "earlier_threads_bytes": sum(a.size for a in before),
                   "earlier_threads_count": len(before)}
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
        if before:
            text += (f"  Not counted (made by threads already running when the test began: an earlier "
                     f"test's or the session's): {format_size(sum(a.size for a in before))} in "
                     f"{len(before)} allocation(s), by line:\n"
                     + "\n".join(f"    {s}" for s in before_stats) + "\n")
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


def which_leaks(plan: Plan, live: list) -> tuple:
    """(counted, not counted, error message or None) of the allocations still alive."""
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
                    f"{where(a)} ({format_size(a.size)}; marker at {plan.where}).\n"
                    f"  What to do: make filter_fn take a memviz Allocation (a.size, a.user_frame, "
                    f"a.traceback, a.kind) and return True to count it as a leak, False to ignore it.")
            (counted if verdict else ignored).append(a)
        return counted, ignored, None
    if not plan.own_code:
        return live, [], None
    counted, ignored = [], []
    real: Dict[str, str] = {}
    for a in live:
        frame = line_frame(a)  # the line every report shows it under (memviz/model/lines.py)
        if not a.traceback and not frame.lineno:  # no Python frame, no forward line: cannot tell, so it counts
            counted.append(a)
            continue
        path = real.get(frame.filename)
        if path is None:
            path = real[frame.filename] = os.path.realpath(frame.filename)
        (counted if path in plan.test_files else ignored).append(a)
    return counted, ignored, None


def graph_check(plan: Plan) -> None:
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
