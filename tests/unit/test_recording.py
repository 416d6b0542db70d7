"""The Recording protocol (memviz/model/recording.py): a live Tracker and a
loaded trace both are one, and give the same answers for the same recording.

Allocations go through the libcupti test double (the ``fake`` fixture), so
the tracker reads the real C store and the trace is the real file format.
"""

import threading
import warnings

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemAllocHost_v2, CBID_cuMemFree_v2, CUDA_ERROR_OUT_OF_MEMORY
from memviz.loaded import LoadedTrace
from memviz.model.recording import Recording, TotalsReads
from memviz.trace import format as F

MiB = 1 << 20


def _run(fake):
    """Two devices, host memory, a freed peak, a label, a thread, a failure."""
    keep = fake.alloc(CBID_cuMemAlloc_v2, 32 * MiB)
    with memviz.label("loading"):
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY)
    fake.free(CBID_cuMemFree_v2, tmp)
    th = threading.Thread(target=fake.alloc, args=(CBID_cuMemAlloc_v2, 3 * MiB), name="loader-1")
    th.start()
    th.join()
    fake.alloc(CBID_cuMemAllocHost_v2, 4096)
    fake.set_device(1)
    fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
    fake.set_device(0)
    return keep


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        return memviz.load(path)


def _failures(x):
    return [(f.size, f.device, f.kind, f.stream, f.result, f.label, f.timestamp_ns, f.thread.name,
             tuple(f.traceback), f.op) for f in x.failures]


def _answers(x):
    """What a reader asks of a recording, as plain data."""
    devices = sorted(x.totals())
    return {
        "current": x.current_bytes(), "peak": x.peak_bytes(),
        "per_device": {d: (x.current_bytes(d), x.peak_bytes(d)) for d in devices + [7]},
        "totals": {d: {k: v[k] for k in ("current", "peak", "allocs", "frees", "failed")}
                   for d, v in x.totals().items()},
        "live": sorted((a.address, a.size, a.device, a.kind, a.label) for a in x.snapshot()),
        "peak_set": sorted((a.address, a.size, a.device) for a in x.peak_snapshot()),
        "failures": _failures(x),
        "threads": sorted(name for _native, _ident, name in x.threads().values()),
    }


@pytest.mark.parametrize("mode", ["saved", "streamed"])
def test_a_tracker_and_its_loaded_trace_are_recordings_with_the_same_answers(fake, tmp_path, mode):
    path = tmp_path / "run.memviz"
    with memviz.track(torch=False, **({"trace": str(path)} if mode == "streamed" else {})) as t:
        _run(fake)
    if mode == "saved":
        t.save(path)
    loaded = _load(path)
    assert isinstance(t, Recording) and isinstance(loaded, Recording)
    assert t.is_live and not loaded.is_live
    mine, theirs = _answers(t), _answers(loaded)
    assert mine == theirs
    assert mine["current"] == (32 + 3 + 5) * MiB and mine["peak"] == (32 + 64) * MiB
    assert mine["failures"][0][:6] == (1 << 40, 0, "device", 0, CUDA_ERROR_OUT_OF_MEMORY, "loading")
    assert "loader-1" in mine["threads"]


def test_a_nested_tracker_and_its_saved_trace_give_the_same_answers(fake, tmp_path):
    with memviz.track(torch=False):
        fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)
        with memviz.track(torch=False) as inner:
            _run(fake)
            running = _answers(inner)  # read through the open window of the store
        inner.save(tmp_path / "inner.memviz")
    loaded = _load(tmp_path / "inner.memviz")
    assert isinstance(inner, Recording) and isinstance(loaded, Recording)
    assert _answers(inner) == _answers(loaded) == running
    assert inner.current_bytes() == loaded.current_bytes() == (32 + 3 + 5) * MiB  # not the outer 16 MiB


def test_the_failures_are_built_one_way_for_both(fake, tmp_path):
    """A tracker whose failures were frozen (a newer tracker reused the
    store) and the trace saved from it list the same failures."""
    with memviz.track(torch=False) as t:
        _run(fake)
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 41, result=CUDA_ERROR_OUT_OF_MEMORY)
    with memviz.track(torch=False):  # freezes t
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    t.save(tmp_path / "frozen.memviz")
    assert [f[0] for f in _failures(t)] == [1 << 40, 1 << 41]
    assert _failures(t) == _failures(_load(tmp_path / "frozen.memviz"))
    assert all(isinstance(f, memviz.FailedAllocation) for f in t.failures)


def test_a_tracker_that_never_started_is_a_recording_without_being_read():
    t = memviz.Tracker(gpu=False)
    assert isinstance(t, Recording)  # failures is a property that raises NotTracking here
    with pytest.raises(memviz.NotTracking):
        t.failures


def test_what_lacks_a_member_is_not_a_recording(tmp_path):
    class Partial(TotalsReads):
        is_live, steps, failures = False, [], []

        def totals(self):
            return {}

    assert not isinstance(Partial(), Recording)
    assert not isinstance(object(), Recording)


def test_current_and_peak_bytes_have_one_implementation():
    assert memviz.Tracker.current_bytes is LoadedTrace.current_bytes is TotalsReads.current_bytes
    assert memviz.Tracker.peak_bytes is LoadedTrace.peak_bytes is TotalsReads.peak_bytes
