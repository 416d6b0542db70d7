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


# ---- Snapshot.filter_traces ------------------------------------------------------------


def _snapshots(seed=7, n=300):
    """The same random traces as a tracemalloc.Snapshot and as a memviz
    Snapshot whose frame filter counts no frame as library code (so the
    user's frame is the innermost one, as in tracemalloc)."""
    import random
    import tracemalloc

    rng = random.Random(seed)
    files = ["/proj/train.py", "/proj/model.py", "/proj/data/loader.py", "/lib/torch/module.py",
             "/proj/cache.pyc", "<string>"]
    raw, allocs = [], []
    flt = memviz.FrameFilter(use_defaults=False)
    for i in range(n):
        depth = rng.randint(1, 4)
        frames = [(rng.choice(files), rng.randint(1, 4)) for _ in range(depth)]  # most recent first
        domain = rng.choice([0, 0, 1, 2])
        size = 1000 + i  # unique: names the trace
        raw.append((domain, size, tuple(frames), depth))
        tb = memviz.Traceback([memviz.Frame(fn, ln, "f") for fn, ln in reversed(frames)], flt)
        allocs.append(memviz.Allocation(0x1000 + i, size, domain, "device", 0,
                                        memviz.ThreadInfo(1, 1, "main"), None, i, tb))
    return tracemalloc.Snapshot(raw, 4), memviz.Snapshot(allocs, frame_filter=flt)


def _filter_pairs():
    import tracemalloc

    specs = [
        (True, "/proj/*", None, False, None), (False, "/proj/*", None, False, None),
        (True, "*/train.py", 2, False, None), (False, "*/train.py", 2, False, None),
        (True, "*/model.py", None, True, None), (False, "*/model.py", None, True, None),
        (True, "*/loader.py", 3, True, 1), (False, "*/loader.py", 3, True, 1),
        (True, "/proj/cache.py", None, False, 0), (False, "/proj/cache.py", None, False, 2),
        (True, "<string>", None, False, None), (True, "*", 1, False, 0),
    ]
    for s in specs:
        yield [tracemalloc.Filter(*s)], [memviz.Filter(*s)]
    yield [tracemalloc.DomainFilter(True, 1)], [memviz.DomainFilter(True, 1)]
    yield [tracemalloc.DomainFilter(False, 0)], [memviz.DomainFilter(False, 0)]
    yield ([tracemalloc.Filter(True, "/proj/*"), tracemalloc.Filter(False, "*/model.py", all_frames=True),
            tracemalloc.DomainFilter(False, 2)],
           [memviz.Filter(True, "/proj/*"), memviz.Filter(False, "*/model.py", all_frames=True),
            memviz.DomainFilter(False, 2)])
    yield ([tracemalloc.Filter(True, "*/train.py"), tracemalloc.Filter(True, "*/model.py", 1)],
           [memviz.Filter(True, "*/train.py"), memviz.Filter(True, "*/model.py", 1)])
    yield [], []


def test_filter_traces_keeps_what_tracemalloc_keeps():
    tm, mine = _snapshots()
    for tm_filters, my_filters in _filter_pairs():
        want = sorted(t.size for t in tm.filter_traces(tm_filters).traces)
        got = mine.filter_traces(my_filters)
        assert isinstance(got, memviz.Snapshot)
        assert sorted(a.size for a in got) == want, my_filters
    assert len(mine.filter_traces([])) == len(mine)


def test_filter_matches_the_users_frame_and_frameless_allocations_by_thread():
    flt = memviz.FrameFilter(use_defaults=False)
    flt.add_library_path("/lib")
    tb = memviz.Traceback([memviz.Frame("/proj/train.py", 42, "main"), memviz.Frame("/lib/torch/m.py", 9, "f")],
                          flt)
    a = memviz.Allocation(1, 10, 0, "device", 0, memviz.ThreadInfo(1, 1, "main"), None, 0, tb)
    b = memviz.Allocation(2, 20, 1, "device", 0, memviz.ThreadInfo(2, 2, "pt_autograd_0"), None, 0,
                          memviz.Traceback())
    snap = memviz.Snapshot([a, b], frame_filter=flt)
    # like statistics("lineno"): the user's line, not the library's innermost frame
    assert [x.size for x in snap.filter_traces([memviz.Filter(True, "/proj/train.py", 42)])] == [10]
    assert [x.size for x in snap.filter_traces([memviz.Filter(True, "/lib/*")])] == []
    assert [x.size for x in snap.filter_traces([memviz.Filter(True, "/lib/*", all_frames=True)])] == [10]
    # frameless allocations match their pseudo-frame, as statistics() name them
    assert [x.size for x in snap.filter_traces([memviz.Filter(False, "<thread *>")])] == [10]
    assert [x.size for x in snap.filter_traces([memviz.Filter(True, "<thread pt_autograd_0>")])] == [20]
    assert [x.size for x in snap.filter_traces([memviz.DomainFilter(True, 1)])] == [20]
    assert snap.filter_traces([memviz.Filter(True, "*")]).frame_filter is flt


