"""Issue 24 (hardening, third pass), items 11, 13 and 15: snapshots at scale,
a label table that never runs out, and threads renamed after they start."""

import threading

import pytest

import memviz
import memviz._core as _core
from fake_cupti import CBID_cuMemAlloc_v2


# ---- item 15: a thread renamed after it starts ---------------------------------


def test_a_thread_renamed_after_it_starts_shows_its_new_name(fake, tmp_path):
    """Snapshots, traces and dumps name a thread by its name when they name
    it, not the one it had when memviz first saw it."""
    go = threading.Event()
    ready = threading.Semaphore(0)

    def work():
        fake.alloc(CBID_cuMemAlloc_v2, 4096)
        ready.release()
        go.wait(10)
        fake.alloc(CBID_cuMemAlloc_v2, 8192)

    already = threading.Thread(target=work, name="first-running")
    already.start()  # running before tracking: noted from outside
    assert ready.acquire(timeout=10)
    trace = tmp_path / "t.memviz"
    with memviz.track(trace=str(trace)) as t:
        th = threading.Thread(target=work, name="first-started")
        th.start()  # noted as it starts, under its first name
        assert ready.acquire(timeout=10)
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)  # the main thread
        assert {a.thread.name for a in t.snapshot()} >= {"first-started", "MainThread"}
        th.name, already.name = "second-started", "second-running"
        go.set()
        th.join()
        already.join()
        names = {a.thread.name for a in t.snapshot()}
        assert {"second-started", "second-running"} <= names, names
        assert not names & {"first-started", "first-running"}, names
        dump = tmp_path / "d.memviz"
        t.save(str(dump))
    assert {"second-started", "second-running"} <= {a.thread.name for a in t.snapshot()}
    for path in (trace, dump):
        back = {a.thread.name for a in memviz.load(str(path)).snapshot()}
        assert {"second-started", "second-running"} <= back, (path.name, back)


# ---- item 13: the label table never ran out... until it did ----------------------

LABELS_OVER_TRACKERS = """
import json, sys, threading, warnings
sys.path[:0] = [{root!r}, {tests!r}]
import memviz
from fake_cupti import FakeCupti
fake = FakeCupti({fake_path!r})
warnings.simplefilter("ignore")
kept = memviz.label("made before any tracker")
held, go, done = threading.Event(), threading.Event(), threading.Event()
def hold():  # a thread inside a label block while the next tracker starts
    with memviz.label("held across the start"):
        held.set()
        go.wait(60)
        fake.alloc({cbid}, 3 << 20)
    done.set()
th = threading.Thread(target=hold)
th.start()
held.wait(30)
with memviz.track(torch=False) as t1:
    for i in range(66000):  # past the table: the last ones overflow
        with memviz.label(f"first {{i}}"):
            fake.alloc({cbid}, 4096 + i)
first = {{a.size: a.label for a in t1.snapshot()}}
results = []
for n in range(3):  # later trackers: fresh ids, each with its own names
    with memviz.track(torch=False, trace={trace!r} + str(n)) as t:
        if n == 0:
            go.set()
            th.join()
        for i in range(40000):
            with memviz.label(f"tracker {{n}} label {{i}}"):
                fake.alloc({cbid}, 4096 + i)
        with kept:
            fake.alloc({cbid}, 1 << 20)
    snap = {{a.size: a.label for a in t.snapshot()}}
    loaded = {{a.size: a.label for a in memviz.load({trace!r} + str(n)).snapshot()}}
    results.append(dict(
        wrong=sum(snap[4096 + i] != f"tracker {{n}} label {{i}}" for i in range(40000)),
        kept=snap[1 << 20], held=snap.get(3 << 20), same=snap == loaded,
        info=t.capture_info()["store"]))
print("RESULT " + json.dumps(dict(
    first_overflowed=sum(v == memviz._core.LABEL_OVERFLOW for v in first.values()),
    first_named=first[4096] == "first 0", results=results, t1_after=first == {{a.size: a.label for a in t1.snapshot()}})))
"""


def test_label_ids_are_reused_by_later_trackers(fake_path, tmp_path):
    """Issue 24, item 13: after 65,534 labels every new label of every later
    tracker was '<labels overflowed>'. Ids no label block holds are freed
    when a new outermost tracker starts: later trackers name theirs, a label
    object made earlier and a block held across the start keep their names,
    traces name them too, and earlier trackers' snapshots are unchanged.
    (A subprocess: the table lives as long as the process.)"""
    from test_capture import _run_script

    r = _run_script(LABELS_OVER_TRACKERS, fake_path=fake_path, cbid=CBID_cuMemAlloc_v2,
                    trace=str(tmp_path / "labels.memviz"))
    assert r["first_overflowed"] > 0 and r["first_named"] and r["t1_after"]
    for n, res in enumerate(r["results"]):
        assert res["wrong"] == 0, (n, res)
        assert res["kept"] == "made before any tracker", (n, res)
        assert res["same"], n
        assert res["info"]["labels_overflowed"] == 0, (n, res["info"])
    assert r["results"][0]["held"] == "held across the start"
    assert r["results"][-1]["info"]["label_reclaims"] >= 2


# ---- item 11: snapshots at scale ---------------------------------------------


def _same(stats, top):
    return [(str(s.key), s.size, s.count) for s in stats] == [(str(s.key), s.size, s.count) for s in top]


def test_top_is_the_statistics_head_without_an_object_per_allocation(fake, tmp_path):
    """Issue 24, item 11: snapshot() builds an object per live allocation
    (8 million took 55 s and 4 GB); Tracker.top(n) gives statistics()[:n]
    from groups the C core makes, live, nested and once frozen."""
    def site_a(n):
        fake.alloc_loop(n, 4096)  # many allocations, one line

    def site_b():
        for i in range(30):
            fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)

    lib = tmp_path / "deep_library.py"  # 20 library frames inside the user's line
    lib.write_text("def down(alloc, n):\n    return alloc() if n == 0 else down(alloc, n - 1)\n")
    memviz.frames.add_library_path(str(tmp_path))
    import importlib.util
    spec = importlib.util.spec_from_file_location("deep_library", lib)
    deep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deep)

    with memviz.track(torch=False) as t:
        site_a(20000)
        site_b()
        import functools
        deep.down(functools.partial(fake._c.fake_alloc, CBID_cuMemAlloc_v2, 9 << 20, 0, 0), 20)  # DEEP
        with memviz.label("lab"):
            fake.alloc(CBID_cuMemAlloc_v2, 3 << 20)
        fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 5 << 20)  # no Python frames
        with memviz.track(torch=False) as inner:
            site_b()
            site_a(100)
        for key in ("lineno", "filename", "label", "thread", "device"):
            stats = t.snapshot().statistics(key)
            assert _same(stats, t.top(None, key)), key
            assert _same(stats[:2], t.top(2, key)), key
        assert t.top(1)[0].count == 20100 and t.top(1)[0].size == 20100 * 4096
        nine = [s for s in t.top(None) if s.size == 9 << 20]
        assert len(nine) == 1 and nine[0].key.filename == __file__, nine  # this file's line, past 21 frames
        assert "DEEP" in open(__file__).read().splitlines()[nine[0].key.lineno - 1]
        assert _same(inner.snapshot().statistics("lineno"), inner.top(None))
        assert t.top(0) == []
    with memviz.track(torch=False):  # the store goes on: t reads its frozen copy
        fake.alloc(CBID_cuMemAlloc_v2, 7 << 20)
    assert _same(t.snapshot().statistics("lineno"), t.top(None))
    with pytest.raises(memviz.MemvizError):
        t.top(-1)
