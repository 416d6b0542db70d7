"""tracemalloc's shape where memviz claims it: get_traced_memory() /
reset_peak() for the running tracker, and Snapshot.filter_traces() with
memviz.Filter / memviz.DomainFilter. (Traceback's order is in test_snapshot.py.)"""

import pytest

import memviz
from conftest import here
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

MiB = 1 << 20


def alloc(fake, size, device=0):
    fake.set_device(device)
    try:
        return fake.alloc(CBID_cuMemAlloc_v2, size)
    finally:
        fake.set_device(0)


# ---- get_traced_memory / reset_peak ---------------------------------------------------


def test_get_traced_memory_is_current_and_peak_of_the_running_tracker(fake):
    with memviz.track() as t:
        a = alloc(fake, 8 * MiB)
        alloc(fake, 2 * MiB)
        fake.free(CBID_cuMemFree_v2, a)
        assert memviz.get_traced_memory() == (2 * MiB, 10 * MiB) == (t.current_bytes(), t.peak_bytes())
        assert memviz.get_traced_memory(device=0) == (2 * MiB, 10 * MiB)
        assert memviz.get_traced_memory(device=3) == (0, 0)  # a device nothing was allocated on


def test_get_traced_memory_sums_cuda_devices_and_leaves_out_pinned_host(fake):
    from fake_cupti import CBID_cuMemHostAlloc

    with memviz.track():
        a = alloc(fake, 4 * MiB, device=0)
        alloc(fake, 6 * MiB, device=1)
        fake.free(CBID_cuMemFree_v2, a)
        fake.alloc(CBID_cuMemHostAlloc, 16 * MiB)  # pinned host memory: device -1
        assert memviz.get_traced_memory(device=0) == (0, 4 * MiB)
        assert memviz.get_traced_memory(device=1) == (6 * MiB, 6 * MiB)
        assert memviz.get_traced_memory(device=-1) == (16 * MiB, 16 * MiB)
        # each device's own peak, summed: never below current
        assert memviz.get_traced_memory() == (6 * MiB, 10 * MiB)


def test_reset_peak_restarts_the_peak_at_the_current_figure(fake):
    with memviz.track() as t:
        big = alloc(fake, 64 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB); kept_line = here()  # noqa: E702
        fake.free(CBID_cuMemFree_v2, big)
        assert memviz.get_traced_memory() == (4 * MiB, 68 * MiB)
        memviz.reset_peak()
        assert memviz.get_traced_memory() == (4 * MiB, 4 * MiB)
        assert t.peak_bytes(0) == 4 * MiB
        # the peak set is what is live now: the freed 64 MiB is not in it
        peak = t.peak_snapshot(0)
        assert peak.total_bytes() == 4 * MiB
        assert [a.user_frame.lineno for a in peak] == [kept_line]
        x = alloc(fake, 8 * MiB)
        fake.free(CBID_cuMemFree_v2, x)
        assert memviz.get_traced_memory() == (4 * MiB, 12 * MiB)
        assert t.peak_snapshot(0).total_bytes() == 12 * MiB
    assert t.peak_bytes() == 12 * MiB  # the stopped tracker keeps the peak since the reset


def test_reset_peak_of_a_nested_tracker_leaves_the_outer_peak(fake):
    with memviz.track() as outer:
        big = alloc(fake, 64 * MiB)
        fake.free(CBID_cuMemFree_v2, big)
        with memviz.track() as inner:
            x = alloc(fake, 16 * MiB)
            fake.free(CBID_cuMemFree_v2, x)
            alloc(fake, 1 * MiB)
            assert memviz.get_traced_memory() == (1 * MiB, 16 * MiB)  # the running (inner) tracker's
            memviz.reset_peak()
            assert memviz.get_traced_memory() == (1 * MiB, 1 * MiB)
            assert inner.peak_snapshot(0).total_bytes() == 1 * MiB
        assert outer.peak_bytes(0) == 64 * MiB
        assert memviz.get_traced_memory() == (1 * MiB, 64 * MiB)


def test_get_traced_memory_and_reset_peak_without_a_tracker_say_what_to_do():
    assert memviz.active_tracker() is None
    for call in (memviz.get_traced_memory, memviz.reset_peak):
        with pytest.raises(memviz.NotTracking, match=r"memviz\.track\(\)"):
            call()


def test_get_traced_memory_without_gpu_capture_is_zero():
    with memviz.track(gpu=False):
        assert memviz.get_traced_memory() == (0, 0)
        memviz.reset_peak()
        assert memviz.get_traced_memory() == (0, 0)


def test_get_traced_memory_checks_its_argument(fake):
    with memviz.track():
        with pytest.raises(memviz.InvalidArgumentType, match="device"):
            memviz.get_traced_memory(device="cuda:0")


def test_reset_peak_while_other_threads_allocate_and_free(fake):
    """The reset runs under the store's lock: native threads allocating and
    freeing all along never leave a peak below the current figure or a peak
    set that does not add up to the peak."""
    import threading

    stop = threading.Event()

    def churn():
        while not stop.is_set():
            fake.alloc_free_loop(200, size=64 << 10)  # releases the GIL (ctypes)

    with memviz.track() as t:
        workers = [threading.Thread(target=churn) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            for _ in range(300):
                memviz.reset_peak()
                current, peak = memviz.get_traced_memory(device=0)
                assert peak >= current
        finally:
            stop.set()
            for w in workers:
                w.join()
        memviz.reset_peak()
        fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
        assert memviz.get_traced_memory(device=0) == (3 * MiB, 3 * MiB)
        assert t.peak_snapshot(0).total_bytes() == 3 * MiB
