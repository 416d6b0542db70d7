"""When another tool holds CUPTI (issue 25), on the CPU: memviz keeps
working without it, through the allocator route (PyTorch's blocks) and
PyTorch's own cudaMalloc/cudaFree (its segments, src/interpose.h,
MVZ_WRAP_SEGMENTS), says what it cannot see, shares CUPTI where the library
allows it (13.5's multi-subscriber mode), and gives CUPTI up when a profiler
starts inside a tracker.

Driven through the real C capture path, with the libcupti test double
standing in for CUPTI (it refuses a second subscriber, or shares, as asked)
and the stand-in allocator for PyTorch's (its segments come from a stand-in
runtime's cudaMalloc, imported as PyTorch's are)."""

import gc
import platform
import warnings

import pytest

import memviz
from conftest import ROOT
from fake_cupti import CBID_cuMemAlloc_v2

torch = pytest.importorskip("torch", reason="the PyTorch integration needs torch (pip install torch)")

import stand_in_allocator as sa  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.capture import availability as hints  # noqa: E402
from memviz.report.text import text_report  # noqa: E402
from memviz.torch import allocator as route_mod  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route and the segment wrappers patch code on x86-64 glibc only")

KiB, MiB = 1 << 10, 1 << 20
MULTI = 130500  # CUPTI 13.5: multi-subscriber mode (src/cupti_abi.h)


@pytest.fixture(scope="module")
def builds(stand_in_root):
    return lambda name, **defines: sa.build(stand_in_root / name, **defines)


@pytest.fixture
def standin(builds, fake, request, monkeypatch):
    memviz.frames.add_library_path(str(ROOT / "tests" / "stand_in_allocator"))
    monkeypatch.setattr(hints, "_warned_without_cupti", False)

    def make(name="default", **defines):
        return sa.StandInAnswers(builds(f"{request.node.name}-{name}".replace("/", "_"), **defines),
                                 fake.lib.fake_alloc, fake.lib.fake_free)

    yield make
    t = memviz.active_tracker()
    if t is not None:
        t.stop()
    gc.collect()
    assert _core.allocator_state()["outstanding"] == 0
    route_mod._reset_for_tests()


def _attach(t, ans):
    r = t.torch.use_answers(ans)
    assert r.route == "allocator", r.reason
    return r


def _pool(snap):
    """PyTorch's pool as memviz holds it: its blocks, and the rest of its
    segments (a segment's row keeps the bytes its blocks do not)."""
    return sum(a.size for a in snap.allocations if a.kind in ("block", "device"))


def _blocks(snap):
    return sum(a.size for a in snap.allocations if a.kind == "block")


def _work(ans, fake):
    """PyTorch-like tensors (blocks in new segments) and a CuPy-like driver
    allocation outside PyTorch; returns what must stay alive."""
    keep = [ans.alloc(3 * MiB)[0], ans.alloc(700 * KiB)[0], ans.alloc(30 * MiB)[0]]
    other = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)  # another library's cudaMalloc
    return keep, other


def test_a_held_cupti_is_not_a_refusal_pytorch_stays_exact(standin, fake, tmp_path):
    """Another tool holds CUPTI: track() runs, warns once naming the tool and
    what to do, and PyTorch's blocks and segments are exact (the peaks too);
    what other libraries allocate is not seen one by one, and every view
    (capture_info, the text report, the trace read back) says so."""
    ans = standin()
    fake.set_conflict("Nsight Systems 2026.1")
    path = tmp_path / "run.memviz"
    with pytest.warns(memviz.CaptureWarning) as w:
        t = memviz.track(trace=str(path)).start()
    text = " ".join(str(x.message) for x in w)
    assert "Nsight Systems 2026.1" in text and "cupti=False" in text and "allocator" in text
    try:
        assert t.gpu_enabled and not t.cupti_enabled and not fake.is_subscribed()
        _attach(t, ans)
        keep, _other = _work(ans, fake)
        snap = t.snapshot()
        assert _blocks(snap) == ans.allocated()
        assert _pool(snap) == ans.reserved()  # every segment came through the wrappers
        del keep[1]
        peak_blocks = _blocks(t.peak_snapshot(peak="tensor"))
        sources = t.capture_info()["sources"]
    finally:
        t.stop()
    assert peak_blocks == 3 * MiB + 700 * KiB + 30 * MiB
    assert sources["cupti"]["used"] is False and "Nsight Systems 2026.1" in sources["cupti"]["reason"]
    assert sources["allocator"] == {"used": True, "segments": "allocator", "reason": None}
    assert any("not seen one by one" in g for g in sources["gaps"])
    report = text_report(t)
    assert "without CUPTI (CUPTI is held by Nsight Systems 2026.1" in " ".join(report.split()), report
    from memviz.report import _data, tracker_repr_html
    assert _data._meta(t, None, 0, 1)["capture"].startswith("without CUPTI (CUPTI is held by Nsight")  # HTML
    assert "without CUPTI (CUPTI is held by Nsight" in tracker_repr_html(t)  # the notebook's view
    assert memviz.capture_info()["sources"]["cupti"]["used"] is False  # the last tracker's
    back = memviz.load(str(path))
    assert back.capture_info()["sources"]["cupti"]["used"] is False
    assert back.snapshot().total_bytes() == t.snapshot().total_bytes()
    assert "without CUPTI" in " ".join(text_report(back).split())


