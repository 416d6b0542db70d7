"""The allocator route (src/allocator.h, memviz/torch/allocator.py) on the
CPU: the real probe and the real C wrappers against a stand-in library shaped
like PyTorch's caching allocator (tests/stand_in_allocator), whose segments
come from the libcupti test double's "driver", as PyTorch's come from
cudaMalloc."""

import gc
import platform
import threading

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


@pytest.fixture(scope="module")
def builds(stand_in_root):
    return lambda name, **defines: sa.build(stand_in_root / name, **defines)


@pytest.fixture
def standin(builds, fake, request):
    """Stand-in allocators, one library per test and layout (their state
    is the library's: a fresh one per test), attached through the real probe."""
    memviz.frames.add_library_path(str(ROOT / "tests" / "stand_in_allocator"))
    made = []

    def make(name="default", attach=True, **defines):
        ans = sa.StandInAnswers(builds(f"{request.node.name}-{name}".replace("/", "_"), **defines),
                                fake.lib.fake_alloc, fake.lib.fake_free)
        made.append(ans)
        return ans

    yield make
    t = memviz.active_tracker()
    if t is not None:
        t.stop()
    gc.collect()
    st = _core.allocator_state()
    assert st["outstanding"] == 0, ("a test left tensors made while attached", st)
    route_mod._reset_for_tests()


def _attach(t, ans):
    r = t.torch.use_answers(ans)  # ATTACH
    assert r.route == "allocator", r.reason
    return r


def test_every_block_has_its_line_and_pytorch_counts_agree(standin):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        a, _ = ans.alloc(10_000); la = here()  # noqa: E702
        b, _ = ans.alloc(300); lb = here()  # noqa: E702
        raw = ans.raw_alloc(5000); lr = here()  # noqa: E702
        snap = t.snapshot()
        blocks = [x for x in snap.allocations if x.kind == "block"]
        lines = {x.user_frame.lineno: x.size for x in blocks}
        assert lines == {la: 10240, lb: 512, lr: 5120}
        assert sum(x.size for x in blocks) == ans.allocated()
        assert memviz.capture_info()["pytorch"] == {"route": "allocator", "reason": None, "slots": 40,
                                                    "record_stream": (9, 17), "raw": (6, 7)}
        assert snap.pytorch["route"] == "allocator"
        # Both levels, every byte once: the blocks and what they leave of the segment.
        (seg,) = snap.segments
        assert seg.allocated == ans.allocated() and seg.unused == seg.size - seg.allocated
        unused = [x for x in snap.allocations if x.category == "unused_pool"]
        assert [x.size for x in unused] == [seg.unused]
        assert snap.total_bytes() == seg.size
        assert all(x.segment == seg.address for x in blocks)
        ans.raw_free(raw)
        del a
        assert {x.user_frame.lineno for x in t.snapshot().allocations if x.kind == "block"} == {lb}
        del b
    assert t.snapshot().fragmentation()[0]["allocated"] == 0


def test_fragmentation_figures_come_from_the_live_blocks(standin):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        held = [ans.alloc(4096)[0] for _ in range(8)]
        first = held[0].data_ptr()
        del held[1::2]  # four 4 KiB holes between live blocks
        snap = t.snapshot()
        (seg,) = snap.segments
        # the probe's own blocks, freed, merged back into one free block: best fit
        # starts again at the segment's start
        assert first == seg.address
        live = sorted(x.data_ptr() for x in held)
        assert [b.address for b in seg.blocks] == live
        tail = seg.address + seg.size - (live[-1] + 4096)  # the last hole merged with the tail
        gaps = [4096, 4096, 4096, tail]
        assert seg.free_gaps == len(gaps) and seg.largest_free == max(gaps)
        assert snap.fragmentation(0) == {0: {"segments": 1, "reserved": seg.size, "allocated": 4 * 4096,
                                             "unused": seg.size - 4 * 4096, "largest_free": max(gaps),
                                             "free_gaps": len(gaps)}}
        held.clear()


