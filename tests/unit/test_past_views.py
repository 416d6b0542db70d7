"""The past, exactly (issue 22) on the CPU: what PyTorch held when tracking
started is part of the record (memviz/torch/before.py), the two peaks
(device and tensor), and every view agreeing: the live tracker, its
peak snapshots, and the trace it wrote, read back. Driven through the real
allocator route and C store, against the stand-in allocator whose segments
come from the libcupti test double's "driver"."""

import gc
import platform

import pytest

import memviz
from conftest import ROOT, here

torch = pytest.importorskip("torch")  # the integration attaches with torch imported

import stand_in_allocator as sa  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.torch import allocator as route_mod  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route patches a C++ vtable on x86-64 glibc only")

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def builds(stand_in_root):
    return lambda name, **defines: sa.build(stand_in_root / name, **defines)


@pytest.fixture
def standin(builds, fake, request):
    memviz.frames.add_library_path(str(ROOT / "tests" / "stand_in_allocator"))

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


def blocks(snap):
    return {a.address: a for a in snap.allocations if a.kind == "block"}


def test_what_exists_at_attach_is_live_in_every_view(standin, tmp_path):
    """Blocks and segments PyTorch held before track() are in the live
    snapshot, both peak snapshots, the trace and the trace's peaks, flagged
    before_tracking, at PyTorch's sizes; the tensor peak counts them."""
    ans = standin()
    params = [ans.alloc(256 * KiB)[0] for _ in range(4)]  # "the model": made before tracking
    held_before = ans.allocated()
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path)) as t:
        _attach(t, ans)
        seeded = t.torch.before_tracking
        assert seeded["blocks"] == 4 and seeded["block_bytes"] == held_before
        assert seeded["segments"] >= 1
        live = blocks(t.snapshot())
        old = {a for a, x in live.items() if x.before_tracking}
        assert old == {p.data_ptr() for p in params}
        acts = [ans.alloc(100 * KiB)[0] for _ in range(6)]; line = here()  # noqa: E702
        peak_alloc = ans.allocated()
        del acts
        tail, _ = ans.alloc(10 * KiB)
        tensor = t.peak_snapshot(peak="tensor")
        assert tensor.peak == "tensor"
        tb = blocks(tensor)
        # the tensor peak: parameters (before tracking) and the six activations
        assert sum(x.size for x in tb.values()) == peak_alloc
        assert {x.address for x in tb.values() if x.before_tracking} == old
        assert sum(1 for x in tb.values() if x.user_frame and x.user_frame.lineno == line) == 6
        assert t.tensor_totals()[0]["peak"] == peak_alloc
        device = t.peak_snapshot()
        assert device.peak == "device"
        # the device's peak holds the segments made before tracking too
        assert any(s.before_tracking for s in device.segments)
        del tail
    loaded = memviz.load(str(path))
    lt = loaded.peak_snapshot(peak="tensor")
    assert lt.peak == "tensor"
    assert sorted((a.address, a.size, a.before_tracking) for a in blocks(lt).values()) == \
        sorted((a.address, a.size, a.before_tracking) for a in tb.values())
    assert loaded.tensor_totals()[0]["peak"] == peak_alloc
    end = blocks(loaded.snapshot())
    assert {a for a, x in end.items() if x.before_tracking} == old
    params.clear()


def test_the_probe_is_memviz_own_and_never_on_a_user_line(standin):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        x, _ = ans.alloc(4 * KiB); line = here()  # noqa: E702
        snap = t.snapshot()
        mine = [a for a in snap.allocations if a.user_frame and a.user_frame.lineno == line]
        assert [a.size for a in mine] == [4 * KiB]
        # the segment the probe made is memviz's, not the line that ran first
        probe = [a for a in _core.live() if a.flags & _core.FLAG_MEMVIZ]
        assert probe and all(a.kind == _core.KIND_DEVICE for a in probe)
        own = [a for a in t.peak_snapshot().allocations if a.address in {p.address for p in probe}]
        assert own and all(str(a.user_frame.filename) == "<memviz>" for a in own)
        assert {s.key.filename for s in snap.statistics("lineno")} >= {"<memviz>"}
        del x


def test_peak_snapshot_names_its_peak_and_refuses_others(standin):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        with pytest.raises(memviz.InvalidArgument, match="peak=\"tensor\""):
            t.peak_snapshot(peak="tensors")


def test_a_trace_of_format_1_still_reads():
    """The sample shipped with memviz (and every trace written before the
    record grew) has 32-byte records: fields past them read as 0."""
    from memviz._package import PACKAGE_DIR
    import pathlib
    sample = pathlib.Path(PACKAGE_DIR) / "data" / "sample.memviz"
    if not sample.exists():
        pytest.skip("no sample trace in this checkout")
    loaded = memviz.load(str(sample))
    if loaded.format_version != 1:
        pytest.skip("the sample was recorded again in format 2")
    snap = loaded.peak_snapshot()
    assert snap.allocations and all(a.requested == a.size for a in snap.allocations)