def test_cupti_false_never_subscribes_and_says_nothing(standin, fake):
    ans = standin()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memviz.CaptureWarning)
        with memviz.track(cupti=False) as t:
            assert not fake.is_subscribed() and not _core.cupti_held()
            _attach(t, ans)
            keep, other = _work(ans, fake)
            snap = t.snapshot()
    assert _blocks(snap) == ans.allocated() and _pool(snap) == ans.reserved()
    assert other not in {a.address for a in snap.allocations}  # outside PyTorch: not seen
    assert t.cupti_off_reason == "cupti=False was passed"
    assert t.capture_info()["sources"]["cupti"]["reason"] == "cupti=False was passed"
    del keep


def test_a_nested_tracker_says_what_the_capture_it_shares_sees(standin, fake):
    ans = standin()
    with memviz.track(cupti=False) as outer:
        _attach(outer, ans)
        with memviz.track() as inner:
            keep, _ = _work(ans, fake)
            sources = inner.capture_info()["sources"]
    assert not inner.cupti_enabled and inner.cupti_off_reason == "cupti=False was passed"
    assert sources["allocator"]["segments"] == "allocator" and sources["cupti"]["used"] is False
    del keep


def test_cupti_true_is_cupti_or_a_conflict_naming_the_holder(standin, fake):
    standin()
    fake.set_conflict("ncu")
    with pytest.raises(memviz.CaptureConflict, match="ncu") as e:
        memviz.track(cupti=True).start()
    assert e.value.holder == "ncu" and memviz.active_tracker() is None


def test_with_cupti_the_segment_wrappers_stay_quiet(standin, fake):
    """With CUPTI held, its cuMemAlloc callback records PyTorch's segments;
    the wrappers (attached only without CUPTI) would record each twice."""
    ans = standin()
    with memviz.track() as t:
        assert t.cupti_enabled and fake.is_subscribed()
        _attach(t, ans)
        assert t.torch.segments_route is None
        keep, other = _work(ans, fake)
        snap = t.snapshot()
    assert _pool(snap) == ans.reserved() + 5 * MiB  # and the other library's allocation
    assert other in {a.address for a in snap.allocations}
    del keep


def test_a_sharing_cupti_13_5_is_joined_and_its_activity_buffers_left_alone(standin, fake):
    """CUPTI 13.5's multi-subscriber mode: memviz asks to share and, where
    the holder shares too, subscribes beside it; the activity API's buffer
    callbacks (one per process) stay the other tool's."""
    ans = standin()
    fake.set_version(MULTI)
    fake.set_conflict("CUPTI for Kineto", shares=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memviz.CaptureWarning)
        with memviz.track() as t:
            assert t.cupti_enabled and fake.is_subscribed()
            assert t.cupti_shared_with == "CUPTI for Kineto"
            assert not t.activity_enabled and "CUPTI for Kineto" in t.activity_error
            _attach(t, ans)
            keep, other = _work(ans, fake)
            snap = t.snapshot()
            sources = t.capture_info()["sources"]
    assert other in {a.address for a in snap.allocations}  # CUPTI's callbacks see it all
    assert sources["cupti"] == {"used": True, "reason": None, "shared_with": "CUPTI for Kineto"}
    assert "CUPTI shared with CUPTI for Kineto" in " ".join(text_report(t).split())
    del keep