def test_attach_after_tensors_exist_and_their_frees(standin):
    ans = standin()
    before = [ans.alloc(1 << 20)[0] for _ in range(3)]  # made before tracking: no line
    with memviz.track() as t:
        _attach(t, ans)
        mine, _ = ans.alloc(2048); line = here()  # noqa: E702
        snap = t.snapshot()
        old = {x.address: x for x in snap.allocations if x.before_tracking and x.kind == "block"}
        assert set(old) == {x.data_ptr() for x in before}
        assert all(x.size == 1 << 20 and x.thread.name == "before tracking" for x in old.values())
        assert sum(x.size for x in snap.allocations if x.kind == "block") == ans.allocated()
        # Segments made before tracking are there too, marked, with their unused bytes.
        assert any(s.before_tracking for s in snap.segments)
        before.pop()  # its free goes through PyTorch's deleter: the next snapshot knows from PyTorch
        snap = t.snapshot()
        assert len([x for x in snap.allocations if x.before_tracking and x.kind == "block"]) == 2
        assert [x.user_frame.lineno for x in snap.allocations if x.kind == "block"
                and not x.before_tracking] == [line]
        del mine
    before.clear()


def test_detach_with_tensors_live_leaves_the_allocator_as_it_was(standin):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        during, _ = ans.alloc(4096)
        assert ans.lib.sa_tensor_deleter(during.handle) == _core.allocator_state()["memviz_deleter"]
        assert ans.lib.sa_has_standard_deleter(during.handle)  # raw_deleter() agrees while attached
        stream_used, addr = ans.alloc(4096)
        ans.record_stream(stream_used)  # reaches the stand-in although the deleter is memviz's
        del stream_used
        assert ans.lib.sa_state(addr) == 2
        ans.lib.sa_process_events()
    st = _core.allocator_state()
    assert not st["attached"] and st["vtable"] == "draining" and st["outstanding"] == 1
    after, _ = ans.alloc(4096)  # PyTorch's own deleter again, and its own raw_deleter()
    assert ans.lib.sa_tensor_deleter(after.handle) != st["memviz_deleter"]
    assert ans.lib.sa_has_standard_deleter(after.handle)
    where = during.data_ptr()
    ans.record_stream(during)  # made while attached: its stream use must still reach PyTorch
    del during
    assert ans.lib.sa_state(where) == 2  # freed, waiting for the recorded stream
    ans.lib.sa_process_events()
    st = _core.allocator_state()
    assert st["vtable"] == "pytorch" and st["outstanding"] == 0  # the last one freed: PyTorch's vtable
    del after
    assert ans.allocated() == 0


def test_threads_with_and_without_python_frames(standin, fake):
    ans = standin()
    errors = []

    def work():
        try:
            keep = []
            for i in range(300):
                x, _ = ans.alloc(512 * (1 + i % 7))
                if i % 3 == 0:
                    keep.append(x)
            keep_all.extend(keep)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    keep_all = []
    with memviz.track() as t:
        _attach(t, ans)
        threads = [threading.Thread(target=work, name=f"w{i}") for i in range(4)]
        for th in threads:
            th.start()
        ans.lib.sa_native_thread(200, 10, 1024)  # an engine thread: no Python frames
        for th in threads:
            th.join()
        assert not errors
        assert _core.block_totals()[0]["current"] == ans.allocated()
        snap = t.snapshot()
        blocks = [x for x in snap.allocations if x.kind == "block"]
        assert sum(x.size for x in blocks) == ans.allocated()
        assert {x.thread.name for x in blocks if x.traceback} == {f"w{i}" for i in range(4)}
        assert sum(1 for x in blocks if not x.traceback) == 10
        keep_all.clear()
        assert _core.block_totals()[0]["current"] == ans.allocated() == 10 * 1024
        ans.lib.sa_native_free_kept()
        assert _core.block_totals()[0]["current"] == ans.allocated() == 0


