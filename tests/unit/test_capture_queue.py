"""The capture queue (src/capq.c): the capture path hands its events to the
store without taking the store's lock, and every reader applies what the
queue holds before it reads. Nothing may be lost, reordered or read half
written, whether the queue fills, readers race the writers, or the process
forks while threads allocate."""

import os
import threading
import time

import pytest

import memviz
from memviz import _core
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

MiB = 1 << 20


def at_depth(k, fn):
    return at_depth(k - 1, fn) if k > 0 else fn()


@pytest.fixture
def unshared():
    """Every frame of every allocation written into the queue: a C loop
    allocates from one stack, whose frames are else written once and then
    left out (test_an_allocation_queues_only_the_frames_that_changed)."""
    was = _core._share_frames(False)
    yield
    _core._share_frames(was)


def test_a_full_queue_is_applied_by_the_allocating_thread_and_nothing_is_lost(fake, unshared):
    """256 frames an allocation take 65 of the queue's 65,536 units: 20,000
    allocations fill it many times over while its drainer thread is paused.
    The allocating thread then applies it itself."""
    n = 20000
    with memviz.track(depth=256, torch=False) as t:
        _core._drainer(False)  # else it may keep up, where cores are free
        try:
            full = _core.stats()["queue_full"]
            at_depth(300, lambda: fake.alloc_loop(n, 4096))
            stats = _core.stats()
        finally:
            _core._drainer(True)
        tot = t.totals()[0]
    assert stats["queue_full"] > full, stats
    assert (tot["allocs"], tot["current"], tot["live_count"]) == (n, n * 4096, n), tot
    allocs = t.snapshot().allocations
    assert len(allocs) == n
    assert {len(a.traceback) for a in allocs} == {256}
    assert _core.stats()["queue_events"] >= n


def test_an_allocation_storm_wakes_the_drainer_before_its_period(fake, unshared):
    """The drainer runs every 4 ms, but 256-frame allocations from a C loop
    fill a quarter of the queue (250 of them) far sooner: the allocating
    thread wakes it then (counted in queue_kicks), and every event is still
    applied once, in order."""
    n = 20000
    with memviz.track(depth=256, torch=False) as t:
        first = _core.stats()
        before = first["queue_kicks"]
        at_depth(300, lambda: fake.alloc_loop(n, 4096))
        stats = _core.stats()
        tot = t.totals()[0]
        live = len(t.snapshot().allocations)
    assert stats["queue_kicks"] > before, stats
    # counted as the store applies them, not by the capture path: each once
    assert stats["calls"]["alloc"] - first["calls"]["alloc"] == n, stats["calls"]
    assert (tot["allocs"], tot["current"], tot["live_count"], live) == (n, n * 4096, n, n), tot


def test_readers_racing_allocating_threads_see_whole_consistent_states(fake):
    """Four native threads allocate and free flat out while this thread reads:
    every read sees only whole events (its live allocations add up to its
    totals), and at the end every event is counted once."""
    done = threading.Event()
    errors = []

    def hammer():
        try:
            if fake.alloc_many_in_native_threads(4, 30000, 4096) != 0:
                errors.append("alloc_many failed")
        finally:
            done.set()

    with memviz.track(torch=False) as t:
        th = threading.Thread(target=hammer)
        th.start()
        reads = 0
        while not done.is_set() or reads < 5:
            snap = t.snapshot()
            tot = t.totals().get(0)
            assert snap.total_bytes() % 4096 == 0
            assert snap.total_bytes() <= 4 * 4096
            if tot is not None:
                assert tot["peak"] <= 4 * 4096, tot
            reads += 1
        th.join()
    assert not errors
    tot = t.totals()[0]
    assert (tot["allocs"], tot["frees"], tot["current"]) == (120000, 120000, 0), tot
    assert reads >= 5


def test_an_allocation_is_in_the_store_before_the_next_python_line_reads_it(fake):
    """No waiting for the drainer: a read right after the call sees it."""
    with memviz.track(torch=False) as t:
        for i in range(200):
            a = fake.alloc(CBID_cuMemAlloc_v2, MiB)
            assert t.current_bytes() == MiB, i
            fake.free(CBID_cuMemFree_v2, a)
            assert t.current_bytes() == 0, i


