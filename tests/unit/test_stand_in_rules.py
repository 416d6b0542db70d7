"""The stand-in caching allocator (tests/stand_in_allocator) follows PyTorch's
native allocator's rules (c10/cuda/CUDACachingAllocator.cpp): rounding,
pools per stream, best fit, max_split_size, segment sizes, splitting,
merging, pending frees and empty_cache. It is the reference memviz's model
of block sizes is held against, so here it is held against a second,
independent model of the same rules (Reference, below, in plain Python),
block by block, over hand-picked cases and random alloc/free sequences."""

import ctypes
import random

import pytest

import stand_in_allocator as sa

KiB, MiB = 1 << 10, 1 << 20
DRIVER_ALLOC = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int)
DRIVER_FREE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int)
CBID_cuMemAlloc_v2, CBID_cuMemFree_v2 = 243, 245


class Driver:
    """cuMemAlloc / cuMemFree: addresses never reused, a gap between
    segments (so a block running past its segment would show)."""

    def __init__(self):
        self.next, self.calls = 0x7F0000000000, []

    def alloc(self, size):
        addr, self.next = self.next, self.next + size + 64 * MiB
        self.calls.append(("alloc", addr, size))
        return addr

    def free(self, addr):
        self.calls.append(("free", addr))


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    return sa.build(tmp_path_factory.mktemp("stand_in_rules") / "rules")


@pytest.fixture
def standin(lib_path):
    """The stand-in, reset, with a driver of its own (its calls in .driver)."""
    driver = Driver()

    def alloc(cbid, size, stream, result):
        assert cbid == CBID_cuMemAlloc_v2
        return driver.alloc(size)

    def free(cbid, addr, stream, result):
        assert cbid == CBID_cuMemFree_v2
        driver.free(addr)

    callbacks = DRIVER_ALLOC(alloc), DRIVER_FREE(free)
    ans = sa.StandInAnswers(lib_path, *callbacks)
    ans.reset()
    ans.driver, ans._callbacks = driver, callbacks
    yield ans
    ans.reset()


# ---- the reference: the same rules, written again, plainly ----

