"""PyTorch's own block sizes at every moment (src/blocks.c) on the CPU: the
store sizes each block by PyTorch's caching-allocator rules as it is
recorded, so live snapshots, past ones (the peak, snapshot(at_ns)) and a
trace read back hold the sizes PyTorch handed out, with the remainders it
did not split off. The reference is the stand-in allocator, which follows
those rules (tests/unit/test_stand_in_rules.py checks it against a Python model)."""

import gc
import platform
import random

import pytest

import memviz
from conftest import ROOT

torch = pytest.importorskip("torch")  # the integration attaches with torch imported

import stand_in_allocator as sa  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.torch import allocator as route_mod  # noqa: E402
from memviz.torch import rules  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route patches a C++ vtable on x86-64 glibc only")

MiB = 1 << 20


@pytest.fixture(scope="module")
def builds(stand_in_root):
    return lambda name, **defines: sa.build(stand_in_root / name, **defines)


@pytest.fixture
def standin(builds, fake, request, monkeypatch):
    memviz.frames.add_library_path(str(ROOT / "tests" / "stand_in_allocator"))

    def make(name="default", conf="", max_split=0, divisions=0):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        ans = sa.StandInAnswers(builds(f"{request.node.name}-{name}".replace("/", "_")),
                                fake.lib.fake_alloc, fake.lib.fake_free)
        if max_split or divisions:
            ans.configure(max_split, divisions)
        return ans

    yield make
    t = memviz.active_tracker()
    if t is not None:
        t.stop()
    gc.collect()
    assert _core.allocator_state()["outstanding"] == 0
    route_mod._reset_for_tests()
    rules.apply(rules.Settings())


def _attach(t, ans):
    r = t.torch.use_answers(ans)
    assert r.route == "allocator", r.reason
    return r


def pytorch_blocks(ans):
    """{address: (size, requested)} of the blocks the stand-in holds."""
    return {b["address"]: (b["size"], b["requested_size"]) for seg in ans.snapshot()
            for b in seg["blocks"] if b["state"] != "inactive"}


def ours(snap):
    return {a.address: (a.size, a.requested) for a in snap.allocations if a.kind == "block"}


def store_blocks():
    """{address: (size, requested)} of the blocks as the C store holds them
    (a live snapshot also checks them against PyTorch's view; this does not)."""
    return {r.address: (r.size, r.requested) for r in _core.live() if r.kind == _core.KIND_BLOCK}


def test_the_classic_cases(standin):
    """A 17 MiB request gets the whole 18 MiB segment (the 1 MiB left is not
    split off), a 1.5 MiB one in a fresh 20 MiB segment is split, a small one
    is its size rounded to 512 bytes; each with what it asked for."""
    ans = standin()
    with memviz.track() as t:
        _attach(t, ans)
        a = ans.alloc(17 * MiB)[0]
        b = ans.alloc(3 * MiB // 2)[0]
        c = ans.alloc(1000)[0]
        got = store_blocks()
        assert got[a.data_ptr()] == (18 * MiB, 17 * MiB)
        assert got[b.data_ptr()] == (3 * MiB // 2, 3 * MiB // 2)
        assert got[c.data_ptr()] == (1024, 1000)
        assert got == pytorch_blocks(ans)
        del a, b, c


def test_settings_are_read_as_pytorch_reads_them():
    s = rules.Settings()
    assert rules.parse("max_split_size_mb:200,expandable_segments:True").as_dict() == {
        "max_split_size": 200 * MiB, "roundup_power2_divisions": [0] * 16, "expandable_segments": True}
    assert rules.parse("roundup_power2_divisions:[256:1,512:2,>:8]").divisions == \
        [1] * 8 + [1, 2] + [8] * 6
    assert rules.parse("roundup_power2_divisions:4").divisions == [4] * 16
    assert s == rules.from_environment({})


@pytest.mark.parametrize("conf, max_split, divisions", [
    ("", 0, 0),
    ("max_split_size_mb:64", 64 * MiB, 0),
    ("roundup_power2_divisions:4", 0, 4),
])
def test_live_past_and_trace_sizes_equal_pytorchs(standin, tmp_path, conf, max_split, divisions):
    ans = standin(conf=conf, max_split=max_split, divisions=divisions)
    rnd = random.Random(len(conf))
    path = tmp_path / "sizes.memviz"
    held, moments = [], []
    with memviz.track(trace=str(path)) as t:
        _attach(t, ans)
        for step in range(400):
            kind = rnd.random()
            n = (rnd.randrange(1, 1 << 20) if kind < 0.4 else
                 rnd.randrange(1, 30) * MiB - rnd.randrange(0, 8192))
            held.append(ans.alloc(n)[0])
            if len(held) > 40:
                held.pop(rnd.randrange(len(held)))
            if step % 50 == 49:
                snap = t.snapshot()
                want = pytorch_blocks(ans)
                assert store_blocks() == want, step
                assert ours(snap) == want, step
                moments.append((snap.timestamp_ns, want))
        peak = t.peak_snapshot(peak="tensor")
        assert sum(size for size, _ in ours(peak).values()) == t.tensor_totals()[0]["peak"]
        held.clear()
    loaded = memviz.load(str(path))
    for at_ns, want in moments:
        assert ours(loaded.snapshot(at_ns=at_ns)) == want
    assert ours(loaded.peak_snapshot(peak="tensor")) == ours(peak)
    # and no block's size was a guess
    assert not any(a.size_estimated for a in loaded.snapshot(at_ns=moments[-1][0]).allocations)


def test_a_block_freed_unseen_is_retired_when_its_memory_is_handed_out(standin):
    """A tensor made before tracking and freed while tracking (its deleter
    is PyTorch's, which memviz does not see) stops counting once PyTorch
    hands its memory out again, or once a live snapshot sees it gone."""
    ans = standin()
    big = ans.alloc(40 * MiB)[0]  # before tracking
    with memviz.track() as t:
        _attach(t, ans)
        addr = big.data_ptr()
        del big
        gc.collect()
        again = ans.alloc(12 * MiB)[0]  # best fit: the freed block's memory
        assert again.data_ptr() == addr
        assert store_blocks() == pytorch_blocks(ans)
        assert t.tensor_totals()[0]["current"] == ans.allocated()
        small = ans.alloc(4096)[0]
        keep = ans.alloc(3 * MiB)[0]
        del keep, again
        gc.collect()
        assert ours(t.snapshot()) == pytorch_blocks(ans)
        del small


def test_a_free_waiting_on_another_stream_is_said(standin, tmp_path):
    """A block freed while another stream's use was recorded on it goes back
    to PyTorch only when that stream is done, which memviz does not see: the
    snapshots (live and from the trace) say so; without one they say nothing."""
    ans = standin()
    path = tmp_path / "streams.memviz"
    with memviz.track(trace=str(path)) as t:
        _attach(t, ans)
        plain = ans.alloc(3 * MiB)[0]
        assert t.peak_snapshot(peak="tensor").size_note is None
        used = ans.alloc(3 * MiB)[0]
        ans.record_stream(used)
        del used, plain
        ans.lib.sa_process_events()
        live = t.peak_snapshot(peak="tensor").size_note
    assert live and "1 block(s) were freed while another stream" in live
    assert memviz.load(str(path)).peak_snapshot(peak="tensor").size_note == live
