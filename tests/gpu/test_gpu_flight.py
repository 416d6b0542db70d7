"""Traces by the native writer and the flight recorder on a real GPU (pytest
-m gpu): a GPT-like step on the allocator route streamed to a trace, a
PyTorch OutOfMemoryError dumped before the program sees it, SIGUSR1."""

import textwrap

import pytest

from test_gpu_capture import _REASON, run  # noqa: F401  (same runner, same skip)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

STEP = """
import torch, os, glob, time
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                              torch.nn.Linear(4096, 1024)) for _ in range(6)]).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(256, 1024, device="cuda")
def train_step():
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
train_step()
torch.cuda.synchronize()
"""


def test_a_streamed_trace_on_the_allocator_route_holds_every_block(tmp_path):
    r = run(STEP + textwrap.dedent(f"""
        import memviz.trace.writer as W
        path = {str(tmp_path / "run.memviz")!r}
        start_live = torch.cuda.memory_allocated()  # parameters and optimizer state: before the trace
        with memviz.track(trace=path) as t:
            native = next(p for p in t.subscribers if isinstance(p, W.TraceWriter)).native
            for _ in range(40):
                train_step()
            torch.cuda.synchronize()
            live = torch.cuda.memory_allocated()
            peak_torch = torch.cuda.max_memory_allocated()
            route = t.torch.route.route if t.torch and t.torch.route else None
        tr = memviz.load(path)
        ev = list(tr.events())
        blocks = sum(1 for e in ev if e.kind == "block")
        cur_blocks = sum(a.size for a in tr.snapshot().allocations if a.kind == "block")
        out(native=native, route=route, events=len(ev), blocks=blocks, bytes=os.path.getsize(path),
            dropped=tr.dropped_events, cur_blocks=cur_blocks, live=live, truncated=tr.truncated,
            start_live=start_live)
    """))
    print("native trace on the route:", r)
    assert r["native"] and r["route"] == "allocator" and not r["truncated"], r
    assert r["blocks"] > 500 and r["dropped"] == 0, r
    # The blocks live at the end: all of PyTorch's allocated bytes, those that
    # were live before the trace began (read from PyTorch then) included.
    assert r["cur_blocks"] == r["live"], r
    assert r["bytes"] / r["events"] <= 4, r


def test_pytorch_oom_is_dumped_before_the_program_sees_it(tmp_path):
    r = run(STEP + textwrap.dedent(f"""
        folder = {str(tmp_path)!r}
        with memviz.track(flight_recorder="256 MiB", flight_dir=folder) as t:
            train_step()
            before, raised_s, on_disk_s = [], None, None
            try:
                line = here() + 1
                t0 = time.perf_counter(); torch.empty(1 << 48, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                raised_s = time.perf_counter() - t0  # PyTorch's retry and memviz's freeze
                t.flight_recorder.wait_for_dumps(1.0)  # issue 27: on disk within a second
                on_disk_s = time.perf_counter() - t0
                before = sorted(glob.glob(os.path.join(folder, "memviz-flight-*.memviz")))
            train_step()
        tr = memviz.load(before[0]) if before else None
        fr = tr.end["flight_recorder"] if tr else {{}}
        fails = tr.failures if tr else []
        top = tr.snapshot().statistics("category") if tr else []
        out(dumps=[os.path.basename(p) for p in before], reason=fr.get("reason"), expected=line,
            raised_s=raised_s, on_disk_s=on_disk_s,
            failed_lines=[f.traceback.user_frame.lineno for f in fails if f.traceback and f.traceback.user_frame],
            failed_sizes=[f.size for f in fails], cats=[str(s.key) for s in top][:8],
            block_events=sum(1 for e in tr.events() if e.kind == "block") if tr else 0)
    """))
    print("OOM dump:", r)
    assert len(r["dumps"]) >= 1 and r["reason"].startswith("PyTorch out of memory"), r
    assert r["on_disk_s"] < 1.0, r
    assert r["expected"] in r["failed_lines"], r  # the failed driver call, at the line that asked
    assert r["block_events"] > 50, r  # the step before the OOM, block by block


def test_sigusr1_dumps_a_running_training_loop(tmp_path):
    r = run(STEP + textwrap.dedent(f"""
        import signal
        with memviz.track(flight_recorder="64 MiB", flight_dir={str(tmp_path)!r}) as t:
            for i in range(4):
                train_step()
                if i == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
            torch.cuda.synchronize()
            import time
            deadline = time.monotonic() + 60
            while not t.flight_recorder.dumps and time.monotonic() < deadline:
                time.sleep(0.05)  # the recorder's thread writes it, not the handler
            dumps = list(t.flight_recorder.dumps)
            stats = t.flight_recorder.stats()
        tr = memviz.load(dumps[0])
        out(n=len(dumps), reason=tr.end["flight_recorder"]["reason"], events=tr.event_count,
            memory=stats["memory"], budget=stats["budget"])
    """))
    print("SIGUSR1 dump:", r)
    assert r["n"] == 1 and r["reason"] == "SIGUSR1" and r["events"] > 100, r
    assert r["memory"] <= r["budget"], r