def test_the_probe_finds_the_layout_it_does_not_assume_it(standin):
    ans = standin("shuffled", DATA_W=2, DELETER_W=3, CTX_W=0, DEVICE_W=1, SLOT_RS=23, SLOT_RS_GENERIC=-1,
                  SLOT_RAW_ALLOC=11, SLOT_RAW_DELETE=31)
    with memviz.track() as t:
        _attach(t, ans)
        st = _core.allocator_state()
        data_w, deleter_w, ctx_w, device_w = st["words"]
        # data and context hold the same address here: either order records the same
        assert (deleter_w, device_w, {data_w, ctx_w}) == (3, 1, {0, 2})
        assert st["record_stream"] == (23, -1)
        assert (st["raw_alloc_with_stream"], st["raw_delete"]) == (11, 31)
        x, _ = ans.alloc(1000); line = here()  # noqa: E702
        assert [a.user_frame.lineno for a in t.snapshot().allocations if a.kind == "block"] == [line]
        del x


@pytest.mark.parametrize("defines, why", [
    ({"SLOT_RS": 3}, "is not c10::Allocator's"),  # recordStream where is_simple_data_ptr belongs
    ({"CTX_W": 1, "DELETER_W": 2, "STAND_IN_CTX_OFFSET": 64}, "context is not its data pointer"),
    ({"STAND_IN_IGNORE_RECORD_STREAM": 1}, "recordStream could not be told"),
    ({"STAND_IN_MISCOUNT": 1}, "memviz saw"),
])
def test_a_failed_check_falls_back_to_segments_and_says_why(standin, defines, why):
    ans = standin("bad" + "_".join(f"{k}{v}" for k, v in defines.items()), **defines)
    with memviz.track() as t:
        r = t.torch.use_answers(ans)
        assert r.route == "segments" and why in r.reason, r.reason
        assert memviz.capture_info()["pytorch"]["route"] == "segments"
        assert not _core.allocator_state()["attached"]
        x, _ = ans.alloc(4096)  # PyTorch's vtable and deleter, untouched
        assert ans.lib.sa_tensor_deleter(x.handle) != _core.allocator_state()["memviz_deleter"]
        assert not [a for a in t.snapshot().allocations if a.kind == "block"]
        del x
    assert ans.allocated() == 0


def test_reports_say_which_route(standin, tmp_path):
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        x, _ = ans.alloc(4096)
        from memviz.report.text import text_report
        text = text_report(t, outside={})
        html = t.to_html(str(tmp_path / "r.html"))
        del x
    assert "PyTorch memory seen through: allocator" in text
    assert "PyTorch memory seen through" in open(html).read()


def test_a_nested_tracker_reads_the_outer_trackers_route(standin):
    ans = standin()
    with memviz.track() as outer:
        _attach(outer, ans)
        with memviz.track() as inner:
            assert inner.torch.route.route == "allocator"
            x, _ = ans.alloc(4096); line = here()  # noqa: E702
            assert [a.user_frame.lineno for a in inner.snapshot().allocations
                    if a.kind == "block" and not a.before_tracking] == [line]
        assert _core.allocator_state()["attached"]  # the inner tracker did not take it away
        assert route_mod._failed is None
        del x


def test_a_nested_tracker_keeps_the_route_when_the_outer_stops_first(standin):
    """The outer tracker owns the route; stopped while a nested tracker runs, it
    leaves the route attached until that one stops too (detached at once, the
    nested tracker saw none of PyTorch's blocks from then on)."""
    ans = standin()
    outer = memviz.track().start()
    _attach(outer, ans)
    inner = memviz.track().start()
    outer.stop()
    assert _core.allocator_state()["attached"]
    x, _ = ans.alloc(4096); line = here()  # noqa: E702
    blocks = [a for a in inner.snapshot().allocations if a.kind == "block" and not a.before_tracking]
    assert [a.user_frame.lineno for a in blocks] == [line]
    assert not [a for a in outer.snapshot().allocations if a.kind == "block" and a.size == 4096]
    inner.stop()
    assert not _core.allocator_state()["attached"]
    assert route_mod._failed is None
    del x


