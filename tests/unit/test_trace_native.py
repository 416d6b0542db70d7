"""The native trace writer (src/trace_writer.c): the file it writes holds
what the Python writer's holds, Python does no per-event work, and a failed
write never reaches the program."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.trace import format as F
from memviz.trace.writer import TraceWriter

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not memviz._core.zlib_available(),
                                reason="libz.so.1 cannot be loaded here, so traces use the Python writer")


def workload(fake):
    kept = []
    for i in range(3000):
        a = fake.alloc(CBID_cuMemAlloc_v2, 4096 * (1 + i % 13))
        if i % 5:
            fake.free(CBID_cuMemFree_v2, a)
        else:
            kept.append(a)
    fake.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=2)
    return kept


def record(fake, path, writer, monkeypatch):
    monkeypatch.setenv("MEMVIZ_TRACE_WRITER", writer)
    with memviz.track(trace=str(path), torch=False) as t:
        w = next(p for p in t.subscribers if isinstance(p, TraceWriter))
        assert w.native == (writer == "native")
        with memviz.label("phase"):
            workload(fake)
    return w


def events(trace):
    return [(e.op, e.size, e.label, e.traceback.user_frame.lineno if e.traceback else None)
            for e in trace.events()]


def test_the_native_file_holds_what_the_python_writers_does(fake, tmp_path, monkeypatch):
    a, b = tmp_path / "native.memviz", tmp_path / "python.memviz"
    wa = record(fake, a, "native", monkeypatch)
    fake.reset()
    record(fake, b, "python", monkeypatch)
    ta, tb = memviz.load(a), memviz.load(b)
    assert not ta.truncated and events(ta) == events(tb) and len(events(ta)) == 5401
    def counts(t):
        return {d: {k: v for k, v in x.items() if "timestamp" not in k} for d, x in t.totals().items()}
    assert counts(ta) == counts(tb) and ta.dropped_events == 0
    assert wa.events_written == 5401 and wa.dropped == 0
    # The same compression of the same planes (chunks may split at other events).
    assert os.path.getsize(a) < 1.5 * os.path.getsize(b), (os.path.getsize(a), os.path.getsize(b))
    assert os.path.getsize(a) / 5401 < 4


def test_python_does_no_per_event_work(fake, tmp_path, monkeypatch):
    """Events never pass through Python: the drain the Python writer uses is
    never called, and the file still holds them all."""
    def no(*a):
        raise AssertionError("events went through Python")
    monkeypatch.setattr(memviz._core, "trace_drain", no)
    path = tmp_path / "n.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        fake.alloc_free_loop(20000)
        w = next(p for p in t.subscribers if isinstance(p, TraceWriter))
        w.flush()
    assert w.error is None and memviz.load(path).event_count >= 40000


def test_a_full_disk_stops_the_native_writer_not_the_program(fake_path, tmp_path):
    """RLIMIT_FSIZE makes write(2) fail part-way (EFBIG), as a full disk
    would: the program goes on, a TraceWarning says how far the file goes,
    and it loads up to there."""
    (tmp_path / "prog.py").write_text(textwrap.dedent("""
        import os, resource, signal, sys, time, warnings
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
        import memviz
        fake = FakeCupti()
        # Room for several whole chunks (65,536 events, about 200 KB each),
        # however many events the writer takes at a time.
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with memviz.track(trace="t.memviz", torch=False) as t:
                for i in range(40):
                    fake.alloc_free_loop(20000)
                    time.sleep(0.03)  # the writer thread writes a chunk or two
                print("current", t.current_bytes())
        print("warned", [str(x.message) for x in w if "incomplete" in str(x.message)])
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               MEMVIZ_CUPTI_LIBRARY=fake_path)
    p = subprocess.run([sys.executable, "prog.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "current 0" in p.stdout and "File too large" in p.stdout, p.stdout
    assert os.path.getsize(tmp_path / "t.memviz") <= 1_000_000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        trace = memviz.load(str(tmp_path / "t.memviz"), recover=True)
    assert trace.truncated and 65536 <= trace.event_count < 40 * 40000, trace.event_count


def test_each_trace_gets_the_ring_it_asks_for(fake, tmp_path):
    """A flight recorder's small ring (16 MiB: 52,428 events) must not stay
    the ring of a later trace, which asks for a million: 400,000 events at
    once, faster than any drain, all kept."""
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False):
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    path = tmp_path / "after.memviz"
    with memviz.track(trace=str(path), torch=False):
        fake.lib.fake_alloc_free_loop(CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, 200_000, MiB)
    trace = memviz.load(path)
    assert trace.dropped_events == 0 and trace.event_count >= 400_000


def test_a_stopped_tracker_with_a_trace_sums_its_category_series_in_c(fake, tmp_path):
    """The HTML report of a tracker that streamed a trace takes the loaded
    trace's pass over its file (the same series as its events() through the C pass)."""
    from memviz.report import _categories

    path = tmp_path / "c.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        for i in range(200):
            a = fake.alloc(CBID_cuMemAlloc_v2, MiB * (1 + i % 3))
            if i % 4:
                fake.free(CBID_cuMemFree_v2, a)
    allocs = list(t.snapshot().allocations)
    known = {(a.device, a.address, a.timestamp_ns, a.kind): "activation" for a in allocs}
    fast = t._category_series(known, t.stopped_ns)
    assert fast is not None and fast == memviz.load(path)._category_series(known, t.stopped_ns)
    assert fast[0]["activation"][1][-1] == sum(a.size for a in allocs) == 99 * MiB
    # Through the report's own entry point: the pass over the file, and the
    # same last levels as the pass over the events() repacked.
    via_report, note = _categories.category_series(t, allocs, [], {}, t.stopped_ns)
    slow, _ = _categories.category_series(type("NoFastPath", (), {"events": t.events})(), allocs, [], {},
                                          t.stopped_ns)
    assert note == "from the recorded events"
    assert {c: v[1][-1] for c, v in via_report[0].items()} == {c: v[1][-1] for c, v in slow[0].items()}