class Reference:
    def __init__(self, max_split_size=0, divisions=0):
        self.max_split = max_split_size or float("inf")
        self.divisions = divisions
        self.driver = Driver()
        self.segments = []  # {"address", "size", "stream", "small", "blocks": [[addr, size, requested, state]]}
        self.allocated = 0

    def round(self, n):
        if n < 512:
            return 512
        d = self.divisions
        if d > 1 and n > 512 * d:
            if n & (n - 1) == 0:
                return n
            low = 1 << (n.bit_length() - 1)  # the power of two below n
            step = low // d
            return -(-n // step) * step
        return -(-n // 512) * 512

    def alloc(self, n, stream=0):
        size = self.round(n)
        small = size <= MiB
        fits = [(b[1], b[0], seg, b) for seg in self.segments if seg["small"] == small and seg["stream"] == stream
                for b in seg["blocks"] if b[3] == "inactive" and b[1] >= size]
        found = min(fits, key=lambda f: (f[0], f[1])) if fits else None
        if found and size < self.max_split <= found[0]:
            found = None
        if found and size >= self.max_split and found[0] >= size + 20 * MiB:
            found = None
        if found:
            seg, block = found[2], found[3]
        else:
            total = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            block = [self.driver.alloc(total), total, 0, "inactive"]
            seg = {"address": block[0], "size": total, "stream": stream, "small": small, "blocks": [block]}
            self.segments.append(seg)
        rest = block[1] - size
        if (rest >= 512) if small else (size < self.max_split and rest > MiB):
            at = seg["blocks"].index(block)
            seg["blocks"].insert(at + 1, [block[0] + size, rest, 0, "inactive"])
            block[1] = size
        block[2], block[3] = n, "active_allocated"
        self.allocated += block[1]
        return block[0]

    def _where(self, addr):
        for seg in self.segments:
            for i, b in enumerate(seg["blocks"]):
                if b[0] == addr and b[3] != "inactive":
                    return seg, i
        raise KeyError(hex(addr))

    def free(self, addr, stream_used=False):
        seg, i = self._where(addr)
        block = seg["blocks"][i]
        self.allocated -= block[1]
        if stream_used:
            block[3] = "active_pending_free"
        else:
            self._free(seg, i)

    def _free(self, seg, i):
        blocks = seg["blocks"]
        blocks[i][2:] = [0, "inactive"]
        if i + 1 < len(blocks) and blocks[i + 1][3] == "inactive":
            blocks[i][1] += blocks.pop(i + 1)[1]
        if i > 0 and blocks[i - 1][3] == "inactive":
            blocks[i - 1][1] += blocks.pop(i)[1]

    def process_events(self):
        for seg in self.segments:
            while any(b[3] == "active_pending_free" for b in seg["blocks"]):
                self._free(seg, [b[3] for b in seg["blocks"]].index("active_pending_free"))

    def empty_cache(self):
        self.process_events()
        gone = [s for s in self.segments if len(s["blocks"]) == 1 and s["blocks"][0][3] == "inactive"]
        for s in gone:
            self.driver.free(s["address"])
            self.segments.remove(s)
        return len(gone)

    def snapshot(self):
        return [(s["address"], s["size"], s["stream"], "small" if s["small"] else "large",
                 [tuple(b) for b in s["blocks"]]) for s in sorted(self.segments, key=lambda s: s["address"])]


def shape(snapshot):
    """The stand-in's snapshot() in the reference's terms, after checking
    what every segment must hold."""
    out = []
    for s in snapshot:
        blocks = s["blocks"]
        assert s["is_expandable"] is False and s["device"] == 0
        assert blocks and blocks[0]["address"] == s["address"]
        assert sum(b["size"] for b in blocks) == s["total_size"]  # blocks tile the segment
        assert all(a["address"] + a["size"] == b["address"] for a, b in zip(blocks, blocks[1:]))
        assert not any(a["state"] == b["state"] == "inactive" for a, b in zip(blocks, blocks[1:]))  # merged
        assert s["allocated_size"] == sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append((s["address"], s["total_size"], s["stream"], s["segment_type"],
                    [(b["address"], b["size"], b["requested_size"], b["state"]) for b in blocks]))
    return out


def only_block(ans, addr):
    """(block, its segment) of the stand-in's snapshot at addr."""
    for s in ans.snapshot():
        for b in s["blocks"]:
            if b["address"] == addr:
                return b, s
    raise KeyError(hex(addr))


# ---- the classic cases ----

def test_a_17_mib_request_gets_an_18_mib_segment_and_all_of_it(standin):
    t, addr = standin.alloc(17 * MiB)
    block, seg = only_block(standin, addr)
    assert (seg["total_size"], seg["segment_type"]) == (18 * MiB, "large")
    assert len(seg["blocks"]) == 1  # the 1 MiB left is not over kSmallSize: not split
    assert (block["size"], block["requested_size"], block["state"]) == (18 * MiB, 17 * MiB, "active_allocated")
    assert standin.allocated() == 18 * MiB == standin.reserved()
    del t
    assert standin.allocated() == 0


def test_a_1_5_mib_request_splits_a_fresh_20_mib_segment(standin):
    t, addr = standin.alloc(3 * MiB // 2)
    block, seg = only_block(standin, addr)
    assert seg["total_size"] == 20 * MiB
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(3 * MiB // 2, "active_allocated"),
                                                                (37 * MiB // 2, "inactive")]
    assert standin.allocated() == 3 * MiB // 2
    del t


@pytest.mark.parametrize("n", [1, 511, 512, 513, 4096, 10_000, MiB - 1, MiB])
def test_a_small_request_in_a_2_mib_segment_is_its_rounded_size(standin, n):
    t, addr = standin.alloc(n)
    block, seg = only_block(standin, addr)
    rounded = max(512, -(-n // 512) * 512)
    assert (seg["total_size"], seg["segment_type"]) == (2 * MiB, "small")
    assert (block["size"], block["requested_size"]) == (rounded, n)
    assert [b["size"] for b in seg["blocks"]] == [rounded, 2 * MiB - rounded]
    assert standin.allocated() == rounded
    rest = 2 * MiB - rounded
    u, addr2 = standin.alloc(min(rest, MiB))  # the small pool's free block, right after it
    assert addr2 == addr + rounded and len(standin.snapshot()) == 1
    if rest <= MiB:  # it took the rest, exactly: no remainder
        assert [b["state"] for b in standin.snapshot()[0]["blocks"]] == ["active_allocated"] * 2
    del t, u


def test_a_best_fit_remainder_of_a_mib_or_less_stays_with_the_block(standin):
    a, addr = standin.alloc(5 * MiB)  # a 20 MiB segment: 5 MiB + 15 MiB free
    b, baddr = standin.alloc(29 * MiB // 2)  # best fit: the free 15 MiB, 0.5 MiB left
    block, seg = only_block(standin, baddr)
    assert len(standin.snapshot()) == 1 and baddr == addr + 5 * MiB
    assert (block["size"], block["requested_size"]) == (15 * MiB, 29 * MiB // 2)
    assert standin.allocated() == 20 * MiB
    del a, b


def test_best_fit_takes_the_smallest_hole_and_frees_merge(standin):
    t = [standin.alloc(n) for n in (4 * KiB, 8 * KiB, 4 * KiB, 16 * KiB, 4 * KiB)]
    base = t[0][1]
    del t[3]  # a 16 KiB hole
    del t[1]  # an 8 KiB hole
    x, addr = standin.alloc(6 * KiB)
    assert addr == base + 4 * KiB  # the 8 KiB hole, not the 16 KiB one nor the segment's tail
    _, seg = only_block(standin, addr)
    assert [(b["size"], b["state"]) for b in seg["blocks"]][:3] == [(4 * KiB, "active_allocated"),
                                                                   (6 * KiB, "active_allocated"),
                                                                   (2 * KiB, "inactive")]
    t.clear()
    del x
    (seg,) = standin.snapshot()
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(2 * MiB, "inactive")]
    assert standin.empty_cache() == 1 and standin.snapshot() == []
    assert standin.driver.calls[-1] == ("free", base)


def test_a_recorded_stream_keeps_the_block_until_its_events(standin):
    a, aa = standin.alloc(4 * KiB)
    b, ba = standin.alloc(4 * KiB)
    standin.record_stream(a)
    del a
    assert standin.lib.sa_state(aa) == 2 and standin.allocated() == 4 * KiB
    del b  # its neighbour is pending: no merge with it
    (seg,) = standin.snapshot()
    assert [b["state"] for b in seg["blocks"]] == ["active_pending_free", "inactive"]
    assert seg["blocks"][0]["requested_size"] == 4 * KiB
    standin.lib.sa_process_events()
    (seg,) = standin.snapshot()
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(2 * MiB, "inactive")]


def test_empty_cache_waits_for_recorded_streams_and_keeps_busy_segments(standin):
    a, _ = standin.alloc(4 * KiB)
    b, _ = standin.alloc(5 * MiB)
    standin.record_stream(a)
    del a
    assert standin.empty_cache() == 1  # the small segment (its pending block freed); b's stays
    (seg,) = standin.snapshot()
    assert seg["segment_type"] == "large"
    del b


def test_pools_and_streams_are_separate(standin):
    a, aa = standin.alloc(MiB)  # small pool: a 2 MiB segment, 1 MiB free
    b, ba = standin.alloc(MiB + 1)  # large pool: its own 20 MiB segment
    assert len(standin.snapshot()) == 2
    del b
    standin.set_stream(7)
    c, ca = standin.alloc(4 * KiB)  # the free 1 MiB is stream 0's
    standin.set_stream(0)
    segs = {s["address"]: s for s in standin.snapshot()}
    assert len(segs) == 3 and only_block(standin, ca)[1]["stream"] == 7
    raw = standin.raw_alloc(4 * KiB)  # on the current stream: into stream 0's small segment
    assert raw == aa + MiB
    standin.raw_free(raw)
    del a, c


def test_max_split_size(standin):
    standin.configure(max_split_size=24 * MiB)
    big, addr = standin.alloc(25 * MiB)  # at or over max_split_size: never split
    block, seg = only_block(standin, addr)
    assert seg["total_size"] == 26 * MiB and block["size"] == 26 * MiB
    del big
    small, saddr = standin.alloc(5 * MiB)  # below it: never an oversize free block
    assert only_block(standin, saddr)[1]["total_size"] == 20 * MiB
    again, again_addr = standin.alloc(24 * MiB)  # at it: the 26 MiB block is within 20 MiB
    assert again_addr == addr and only_block(standin, addr)[0]["size"] == 26 * MiB
    del again
    standin.configure(max_split_size=30 * MiB)
    other, oaddr = standin.alloc(16 * MiB)  # 26 MiB is no longer oversize: taken and split
    assert oaddr == addr and only_block(standin, addr)[0]["size"] == 16 * MiB
    del small, other


def test_max_split_size_bounds_the_oversize_rounding(standin):
    standin.configure(max_split_size=22 * MiB)
    big, addr = standin.alloc(60 * MiB)
    del big
    t, taddr = standin.alloc(40 * MiB)  # 60 >= 40 + 20: not that block
    assert taddr != addr and only_block(standin, taddr)[1]["total_size"] == 40 * MiB
    u, uaddr = standin.alloc(41 * MiB)  # 60 < 41 + 20: the whole 60 MiB block
    assert uaddr == addr and only_block(standin, addr)[0]["size"] == 60 * MiB
    del t, u


@pytest.mark.parametrize("divisions, n, rounded", [
    (0, 1, 512), (0, 513, 1024), (0, 5000, 5120),
    (4, 1000, 1024),  # not over 512 * 4: multiples of 512
    (4, 2049, 2560), (4, 5000, 5120), (4, MiB, MiB), (4, MiB + 1, 5 * MiB // 4),
    (4, 3 * MiB, 3 * MiB), (4, 3 * MiB + 1, 7 * MiB // 2), (8, 17 * MiB, 18 * MiB),
    (8, 4095, 4096), (2, 33 * MiB, 48 * MiB), (1, 33 * MiB + 1, 33 * MiB + 512),
])
def test_round_size(standin, divisions, n, rounded):
    standin.configure(roundup_power2_divisions=divisions)
    assert standin.round_size(n) == rounded == Reference(divisions=divisions).round(n)


def test_configure_refuses_what_pytorch_refuses(standin):
    with pytest.raises(ValueError):
        standin.configure(max_split_size=20 * MiB)
    with pytest.raises(ValueError):
        standin.configure(roundup_power2_divisions=3)
    standin.configure(max_split_size=21 * MiB, roundup_power2_divisions=16)


# ---- random sequences against the reference ----

def random_size(rng):
    r = rng.random()
    if r < 0.15:
        return rng.choice([1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 17 * MiB,
                           3 * MiB // 2, 2 * MiB, 20 * MiB, 30 * MiB])
    if r < 0.55:
        return rng.randint(1, MiB)
    return int(2 ** rng.uniform(20, 24.9))  # 1 MiB .. 30 MiB


@pytest.mark.parametrize("max_split_size, divisions", [(0, 0), (24 * MiB, 0), (0, 4), (21 * MiB, 8), (0, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_match_the_reference(standin, max_split_size, divisions, seed):
    rng = random.Random(seed * 1000 + divisions * 10 + max_split_size // MiB)
    standin.configure(max_split_size, divisions)
    ref = Reference(max_split_size, divisions)
    live = []  # (tensor or None, address, raw)
    stream = 0
    for step in range(250):
        op = rng.random()
        if op < 0.5 or not live:
            n = random_size(rng)
            if rng.random() < 0.2:
                addr = standin.raw_alloc(n)
                live.append((None, addr))
            else:
                t, addr = standin.alloc(n)
                live.append((t, addr))
            assert addr == ref.alloc(n, stream), (step, n)
        elif op < 0.85:
            t, addr = live.pop(rng.randrange(len(live)))
            pending = t is not None and rng.random() < 0.2
            if t is None:
                standin.raw_free(addr)
            else:
                if pending:
                    standin.record_stream(t)
                del t
            ref.free(addr, pending)
        elif op < 0.9:
            standin.lib.sa_process_events()
            ref.process_events()
        elif op < 0.95:
            stream = rng.choice([0, 0, 7])
            standin.set_stream(stream)
        else:
            assert standin.empty_cache() == ref.empty_cache()
        assert shape(standin.snapshot()) == ref.snapshot(), step
        assert standin.allocated() == ref.allocated
    t = None
    for held, addr in live:  # everything freed and its events done: every segment goes back
        if held is None:
            standin.raw_free(addr)
        ref.free(addr)
    held = None
    live.clear()  # the tensors' last references: their deleters run
    assert standin.allocated() == ref.allocated == 0
    assert standin.empty_cache() == ref.empty_cache()
    assert standin.snapshot() == [] and ref.segments == []
    # the same segments asked for, in the same order; the same ones given back (the
    # order within one empty_cache() is no rule)
    assert [c for c in standin.driver.calls if c[0] == "alloc"] == [c for c in ref.driver.calls if c[0] == "alloc"]
    assert sorted(c for c in standin.driver.calls if c[0] == "free") == \
        sorted(c for c in ref.driver.calls if c[0] == "free")
