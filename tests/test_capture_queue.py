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


def test_a_full_queue_is_applied_by_the_allocating_thread_and_nothing_is_lost(fake):
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


def test_an_allocation_storm_wakes_the_drainer_before_its_period(fake):
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
