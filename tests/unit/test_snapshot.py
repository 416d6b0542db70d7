"""Tests for memviz.model.snapshot, using synthetic raw rows (no memviz._core)."""

import os
import sysconfig
import threading
import time

import pytest

from memviz import _core
from memviz.model.frame_filter import FrameFilter
from memviz.model.rows import snapshot_from_raw
from memviz.model.snapshot import Allocation, Snapshot, ThreadInfo
from memviz.model.statistics import Statistic, StatisticDiff
from memviz.model.traceback import Frame, Traceback

MiB, GiB = 1 << 20, 1 << 30
PURELIB = sysconfig.get_paths()["purelib"]
STDLIB = sysconfig.get_paths()["stdlib"]
TRAIN = "/home/alice/proj/train.py"
MODEL = "/home/alice/proj/model.py"
TORCH = os.path.join(PURELIB, "torch", "nn", "modules", "module.py")
CTX = os.path.join(STDLIB, "contextlib.py")

# stack id -> frames, innermost first
STACKS = {
    # train.py:3 -> torch module.py -> contextlib (innermost)
    1: ((CTX, 137, "__enter__"), (TORCH, 1518, "_call_impl"), (TRAIN, 3, "main")),
    # model.py:20 (called from train.py:7) directly allocates
    2: ((MODEL, 20, "forward"), (TORCH, 1518, "_call_impl"), (TRAIN, 7, "main")),
    # train.py:3 again via a different library path
    3: ((TORCH, 900, "to"), (TRAIN, 3, "main")),
    # unknown line numbers
    4: ((MODEL, None, "init"), (TRAIN, -1, "main")),
}
def thread(native_id, ident, name, serial=None):
    """An entry of the C core's thread table."""
    return _core.ThreadRow((native_id, ident, name, serial))


THREADS = {
    0: thread(1000, 111, "python3"),
    1: thread(1001, 222, "pt_autograd_0"),
}


def fake_resolve(calls=None):
    def resolve(ids):
        if calls is not None:
            calls.append(set(ids))
        return {i: STACKS[i] for i in ids if i in STACKS}
    return resolve


def row(addr, size, stack_id, *, device=0, kind=0, thread=0, label=None, seq=0, stream=0,
        requested=None, flags=0):
    return (addr, size, device, kind, stream, thread, label, 1_000 + seq, stack_id, seq,
            size if requested is None else requested, flags)


def base_rows():
    return [
        row(0x1000, 256 * MiB, 1, seq=1),                       # train.py:3
        row(0x2000, 64 * MiB, 3, seq=2),                        # train.py:3
        row(0x3000, 128 * MiB, 2, seq=3, label="model"),        # model.py:20
        row(0x4000, 32 * MiB, 0, thread=1, seq=4),              # autograd thread, frameless
        row(0x5000, 16 * MiB, 0, thread=1, seq=5, label="grads"),
        row(0x6000, 1 * MiB, 2, device=1, kind=1, seq=6),       # pinned host, device 1
    ]


@pytest.fixture
def flt():
    return FrameFilter()


@pytest.fixture
def snap(flt):
    return snapshot_from_raw(base_rows(), fake_resolve(), THREADS, flt, timestamp_ns=42)


def test_build_basic(snap):
    assert len(snap) == 6 and snap.timestamp_ns == 42
    a = snap.allocations[0]
    assert isinstance(a, Allocation)
    assert (a.address, a.size, a.device, a.kind, a.stream, a.label, a.timestamp_ns, a.seq) == (
        0x1000, 256 * MiB, 0, "device", 0, None, 1001, 1)
    assert a.thread == ThreadInfo(1000, 111, "python3")
    assert a.traceback[-1] == Frame(CTX, 137, "__enter__")  # oldest first: the innermost is last
    assert a.traceback[0] == Frame(TRAIN, 3, "main")
    assert a.user_frame == Frame(TRAIN, 3, "main")
    assert str(a.traceback) == f"{TRAIN}:3"
    assert [x.kind for x in snap] == ["device"] * 5 + ["host"]
    frameless = snap.allocations[3]
    assert frameless.traceback == () and frameless.traceback.user_frame is None
    assert frameless.thread.name == "pt_autograd_0"
    assert snap.devices == {0: None, 1: None}


