"""Many ranks (issue 29): the merged report of 64 synthetic ranks recorded
through the real writer with the libcupti test double (tests/rank_traces.py),
read in parallel; the same answers from the DuckDB merge over Parquet; the
Parquet export; files that cannot be read named and left out, among 1,000.

The tests that need pyarrow, DuckDB or Polars skip, saying what to install.
"""

import json
import os
import shutil
import statistics
import zlib

import pytest

import memviz
from conftest import line_of
from memviz.__main__ import main
from memviz.capture import cupti as _capture
from memviz.report.ranks_questions import clocks
from memviz.report.ranks_summary import RankSummary
from memviz.trace import format as F

RANKS = 64
STEPS = 12
LEAKY = 5  # the one rank whose memory grows
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
SYNTH = os.path.join(HERE, "rank_traces.py")
MiB = 1 << 20


@pytest.fixture(scope="module")
def ranks64(fake_path, tmp_path_factory):
    """64 ranks' traces, recorded once for the module."""
    from fake_cupti import FakeCupti
    from rank_traces import record_ranks

    lib = _capture.loaded()
    if lib is not None and os.path.realpath(lib.path) != os.path.realpath(fake_path):
        pytest.skip(f"a real libcupti ({lib.path}) is already loaded in this process")
    folder = tmp_path_factory.mktemp("ranks64")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_capture.ENV_LIBRARY, fake_path)
        fake = FakeCupti(fake_path)
        fake.reset()
        memviz.frames.add_library_path(os.path.join(HERE, "fake_cupti"))
        try:
            paths = record_ranks(fake, str(folder), RANKS, steps=STEPS, leak=[LEAKY])
        finally:
            memviz.frames.reset()
            fake.reset()
    return folder, paths