def test_events_keep_their_order_across_threads(fake):
    """An address freed on one thread and made again on another is live
    once, with the second line: the queue applies events in the order the
    threads claimed them."""
    with memviz.track(torch=False) as t:
        for _ in range(300):
            a = fake.alloc(CBID_cuMemAlloc_v2, MiB)
            th = threading.Thread(target=fake.free, args=(CBID_cuMemFree_v2, a))
            th.start()
            th.join()
        last = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    snap = t.snapshot()
    assert [(a.address, a.size) for a in snap.allocations] == [(last, 2 * MiB)]
    tot = t.totals()[0]
    assert (tot["allocs"], tot["frees"]) == (301, 300), tot
    assert t.capture_info()["store"]["unmatched_frees"] == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_threads_fill_the_queue_leaves_a_readable_child(fake):
    """Entries other threads claimed in the parent may never be published in
    the child: the child drops them and reads its store without hanging."""
    started = threading.Event()

    def hammer():
        started.set()
        fake.alloc_many_in_native_threads(3, 200000, 4096)

    with memviz.track(depth=64, torch=False) as t:
        th = threading.Thread(target=hammer)
        th.start()
        started.wait()
        time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            code = 5
            try:
                t.totals()
                t.snapshot()
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                pytest.fail("the forked child hung reading its store")
            time.sleep(0.01)
        th.join()
    assert os.waitstatus_to_exitcode(status) == 0
    tot = t.totals()[0]
    assert (tot["allocs"], tot["frees"], tot["current"]) == (600000, 600000, 0), tot


@pytest.mark.parametrize("tsc", [True, False], ids=["tsc", "vdso"])
def test_event_times_are_the_monotonic_clock_whichever_tick_the_capture_path_reads(fake, tsc):
    """The capture path reads the CPU's time-stamp counter where it is
    invariant (src/clock.c), else the vDSO's clock; the store turns ticks
    into CLOCK_MONOTONIC nanoseconds as it applies the queue. Either way an
    allocation's time lies between Python's time.monotonic_ns() read just
    before and just after it, a free's too (the timeline's points), even
    when the queue is applied long after the event (the drainer paused)."""
    was, rate = _core._clock()
    if tsc and rate == 0:
        pytest.skip("this machine's TSC is not invariant, or its kernel does not keep time with it:"
                    " the capture path reads the vDSO's clock, the other case")
    slack = 20_000  # ns: the conversion's rounding and rate, far under any window here
    _core._clock(tsc)
    try:
        with memviz.track(torch=False) as t:
            made, gone = [], []
            for paused in (False, True):
                if paused:
                    _core._drainer(False)
                for _ in range(6):
                    before = time.monotonic_ns()
                    a = fake.alloc(CBID_cuMemAlloc_v2, MiB)
                    made.append((a, before, time.monotonic_ns()))
                    time.sleep(0.003)
                for a, _, _ in made[-6:]:
                    before = time.monotonic_ns()
                    fake.free(CBID_cuMemFree_v2, a)
                    gone.append((before, time.monotonic_ns()))
                    time.sleep(0.003)
                if paused:
                    time.sleep(0.05)  # applied 50 ms after the last event, by this read
                    t.totals()
                    _core._drainer(True)
            points = [p for p in _core.timeline() if p.device == 0]
            tot = t.totals()[0]
    finally:
        _core._clock(was)
    assert (tot["allocs"], tot["frees"]) == (12, 12), tot
    # The timeline has a point at every change: 12 rises and 12 falls, in order.
    times = [p.timestamp_ns for p in points]
    assert times == sorted(times) and len(set(times)) == len(times)
    rises = [p.timestamp_ns for prev, p in zip(points, points[1:]) if p.bytes > prev.bytes]
    falls = [p.timestamp_ns for prev, p in zip(points, points[1:]) if p.bytes < prev.bytes]
    if points and points[0].bytes > 0:
        rises.insert(0, points[0].timestamp_ns)
    assert len(rises) == 12 and len(falls) == 12, points
    order = sorted([(b, e, "made") for _, b, e in made] + [(b, e, "gone") for b, e in gone])
    got = sorted([(ts, "made") for ts in rises] + [(ts, "gone") for ts in falls])
    for (b, e, what), (ts, kind) in zip(order, got):
        assert kind == what and b - slack <= ts <= e + slack, (what, b, ts, e)