def test_kinds_and_unknown_codes(flt):
    rows = [row(i, 1, 0, kind=k) for i, k in enumerate([0, 1, 2, 3, 4, 9])]
    snap = snapshot_from_raw(rows, fake_resolve(), THREADS, flt)
    assert [a.kind for a in snap] == ["device", "host", "managed", "static", "physical", "unknown(9)"]


def test_interning_and_resolve_called_once(flt):
    calls = []
    rows = base_rows() + [row(0x9000 + i, 1, 1) for i in range(10)]
    snap = snapshot_from_raw(rows, fake_resolve(calls), THREADS, flt)
    assert calls == [{1, 2, 3}]  # once, without stack id 0
    tbs = [a.traceback for a in snap if a.traceback == Traceback(Frame(*f) for f in reversed(STACKS[1]))]
    assert len(tbs) == 11 and all(t is tbs[0] for t in tbs)
    # frames shared between stacks are the same object
    torch_frames = {id(f) for a in snap for f in a.traceback if f == (TORCH, 1518, "_call_impl")}
    assert len(torch_frames) == 1
    assert snap.allocations[3].traceback is snap.allocations[4].traceback  # empty, shared


def test_unknown_lineno_and_unresolved_stack(flt):
    rows = [row(1, 10, 4), row(2, 20, 77)]
    snap = snapshot_from_raw(rows, fake_resolve(), THREADS, flt)
    tb = snap.allocations[0].traceback
    assert tb[-1] == Frame(MODEL, 0, "init") and tb[0].lineno == 0
    assert str(tb[-1]) == f"{MODEL}:?"
    assert any("line ?" in line for line in tb.format())
    assert str(snap.allocations[1].traceback) == "<unresolved stack>:?"


def test_statistics_lineno(snap):
    stats = snap.statistics("lineno")
    assert [(str(s.key), s.size, s.count) for s in stats] == [
        (f"{TRAIN}:3", 320 * MiB, 2),
        (f"{MODEL}:20", 129 * MiB, 2),
        ("<thread pt_autograd_0>", 48 * MiB, 2),
    ]
    top = stats[0]
    assert isinstance(top, Statistic)
    assert top.key == Frame(TRAIN, 3, "main")
    assert tuple(top.traceback) == (top.key,)
    assert str(top) == f"{TRAIN}:3: size=320 MiB, count=2, average=160 MiB"


def test_statistics_str_like_tracemalloc(flt):
    snap = snapshot_from_raw([row(1, 256 * MiB, 3)], fake_resolve(), THREADS, flt)
    (stat,) = snap.statistics("lineno")
    assert str(stat) == f"{TRAIN}:3: size=256 MiB, count=1, average=256 MiB"


def test_statistics_sorting_ties_on_count(flt):
    rows = [row(1, 100, 2), row(2, 50, 3), row(3, 50, 3)]  # 100 B each key
    snap = snapshot_from_raw(rows, fake_resolve(), THREADS, flt)
    stats = snap.statistics("lineno")
    assert [(s.size, s.count) for s in stats] == [(100, 2), (100, 1)]
    assert stats[0].key.filename == TRAIN


def test_statistics_filename(snap):
    stats = snap.statistics("filename")
    assert [(s.key, s.size, s.count) for s in stats] == [
        (TRAIN, 320 * MiB, 2), (MODEL, 129 * MiB, 2), ("<thread pt_autograd_0>", 48 * MiB, 2)]
    assert stats[0].traceback[0] == Frame(TRAIN, 0, "")


def test_statistics_traceback(snap):
    stats = snap.statistics("traceback")
    assert [(s.size, s.count) for s in stats] == [
        (256 * MiB, 1), (129 * MiB, 2), (64 * MiB, 1), (48 * MiB, 2)]
    assert stats[0].traceback is stats[0].key
    assert [f.lineno for f in stats[0].traceback] == [3, 1518, 137]  # oldest first
    assert str(stats[0]).startswith(f"{TRAIN}:3: size=256 MiB")


