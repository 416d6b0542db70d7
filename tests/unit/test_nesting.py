"""Trackers nested in a running tracker (memviz.track() inside memviz.track(),
inside `memviz run`, from other threads).

A nested tracker sees its own window, as if tracking had started when it
started: what was allocated after that, the peak of that, the failures after
that. Memory that was already live is known (its frees are not the nested
tracker's, its amount is ``baseline``). The enclosing tracker keeps
everything. Driven through the libcupti test double.
"""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import memviz
from conftest import here
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, CUDA_ERROR_OUT_OF_MEMORY

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
THIS = os.path.abspath(__file__)


def sizes(snap):
    return sorted(a.size // MiB for a in snap.allocations)


def window_sequence(fake, a):
    """What happens inside the nested tracker (a: an address made before it)."""
    c = fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)
    fake.free(CBID_cuMemFree_v2, c)
    d = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    fake.free(CBID_cuMemFree_v2, a)  # made before the window: not the nested tracker's free
    fake.alloc(CBID_cuMemAlloc_v2, 100 * MiB, result=CUDA_ERROR_OUT_OF_MEMORY)
    return d


def test_nested_tracker_sees_its_window_and_the_outer_keeps_everything(fake):
    with memviz.track() as outer:
        a = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        with memviz.track() as inner:
            assert inner.outer is outer and memviz.active_tracker() is inner
            assert inner.baseline == {0: 12 * MiB}
            window_sequence(fake, a)
        assert not inner.running and outer.running and memviz.active_tracker() is outer
        assert fake.is_subscribed()
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
    tin, tout = inner.totals()[0], outer.totals()[0]
    assert (tin["current"], tin["peak"], tin["allocs"], tin["frees"], tin["failed"]) == \
        (2 * MiB, 16 * MiB, 2, 1, 1)
    assert (tin["alloc_bytes"], tin["live_count"], tin["peak_count"]) == (18 * MiB, 1, 1)
    assert (tout["current"], tout["peak"], tout["allocs"], tout["frees"], tout["failed"]) == \
        (7 * MiB, 28 * MiB, 5, 2, 1)
    assert sizes(inner.snapshot()) == [2] and sizes(outer.snapshot()) == [1, 2, 4]
    assert sizes(inner.peak_snapshot()) == [16] and sizes(outer.peak_snapshot()) == [4, 8, 16]
    assert [f.size for f in inner.failures] == [100 * MiB] == [f.size for f in outer.failures]
    assert [v // MiB for _, dev, v in inner.timeline() if dev == 0] == [16, 0, 2]
    assert not fake.is_subscribed() and memviz.active_tracker() is None


def test_nested_tracker_reads_like_a_tracker_started_there(fake):
    """The same sequence, once nested and once on its own: the same numbers."""
    keys = ("current", "peak", "allocs", "frees", "failed", "alloc_bytes", "live_count", "peak_count")

    def reading(t):
        tot = t.totals()[0]
        return ([tot[k] for k in keys], sizes(t.snapshot()), sizes(t.peak_snapshot()),
                [f.size for f in t.failures], [v for _, _, v in t.timeline()],
                [(s.key.lineno, s.size) for s in t.snapshot().statistics("lineno")])

    with memviz.track():
        a = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        with memviz.track() as nested:
            window_sequence(fake, a)
    a = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)  # before tracking: unknown to the tracker
    with memviz.track() as alone:
        window_sequence(fake, a)
    assert reading(nested) == reading(alone)
    assert alone.baseline == {} and alone.outer is None


def test_stopping_the_outer_while_a_nested_tracker_runs(fake):
    """The outer stops and keeps what it saw until then; capture goes on for
    the nested tracker and ends (CUPTI unsubscribed) when the last one stops."""
    outer = memviz.start()
    inner = memviz.start()
    fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
    outer.stop()
    assert not outer.running and inner.running and fake.is_subscribed()
    assert memviz.active_tracker() is inner
    fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    assert outer.current_bytes() == 1 * MiB and inner.current_bytes() == 3 * MiB
    assert memviz.stop() is inner
    assert not fake.is_subscribed() and memviz.active_tracker() is None
    assert outer.totals()[0]["allocs"] == 1 and inner.totals()[0]["allocs"] == 2
    # Both stay readable after the store is reused.
    with memviz.track() as later:
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
    assert later.outer is None and later.current_bytes() == 4 * MiB
    assert (outer.current_bytes(), inner.current_bytes()) == (1 * MiB, 3 * MiB)
    assert sizes(inner.snapshot()) == [1, 2] and sizes(outer.snapshot()) == [1]