def _doc(capsys, *argv):
    assert main(["report", *map(str, argv), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _same(a, b):
    """The two merged documents, but for how they were worked out."""
    for k in ("engine", "workers"):
        a.pop(k, None), b.pop(k, None)
    assert a.keys() == b.keys()
    for k in a:
        assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True), k


def test_jobs_beyond_the_files_start_no_more_workers_than_files(ranks64, capsys, monkeypatch):
    """--jobs 64 on four files: as many workers as files (every worker
    was started up front: thousands of processes for four files)."""
    import concurrent.futures as cf

    folder, paths = ranks64
    asked = []
    real = cf.ProcessPoolExecutor

    def pool(*args, **kwargs):
        asked.append(kwargs.get("max_workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cf, "ProcessPoolExecutor", pool)
    few = [str(p) for p in paths[:4]]
    doc = _doc(capsys, *few, "--jobs", "64", "--engine", "python")
    assert asked == [4] and doc["workers"] == 4


def test_64_ranks_merged_figures_equal_each_ranks_own_report(ranks64, capsys):
    folder, paths = ranks64
    doc = _doc(capsys, folder / "run.rank*.memviz", "--jobs", "2", "--engine", "python")
    assert [r["rank"] for r in doc["ranks"]] == list(range(RANKS)) and doc["world_size"] == RANKS
    assert doc["notes"] == [] and doc["skipped"] == [] and doc["workers"] == 2
    for row, path in zip(doc["ranks"], paths):
        own = _doc(capsys, path)  # the rank's own report
        dev = next(d for d in own["devices"] if d["device"] == row["device"])
        assert (row["peak"], row["current"], row["trace"]) == (dev["peak"], dev["current"], path)
        assert row["steps"] == len(own["steps"]) == STEPS
        assert [f["kind"] for f in row["findings"]] == [f["kind"] for f in own["findings"]]
        assert row["peak_at_s"] == pytest.approx((dev["peak_timestamp_ns"] - memviz.load(path).started_ns) / 1e9)
    from rank_traces import big_size
    leaky_peak = big_size(LEAKY) + STEPS * 2 * MiB + 8 * MiB
    assert doc["ranks"][LEAKY]["peak"] == leaky_peak
    assert doc["top_peaks"][0]["rank"] == LEAKY and doc["top_peaks"][0]["peak_step"] == STEPS - 1
    assert [t["rank"] for t in doc["top_peaks"][1:5]] == [15, 31, 47, 63]  # 47 MiB + 8 MiB each
    peaks = [r["peak"] for r in doc["ranks"]]
    imb = doc["imbalance"]
    assert imb["median_peak"] == statistics.median(peaks) and imb["max_rank"] == LEAKY
    assert imb["ratio"] == pytest.approx(max(peaks) / statistics.median(peaks))
    assert imb["min_rank"] == 0 and imb["spread"] == max(peaks) - min(peaks)
    grow = doc["growing_ranks"]
    assert [g["rank"] for g in grow["ranks"]] == [LEAKY] and grow["ranks"][0]["trend_per_step"] == 2 * MiB
    assert grow["median_trend_per_step"] == 0
    growth = [k for k in doc["findings_by_kind"] if k["kind"] == "growth"]
    assert growth and growth[0]["ranks"] == [LEAKY] and growth[0]["outlier"] and not growth[0]["common"]
    top = doc["lines"][0]  # the leak differs most between ranks: 24 MiB on one rank, 0 on the others
    assert (top["file"], top["line"]) == (SYNTH, line_of(SYNTH, "# LEAK_LINE"))
    assert top["spread"] == STEPS * 2 * MiB and top["bytes"][str(LEAKY)] == STEPS * 2 * MiB
    big = next(x for x in doc["lines"] if x["line"] == line_of(SYNTH, "# BIG_LINE"))
    assert big["bytes"] == {str(r): big_size(r) for r in range(RANKS)}
    assert len(doc["steps"]) == STEPS and len(doc["steps"][0]["ranks"]) == RANKS
    assert doc["clocks"]["steps_used"] == STEPS and len(doc["clocks"]["hosts"]) == 1

    assert main(["report", str(folder / "run.rank*.memviz"), "--engine", "python"]) == 0
    text = capsys.readouterr().out
    assert "memviz report: 64 ranks of 64" in text and max(map(len, text.splitlines())) <= 99
    assert f"Ranks whose memory grows while the others' does not (1;" in text
    assert "growth" in text and "outliers: 5" in text and "Highest peaks (of 64 ranks):" in text
    assert "have a column for 6 of the 64 ranks" in text, text
    out = folder / "ranks.html"
    assert main(["report", str(folder / "run.rank*.memviz"), "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert page.count('<svg class="mvz-chart"') == 2 and page.count("<rect ") >= RANKS
    assert "<script>" not in page and "script-src" not in page
    assert "Ranks whose memory grows while the others" in page and "Highest peaks (of 64 ranks)" in page


def test_the_parallel_and_the_serial_merge_agree(ranks64, capsys):
    folder, _ = ranks64
    _same(_doc(capsys, folder / "run.rank*.memviz", "--jobs", "1", "--engine", "python"),
          _doc(capsys, folder / "run.rank*.memviz", "--jobs", "2", "--engine", "python"))


def test_duckdb_gives_the_parallel_merges_answers(ranks64, capsys):
    pytest.importorskip("duckdb", reason="the DuckDB merge needs duckdb: pip install duckdb (or 'memviz-gpu[duckdb]')")
    pytest.importorskip("pyarrow", reason="the DuckDB merge reads Parquet: pip install pyarrow")
    folder, _ = ranks64
    a = _doc(capsys, folder / "run.rank*.memviz", "--jobs", "2", "--engine", "python")
    b = _doc(capsys, folder / "run.rank*.memviz", "--jobs", "2", "--engine", "duckdb")
    assert (a["engine"], b["engine"]) == ("python", "duckdb")
    for k in ("mean_peak", "stdev_peak", "cv"):  # sums of 64 floats: the last bits may differ
        assert a["imbalance"].pop(k) == pytest.approx(b["imbalance"].pop(k))
    _same(a, b)


def test_duckdb_absent_says_what_to_install(ranks64, capsys, monkeypatch):
    import memviz.export.parquet as P

    monkeypatch.setattr(P, "missing", lambda *m: list(m))
    folder, paths = ranks64
    assert main(["report", *paths[:3], "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and "duckdb" in err and "Traceback" not in err
    assert main(["export", "--parquet", str(folder / "nope"), paths[0]]) == 2
    err = capsys.readouterr().err
    assert "needs pyarrow" in err and "pip install" in err


def _export(argv, capsys):
    assert main(["export", "--parquet", *map(str, argv)]) == 0
    return capsys.readouterr().err


def test_parquet_export_of_the_ranks(ranks64, capsys, tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet", reason="the Parquet export needs pyarrow: pip install pyarrow")
    import memviz.export.parquet as P

    folder, paths = ranks64
    out = tmp_path / "out"
    assert "wrote 4 traces as Parquet" in _export([out, *paths[:4], "--jobs", "2"], capsys)
    manifest = json.loads((out / "memviz_parquet.json").read_text())
    assert manifest["memviz_parquet"] == P.SCHEMA_VERSION == 2 and set(manifest["tables"]) == {
        "ranks", "events", "stacks", "steps", "peaks", "peak_lines", "findings"}
    for table in manifest["tables"]:  # small ranks: one file per table for the 4, named after them
        files = sorted(os.listdir(out / table))
        assert files == ["ranks-00000-00003.parquet"], (table, files)
        meta = pq.read_schema(out / table / files[0]).metadata
        assert meta[b"memviz_schema_version"] == b"2" and meta[b"memviz_table"] == table.encode()
    events = pq.read_table(out / "events").to_pylist()
    assert [e["rank"] for e in events] == sorted(e["rank"] for e in events)  # in the order of the files given
    for r in range(4):
        t = memviz.load(paths[r])
        mine = [e for e in events if e["rank"] == r]
        theirs = list(t.events())
        assert [(e["op"], e["timestamp_ns"], e["size"], e["address"], e["device"]) for e in mine] == \
            [(e.op, e.timestamp_ns, e.size, e.address, e.device) for e in theirs]
        live = sum(e["size"] if e["op"] == "alloc" else -e["size"] for e in mine if e["kind"] == "device")
        assert live == t.current_bytes()
        made = {e["alloc_id"]: e for e in mine if e["op"] != "free"}
        assert len(made) == len([e for e in mine if e["op"] != "free"])  # one number each
        marks = sorted(s.timestamp_ns for s in t.steps)
        order: dict = {}
        for e in mine:  # (step marks before it) << 32 | its order among its step's allocations
            if e["op"] != "free":
                step = sum(m < e["timestamp_ns"] for m in marks)
                assert e["alloc_id"] == (step << 32) | order.get(step, 0), e
                order[step] = order.get(step, 0) + 1
        assert sorted(order) == list(range(STEPS))  # each step's allocations (none after the last)
        for e in mine:  # a free joins its allocation by alloc_id
            if e["op"] == "free" and e["alloc_id"] is not None:
                a = made[e["alloc_id"]]
                assert (a["address"], a["size"], a["device"]) == (e["address"], e["size"], e["device"])
                assert a["timestamp_ns"] <= e["timestamp_ns"]
        assert any(e["op"] == "free" and e["alloc_id"] is not None for e in mine)
    stacks = pq.read_table(out / "stacks").to_pylist()
    big = line_of(SYNTH, "# BIG_LINE")
    assert any(s["user_line"] == big and s["user_file"] == SYNTH and s["frames"][-1]["line"] == big
               for s in stacks)
    peaks = {(p["rank"], p["peak_kind"]): p["bytes"] for p in pq.read_table(out / "peaks").to_pylist()}
    assert peaks[(2, "device")] == memviz.load(paths[2]).peak_bytes()
    lines = [x for x in pq.read_table(out / "peak_lines").to_pylist() if x["rank"] == 3]
    assert sum(x["bytes"] for x in lines) == memviz.load(paths[3]).peak_bytes()
    steps = pq.read_table(out / "steps").to_pylist()
    assert len([s for s in steps if s["rank"] == 0]) == STEPS
    ranks = pq.read_table(out / "ranks").to_pylist()
    assert [(x["rank"], x["world_size"], x["peak"]) for x in ranks] == \
        [(r, RANKS, memviz.load(paths[r]).peak_bytes()) for r in range(4)]
    # large ranks: each one's events in a file of its own, written by its worker; the same rows
    monkeypatch.setattr(P, "POOL_BELOW", 0)
    own = tmp_path / "own"
    _export([own, *paths[:4], "--jobs", "2"], capsys)
    assert sorted(os.listdir(own / "events")) == [f"rank-{r:05d}.parquet" for r in range(4)]
    assert sorted(os.listdir(own / "ranks")) == ["ranks-00000-00003.parquet"]
    assert pq.read_table(own / "events").to_pylist() == events
    monkeypatch.setattr(P, "POOL_BELOW", 1 << 16)
    # row groups of a few rows: the shared files written as they fill, the same rows
    monkeypatch.setattr(P, "_BATCH", 16)
    small = tmp_path / "small"
    _export([small, *paths[:4], "--jobs", "1"], capsys)
    for table in manifest["tables"]:
        assert pq.read_table(small / table).to_pylist() == pq.read_table(out / table).to_pylist(), table
    assert pq.ParquetFile(small / "events" / "ranks-00000-00003.parquet").metadata.num_row_groups >= 4
    monkeypatch.setattr(P, "_BATCH", 1 << 17)
    # --force: the same ranks' files replaced, not added to
    _export([own, *paths[:4], "--jobs", "1", "--force"], capsys)
    assert pq.read_table(own / "ranks").num_rows == 4
    # LoadedTrace.to_parquet: one trace, one file per table named after its rank
    one = tmp_path / "one"
    written = memviz.load(paths[1]).to_parquet(str(one))
    assert sorted(os.path.relpath(w, one) for w in written) == sorted(
        f"{t}/rank-00001.parquet" for t in manifest["tables"])
    assert pq.read_table(one / "events").to_pylist() == [e for e in events if e["rank"] == 1]
    assert not [f for _d, _s, fs in os.walk(tmp_path) for f in fs if ".tmp-" in f]  # no temporary left


@pytest.mark.parametrize("bulk", [300, 20_000, 80_000])
def test_the_parquet_export_is_at_most_1_5x_the_traces(fake, tmp_path, capsys, bulk):
    """Issue 29's target, on small ranks (a few hundred events: the tables'
    files' own overhead weighs) up to ranks whose events get a file each."""
    pytest.importorskip("pyarrow", reason="the Parquet export needs pyarrow: pip install pyarrow")
    import memviz.export.parquet as P
    from rank_traces import record_rank

    paths = [record_rank(fake, str(tmp_path), r, 4, steps=10, bulk=bulk, leak=(r == 1)) for r in range(4)]
    out = tmp_path / "pq"
    _export([out, *paths, "--jobs", "2"], capsys)
    own = sorted(f for f in os.listdir(out / "events") if f.startswith("rank-"))
    assert len(own) == (4 if bulk >= P.POOL_BELOW else 0), own
    memviz_bytes = sum(os.path.getsize(p) for p in paths)
    parquet_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(out) for f in fs)
    print(f"{bulk} events per rank: {parquet_bytes / memviz_bytes:.3f}x")
    assert parquet_bytes <= 1.5 * memviz_bytes, (bulk, parquet_bytes, memviz_bytes, parquet_bytes / memviz_bytes)


def test_each_free_joins_its_allocation_by_alloc_id(fake, tmp_path):
    """Thousands live at once, freed in a shuffled order, some addresses made
    again: every free's alloc_id is its allocation's (the C export's table
    of the live allocations' numbers grows and forgets)."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the Parquet export needs pyarrow: pip install pyarrow")
    import random

    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

    alloc, free = fake.lib.fake_alloc, fake.lib.fake_free
    rng = random.Random(29)
    with memviz.track(trace=str(tmp_path / "t.memviz"), torch=False) as t:
        for step in range(3):
            made = [alloc(CBID_cuMemAlloc_v2, 4096 + 512 * rng.randrange(64), 0, 0) for _ in range(3000)]
            rng.shuffle(made)
            for a in made[:2500]:
                free(CBID_cuMemFree_v2, a, 0, 0)
            t.step()
            for a in made[2500:]:
                free(CBID_cuMemFree_v2, a, 0, 0)
    written = memviz.load(t.trace_path).to_parquet(str(tmp_path / "pq"))
    rows = pq.read_table([w for w in written if "/events/" in w][0]).to_pylist()
    allocs = {e["alloc_id"]: e for e in rows if e["op"] == "alloc"}
    frees = [e for e in rows if e["op"] == "free"]
    assert len(allocs) == len([e for e in rows if e["op"] == "alloc"]) >= 9000 and len(frees) >= 9000
    for e in frees:
        a = allocs[e["alloc_id"]]
        assert (a["address"], a["size"]) == (e["address"], e["size"]) and a["timestamp_ns"] < e["timestamp_ns"]
    assert len({e["alloc_id"] for e in frees}) == len(frees)
    assert {a >> 32 for a in allocs} == {0, 1, 2}  # the step marks before each


def test_polars_reads_the_export_as_documented(ranks64, tmp_path):
    pl = pytest.importorskip("polars", reason="the Polars example needs polars: pip install polars")
    pytest.importorskip("pyarrow", reason="the Parquet export needs pyarrow: pip install pyarrow")
    _, paths = ranks64
    assert main(["export", "--parquet", str(tmp_path), *paths[:3]]) == 0
    peaks = (pl.scan_parquet(str(tmp_path / "ranks" / "*.parquet")).select("rank", "peak")
             .sort("peak", descending=True).collect())
    assert peaks["rank"].to_list() == [2, 1, 0]


def _with_rank(src, dst, rank, world):
    """A copy of the trace ``src`` as rank ``rank`` of ``world`` (its META chunk rewritten)."""
    data = open(src, "rb").read()
    at = F.HEADER.size
    kind, length = F.CHUNK_HEAD.unpack_from(data, at)
    payload = data[at + F.CHUNK_HEAD.size: at + F.CHUNK_HEAD.size + length]
    if kind & F.COMPRESSED:
        payload = zlib.decompress(payload)
    meta = json.loads(payload)
    meta["ranks"].update(rank=rank, local_rank=rank % 8, world_size=world)
    rest = data[at + F.CHUNK_HEAD.size + length + F.CRC.size:]
    with open(dst, "wb") as f:
        f.write(F.header() + F.chunk(F.META, F.json_bytes(meta)) + rest)


def test_1000_ranks_with_3_bad_files_name_the_3(ranks64, capsys, tmp_path):
    _, paths = ranks64
    world = 1000
    for r in range(world):
        _with_rank(paths[r % 16], tmp_path / f"run.rank{r}.memviz", r, world)
    os.unlink(tmp_path / "run.rank17.memviz")  # missing
    data = (tmp_path / "run.rank400.memviz").read_bytes()
    (tmp_path / "run.rank400.memviz").write_bytes(data[:10])  # truncated inside the header
    (tmp_path / "run.rank999.memviz").write_bytes(b"PK\x03\x04 not a trace at all" * 10)  # foreign
    cut = tmp_path / "run.rank500.memviz"  # cut short after its first chunks: read, and noted
    cut.write_bytes(cut.read_bytes()[:-40])
    given = [str(tmp_path / f"run.rank{r}.memviz") for r in range(world)]
    assert main(["report", *given, "--format", "json", "--jobs", "2", "--engine", "python"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    bad = {given[17], given[400], given[999]}
    assert {x["trace"] for x in doc["skipped"]} == bad
    assert len(doc["ranks"]) == world - 3 and "3 files could not be read" in doc["notes"][0]
    assert any("rank 500's trace is incomplete" in n for n in doc["notes"]), doc["notes"]
    assert any("3 of the 1000 ranks have no file here (ranks 17, 400, 999)" in n for n in doc["notes"])
    for b in bad:
        assert f"left out {b}" in cap.err
    assert "Traceback" not in cap.err
    html = tmp_path / "r.html"  # the page names them too (four ranks here: the page is the same code)
    assert main(["report", *given[:4], given[17], given[999], "--format", "html", "-o", str(html)]) == 0
    capsys.readouterr()
    page = html.read_text()
    assert "Files left out (2)" in page and "run.rank17.memviz" in page and "run.rank999.memviz" in page


def test_foreign_files_among_ranks_are_left_out_and_too_few_refused(ranks64, capsys, tmp_path):
    _, paths = ranks64
    other = tmp_path / "other.memviz"
    shutil.copy(paths[0], other)
    data = other.read_bytes()
    # a file of another run: its run id differs from the other ranks' (a strict majority)
    at = F.HEADER.size
    kind, length = F.CHUNK_HEAD.unpack_from(data, at)
    payload = data[at + F.CHUNK_HEAD.size: at + F.CHUNK_HEAD.size + length]
    meta = json.loads(zlib.decompress(payload) if kind & F.COMPRESSED else payload)
    meta["ranks"].update(run_id="another-run", rank=70)
    other.write_bytes(F.header() + F.chunk(F.META, F.json_bytes(meta)) + data[at + 5 + length + 4:])
    doc = _doc(capsys, *paths[:4], other, "--engine", "python")
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert doc["skipped"] == [{"trace": str(other), "reason": "it is from another run: its launcher run id is "
                                                              "'another-run', the others' 'scale-run'"}]
    (tmp_path / "junk.memviz").write_text("hello")
    assert main(["report", paths[0], str(tmp_path / "junk.memviz"), str(tmp_path / "gone.memviz")]) == 2
    err = capsys.readouterr().err
    assert "1 of the 3 files could be read" in err and "junk.memviz" in err and "gone.memviz" in err
    assert "Traceback" not in err


def test_a_foreign_file_of_a_kept_ranks_number_is_not_counted_twice_by_duckdb(ranks64, capsys, tmp_path):
    pytest.importorskip("duckdb", reason="the DuckDB merge needs duckdb: pip install duckdb (or 'memviz-gpu[duckdb]')")
    pytest.importorskip("pyarrow", reason="the DuckDB merge reads Parquet: pip install pyarrow")
    _, paths = ranks64
    data = open(paths[LEAKY], "rb").read()  # rank 5's file, as rank 2 of another run
    at = F.HEADER.size
    kind, length = F.CHUNK_HEAD.unpack_from(data, at)
    payload = data[at + F.CHUNK_HEAD.size: at + F.CHUNK_HEAD.size + length]
    meta = json.loads(zlib.decompress(payload) if kind & F.COMPRESSED else payload)
    meta["ranks"].update(run_id="another-run", rank=2)
    other = tmp_path / "other.rank2.memviz"
    other.write_bytes(F.header() + F.chunk(F.META, F.json_bytes(meta)) + data[at + 5 + length + 4:])
    given = [*paths[:6], other]
    a = _doc(capsys, *given, "--engine", "python", "--jobs", "2")
    b = _doc(capsys, *given, "--engine", "duckdb", "--jobs", "2")
    assert [x["trace"] for x in b["skipped"]] == [str(other)]
    for k in ("mean_peak", "stdev_peak", "cv"):
        assert a["imbalance"].pop(k) == pytest.approx(b["imbalance"].pop(k))
    _same(a, b)


def _summary(rank, host, wall, steps):
    return RankSummary(rank=rank, host=host, start_wall_time=wall, start_monotonic_ns=1000,
                       steps=[(i, 1000 + int(t * 1e9), 0, 0, 0) for i, t in enumerate(steps)])


def test_clocks_between_hosts_from_the_step_marks():
    ends = [1.0, 2.0, 3.0, 4.0, 5.0]
    # host b's clock is 2.5 s ahead; rank 3 ends its steps 0.1 s late on host b
    got = clocks([_summary(0, "a", 100.0, ends), _summary(1, "a", 100.0, ends),
                  _summary(2, "b", 102.5, ends), _summary(3, "b", 102.5, [t + 0.1 for t in ends]),
                  _summary(4, "c", 100.0, ends)])
    assert got["steps_used"] == 5 and got["why_none"] is None
    hosts = {h["host"]: h for h in got["hosts"]}
    assert hosts["b"]["offset_s"] == pytest.approx(2.55) and hosts["a"]["offset_s"] == pytest.approx(0)
    assert hosts["b"]["late_spread_s"] == pytest.approx(0.1) and got["hosts"][0]["host"] == "b"
    assert got["max_offset_s"] == pytest.approx(2.55)
    assert clocks([_summary(0, "a", 1.0, [])])["why_none"] == "fewer than two ranks recorded steps"


def test_the_export_verb_says_what_it_does_and_what_is_wrong(capsys, tmp_path):
    assert main(["export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--parquet OUT" in out and "pyarrow" in out and "--jobs" in out
    assert main(["export", "run.memviz"]) == 2  # no --parquet
    assert "--parquet" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "export" in capsys.readouterr().out
    pytest.importorskip("pyarrow", reason="the Parquet export needs pyarrow: pip install pyarrow")
    (tmp_path / "afile").write_text("x")
    assert main(["export", "--parquet", str(tmp_path / "afile"), str(tmp_path / "t.memviz")]) == 2
    assert "it is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "done" / "events").mkdir(parents=True)  # an earlier export: kept unless --force
    assert main(["export", "--parquet", str(tmp_path / "done"), str(tmp_path / "t.memviz")]) == 2
    assert "already holds an export" in capsys.readouterr().err
    assert main(["export", "--parquet", str(tmp_path / "out"), str(tmp_path / "gone.memviz")]) == 2
    err = capsys.readouterr().err
    assert "left out" in err and "gone.memviz" in err and "none of the 1 files" in err
    # a folder that cannot be made: what to do, not a traceback (as the reports' -o)
    for bad in (tmp_path / "afile" / "sub", "/proc/memviz-no-such-folder"):
        assert main(["export", "--parquet", str(bad), str(tmp_path / "t.memviz")]) == 2
        err = capsys.readouterr().err
        assert "cannot write the Parquet export" in err and "What to do" in err, err
        with pytest.raises(memviz.OutputError, match="Parquet export"):
            memviz.export.parquet.make_folder(str(bad))


def test_traces_without_a_rank_never_overwrite_each_other(fake, tmp_path, capsys, monkeypatch):
    """Two traces recorded without a launcher, exported together: each keeps
    its events' own file (the second ``single.1.parquet``, not over the
    first), and the export says their rows cannot be told apart.
    LoadedTrace.to_parquet into a folder that holds that rank's tables
    refuses without force=True; ``--force`` replaces an earlier export whole."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the Parquet export needs pyarrow: pip install pyarrow")
    import memviz.export.parquet as P
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

    paths = []
    for k, n in enumerate((300, 500)):
        with memviz.track(trace=str(tmp_path / f"t{k}.memviz"), torch=False) as t:
            for _ in range(n):
                fake.lib.fake_free(CBID_cuMemFree_v2, fake.lib.fake_alloc(CBID_cuMemAlloc_v2, 4096, 0, 0), 0, 0)
        assert memviz.load(t.trace_path).rank is None
        paths.append(t.trace_path)
    monkeypatch.setattr(P, "POOL_BELOW", 1)  # every trace's events in a file of its own
    out = tmp_path / "pq"
    assert main(["export", "--parquet", str(out), *paths, "--jobs", "1"]) == 0
    assert "recorded without a launcher's rank" in capsys.readouterr().err
    assert sorted(os.listdir(out / "events")) == ["single.1.parquet", "single.parquet"]
    counts = sorted(pq.read_table(out / "events" / f).num_rows for f in os.listdir(out / "events"))
    assert counts[0] >= 600 and counts[1] >= 1000  # both traces' allocs and frees, none lost
    # --force: the earlier export's files go, none stays beside the new ones; a file of the user's stays
    (out / "events" / "mine.parquet").write_bytes(b"not memviz's")
    # ... but only once the new export is written: a --force run that exports nothing
    # (no file readable) leaves the earlier export whole (it was removed first)
    before = {f: (out / "events" / f).read_bytes() for f in os.listdir(out / "events")}
    (tmp_path / "empty.memviz").write_bytes(b"")
    assert main(["export", "--parquet", str(out), str(tmp_path / "empty.memviz"), "--jobs", "1",
                 "--force"]) == 2
    assert "left as it was" in capsys.readouterr().err
    assert {f: (out / "events" / f).read_bytes() for f in os.listdir(out / "events")} == before
    assert (out / "memviz_parquet.json").exists()
    assert main(["export", "--parquet", str(out), paths[0], "--jobs", "1", "--force"]) == 0
    assert sorted(os.listdir(out / "events")) == ["mine.parquet", "single.parquet"]
    # to_parquet: the same rank's tables are not replaced without force=True
    one = tmp_path / "one"
    memviz.load(paths[0]).to_parquet(str(one))
    with pytest.raises(memviz.InvalidArgument, match="force=True"):
        memviz.load(paths[1]).to_parquet(str(one))
    memviz.load(paths[1]).to_parquet(str(one), force=True)
    assert pq.read_table(one / "events").num_rows >= 1000