def test_statistics_cumulative(snap):
    stats = snap.statistics("lineno", cumulative=True)
    by_key = {(s.key.filename, s.key.lineno): (s.size, s.count) for s in stats}
    assert by_key[(TRAIN, 3)] == (320 * MiB, 2)
    assert by_key[(TRAIN, 7)] == (129 * MiB, 2)
    assert by_key[(TORCH, 1518)] == (385 * MiB, 3)  # stacks 1 and 2
    assert by_key[(TORCH, 900)] == (64 * MiB, 1)
    assert by_key[(CTX, 137)] == (256 * MiB, 1)
    assert by_key[("<thread pt_autograd_0>", 0)] == (48 * MiB, 2)
    assert [s.size for s in stats] == sorted((s.size for s in stats), reverse=True)

    files = {s.key: (s.size, s.count) for s in snap.statistics("filename", cumulative=True)}
    # TORCH appears in stacks 1, 2 and 3; counted once per allocation
    assert files[TORCH] == (449 * MiB, 4)
    assert files[TRAIN] == (449 * MiB, 4)
    assert files[CTX] == (256 * MiB, 1)


def test_cumulative_counts_repeated_frame_once(flt):
    rec = ((TRAIN, 5, "rec"), (TRAIN, 5, "rec"), (TRAIN, 9, "main"))
    snap = snapshot_from_raw([row(1, 10, 5)], lambda ids: {5: rec}, THREADS, flt)
    stats = {(s.key.lineno): (s.size, s.count) for s in snap.statistics("lineno", cumulative=True)}
    assert stats == {5: (10, 1), 9: (10, 1)}
    (f,) = snap.statistics("filename", cumulative=True)
    assert (f.size, f.count) == (10, 1)


def test_cumulative_rejected_for_other_keys(snap):
    for kt in ("traceback", "label", "device", "kind", "thread"):
        with pytest.raises(ValueError, match="cumulative"):
            snap.statistics(kt, cumulative=True)
    with pytest.raises(ValueError, match="unknown key_type"):
        snap.statistics("bogus")


def test_statistics_label(snap):
    stats = snap.statistics("label")
    assert [(s.key, s.size, s.count) for s in stats] == [
        ("<no label>", 321 * MiB, 3),  # includes the device-1 host allocation
        ("model", 128 * MiB, 1),
        ("<thread pt_autograd_0>", 32 * MiB, 1),  # frameless and unlabelled
        ("grads", 16 * MiB, 1),  # frameless but labelled: the label wins
    ]
    assert stats[1].traceback == ()
    assert str(stats[1]) == "model: size=128 MiB, count=1, average=128 MiB"


def test_statistics_device_kind_thread(snap):
    dev = snap.statistics("device")
    assert [(s.key, s.size, s.count) for s in dev] == [(0, 496 * MiB, 5), (1, 1 * MiB, 1)]
    assert str(dev[1]).startswith("cuda:1: size=1 MiB, count=1")
    kinds = snap.statistics("kind")
    assert [(s.key, s.count) for s in kinds] == [("device", 5), ("host", 1)]
    thr = snap.statistics("thread")
    assert [(s.key, s.size) for s in thr] == [("python3", 449 * MiB), ("pt_autograd_0", 48 * MiB)]