def test_filter_attributes_and_repr():
    f = memviz.Filter(False, "/x/a.pyc", 3, all_frames=True, domain=1)
    assert (f.inclusive, f.filename_pattern, f.lineno, f.all_frames, f.domain) == (False, "/x/a.py", 3, True, 1)
    assert "a.py" in repr(f) and f == memviz.Filter(False, "/x/a.py", 3, True, 1)
    d = memviz.DomainFilter(True, 0)
    assert (d.inclusive, d.domain) == (True, 0)


def test_filter_traces_says_what_it_takes():
    snap = memviz.Snapshot([])
    with pytest.raises(memviz.InvalidArgumentType, match=r"filter_traces\(\[f\]\)|a list"):
        snap.filter_traces(memviz.Filter(True, "*"))
    with pytest.raises(memviz.InvalidArgumentType, match="memviz.Filter"):
        snap.filter_traces([lambda a: True])
    with pytest.raises(memviz.InvalidArgumentType, match="filename_pattern"):
        memviz.Filter(True, 3)
    with pytest.raises(memviz.InvalidArgumentType, match="inclusive"):
        memviz.Filter("yes", "*")
    with pytest.raises(memviz.InvalidArgumentType, match="lineno"):
        memviz.Filter(True, "*", lineno="3")
    with pytest.raises(memviz.InvalidArgumentType, match="domain"):
        memviz.DomainFilter(True, "cuda:0")


# ---- what the README says an allocation has ---------------------------------------------


def test_the_readme_names_only_attributes_an_allocation_has():
    import re
    from pathlib import Path

    from memviz.model.snapshot import Allocation

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    has = set(Allocation._fields) | {n for n in dir(Allocation) if not n.startswith("_")}
    named = set(re.findall(r"`(?:allocation|a)\.(\w+)", readme))
    assert {"traceback", "kind", "size"} <= named and named <= has, named - has
    # "`Snapshot.allocations` yields each live allocation: address, size, ... and a traceback"
    listed = readme.split("`Snapshot.allocations` yields each live allocation:", 1)[1].split(" of `Frame(")[0]
    words = set(re.findall(r"\w+", re.sub(r"\([^()]*\)", "", listed))) - {"and", "a"}
    assert "timestamp_ns" in words and words <= set(Allocation._fields), words - set(Allocation._fields)


def test_the_readme_notebook_snippet_defines_every_name_it_uses():
    import ast
    import builtins
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## In a notebook or a script", 1)[1]
    tree = ast.parse(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    defined = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    defined |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert "snap" in used and used - defined - set(dir(builtins)) == set()


def test_with_no_tracker_running_the_pair_answers_as_tracemalloc_does(fake):
    """tracemalloc.get_traced_memory() is (0, 0) when not tracing, and
    reset_peak() does nothing; memviz's pair answers the same way."""
    import tracemalloc
    assert not tracemalloc.is_tracing() and tracemalloc.get_traced_memory() == (0, 0)
    assert memviz.active_tracker() is None
    assert memviz.get_traced_memory() == (0, 0) and memviz.get_traced_memory(device=0) == (0, 0)
    assert memviz.reset_peak() is None
    with memviz.track() as t:
        alloc(fake, MiB)
    assert memviz.get_traced_memory() == (0, 0) and t.peak_bytes() == MiB  # the stopped tracker keeps its own


def test_summary_is_the_text_report_of_a_tracker_or_a_trace(fake, tmp_path):
    """memviz.summary(t): what torch.cuda.memory_summary() is to PyTorch."""
    from memviz.report.text import text_report
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path)) as t:
        alloc(fake, 3 * MiB)
        running = memviz.summary()  # the running tracker's
        assert "3 MiB" in running or "3.00 MiB" in running
    assert memviz.summary(t, top=5) == text_report(t, top=5)
    assert "test_tracemalloc_shape.py" in memviz.summary(memviz.load(str(path)))
    with pytest.raises(memviz.NotTracking, match=r"memviz\.summary\(t\)"):
        memviz.summary()
    # a path, or anything else, where a recording is expected: what to pass, not an AttributeError
    from memviz.report import html as _html
    for bad in (str(path), path, 5):
        for call in (memviz.summary, _html.render, lambda x: _html.write(x, str(tmp_path / "r.html"))):
            with pytest.raises(memviz.InvalidArgumentType, match="a memviz Tracker or a loaded trace"):
                call(bad)
    with pytest.raises(memviz.InvalidArgumentType, match=r"memviz\.load\(path\)"):
        memviz.summary(str(path))
    assert not (tmp_path / "r.html").exists()