# ---- an allocation's frames, as far as they changed (store.c) -------------------------

def _descend(path, i, fn):
    if i == len(path):
        return fn()
    return (_step_a if path[i] == "a" else _step_b)(path, i + 1, fn)


def _step_a(path, i, fn):
    return _descend(path, i, fn)  # a frame at this line


def _step_b(path, i, fn):
    return _descend(path, i, fn)  # and another at this one


def _program(seed, n, base):
    """n allocations, each of its own size (base + i pages), each from a call
    path that keeps a random part of the previous one's outer end and
    changes the rest: depths from 0 to 90 frames, the middle of the stack
    changing as well as its depth. Some are freed along the way."""
    import random

    rnd = random.Random(seed)
    path, steps = [], []
    for i in range(n):
        keep = rnd.randint(0, len(path))
        path = path[:keep] + [rnd.choice("ab") for _ in range(rnd.randint(0, 6))]
        if len(path) > 45:
            path = path[:rnd.randint(0, 45)]
        steps.append((list(path), base + (i + 1) * 4096, rnd.random() < 0.2))
    return steps


def _site(fake, size):
    """The innermost Python frame, on one of two lines (the double's C entry
    called directly): two stacks that differ in that frame alone."""
    if size & (1 << 13):
        return fake._c.fake_alloc(CBID_cuMemAlloc_v2, size, 0, 0)
    return fake._c.fake_alloc(CBID_cuMemAlloc_v2, size, 0, 0)


def _run(fake, steps):
    live = []
    for path, size, free_one in steps:
        live.append(_descend(path, 0, lambda: _site(fake, size)))
        if free_one and len(live) > 1:
            fake.free(CBID_cuMemFree_v2, live.pop(0))
    return live


def _tracebacks(fake, programs, depth, share):
    """Each program in its own thread, all at once; every live allocation's
    traceback, by size."""
    was = _core._share_frames(share)
    try:
        with memviz.track(depth=depth, torch=False) as t:
            first = _core.stats()
            threads = [threading.Thread(target=_run, args=(fake, p)) for p in programs]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            stats = _core.stats()
            stats = {k: stats[k] - first[k] for k in stats if k.startswith("queue_")}
            got = {a.size: tuple((f.filename, f.lineno, f.name) for f in a.traceback)
                   for a in t.snapshot().allocations}
    finally:
        _core._share_frames(was)
    return got, stats


@pytest.mark.parametrize("depth", [8, 32, 256])
def test_an_allocation_queues_only_the_frames_that_changed_and_reads_back_whole(fake, depth):
    """The capture path writes into the queue only the innermost frames that
    differ from the previous stack the same thread queued; the store joins
    the rest back from that stack. Three threads at once, each allocating
    from call paths that change at random in depth and in the middle
    (stacks deeper than `depth` included, where the walk keeps the user's
    outer frames): every allocation's traceback is the one read with every
    frame written, and the Python call path it was made from."""
    programs = [_program(seed, 400, base=k << 30) for k, seed in enumerate((1, 2, 3))]
    whole, _ = _tracebacks(fake, programs, depth, share=False)
    shared, stats = _tracebacks(fake, programs, depth, share=True)
    assert shared == whole
    assert stats["queue_kept_mismatch"] == 0, stats
    assert stats["queue_frames_kept"] > 0, stats
    # and the tracebacks are right, not only alike: the call path's lines, in order
    line_a = _step_a.__code__.co_firstlineno + 1
    line_b = _step_b.__code__.co_firstlineno + 1
    for prog in programs:
        alive = {size for _, size, _ in prog} & set(shared)
        for path, size, _ in prog:
            if size not in alive:
                continue
            steps = [ln for fn, ln, name in shared[size] if name in ("_step_a", "_step_b")]
            want = [line_a if c == "a" else line_b for c in path]
            if len(shared[size]) < depth:  # the whole stack kept
                assert steps == want, (path, shared[size])
            else:  # cut: the kept steps are a run of the path's (outer end first)
                s = ",".join(map(str, steps))
                assert s in ",".join(map(str, want)), (path, steps)