def test_compare_to(flt):
    old = snapshot_from_raw(
        [row(1, 256 * MiB, 1), row(2, 100 * MiB, 2), row(3, 8 * MiB, 0, thread=1)],
        fake_resolve(), THREADS, flt)
    new = snapshot_from_raw(
        [row(1, 256 * MiB, 1), row(4, 512 * MiB, 3), row(5, 110 * MiB, 2), row(6, 1, 2)],
        fake_resolve(), THREADS, flt)
    diffs = new.compare_to(old, "lineno")
    assert all(isinstance(d, StatisticDiff) for d in diffs)
    assert [(str(d.key), d.size, d.size_diff, d.count, d.count_diff) for d in diffs] == [
        (f"{TRAIN}:3", 768 * MiB, 512 * MiB, 2, 1),
        (f"{MODEL}:20", 110 * MiB + 1, 10 * MiB + 1, 2, 1),
        ("<thread pt_autograd_0>", 0, -8 * MiB, 0, -1),
    ]
    assert str(diffs[0]) == (
        f"{TRAIN}:3: size=768 MiB (+512 MiB), count=2 (+1), average=384 MiB")
    assert str(diffs[2]) == "<thread pt_autograd_0>: size=0 B (-8 MiB), count=0 (-1)"
    # unchanged keys are kept, with zero diffs
    same = new.compare_to(new, "label")
    assert [(d.size_diff, d.count_diff) for d in same] == [(0, 0)]
    # a diff against an empty snapshot equals the statistics
    vs_empty = new.compare_to(Snapshot([]), "traceback")
    assert [(d.size, d.size_diff) for d in vs_empty] == [
        (s.size, s.size) for s in new.statistics("traceback")]


def test_compare_to_cumulative(flt):
    old = snapshot_from_raw([row(1, 10, 1)], fake_resolve(), THREADS, flt)
    new = snapshot_from_raw([row(1, 10, 1), row(2, 5, 2)], fake_resolve(), THREADS, flt)
    diffs = {(d.key.filename, d.key.lineno): d.size_diff for d in new.compare_to(old, "lineno", True)}
    assert diffs[(TORCH, 1518)] == 5 and diffs[(CTX, 137)] == 0 and diffs[(MODEL, 20)] == 5


def test_filter_total_by_device(snap):
    assert snap.total_bytes() == 497 * MiB
    assert snap.total_bytes(0) == 496 * MiB and snap.total_bytes(1) == MiB
    assert snap.total_bytes(7) == 0
    big = snap.filter(lambda a: a.size >= 64 * MiB)
    assert isinstance(big, Snapshot) and len(big) == 3 and big.total_bytes() == 448 * MiB
    assert big.timestamp_ns == snap.timestamp_ns and big.frame_filter is snap.frame_filter
    per = snap.by_device()
    assert list(per) == [0, 1]
    assert [len(per[0]), len(per[1])] == [5, 1]
    assert per[1].allocations[0].kind == "host"
    assert repr(snap) == "<Snapshot 6 allocation(s), 497 MiB on cuda:0, cuda:1>"
    assert repr(Snapshot([])) == "<Snapshot 0 allocation(s), 0 B on no device>"


def test_devices_argument():
    assert Snapshot([], devices={0: "H200"}).devices == {0: "H200"}
    assert Snapshot([], devices=[0, 1]).devices == {0: None, 1: None}


def test_snapshot_frame_filter_changes_lineno(flt):
    snap = snapshot_from_raw([row(1, 10, 2)], fake_resolve(), THREADS, flt)
    assert snap.statistics("lineno")[0].key.filename == MODEL
    flt.add_library_path(MODEL)  # hide the model wrapper
    assert snap.statistics("lineno")[0].key == Frame(TRAIN, 7, "main")
    assert str(snap.allocations[0].traceback) == f"{TRAIN}:7"  # cached user frame refreshed
    flt.add_user_path(os.path.join(PURELIB, "torch"))
    assert snap.statistics("lineno")[0].key.filename == TORCH


def test_traceback_format():
    tb = Traceback([Frame("/x/outer.py", 9, "outer"), Frame(__file__, 1, "inner")])
    lines = tb.format()
    assert lines[0] == '  File "/x/outer.py", line 9, in outer'
    assert lines[1] == f'  File "{__file__}", line 1, in inner'
    assert lines[2] == '    """Tests for memviz.model.snapshot, using synthetic raw rows (no memviz._core)."""'
    assert tb.format(most_recent_first=True)[0] == f'  File "{__file__}", line 1, in inner'
    assert tb.format(limit=1) == lines[1:]
    assert tb.format(limit=-1) == lines[:1]
    assert str(Traceback()) == "<no Python frames>"
    assert hash(tb) == hash(Traceback(list(tb)))