def test_reports_show_both_peaks_and_what_was_there_before(standin, tmp_path):
    """The text and JSON reports of a trace give the tensor peak with its lines
    beside the device's, and what PyTorch held when tracking started."""
    from memviz.cli.report import json_report
    from memviz.report.text import text_report

    ans = standin()
    params = [ans.alloc(512 * KiB)[0] for _ in range(3)]
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path)) as t:
        _attach(t, ans)
        acts = [ans.alloc(200 * KiB)[0] for _ in range(4)]; line = here()  # noqa: E702
        del acts
    loaded = memviz.load(str(path))
    for rec in (t, loaded):
        text = text_report(rec, outside={})
        assert "Top lines at the tensor peak of cuda:0" in text
        at_tensor = text.split("Top lines at the tensor peak of cuda:0", 1)[1].split("\n\n", 1)[0]
        assert f"test_past_views.py:{line}" in at_tensor
        before = text.split("Before tracking started", 1)[1].split("\n\n", 1)[0]
        assert "held by PyTorch (4 allocations): other_pytorch 1.5 MiB, unused_pool" in before
    rep = json_report(loaded)
    (dev,) = [d for d in rep["devices"] if d["device"] == 0]
    assert dev["tensor_peak"] == loaded.tensor_totals()[0]["peak"]
    assert any(x["line"] == line for x in dev["top_lines_at_tensor_peak"])
    before = rep["before_tracking"]["0"]
    assert before["count"] >= 3 and before["bytes"] >= 3 * 512 * KiB
    from memviz.report import _data  # the HTML report's data: the same two tables
    tables = _data.collect(loaded)["tables"]
    assert "lines at the tensor peak" in tables and "before tracking" in tables
    flat = str(tables["lines at the tensor peak"]["rows"])
    assert f"test_past_views.py:{line}" in flat or str(line) in flat
    params.clear()


def test_pytorchs_own_frames_of_what_was_there_are_kept_and_interned(fake):
    """With PyTorch's memory history on when tracking starts, the blocks read
    then keep PyTorch's Python frames (innermost first); equal stacks are one."""
    from memviz.torch import before

    frames = [{"filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", "line": 1340, "name": "_apply"},
              {"filename": "/src/model.cpp", "line": 5, "name": "c++"},  # C++ frames are left out
              {"filename": "/venv/lib/libtorch_cuda.so", "line": 0, "name": "c10::x"},
              {"filename": "??", "line": 0, "name": "??"},
              {"filename": "/home/me/train.py", "line": 12, "name": "build"}]

    class Answers:
        device = 0

        def snapshot(self):
            return [{"device": 0, "address": 0x7000_0000_0000, "total_size": 2 * MiB, "stream": 0,
                     "blocks": [{"address": 0x7000_0000_0000 + k * 4096, "size": 4096,
                                 "requested_size": 4000, "state": "active_allocated",
                                 "frames": list(frames)} for k in range(3)]}]

    with memviz.track(torch=False) as t:
        stacks_before = _core.stats()["stacks"]
        got = before.seed(Answers())
        assert got["blocks"] == 3 and got["segments"] == 1
        assert _core.stats()["stacks"] == stacks_before + 1  # three blocks, one stack
        snap = t.snapshot()
        blocks = [a for a in snap.allocations if a.kind == "block"]
        assert len(blocks) == 3 and all(a.before_tracking and a.requested == 4000 for a in blocks)
        assert [(f.filename, f.lineno) for f in blocks[0].traceback] == [
            ("/home/me/train.py", 12), ("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1340)]
        mine = [st for st in snap.statistics("lineno") if st.key.filename == "/home/me/train.py"]
        assert [(st.key.lineno, st.count, st.size) for st in mine] == [(12, 3, 3 * 4096)]


def test_the_notebook_view_shows_the_tensor_peak_and_what_was_there(standin):
    from memviz.report.notebook import tracker_repr_html as tracker_html

    ans = standin()
    kept = ans.alloc(512 * KiB)[0]  # before tracking
    with memviz.track() as t:
        _attach(t, ans)
        x = ans.alloc(300 * KiB)[0]; line = here()  # noqa: E702
        del x
    html = tracker_html(t)
    assert "Top lines at the tensor peak" in html and f":{line}" in html
    assert "Held by PyTorch when tracking started: cuda:0:" in html
    del kept


def test_a_block_waiting_on_another_stream_at_attach_is_not_live(standin):
    """A block freed before tracking whose free waits on another stream is
    gone for its program: it is not recorded as live (PyTorch's own free of it,
    once that stream is done, would never be seen and it would stay forever)."""
    ans = standin()
    kept = ans.alloc(64 * KiB)[0]
    waiting = ans.alloc(64 * KiB)[0]
    addr = waiting.data_ptr()
    ans.record_stream(waiting)
    del waiting
    with memviz.track() as t:
        _attach(t, ans)
        seeded = {r.address for r in _core.live() if r.flags & _core.FLAG_BEFORE and r.kind == _core.KIND_BLOCK}
        assert kept.data_ptr() in seeded and addr not in seeded
    ans.lib.sa_process_events()
    del kept