def test_oom_report_takes_fragmentation_from_the_live_blocks(standin):
    from memviz.torch import oom

    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        held = [ans.alloc(8192)[0] for _ in range(6)]
        del held[2]
        snap = t.snapshot()
        report = oom.OomReport(1 << 20, 0, "train.py:1", "test", 0)
        oom._segments(report, snap, 0)
        frag = snap.fragmentation(0)[0]
        assert (report.largest_free_block, report.free_gaps, report.segments) == \
            (frag["largest_free"], frag["free_gaps"], frag["segments"])
        # the probe's first block made the segment: memviz's own, never the line that attached
        assert report.largest_gap_segment.startswith("<memviz>")
        report.torch_reserved, report.torch_allocated, report.reserved_unused = frag["reserved"], 0, frag["unused"]
        assert f"{frag['free_gaps']} gaps in 1 segments" in str(report)
        held.clear()


def test_fragmentation_findings_carry_the_gaps_between_live_blocks(standin):
    from memviz.analysis import diagnose as _diagnose

    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        held = [ans.alloc(8192)[0] for _ in range(5)]
        del held[1]
        frag = t.snapshot().fragmentation(0)[0]
        f = _diagnose._frag_finding("reserved grew.", {"device": 0}, [], t)
        assert f.numbers["free_gaps"] == frag["free_gaps"] and f.numbers["segments"] == 1
        assert f"{frag['free_gaps']} gaps between live blocks" in f.message
        held.clear()


def test_before_cuda_initialises_the_route_attaches_at_pytorchs_lazy_init(standin, monkeypatch):
    """track() before the first CUDA use: probing would initialise CUDA, so
    memviz queues its attach on PyTorch's lazy init (torch.cuda._lazy_call)
    and says that it waits."""
    from memviz.torch import integration

    ans = standin()
    queued = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(integration._alloc, "TorchAnswers", lambda _torch: ans)
    with memviz.track() as t:
        assert t.torch.route.route == "segments" and "waiting" in t.torch.route.reason
        assert len(queued) == 1
        queued[0]()  # PyTorch initialises CUDA
        assert t.torch.route.route == "allocator", t.torch.route.reason
        x, _ = ans.alloc(4096); line = here()  # noqa: E702
        assert [a.user_frame.lineno for a in t.snapshot().allocations
                if a.kind == "block" and not a.before_tracking] == [line]
        del x
    queued[0]()  # after stop: nothing happens
    assert not _core.allocator_state()["attached"]


def test_html_segments_view_draws_each_segment_with_its_blocks(standin, tmp_path):
    """The HTML report's segments view in a real Chromium: one bar per
    segment, one coloured part per live block, the hover naming its line."""
    from test_html_report import _browser, need_browser, open_page

    need_browser()  # skips, saying what to install, before selenium is imported
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        held = [ans.alloc(256 << 10)[0] for _ in range(3)]; line = here()  # noqa: E702
        big, _ = ans.alloc(3 << 20)
        path = t.to_html(str(tmp_path / "segments.html"))
        held.clear()
        del big
    browser = _browser()
    try:
        open_page(browser, path)
        section = browser.find_element(By.ID, "mvz-segments")
        bars = section.find_elements(By.CLASS_NAME, "mvz-seg-bar")
        assert len(bars) == 2  # the 2 MiB segment with the three blocks, and the 20 MiB one of the 3 MiB
        blocks = [len(b.find_elements(By.CLASS_NAME, "mvz-seg-block")) for b in bars]
        assert sorted(blocks) == [1, 3], blocks
        small = bars[blocks.index(3)].find_elements(By.CLASS_NAME, "mvz-seg-block")[0]
        ActionChains(browser).move_to_element(small).perform()
        tip = browser.execute_script("return document.querySelector('.mvz-tip').textContent")
        assert f"test_allocator_route.py:{line}" in tip, tip
    finally:
        browser.quit()


def test_workspace_category_is_for_matrix_multiplies_only():
    from memviz.torch.categories import _is_blas_workspace

    class A:
        def __init__(self, op=None, node=None):
            self.op, self.autograd_node = op, node

    assert _is_blas_workspace(A("torch.nn.functional.linear")) and _is_blas_workspace(A("operator @"))
    assert _is_blas_workspace(A("x.matmul")) and _is_blas_workspace(A(None, "AddmmBackward0"))
    assert not _is_blas_workspace(A("torch.distributed.comm")) and not _is_blas_workspace(A("x.summ"))
    assert not _is_blas_workspace(A("torch.zeros_like")) and not _is_blas_workspace(A(None, "MulBackward0"))


