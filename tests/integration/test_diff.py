"""`memviz diff A B` (memviz/cli/diff.py, diff_compare.py, diff_render.py): two runs side by side.

Traces are recorded through the libcupti test double (and, for PyTorch's
segments and blocks, the stand-in caching allocator of
test_allocator_route.py); every figure of the diff is checked against the
trace's (or the recording tracker's) own peak snapshot and totals.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

import memviz
import memviz.cli.diff as D
import memviz.model.pytorch as P
from conftest import ROOT, line_of
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

MiB = 1 << 20
HERE = os.path.abspath(__file__)


def model_step(fake, weights, activations, workspace):
    """A training step's shape: weights kept, activations freed after the
    step's workspace (the peak), as a run with or without a remedy would.
    (The double's C calls directly: a process that loads the trace does not
    know fake_cupti's Python wrapper as a library to skip.)"""
    alloc, free = fake.lib.fake_alloc, fake.lib.fake_free
    kept = [alloc(CBID_cuMemAlloc_v2, weights, 0, 0)]  # weights-line
    acts = [alloc(CBID_cuMemAlloc_v2, n, 0, 0) for n in activations]  # activations-line
    if workspace:
        tmp = alloc(CBID_cuMemAlloc_v2, workspace, 0, 0)  # workspace-line
        free(CBID_cuMemFree_v2, tmp, 0, 0)
    for a in acts:
        free(CBID_cuMemFree_v2, a, 0, 0)
    return kept


def record(fake, path, weights=64 * MiB, activations=(32 * MiB,) * 4, workspace=16 * MiB,
           device=None, **options):
    if device is not None:
        fake.set_device(device)
    try:
        with memviz.track(trace=str(path), torch=False, **options) as t:
            kept = model_step(fake, weights, activations, workspace)
            kept.append(fake.lib.fake_alloc(CBID_cuMemAlloc_v2, MiB, 0, 0))  # end-line
    finally:
        if device is not None:
            fake.set_device(0)
    return t


def lines_at_peak(trace, dev=0):
    """{(file, line): (bytes, count)} of a trace's own peak snapshot."""
    return {(s.key.filename, s.key.lineno): (s.size, s.count)
            for s in trace.peak_snapshot(dev).statistics("lineno")}


@pytest.fixture
def two(fake, tmp_path):
    """A: four 32 MiB activations and a 16 MiB workspace; B: one activation
    (as with activation checkpointing), no workspace."""
    ta = record(fake, tmp_path / "a.memviz")
    tb = record(fake, tmp_path / "b.memviz", activations=(32 * MiB,), workspace=0)
    return tmp_path / "a.memviz", tmp_path / "b.memviz", ta, tb


def test_figures_are_each_traces_own_peak_and_lines(two):
    pa, pb, _, _ = two
    a, b = memviz.load(str(pa)), memviz.load(str(pb))
    doc = D.compare(a, b)
    (dev,) = doc["devices"]
    assert (dev["device_a"], dev["device_b"], dev["name"]) == (0, 0, "cuda:0")
    f = dev["figures"]
    for name in ("peak", "current", "allocs", "failed"):
        assert (f[name]["a"], f[name]["b"]) == (a.totals()[0][name], b.totals()[0][name])
    # The peak is what each trace's peak snapshot holds.
    assert f["peak"]["a"] == a.peak_snapshot(0).total_bytes() == 64 * MiB + 4 * 32 * MiB + 16 * MiB
    assert f["peak"]["b"] == b.peak_snapshot(0).total_bytes() == 64 * MiB + 32 * MiB
    assert f["peak"]["diff"] == f["peak"]["b"] - f["peak"]["a"]
    assert f["peak"]["ratio"] == pytest.approx(f["peak"]["b"] / f["peak"]["a"])
    assert doc["peaks"] == [{"device": 0, "a": f["peak"]["a"], "b": f["peak"]["b"]}]
    # Lines: every line whose bytes at the peak differ, with both sides' figures.
    la, lb = lines_at_peak(a), lines_at_peak(b)
    changed = {k for k in set(la) | set(lb) if la.get(k) != lb.get(k)}
    rows = {(r["file"], r["line"]): r for r in dev["lines"]}
    assert set(rows) == changed
    assert {k[1] for k in changed} == {line_of(HERE, "# activations-line"), line_of(HERE, "# workspace-line")}
    for k, r in rows.items():
        assert (r["a"], r["count_a"]) == la.get(k, (0, 0))
        assert (r["b"], r["count_b"]) == lb.get(k, (0, 0))
        assert r["diff"] == r["b"] - r["a"]
        assert r["ratio"] == (r["b"] / r["a"] if r["a"] else None)
    assert [abs(r["diff"]) for r in dev["lines"]] == sorted((abs(r["diff"]) for r in dev["lines"]), reverse=True)
    assert dev["more_lines"] == {"count": 0, "diff": 0}
    # Recorded with torch=False: no PyTorch figures, said once.
    assert dev["categories"] is None and f["torch_reserved_peak"]["a"] is None
    assert any("PyTorch's own figures" in n for n in doc["notes"])


def test_text_shows_the_same_figures_side_by_side(two, monkeypatch):
    pa, pb, _, _ = two
    monkeypatch.chdir(os.path.dirname(HERE))  # lines are shown from the cwd: a short path keeps each row on one line
    a, b = memviz.load(str(pa)), memviz.load(str(pb))
    text = D.diff_text(a, b)
    doc = D.compare(a, b)
    peak = doc["devices"][0]["figures"]["peak"]
    row = next(x for x in text.splitlines() if x.strip().startswith("peak (memviz"))
    cells = [memviz.format_size(peak["a"]), memviz.format_size(peak["b"]),
             memviz.format_size(peak["diff"], sign=True), f"{peak['ratio']:.2f}x"]
    assert row.split()[-7:] == " ".join(cells).split()
    act = line_of(HERE, "# activations-line")
    line = next(x for x in text.splitlines() if f"test_diff.py:{act}" in x)
    r = next(r for r in doc["devices"][0]["lines"] if r["line"] == act)
    assert line.split()[1:] == " ".join([memviz.format_size(r["a"]), memviz.format_size(r["b"]),
                                         memviz.format_size(r["diff"], sign=True),
                                         f"{r['ratio']:.2f}x"]).split()
    assert "B / A" in text and "Top lines at the peak by change" in text
    assert "PyTorch's peak reserved" not in text  # neither trace has it: left out, with a note


def test_a_tracker_compares_as_its_trace_does(two):
    pa, pb, ta, tb = two
    live, loaded = D.compare(ta, tb), D.compare(memviz.load(str(pa)), memviz.load(str(pb)))
    assert live["peaks"] == loaded["peaks"]
    assert live["devices"][0]["lines"] == loaded["devices"][0]["lines"]
    assert live["devices"][0]["figures"]["peak"] == loaded["devices"][0]["figures"]["peak"]


def cli(*args, cwd, env=None):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "memviz", "diff", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120)