def test_three_levels(fake):
    with memviz.track() as t1:
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
        with memviz.track() as t2:
            fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
            with memviz.track() as t3:
                fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
            fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        assert t3.outer is t2 and t2.outer is t1
    assert [t.current_bytes() // MiB for t in (t1, t2, t3)] == [15, 14, 4]
    assert t3.baseline == {0: 3 * MiB}


def test_nested_trackers_in_other_threads(fake):
    """Each thread's own tracker is its active one; windows are in time, not
    per thread (a tracker sees every thread's allocations, as on its own)."""
    ev = {k: threading.Event() for k in ("a_ready", "step1", "a_done", "b_ready", "step2", "b_done",
                                         "finish")}
    got = {}

    def worker(name, ready, step, done, size):
        with memviz.track() as t:
            got[name] = t
            got[name + "_active"] = memviz.active_tracker() is t
            ev[ready].set()
            ev[step].wait()
            fake.alloc(CBID_cuMemAlloc_v2, size)
            ev[done].set()
            ev["finish"].wait()

    with memviz.track() as outer:
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
        ta = threading.Thread(target=worker, args=("a", "a_ready", "step1", "a_done", 2 * MiB))
        tb = threading.Thread(target=worker, args=("b", "b_ready", "step2", "b_done", 4 * MiB))
        ta.start()
        ev["a_ready"].wait()
        ev["step1"].set()
        ev["a_done"].wait()
        tb.start()
        ev["b_ready"].wait()
        assert memviz.active_tracker() is outer  # this thread's own, not the latest started
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)  # main thread: inside both windows
        ev["step2"].set()
        ev["b_done"].wait()
        ev["finish"].set()
        ta.join()
        tb.join()
        assert memviz.active_tracker() is outer
    a, b = got["a"], got["b"]
    assert got["a_active"] and got["b_active"]
    assert a.outer is outer and b.outer is a  # b's thread started none: the latest started
    assert (a.current_bytes(), b.current_bytes(), outer.current_bytes()) == (14 * MiB, 12 * MiB, 15 * MiB)
    assert b.baseline == {0: 3 * MiB} and a.baseline == {0: 1 * MiB}
    assert (a.totals()[0]["allocs"], b.totals()[0]["allocs"], outer.totals()[0]["allocs"]) == (3, 2, 4)
    assert not fake.is_subscribed()


def test_this_threads_tracker_is_stopped_by_memviz_stop(fake):
    outer = memviz.start()
    started = threading.Event()
    release = threading.Event()
    box = {}

    def worker():
        box["t"] = memviz.start()
        started.set()
        release.wait()
        box["stopped"] = memviz.stop()

    th = threading.Thread(target=worker)
    th.start()
    started.wait()
    try:
        assert memviz.active_tracker() is outer  # main thread's own tracker first
    finally:
        release.set()
        th.join()
    assert box["stopped"] is box["t"] and outer.running
    assert memviz.stop() is outer


def test_nested_steps_record_the_window(fake):
    with memviz.track() as outer:
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        with memviz.track() as inner:
            fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB); line = here()  # noqa: E702
            r0 = inner.step()
            fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
            r1 = inner.step()
        r2 = outer.step()
    d0, d1 = r0.devices[0], r1.devices[0]
    assert (d0.current, d0.peak, d0.growth, d0.segment_allocs) == (1 * MiB, 1 * MiB, 1 * MiB, 1)
    assert (d1.current, d1.peak, d1.growth, d1.segment_allocs) == (3 * MiB, 3 * MiB, 2 * MiB, 1)
    assert [(g.location, g.bytes) for g in r0.lines] == [(f"{THIS}:{line}", 1 * MiB)]
    assert r2.devices[0].current == 11 * MiB and r2.devices[0].segment_allocs == 3
    assert len(inner.steps) == 2 and len(outer.steps) == 1


def test_nested_tracker_saves_and_loads_its_window(fake, tmp_path):
    with memviz.track():
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        with memviz.track() as inner:
            x = fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)
            fake.free(CBID_cuMemFree_v2, x)
            fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
            inner.save(tmp_path / "running.memviz")
    inner.save(tmp_path / "stopped.memviz")
    for name in ("running.memviz", "stopped.memviz"):
        loaded = memviz.load(tmp_path / name)
        assert loaded.totals()[0]["current"] == 2 * MiB and loaded.totals()[0]["peak"] == 16 * MiB
        assert sizes(loaded.snapshot()) == [2] and sizes(loaded.peak_snapshot()) == [16]


def test_nested_tracker_options_that_conflict_say_what_to_do(fake, tmp_path):
    with memviz.track(depth=8) as outer:
        with memviz.track() as inherits:
            assert inherits.depth == 8
        with memviz.track(depth=8):
            pass
        with pytest.raises(memviz.AlreadyTracking, match=r"depth=8.*leave depth out"):
            memviz.track(depth=16).start()
        with pytest.raises(memviz.AlreadyTracking, match=r"precise mode.*outer tracker"):
            memviz.track(precise=True).start()
        with pytest.raises(memviz.AlreadyTracking, match=r"t\.save\(path\)"):
            memviz.track(trace=str(tmp_path / "x.memviz")).start()
        assert not (tmp_path / "x.memviz").exists()
        assert memviz.active_tracker() is outer and fake.is_subscribed()
    assert not fake.is_subscribed()


def test_nested_gpu_false_sees_no_gpu_memory(fake):
    with memviz.track():
        with memviz.track(gpu=False) as quiet:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
        assert not quiet.gpu_enabled and quiet.totals() == {} and len(quiet.snapshot()) == 0