def test_pytorchs_count_is_read_while_its_lazy_init_runs(monkeypatch):
    """The probe's check runs inside PyTorch's lazy init when tracking began
    first; torch.cuda.memory_allocated() answers 0 until that init returns,
    so the probe reads PyTorch's counter from C."""
    from memviz.torch.allocator import TorchAnswers

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats",
                        lambda device: {"allocated_bytes": {"all": {"current": 4096 * (device + 1), "peak": 1},
                                                            "small_pool": {"current": 0}},
                                        "num_alloc_retries": 0}, raising=False)
    ans = TorchAnswers.__new__(TorchAnswers)
    ans.torch, ans.device = torch, 1
    assert torch.cuda.memory_allocated(1) == 0  # what the Python answer says meanwhile
    assert ans.allocated() == 8192


def test_a_segment_emptied_before_the_report_is_still_pytorchs_at_the_peak(standin):
    """The probe's own blocks leave a segment behind; torch.cuda.empty_cache()
    hands it back before the end, where `memviz run` reads the peak. At the
    peak it is PyTorch's (unused pool), not memory outside PyTorch."""
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        big, _ = ans.alloc(64 << 20)
        del big
        assert ans.empty_cache() >= 1
    peak = t.peak_snapshot(0)
    cats = {str(s.key) for s in peak.statistics("category")}
    assert not any(c.startswith("outside_pytorch") for c in cats), cats
    assert "unused_pool" in cats or "temporary" in cats, cats


def test_growth_lines_read_blocks_not_the_segments_that_hold_them(standin):
    """A line's segments hold blocks counted at the blocks' own lines: the
    step records carry each line's block growth beside its whole growth, and
    a finding about PyTorch's allocated memory reads the blocks, so neither a
    segment made on a thread without Python frames (the backward's) nor the
    segment under a kept block counts a second time."""
    from memviz.analysis import diagnose as _diagnose

    ans = standin()
    kept = []
    with memviz.track() as t:
        _attach(t, ans)
        for _ in range(8):
            kept.append(ans.alloc(3 << 20)[0]); line = here()  # noqa: E702
            ans.lib.sa_native_thread(1, 1, 1 << 20)  # a frameless thread keeps a block (and its segment)
            t.step()
        size = next(x.size for x in t.snapshot().allocations if x.kind == "block" and x.user_frame
                    and x.user_frame.lineno == line)
        ans.lib.sa_native_free_kept()
    post = t.steps[3:]
    mine = [g for s in post for g in s.lines if g.location.endswith(f":{line}")]
    assert len(mine) == len(post) and all(g.block_bytes == size for g in mine), mine
    by_blocks = {fl.location: fl.bytes for fl in _diagnose._grown_lines(post, blocks=True)}
    assert by_blocks[mine[0].location] == len(post) * size, by_blocks
    # with the segments counted too, the same line grows by more than its blocks
    assert {fl.location: fl.bytes for fl in _diagnose._grown_lines(post)}[mine[0].location] >= len(post) * size
    kept.clear()


def test_the_timed_capture_path_counts_every_block_event_per_thread(standin):
    """benchmarks/bench_in_step.py's reading: under _callback_profile("time")
    each thread's allocations and frees through the route are counted, with
    the capture path's time, in its own slot; without it nothing is."""
    ans = standin()

    def totals():
        rows = {r[0]: r for r in _core._capture_timings()}
        me = rows.get(threading.get_native_id(), (0, 0, 0.0, 0, 0.0))
        return me[1], me[2], me[3], me[4]

    with memviz.track() as t:  # profile off: the plain path, nothing timed
        _attach(t, ans)
        before = totals()
        tensor, _ = ans.alloc(4096)
        del tensor
        assert totals() == before
    before = _core._callback_profile("time")
    try:
        n0 = totals()
        with memviz.track() as t:
            _attach(t, ans)
            blocks = [ans.alloc(1 << 12 + i % 4)[0] for i in range(50)]
            del blocks
            snap_blocks = [x for x in t.snapshot().allocations if x.kind == "block"]
        n1 = totals()
    finally:
        _core._callback_profile(before)
    assert not snap_blocks  # recorded as always: every block freed
    allocs, alloc_ns, frees, free_ns = (n1[i] - n0[i] for i in range(4))
    assert (allocs, frees) == (50, 50)
    assert 0 < alloc_ns / allocs < 1e6 and 0 < free_ns / frees < 1e6


