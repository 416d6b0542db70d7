"""Thread names and the label table: a thread renamed after it starts is
shown by its new name in snapshots, traces and dumps; label ids no label
block holds are reused by later trackers, so the table never runs out."""

import threading

import memviz
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