def test_traceback_format_of_file_names_the_os_cannot_take():
    # A code object's file name can hold what no path holds: a lone
    # surrogate (not a byte), a NUL. format() shows the frame without source.
    for name in ("\ud800x.py", "/tmp/a\x00b.py", "/tmp/d\udcffir/x.py"):
        tb = Traceback([Frame(name, 3, "f")])
        assert tb.format() == [f'  File "{name}", line 3, in f']


def test_thread_names_prefer_python_names(flt):
    started, release = threading.Event(), threading.Event()
    info = {}

    def worker():
        info["ident"], info["native"] = threading.get_ident(), threading.get_native_id()
        started.set()
        release.wait()

    t = threading.Thread(target=worker, name="data-loader-3")
    t.start()
    try:
        started.wait()
        threads = {
            0: thread(info["native"], info["ident"], "python3"),
            1: thread(info["native"] + 99999, info["ident"], "reused"),  # ident reused: keep native
            2: thread(5, 12345, None),
        }
        rows = [row(1, 1, 0, thread=0), row(2, 1, 0, thread=1), row(3, 1, 0, thread=2),
                row(4, 1, 0, thread=9)]
        snap = snapshot_from_raw(rows, fake_resolve(), threads, flt)
    finally:
        release.set()
        t.join()
    assert [a.thread.name for a in snap] == ["data-loader-3", "reused", "tid 5", "thread#9"]
    assert snap.allocations[3].thread == ThreadInfo(None, None, "thread#9")
    assert [s.key for s in snap.statistics("label")] == [
        "<thread data-loader-3>", "<thread reused>", "<thread thread#9>", "<thread tid 5>"]


def test_main_thread_name(flt):
    main = threading.main_thread()
    threads = {0: thread(main.native_id, main.ident, "python3")}
    snap = snapshot_from_raw([row(1, 1, 0)], fake_resolve(), threads, flt)
    assert snap.allocations[0].thread.name == "MainThread"


def test_build_100k_rows_fast(flt, capsys):
    n_stacks = 500
    stacks = {
        sid: tuple((f"/home/alice/proj/f{sid % 37}.py", sid, "fn") for _ in range(1))
        + ((TORCH, 1518, "_call_impl"), (CTX, 137, "__enter__"), (TRAIN, sid % 50, "main"))
        for sid in range(1, n_stacks + 1)
    }
    rows = [
        (0x7F0000000000 + i * 512, 512 + (i % 7), i % 2, i % 5, 0, i % 4,
         "lbl" if i % 3 == 0 else None, i, (i % (n_stacks + 1)), i, 512, 0)
        for i in range(100_000)
    ]
    threads = {k: thread(2000 + k, 3000 + k, f"t{k}") for k in range(4)}
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        snap = snapshot_from_raw(rows, lambda ids: {i: stacks[i] for i in ids}, threads, flt)
        best = min(best, time.perf_counter() - t0)
    assert len(snap) == 100_000
    t0 = time.perf_counter()
    stats = snap.statistics("lineno")
    t_stats = time.perf_counter() - t0
    assert sum(s.count for s in stats) == 100_000
    with capsys.disabled():
        print(f"\n[memviz] snapshot_from_raw 100k rows: {best * 1000:.1f} ms; "
              f"statistics('lineno'): {t_stats * 1000:.1f} ms")
    # its speed is measured by benchmarks/bench_bounds.py (snapshot), not asserted here
    # (a wall-clock bound fails on a loaded machine)


# ---- tracemalloc's shape: oldest to most recent -------------------------------------------


def test_traceback_runs_oldest_to_most_recent_like_tracemalloc(snap):
    import tracemalloc

    tracemalloc.start(5)
    try:
        here = [0]

        def inner():
            here[0] = __import__("sys")._getframe().f_lineno; return bytearray(1 << 16)  # noqa: E702

        keep = inner()
        tm_tb = tracemalloc.get_object_traceback(keep)
    finally:
        tracemalloc.stop()
    # tracemalloc's own Traceback: [-1] is the line that allocated, [0] the outermost
    assert tm_tb[-1].lineno == here[0] and len(tm_tb) > 1
    a = snap.allocations[0]  # STACKS[1]: train.py:3 -> torch -> contextlib (innermost)
    assert [f.filename for f in a.traceback] == [TRAIN, TORCH, CTX]
    assert a.traceback[-1] == Frame(CTX, 137, "__enter__")  # the frame that asked for memory
    assert a.user_frame == a.traceback.user_frame == Frame(TRAIN, 3, "main")  # the shortcut is unchanged