def test_command_line_text_and_json(two):
    pa, pb, _, _ = two
    p = cli("a.memviz", "b.memviz", "--json", cwd=pa.parent)
    assert p.returncode == 0, p.stderr
    raw = p.stdout
    doc = json.loads(raw)
    want = D.compare(memviz.load(str(pa)), memviz.load(str(pb)))
    for dev in doc["devices"] + want["devices"]:  # shown paths are relative to the working folder
        for r in dev["lines"]:
            assert r.pop("key").endswith(f"test_diff.py:{r['line']}")
    assert doc["memviz_diff"] == 2 and doc["devices"] == json.loads(json.dumps(want["devices"]))
    assert doc["a"]["path"] == "a.memviz" and doc["b"]["gpu_enabled"] is True
    assert cli("a.memviz", "b.memviz", "--format", "json", cwd=pa.parent).stdout == raw
    p = cli("a.memviz", "b.memviz", "--top", "1", cwd=pa.parent)
    assert p.returncode == 0, p.stderr
    assert "A  a.memviz" in p.stdout and "B  b.memviz" in p.stdout
    assert "1 more changed line(s), -16 MiB in all" in p.stdout
    assert f"test_diff.py:{line_of(HERE, '# activations-line')}" in p.stdout
    p = cli("a.memviz", "b.memviz", "-o", "d.json", "--json", cwd=pa.parent)
    assert p.returncode == 0 and (pa.parent / "d.json").read_text() == raw