@pytest.mark.parametrize("version, shares", [(130100, True), (MULTI, False)])
def test_no_sharing_unless_both_the_library_and_the_holder_allow_it(standin, fake, version, shares):
    """An older CUPTI (it never reads allowMultipleSubscribers: memviz hands
    it the four-field struct), or a holder that did not ask to share: memviz
    goes on without CUPTI."""
    standin()
    fake.set_version(version)
    fake.set_conflict("CUPTI for Kineto", shares=shares)
    with pytest.warns(memviz.CaptureWarning, match="Kineto"):
        with memviz.track() as t:
            assert not t.cupti_enabled and not fake.is_subscribed()


def test_a_profiler_starting_inside_the_tracker_gets_cupti(standin, fake):
    """memviz first, a profiler second: just before PyTorch's profiler
    prepares with CUDA activities, memviz gives CUPTI up (the other tool can
    then subscribe) and goes on through the allocator, PyTorch's segments
    included; a CPU-only profiler leaves CUPTI alone."""
    import torch.autograd.profiler as prof
    from torch.autograd import ProfilerActivity

    ans = standin()
    calls = []
    real = prof._prepare_profiler
    with memviz.track() as t:
        _attach(t, ans)
        assert prof._prepare_profiler is not real  # wrapped while tracking
        before = [ans.alloc(2 * MiB)[0]]
        assert prof._prepare_profiler.__wrapped__ is real  # the original, for tools that look
        # a CPU-only profiler: CUPTI stays memviz's
        t.torch._before_profiler({ProfilerActivity.CPU})
        assert t.cupti_enabled and fake.is_subscribed()
        with pytest.warns(memviz.CaptureWarning, match="torch.profiler started at .*test_cupti_sharing.py"):
            t.torch._before_profiler({ProfilerActivity.CPU, ProfilerActivity.CUDA})
        calls.append(fake.other_tool_subscribes("CUPTI for Kineto"))
        assert not t.cupti_enabled and not _core.cupti_held()
        after = [ans.alloc(40 * MiB)[0]]  # a new segment: through the wrappers now
        del before[0]
        ans.empty_cache()  # a segment made under CUPTI, freed through the wrappers
        snap = t.snapshot()
        sources = t.capture_info()["sources"]
    assert calls == [True]
    assert _blocks(snap) == ans.allocated() and _pool(snap) == ans.reserved()
    assert "torch.profiler started at" in sources["cupti"]["reason"]
    assert prof._prepare_profiler is real  # put back at stop
    del after


def test_the_profiler_patch_releases_cupti_through_torch_s_own_entry(standin, fake, monkeypatch):
    """What torch.profiler.profile calls (_prepare_profiler, looked up in
    torch.autograd.profiler at each call) is what gives CUPTI up; the call
    then goes on to PyTorch's function."""
    import torch.autograd.profiler as prof
    from torch.autograd import ProfilerActivity

    calls = []
    monkeypatch.setattr(prof, "_prepare_profiler", lambda config, activities: calls.append(set(activities)))
    standin()
    with memviz.track() as t:
        assert t.cupti_enabled
        with pytest.warns(memviz.CaptureWarning, match="torch.profiler started at"):
            prof._prepare_profiler("config", {ProfilerActivity.CUDA})
        assert calls == [{ProfilerActivity.CUDA}]
        assert not t.cupti_enabled and not fake.is_subscribed()
        assert fake.other_tool_subscribes("CUPTI for Kineto")


def test_without_the_pytorch_integration_a_held_cupti_turns_gpu_capture_off(fake, monkeypatch):
    monkeypatch.setattr(hints, "_warned_gpu_off", False)
    fake.set_conflict("nsys")
    with pytest.warns(memviz.CaptureWarning, match="nsys"):
        with memviz.track(torch=False) as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert not t.gpu_enabled and "no other way" in t.gpu_off_reason and t.current_bytes() == 0


def test_memviz_run_no_cupti(fake, tmp_path):
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    p = subprocess.run([sys.executable, "-m", "memviz", "run", "--no-cupti", str(script)],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert "ran" in p.stdout and "without CUPTI (cupti=False was passed)" in " ".join(p.stderr.split()), p.stderr