def test_traceback_format_matches_tracemalloc_for_every_limit_and_order():
    import tracemalloc

    raw = [(__file__, n) for n in (7, 5, 3, 1)]  # most recent first, as tracemalloc takes them
    tm = tracemalloc.Traceback(tuple(raw))
    mine = Traceback([Frame(fn, ln, "") for fn, ln in reversed(raw)])
    assert [(f.filename, f.lineno) for f in mine] == [(f.filename, f.lineno) for f in tm]
    for limit in (None, -5, -2, -1, 1, 2, 5):
        for mrf in (False, True):
            assert mine.format(limit, mrf) == tm.format(limit, mrf), (limit, mrf)
            assert mine.format(limit=limit, most_recent_first=mrf) == tm.format(limit=limit,
                                                                                most_recent_first=mrf)


def test_traceback_total_nframe():
    frames = [Frame("/a.py", 1, "f"), Frame("/b.py", 2, "g")]
    assert Traceback(frames).total_nframe == 2
    assert Traceback().total_nframe == 0
    tb = Traceback(frames, total_nframe=40)
    assert tb.total_nframe == 40 and len(tb) == 2
    import pickle
    back = pickle.loads(pickle.dumps(tb))
    assert back == tb and back.total_nframe == 40 and list(back) == frames
    from memviz import InvalidArgument
    with pytest.raises(InvalidArgument, match="total_nframe"):
        Traceback(frames, total_nframe=1)  # fewer than it holds


def test_total_nframe_of_captured_stacks(snap):
    for a in snap:
        assert a.traceback.total_nframe == len(a.traceback)


def test_frame_filter_pick_reads_a_traceback_in_its_own_order(flt):
    tb = Traceback([Frame(TRAIN, 3, "main"), Frame(MODEL, 20, "forward"), Frame(TORCH, 9, "f")])
    assert flt.pick(tb) == Frame(MODEL, 20, "forward")  # the innermost user frame
    assert flt.pick(list(reversed(tb))) == Frame(MODEL, 20, "forward")  # raw stacks: innermost first
    libs = Traceback([Frame(CTX, 1, "a"), Frame(TORCH, 9, "f")])
    assert flt.pick(libs) == Frame(TORCH, 9, "f")  # all library frames: the innermost


def test_the_row_order_snapshots_unpack_is_the_c_records_order():
    """snapshot_from_raw unpacks rows by position; the C core's record type
    names the fields. The two must agree, field for field."""
    from memviz import _core
    from memviz.model.rows import ROW_FIELDS

    assert _core.AllocationRow.__match_args__ == ROW_FIELDS
    row = _core.AllocationRow(range(len(ROW_FIELDS)))
    assert [getattr(row, f) for f in ROW_FIELDS] == list(range(len(ROW_FIELDS)))


def test_kind_names_come_from_the_c_core_and_index_by_code():
    """Allocation.kind is KIND_NAMES[kind code]: the names are the C core's
    MVZ_KIND_* (src/types.h), one for each code from 0 with no gap, so a kind
    added in C is named here without a copy."""
    import memviz._core as core
    from memviz.model.snapshot import KIND_NAMES

    codes = {n[len("KIND_"):].lower(): getattr(core, n) for n in dir(core) if n.startswith("KIND_")}
    assert sorted(codes.values()) == list(range(len(codes)))
    assert {name: KIND_NAMES[code] for name, code in codes.items()} == {name: name for name in codes}
    assert KIND_NAMES[core.KIND_BLOCK] == "block" and KIND_NAMES[core.KIND_DEVICE] == "device"