# ---- errors -------------------------------------------------------------------------------


def test_missing_unreadable_and_foreign_files(two, capsys):
    pa, pb, _, _ = two
    folder = pa.parent
    assert D.main([str(folder / "missing.memviz"), str(pb)]) == 2
    err = capsys.readouterr().err
    assert "missing.memviz" in err and "cannot read the file" in err and "What to do" in err
    (folder / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    assert D.main([str(pa), str(folder / "x.png")]) == 2
    assert "not a memviz trace" in capsys.readouterr().err
    if os.geteuid() != 0:  # root reads anything
        locked = folder / "locked.memviz"
        locked.write_bytes(pa.read_bytes())
        locked.chmod(0)
        assert D.main([str(locked), str(pb)]) == 2
        assert "cannot read the file" in capsys.readouterr().err
    assert D.main([str(pa)]) == 2  # argparse: B is missing
    assert "the following arguments are required: b" in capsys.readouterr().err


def test_a_cut_off_trace_is_compared_up_to_where_it_stops(two, capsys):
    pa, pb, _, _ = two
    cut = pa.parent / "cut.memviz"
    cut.write_bytes(pb.read_bytes()[:-20])
    assert D.main([str(pa), str(cut), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert "warning" in out.err and doc["b"]["truncated"] is True
    assert any(n.startswith("B (cut.memviz) is incomplete") for n in doc["notes"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert doc["peaks"][0]["b"] == memviz.load(str(cut)).peak_snapshot(0).total_bytes()


def test_traces_of_different_devices(fake, tmp_path, capsys):
    pa, pb = tmp_path / "a.memviz", tmp_path / "b.memviz"
    record(fake, pa)
    record(fake, pb, activations=(32 * MiB,), workspace=0, device=1)
    assert D.main([str(pa), str(pb)]) == 2
    err = capsys.readouterr().err
    assert "recorded on different devices" in err and "A (a.memviz) on cuda:0, B (b.memviz) on cuda:1" in err
    assert "--devices 0:1" in err and "What to do" in err
    assert D.main([str(pa), str(pb), "--devices", "0:1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (dev,) = doc["devices"]
    assert (dev["device_a"], dev["device_b"], dev["name"]) == (0, 1, "cuda:0 / cuda:1")
    b = memviz.load(str(pb))
    assert dev["figures"]["peak"]["b"] == b.peak_snapshot(1).total_bytes() == b.totals()[1]["peak"]
    # The same lines on two devices match: the weights line did not change.
    assert line_of(HERE, "# weights-line") not in {r["line"] for r in dev["lines"]}
    assert line_of(HERE, "# activations-line") in {r["line"] for r in dev["lines"]}
    assert D.main([str(pa), str(pb), "--devices", "0:5"]) == 2
    err = capsys.readouterr().err
    assert "has no allocations on cuda:5" in err and "B (b.memviz): cuda:1" in err
    for bad in ("zero", "0:x", "-1:0"):
        assert D.main([str(pa), str(pb), "--devices", bad]) == 2
        assert "--devices" in capsys.readouterr().err


def test_a_trace_recorded_without_gpu_capture(fake, tmp_path, capsys):
    pa, pb = tmp_path / "a.memviz", tmp_path / "b.memviz"
    record(fake, pa)
    with memviz.track(trace=str(pb), gpu=False, torch=False):
        pass
    assert D.main([str(pa), str(pb)]) == 2
    err = capsys.readouterr().err
    assert "B (b.memviz) has no GPU allocations" in err and "record both runs on a GPU" in err
    with pytest.raises(memviz.InvalidArgument, match="trace B has no GPU allocations"):
        D.compare(memviz.load(str(pa)), memviz.load(str(pb)))
    # Two runs without a GPU compare (there is nothing in them), and say why.
    assert D.main([str(pb), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "No allocations in either trace." in out and "no GPU allocations (GPU capture was off" in out


def test_bad_key_is_a_memviz_error(two):
    pa, pb, _, _ = two
    with pytest.raises(memviz.InvalidArgument, match="key 'nope'"):
        D.compare(memviz.load(str(pa)), memviz.load(str(pb)), key="nope")


def test_odd_recorded_figures_are_left_out(fake, tmp_path, monkeypatch, capsys):
    """A trace whose END holds figures of the wrong shape (a newer or damaged
    writer): whatever is not a whole number >= 0 is left out."""
    odd = {"0": {"categories": {"parameter": 4 * MiB, "x": "big", "y": -5, "z": 1.5},
                 "fragmentation": [1, 2], "memory_stats": {"reserved_peak": 9 * MiB, "allocated_peak": "x"},
                 "route": 7},
           "zz": {"categories": {"parameter": 1}}, "1": 7}
    monkeypatch.setattr(P, "pytorch_figures", lambda tracker: odd)
    record(fake, tmp_path / "a.memviz")
    record(fake, tmp_path / "b.memviz", workspace=0)
    assert D.main([str(tmp_path / "a.memviz"), str(tmp_path / "b.memviz"), "--json"]) == 0
    (dev,) = json.loads(capsys.readouterr().out)["devices"]
    assert dev["categories"] == [{"category": "parameter", "a": 4 * MiB, "b": 4 * MiB, "diff": 0,
                                  "ratio": 1.0, "unit": "bytes", "source": "the tracker's peak snapshot"}]
    f = dev["figures"]
    assert f["torch_reserved_peak"]["a"] == 9 * MiB and f["torch_allocated_peak"]["a"] is None
    assert f["reserved_at_peak"]["a"] is None  # no blocks in the trace, no fragmentation recorded


def test_pytorchs_peaks_from_the_step_records_where_the_trace_has_no_memory_stats(fake, tmp_path, monkeypatch):
    """A trace without PyTorch's own figures at the end, but with step records
    (which carry PyTorch's allocated, reserved and allocated peak)."""
    import memviz.analysis.steps as steps

    numbers = {"a": [(10, 40, 30), (10, 70, 50), (10, 60, 35)], "b": [(10, 20, 25), (10, 30, 28)]}
    for name, per_step in numbers.items():
        it = iter(per_step)
        monkeypatch.setattr(steps, "_torch_numbers", lambda st, devs, it=it: {0: tuple(x * MiB for x in next(it))})
        with memviz.track(trace=str(tmp_path / f"{name}.memviz"), torch=False) as t:
            kept = [fake.lib.fake_alloc(CBID_cuMemAlloc_v2, MiB, 0, 0)]
            for _ in per_step:
                t.step()
        del kept
    a, b = memviz.load(str(tmp_path / "a.memviz")), memviz.load(str(tmp_path / "b.memviz"))
    f = D.compare(a, b)["devices"][0]["figures"]
    for side, trace in (("a", a), ("b", b)):
        assert f["torch_reserved_peak"][side] == max(s.devices[0].reserved for s in trace.steps)
        assert f["torch_allocated_peak"][side] == max(s.devices[0].allocated_peak for s in trace.steps)
    assert (f["torch_reserved_peak"]["a"], f["torch_reserved_peak"]["b"]) == (70 * MiB, 30 * MiB)
    assert f["torch_reserved_peak"]["source"] == "the step records (highest reserved)"
    assert "alloc_retries" not in f  # only PyTorch's memory_stats have it


def test_diff_of_mutated_traces_raises_only_memviz_errors():
    """The fuzzer's seeds, with a pytorch_peak field in their END, mutated
    (tests/fuzz_trace.py) for a bounded time: whatever loads compares, with
    itself and with its seed, in text and JSON, or raises a memviz error."""
    import random
    import time

    import fuzz_trace
    from memviz.trace import format as F
    from memviz.loaded import LoadedTrace

    figures = {"0": {"categories": {"parameter": 4 * MiB, "activation": 9 * MiB},
                     "category_counts": {"parameter": 2, "activation": 3},
                     "fragmentation": {"segments": 2, "reserved": 20 * MiB, "allocated": 13 * MiB,
                                       "unused": 7 * MiB, "largest_free": 5 * MiB, "free_gaps": 3},
                     "memory_stats": {"reserved_peak": 24 * MiB, "allocated_peak": 14 * MiB},
                     "route": "allocator"}}

    def with_figures(data):
        head, chunks, tail = fuzz_trace.split(data)
        out = []
        for ctype, payload in chunks:
            if ctype & F.KIND_MASK == F.END:
                end = json.loads(fuzz_trace._payload(ctype, payload)[0])
                end[P.END_KEY] = figures
                ctype, payload = F.END, json.dumps(end).encode()
            out.append((ctype, payload))
        return fuzz_trace.join(head, out, tail)

    def load(data):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return LoadedTrace.from_bytes(data, "<fuzz>", recover=bool(data[-1:] == b"\x01"))
            except memviz.TraceError:
                return None

    seeds = [with_figures(d) for d in fuzz_trace.seeds()]
    loaded_seeds = [load(d) for d in seeds]
    assert all(t is not None and P.END_KEY in t.end for t in loaded_seeds)
    rnd, runs, stop = random.Random(0), 0, time.monotonic() + float(os.environ.get("MEMVIZ_FUZZ_SECONDS", "20")) / 4
    while time.monotonic() < stop or runs < 20:
        k = rnd.randrange(len(seeds))
        data = fuzz_trace.mutate(rnd, seeds[k])
        t = load(data)
        runs += 1
        if t is None:
            continue
        for a, b in ((t, t), (loaded_seeds[k], t)):
            try:
                doc = D.compare(a, b, top=5)
            except memviz.MemvizError:
                continue
            D.render(doc).encode("utf-8")
            json.dumps(doc, allow_nan=False)
    assert runs >= 20


# ---- PyTorch's segments, blocks and categories (the stand-in allocator) ---------------------
#
# The stand-in's libraries can be loaded from one build folder per process only (a second
# libc10_standin.so of the same soname is not loaded), and test_allocator_route.py builds its
# own: these tests run in a child pytest process (the `pool` test starts it), where they are
# the only users of the stand-in.

INNER = os.environ.get("MEMVIZ_TEST_DIFF_POOL") == "1"
try:  # the allocator route's fixtures need torch (the integration attaches with it)
    from test_allocator_route import pytestmark as route_mark  # noqa: E402
    if INNER:
        from test_allocator_route import _attach, builds, standin  # noqa: E402,F401
except pytest.skip.Exception as e:
    route_mark = pytest.mark.skip(reason=str(e))
inner = pytest.mark.skipif(not INNER, reason="runs in the child process of test_pool_figures_in_a_child_process")


@route_mark
def test_pool_figures_in_a_child_process():
    names = [n for n, f in globals().items() if n.startswith("test_") and getattr(f, "_pool", False)]
    env = dict(os.environ, MEMVIZ_TEST_DIFF_POOL="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxXs",
                        *[f"{HERE}::{n}" for n in names]], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert f"{len(names)} passed" in p.stdout, p.stdout[-3000:]


def pool(fn):
    """A test of the child process."""
    fn._pool = True
    return route_mark(inner(fn))


def pool_run(ans, t, holes):
    """Eight 64 KiB blocks in a segment, every other freed when `holes`, then
    a big block: a new segment (20 MiB, the rest of it free), the peak, with
    the first one as it was."""
    _attach(t, ans)
    held = [ans.alloc(64 << 10)[0] for _ in range(8)]
    if holes:
        del held[1::2]
    big, _ = ans.alloc(8 << 20)
    del big
    held.clear()
    ans.empty_cache()  # the next run starts with no segment cached


@pool
def test_segments_and_categories_are_the_recording_trackers(standin, tmp_path, monkeypatch):
    figures = {}
    stats = {"a": {"allocated_peak": 9 * MiB, "reserved_peak": 12 * MiB, "alloc_retries": 0},
             "b": {"allocated_peak": 9 * MiB + (256 << 10), "reserved_peak": 10 * MiB, "alloc_retries": 2}}
    peaks = {}
    ans = standin()  # one stand-in library for both runs: memviz attaches to one allocator
    for name, holes in (("a", True), ("b", False)):
        monkeypatch.setattr(P, "_memory_stats", lambda name=name: {0: stats[name]})
        with memviz.track(trace=str(tmp_path / f"{name}.memviz")) as t:
            pool_run(ans, t, holes)
        peaks[name] = t.peak_snapshot(0)
        figures[name] = P.pytorch_figures(t)
    a, b = memviz.load(str(tmp_path / "a.memviz")), memviz.load(str(tmp_path / "b.memviz"))
    (dev,) = D.compare(a, b)["devices"]
    f = dev["figures"]
    for side in ("a", "b"):
        frag = peaks[side].fragmentation(0)[0]
        assert frag["free_gaps"] >= 1
        for row, key in (("reserved_at_peak", "reserved"), ("allocated_at_peak", "allocated"),
                         ("unused_pool", "unused"), ("largest_free", "largest_free"),
                         ("free_gaps", "free_gaps"), ("segments", "segments")):
            assert f[row][side] == frag[key], (side, row)
        cats = {str(s.key): s.size for s in peaks[side].statistics("category") if s.key != "<unknown>"}
        assert cats and {c["category"]: c[side] for c in dev["categories"] if c[side]} == cats
        assert f["torch_reserved_peak"][side] == stats[side]["reserved_peak"]
        assert f["alloc_retries"][side] == stats[side]["alloc_retries"]
    # the holes between live blocks: the fourth freed block joined the segment's free tail
    assert f["free_gaps"]["a"] - f["free_gaps"]["b"] == 3
    assert f["allocated_at_peak"]["a"] < f["allocated_at_peak"]["b"]
    assert f["torch_reserved_peak"]["ratio"] == pytest.approx(10 / 12)
    text = D.diff_text(a, b)
    assert "at the peak: gaps between blocks" in text and "By category at the peak" in text
    assert "PyTorch's allocation retries" in text


@pool
def test_segments_rebuilt_from_the_events_without_recorded_figures(standin, tmp_path, monkeypatch):
    """A trace without END figures (an older memviz): the segment figures come
    from the blocks and segments in the events, every byte once in the lines."""
    monkeypatch.setattr(P, "pytorch_figures", lambda tracker: {})
    ans = standin()
    for name, holes in (("a", True), ("b", False)):
        with memviz.track(trace=str(tmp_path / f"{name}.memviz")) as t:
            pool_run(ans, t, holes)
    a, b = memviz.load(str(tmp_path / "a.memviz")), memviz.load(str(tmp_path / "b.memviz"))
    (dev,) = D.compare(a, b, top=100)["devices"]
    f = dev["figures"]
    for side, trace in (("a", a), ("b", b)):
        peak = trace.peak_snapshot(0)
        blocks = [x for x in peak.allocations if x.kind == "block"]
        # Segments: the driver allocations that held blocks in the trace, the big
        # block (written after the segment made for it) inside the peak's one.
        segs = peak.segments
        assert len(segs) == 2 and any(x.size == 8 << 20 for x in blocks)
        assert f["reserved_at_peak"][side] == sum(x.size for x in segs)
        assert f["allocated_at_peak"][side] == sum(x.size for x in blocks)
        assert f["segments"][side] == len(segs)
        # Lines count each byte once: the blocks, and what they leave of their segments.
        assert peak.total_bytes() == trace.totals()[0]["peak"]
    assert f["free_gaps"]["a"] - f["free_gaps"]["b"] == 3  # as above
    assert dev["categories"] is None


@pool
def test_a_loaded_trace_has_the_live_trackers_blocks_at_the_peak(standin, tmp_path):
    """The store dates a block when it was asked for, before the segment made
    for it, but the file has it after that segment: the loaded peak still
    holds the block whose request made the peak, as the live tracker's does."""
    ans = standin()
    with memviz.track(trace=str(tmp_path / "a.memviz")) as t:
        pool_run(ans, t, True)
    loaded = memviz.load(str(tmp_path / "a.memviz"))
    blocks = lambda snap: sorted(x.size for x in snap.allocations if x.kind == "block")  # noqa: E731
    assert blocks(loaded.peak_snapshot(0)) == blocks(t.peak_snapshot(0))
    assert loaded.peak_snapshot(0).total_bytes() == t.peak_snapshot(0).total_bytes()


@pool
def test_the_category_chart_of_a_trace_counts_blocks_inside_their_segments_once(standin, tmp_path):
    """The HTML report's memory-by-category chart, replayed from the events:
    blocks and the segments they lie in are one set of bytes (blocks by
    category, the rest of a segment unused_pool), never negative, and the
    stacked total at the peak is the device's peak."""
    from memviz.report._categories import category_series

    ans = standin()
    with memviz.track(trace=str(tmp_path / "a.memviz")) as t:
        pool_run(ans, t, True)
    loaded = memviz.load(str(tmp_path / "a.memviz"))
    peak = loaded.peak_snapshot(0)
    cats, note = category_series(loaded, list(loaded.snapshot().allocations), list(peak.allocations),
                                 {0: loaded.totals()[0]["peak_timestamp_ns"]}, loaded.stopped_ns)
    assert note == "from the recorded events"
    series = cats[0]
    assert "unused_pool" in series, series.keys()

    def at(ts):  # each category's value at ts (step functions)
        total = 0
        for tss, vs in series.values():
            v = 0
            for x, y in zip(tss, vs):
                if x <= ts:
                    v = y
            assert v >= 0
            total += v
        return total
    for tss, vs in series.values():
        assert min(vs) >= 0, (tss, vs)
    assert at(loaded.totals()[0]["peak_timestamp_ns"]) == loaded.totals()[0]["peak"]


def test_the_remedy_example_says_it_needs_a_gpu_and_exits_0():
    pytest.importorskip("torch", reason="the example needs torch to get as far as the GPU check")
    import torch as _torch

    if _torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the example runs for real (the lead runs it on the H200)")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "remedy_compare.py")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "needs a CUDA GPU" in p.stdout and "found no usable CUDA GPU" in p.stdout


def test_json_and_format_text_together_are_refused(capsys):
    """--json with --format text: two formats asked for, said (text was
    written without a word); --json alone, or --format json, is JSON."""
    from memviz.__main__ import main

    sample = os.path.join(ROOT, "memviz", "data", "sample.memviz")
    for verb in (["diff", sample, sample], ["whatif", sample]):
        assert main([*verb, "--json", "--format", "text"]) == 2
        assert "two formats" in capsys.readouterr().err
        for fmt in (["--json"], ["--format", "json"], ["--json", "--format", "json"]):
            assert main([*verb, *fmt]) == 0
            assert capsys.readouterr().out.lstrip().startswith("{")