def test_the_capture_path_can_return_at_once_with_the_route_attached(standin):
    """benchmarks/bench_train_step.py's memviz_noop: with _capture_noop(True)
    after track() attached the route, the wrappers run (they count the blocks
    carrying memviz's deleter) and the store records none of them (a snapshot
    then reads them from PyTorch as there before tracking); off again, the next
    block is recorded; the next start records as always; with capture off,
    the hook says what to do."""
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        assert _core._capture_noop(True) is False
        assert _core._capture_noop(True) is True
        seen = _core.block_totals()[0]["allocs"]  # the probe's, at attach
        outstanding = _core.allocator_state()["outstanding"]
        blocks = [ans.alloc(1 << 12)[0] for _ in range(20)]
        recorded = _core.block_totals()[0]["allocs"] - seen
        through = _core.allocator_state()["outstanding"] - outstanding
        del blocks
        assert through == 20 and recorded == 0, (through, recorded)
        assert _core.allocator_state()["outstanding"] == outstanding
        assert _core._capture_noop(False) is True
        kept, _ = ans.alloc(1 << 12)
        assert [x.size for x in t.snapshot().allocations if x.kind == "block"] == [1 << 12]
        del kept
        _core._capture_noop(True)
    with pytest.raises(RuntimeError, match="start a tracker with the profile off first"):
        _core._capture_noop(True)
    with memviz.track() as t:  # a new start records as always
        _attach(t, ans)
        kept, _ = ans.alloc(1 << 12)
        assert [x.size for x in t.snapshot().allocations if x.kind == "block"] == [1 << 12]
        del kept


def test_the_routes_prefetches_can_be_left_out_and_nothing_recorded_changes(standin):
    """benchmarks/bench_train_step.py's X_nopf: _prefetch(False) leaves out
    what the route asks for ahead while PyTorch allocates; the blocks, their
    sizes and their lines are recorded as with it, and the hook says what
    the setting was. So with bench_toggle.py's weights (32, 64: more cold
    code or data lines an event) and the rest of the switches."""
    ans = standin()

    def lines(t):
        return sorted((a.size, a.traceback[0].lineno) for a in t.snapshot().allocations if a.kind == "block")

    seen = {}
    for mode in (True, False, 4, 7, 15, 2 | 32, 2 | 64, 127 & ~16):
        was = _core._prefetch(mode)
        assert was == 2  # the default (True): the queue's unit only, given back below
        try:
            with memviz.track() as t:
                _attach(t, ans)
                kept = [ans.alloc(1 << k)[0] for k in range(12, 16)]
                seen[mode] = lines(t)
                del kept
        finally:
            assert _core._prefetch(True) == {True: 2, False: 0}.get(mode, mode)
    assert len(seen[True]) == 4 and all(v == seen[True] for v in seen.values()), seen
    with pytest.raises(ValueError, match="a mode from 0 to 127"):
        _core._prefetch(128)
    assert _core._prefetch(True) == 2


def test_a_benchmark_can_change_the_depth_while_capture_runs(standin):
    """benchmarks/bench_toggle.py's d<N>: _depth sets the frames kept from
    the next event on, says what it was, and refuses what no stack holds."""
    ans = standin()

    def depths(t):
        return sorted(len(a.traceback) for a in t.snapshot().allocations if a.kind == "block")

    with memviz.track(depth=16) as t:
        _attach(t, ans)
        a, _ = ans.alloc(1 << 12)
        assert _core._depth(1) == 16
        try:
            b, _ = ans.alloc(1 << 13)
            seen = depths(t)
        finally:
            assert _core._depth(16) == 1
    assert seen[0] == 1 and seen[1] > 1, seen
    with pytest.raises(ValueError, match="between 0 and 256"):
        _core._depth(257)