def test_nested_in_an_outer_without_gpu_capture_says_why(fake):
    with memviz.track(gpu=False):
        with memviz.track() as inner:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert not inner.gpu_enabled and "nested in" in inner.gpu_off_reason
    assert "gpu=False was passed" in inner.gpu_off_reason and not fake.is_subscribed()


def test_windows_run_out_with_a_memviz_error_and_come_back(fake):
    from memviz import _core

    trackers = [memviz.start()]
    try:
        with pytest.raises(memviz.AlreadyTracking, match="nested trackers"):
            for _ in range(_core.MAX_WINDOWS + 1):
                trackers.append(memviz.start())
        assert len(trackers) == _core.MAX_WINDOWS + 1
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        assert all(t.current_bytes() == MiB for t in trackers)
    finally:
        for t in reversed(trackers):
            t.stop()
    with memviz.track():
        with memviz.track() as again:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert again.current_bytes() == MiB


def test_a_script_that_tracks_runs_under_memviz_run(fake_path, tmp_path):
    (tmp_path / "own.py").write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from fake_cupti import FakeCupti
        import memviz
        f = FakeCupti({fake_path!r})
        f.alloc({CBID_cuMemAlloc_v2}, 8 << 20)
        with memviz.track() as t:
            f.alloc({CBID_cuMemAlloc_v2}, 3 << 20)
        print("inner", t.current_bytes(), t.outer is not None, flush=True)
    """))
    env = {k: v for k, v in os.environ.items()}
    env.update(MEMVIZ_CUPTI_LIBRARY=fake_path, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "memviz", "run", "own.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"inner {3 * MiB} True" in p.stdout
    assert "AlreadyTracking" not in p.stderr and "memviz report" in p.stderr
    assert "11 MiB" in p.stderr  # the run's own report counts both


# ---- the PyTorch integration of nested trackers --------------------------------------------


def _scale_op(fake):
    torch = pytest.importorskip("torch", reason="needs torch")

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            fake.alloc(CBID_cuMemAlloc_v2, 64 * 1024)
            return g * 2

    return torch, Scale


@pytest.mark.parametrize("outer_autograd", [True, None])
@pytest.mark.parametrize("outer_stops_first", [False, True])
def test_nested_autograd_labels_installed_once_and_removed_in_any_order(fake, outer_autograd,
                                                                       outer_stops_first):
    torch, Scale = _scale_op(fake)
    import torch.autograd.graph as agraph

    original = agraph._engine_run_backward
    x = torch.randn(8, requires_grad=True)
    outer = memviz.track(autograd=outer_autograd).start()
    inner = memviz.track(autograd=True).start()
    # installs only if none did: the outer one did (autograd naming is on by default)
    assert inner.autograd and inner.torch.autograd is False
    Scale.apply(x).sum().backward()
    (a,) = inner.snapshot().allocations
    assert a.autograd_node == "ScaleBackward"
    if outer_autograd:
        assert inner.graph is outer.graph and inner.snapshot().graph_resident() is not None
    first, second = (outer, inner) if outer_stops_first else (inner, outer)
    first.stop()
    second.stop()
    assert agraph._engine_run_backward is original and memviz._core.label_get() == 0
    assert not memviz._core.active()


def test_a_nested_tracker_keeps_labels_and_graphs_when_the_outer_stops_first(fake):
    """What a nested tracker shares (the autograd labels, the graph recorder, the
    engine's wrapper) stays on while it runs, whichever tracker stops first."""
    torch, Scale = _scale_op(fake)
    import torch.autograd.graph as agraph

    original = agraph._engine_run_backward
    x = torch.randn(8, requires_grad=True)
    outer = memviz.track(autograd=True).start()
    inner = memviz.track(autograd=True).start()
    outer.stop()
    held = Scale.apply(x).sin().sum()  # a graph made after the outer stopped
    assert inner.graph is not None and len(list(inner.graph.resident())) >= 1
    held.backward()
    (a,) = [a for a in inner.snapshot().allocations if a.size == 64 * 1024]
    assert a.autograd_node == "ScaleBackward"
    assert agraph._engine_run_backward is not original
    inner.stop()
    assert agraph._engine_run_backward is original and memviz._core.label_get() == 0
    assert not memviz._core.active()


def test_step_marks_of_nested_trackers_do_not_steal_each_others_lines(fake):
    """Each tracker's step lines are the changes since its own previous step
    (or its start), whichever tracker marked the store in between."""
    with memviz.track() as outer:
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB); l1 = here()  # noqa: E702
        with memviz.track() as inner, memviz.track(gpu=False) as quiet:
            fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB); l2 = here()  # noqa: E702
            ri = inner.step()
            rq = quiet.step()
        ro = outer.step()
    assert [(g.location, g.bytes) for g in ri.lines] == [(f"{THIS}:{l2}", 2 * MiB)]
    assert sorted((g.location, g.bytes) for g in ro.lines) == sorted(
        [(f"{THIS}:{l1}", 1 * MiB), (f"{THIS}:{l2}", 2 * MiB)])
    assert rq.lines == [] and rq.devices == {}