def test_a_loop_on_one_line_writes_its_frames_into_the_queue_once(fake):
    """1,000 allocations from one C loop at one Python stack: the first
    writes its 32 frames, the others none, and every one reads back with
    all 32."""
    with memviz.track(depth=32, torch=False) as t:
        first = _core.stats()
        at_depth(40, lambda: fake.alloc_loop(1000, 4096))
        stats = _core.stats()
        allocs = t.snapshot().allocations
    written = stats["queue_frames_written"] - first["queue_frames_written"]
    kept = stats["queue_frames_kept"] - first["queue_frames_kept"]
    assert (written, kept) == (32, 999 * 32)
    assert len(allocs) == 1000 and {len(a.traceback) for a in allocs} == {32}
    assert len({tuple(a.traceback) for a in allocs}) == 1


def test_shared_frames_start_afresh_with_a_new_tracker(fake):
    """A thread's previous stack is forgotten when the store registers
    threads anew (a new tracker): the first allocation after writes all its
    frames, and none is joined to the last tracker's stack; the next one,
    from a shallower stack on another line, writes only the frames that
    differ, and reads back whole."""
    def deep(k, size):
        return at_depth(k, lambda: fake.alloc(CBID_cuMemAlloc_v2, size))

    with memviz.track(depth=256, torch=False):
        deep(3, MiB)
    with memviz.track(depth=256, torch=False) as t:
        first = _core.stats()
        deep(3, 3 * MiB)  # the same stack as the last tracker's allocation
        deep(2, 5 * MiB)
        now = _core.stats()
        snap = {x.size: [f.name.rsplit(".", 1)[-1] for f in x.traceback]
                for x in t.snapshot().allocations}
    w = now["queue_frames_written"] - first["queue_frames_written"]
    k = now["queue_frames_kept"] - first["queue_frames_kept"]
    me = "test_shared_frames_start_afresh_with_a_new_tracker"
    three = [me, "deep"] + ["at_depth"] * 4 + ["<lambda>", "alloc"]  # alloc: the double's
    two = [me, "deep"] + ["at_depth"] * 3 + ["<lambda>", "alloc"]
    outer = len(snap[3 * MiB]) - len(three)  # pytest's frames, the same for both
    assert outer > 0 and snap[3 * MiB][outer:] == three and snap[5 * MiB][outer:] == two, snap
    assert snap[3 * MiB][:outer] == snap[5 * MiB][:outer]
    # all of the first, after a new tracker; of the second, only what is not pytest's
    assert (w, k) == (outer + len(three) + len(two), outer), (w, k, outer)
    assert now["queue_kept_mismatch"] == 0


def _drainer_runs():
    """How many times memviz's drainer thread has been put on a CPU (Linux schedstat)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "memviz-drain":
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[2])
        except OSError:
            continue
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux's schedstat")
def test_a_benchmark_can_set_the_drainers_period(fake):
    """_drain_period (a benchmark's hook) sets how often the drainer wakes,
    from its next wait, and says what it was; 0 gives the default back, and
    a period out of range is refused with what is allowed."""
    with pytest.raises(ValueError, match="between 0 .the default. and 10 s"):
        _core._drain_period(-1)
    with pytest.raises(ValueError, match="between 0"):
        _core._drain_period(11 * 10**9)
    with memviz.track(torch=False):
        try:
            assert _core._drain_period(10**9) == 4_000_000  # the default: 4 ms
            time.sleep(0.02)  # the wait under way (at most 4 ms) ends
            r0 = _drainer_runs()
            time.sleep(0.3)
            slow = _drainer_runs() - r0
            assert _core._drain_period(1_000_000) == 10**9
            time.sleep(1.05)  # the 1 s wait under way ends
            r1 = _drainer_runs()
            time.sleep(0.3)
            fast = _drainer_runs() - r1
        finally:
            assert _core._drain_period(0) == 1_000_000
    assert _core._drain_period(0) == 4_000_000
    assert slow <= 2 and fast >= 30, (slow, fast)