def test_discarded_entries_are_not_recorded_and_the_next_stack_is_whole(standin):
    """_prefetch's bit 16 (bench_toggle.py): entries are written to the
    thread's own room and never queued, so nothing is recorded. The thread's
    next queued allocation then writes its whole stack: the one it matches
    (the discarded one) is not the store's last, and a join with the store's
    last would name the wrong line."""
    ans = standin()

    def at_line(n):
        return ans.alloc(n)[0], here()

    with memviz.track() as t:
        _attach(t, ans)
        a = ans.alloc(4096)[0]; la = here()  # noqa: E702
        mismatch = _core.stats()["queue_kept_mismatch"]
        out = []
        for n, mode in ((8192, 2 | 16), (16384, True)):
            _core._prefetch(mode)
            out.append(at_line(n)); loop = here()  # noqa: E702
        _core._prefetch(True)
        got = {x.size: x.traceback for x in t.snapshot().allocations if x.kind == "block"}
        assert _core.stats()["queue_kept_mismatch"] == mismatch
        del a, out
    # the discarded block is PyTorch's alone: read from its snapshot, with no line
    assert set(got) == {4096, 8192, 16384} and len(got[8192]) == 0, sorted(got)
    assert got[4096].user_frame.lineno == la
    c = got[16384]
    # the whole stack it was allocated with: at_line's line, from the loop's
    assert c.user_frame.lineno == at_line.__code__.co_firstlineno + 1, c
    assert loop in [f.lineno for f in c], (c, loop)


def test_a_benchmark_can_bypass_the_route_while_attached(standin):
    """bench_toggle.py's off mode: allocator_bypass(True) puts PyTorch's own
    entries in the copy's slots. A block made meanwhile carries PyTorch's
    deleter and is neither recorded nor counted; a block made before is
    still recorded as freed, and keeps its stream uses (recordStream's
    wrappers stay). Off again, the route records as before; detach ends a
    bypass; without a route attached it says what to do."""
    ans = standin()
    with pytest.raises(RuntimeError, match="track\\(\\) first"):
        _core.allocator_bypass(True)
    with memviz.track() as t:
        _attach(t, ans)
        before, _ = ans.alloc(1 << 12)
        seen = _core.block_totals()[0]["allocs"]
        outstanding = _core.allocator_state()["outstanding"]
        assert _core.allocator_bypass(True) is False
        during, _ = ans.alloc(1 << 13)
        assert ans.lib.sa_tensor_deleter(during.handle) != _core.allocator_state()["memviz_deleter"]
        assert _core.block_totals()[0]["allocs"] == seen
        assert _core.allocator_state()["outstanding"] == outstanding
        where = before.data_ptr()
        ans.record_stream(before)  # made before the bypass: its stream use still reaches PyTorch
        del before
        assert ans.lib.sa_state(where) == 2
        ans.lib.sa_process_events()
        assert _core.allocator_state()["outstanding"] == outstanding - 1
        assert _core.allocator_bypass(False) is True
        after, _ = ans.alloc(1 << 14); line = here()  # noqa: E702
        blocks = {x.size: x for x in t.snapshot().allocations if x.kind == "block"}
        assert blocks[1 << 14].user_frame.lineno == line
        assert 1 << 12 not in blocks  # its free was recorded
        assert _core.allocator_bypass(True) is False
        del during, after
    assert _core.allocator_state()["vtable"] == "pytorch"
    with memviz.track() as t:  # detach ended the bypass: a new start records
        _attach(t, ans)
        kept, _ = ans.alloc(1 << 12); line = here()  # noqa: E702
        assert [x.user_frame.lineno for x in t.snapshot().allocations if x.kind == "block"] == [line]
        del kept
