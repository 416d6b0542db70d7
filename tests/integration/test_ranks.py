"""Distributed runs on CPU: one trace per rank and the merged report
(memviz/capture/rank_files.py, memviz/report/ranks.py, memviz/cli/report_ranks.py).

The end-to-end tests run ``python -m torch.distributed.run --nproc-per-node 2``
with the gloo backend; each rank's "GPU" allocations come from the libcupti
test double (the launcher's children inherit MEMVIZ_CUPTI_LIBRARY), rank 0
allocating more than rank 1. The other tests record the ranks one after the
other in this process, with the launcher's variables set by hand.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import memviz
from conftest import line_of
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz._units import format_size
from memviz.capture import cupti as _capture
from memviz.capture.rank_files import rank_glob, rank_meta, rank_path
from memviz.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def no_launcher(monkeypatch):
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# ---- file names -----------------------------------------------------------------


@pytest.mark.parametrize("given, rank, expected", [
    ("run.memviz", "3", "run.rank3.memviz"),
    ("out/run", "0", os.path.join("out", "run.rank0")),
    ("out.d/run.trace.memviz", "1", os.path.join("out.d", "run.trace.rank1.memviz")),
    ("run.rank{rank}.memviz", "2", "run.rank2.memviz"),
    ("{rank}/run.memviz", "2", "2/run.memviz"),
    ("run.rank1.memviz", "1", "run.rank1.memviz"),  # already this rank's: named per rank by the program
    ("ckpt/rank_1/run.memviz", "1", "ckpt/rank_1/run.memviz"),
    ("run.rank10.memviz", "1", "run.rank10.rank1.memviz"),  # rank 10 is not rank 1
    ("franky1.memviz", "1", "franky1.rank1.memviz"),
])
def test_rank_path_under_a_launcher(given, rank, expected):
    env = {"RANK": rank, "WORLD_SIZE": "16"}
    assert rank_path(given, env) == expected
    assert rank_path(rank_path(given, env), env) == rank_path(given, env) or "{rank}" in given


def test_rank_path_without_a_launcher_and_with_local_rank_only():
    assert rank_path("run.memviz", {}) == "run.memviz"
    assert rank_path("run.rank{rank}.memviz", {}) == "run.rank0.memviz"  # a lone process is rank 0 of 1
    assert rank_path("run.memviz", {"LOCAL_RANK": "1"}) == "run.rank1.memviz"
    assert rank_path("run.memviz", {"RANK": "not a number"}) == "run.memviz"
    assert rank_glob("out/run.memviz") == os.path.join("out", "run.rank*.memviz")
    assert rank_glob("run.{rank}.memviz") == "run.*.memviz"


def test_rank_meta_never_initialises_cuda():
    meta = rank_meta({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc",
                      "CUDA_VISIBLE_DEVICES": "2,3"})
    assert meta == {"rank": 1, "local_rank": 1, "world_size": 2, "host": socket.gethostname(),
                    "run_id": "abc", "cuda_visible_devices": "2,3", "cuda_device": None}
    assert rank_meta({"TORCHELASTIC_RUN_ID": "none"})["run_id"] is None
    torch = sys.modules.get("torch")
    if torch is not None:
        assert not torch.cuda.is_initialized()


# ---- traces of ranks recorded here, one after the other ---------------------------


def _record(fake, monkeypatch, folder, rank, world=2, big=64, spike=False, run_id="run-1", steps=10):
    """One rank's run: a buffer of ``big`` MiB (BIG), 2 MiB kept per step
    (LEAK), 8 MiB freed in each step (TEMP)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    fake.set_device(rank % 8)
    with memviz.track(trace=str(folder / "run.memviz")) as t:
        alloc, free = fake.lib.fake_alloc, fake.lib.fake_free
        alloc(CBID_cuMemAlloc_v2, big * MiB, 0, 0)  # BIG
        for step in range(steps):
            alloc(CBID_cuMemAlloc_v2, 2 * MiB, 0, 0)  # LEAK
            free(CBID_cuMemFree_v2, alloc(CBID_cuMemAlloc_v2, 8 * MiB, 0, 0), 0, 0)  # TEMP
            if spike and step == 8:
                free(CBID_cuMemFree_v2, alloc(CBID_cuMemAlloc_v2, 80 * MiB, 0, 0), 0, 0)  # SPIKE
            t.step(tokens=4096 if spike and step == 8 else 512)  # a long input makes the spike
    fake.set_device(0)
    return t.trace_path


def _json(capsys, *argv):
    assert main(["report", *map(str, argv), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_merged_report_of_ranks_recorded_here(fake, no_launcher, tmp_path, capsys):
    paths = [_record(fake, no_launcher, tmp_path, 0, big=64, spike=True),
             _record(fake, no_launcher, tmp_path, 1, big=16)]
    assert [os.path.basename(p) for p in paths] == ["run.rank0.memviz", "run.rank1.memviz"]
    assert not (tmp_path / "run.memviz").exists()
    traces = [memviz.load(p) for p in paths]
    assert [(t.rank, t.local_rank, t.world_size, t.run_id, t.devices) for t in traces] == \
        [(0, 0, 2, "run-1", [0]), (1, 1, 2, "run-1", [1])]
    doc = _json(capsys, tmp_path / "run.rank1.memviz", tmp_path / "run.rank0.memviz")  # any order
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["world_size"] == 2 and doc["notes"] == []
    for row, t in zip(doc["ranks"], traces):
        assert row["peak"] == t.peak_bytes() and row["current"] == t.current_bytes()
        assert row["device"] == t.rank and row["steps"] == 10
        peak_ts = t.totals()[t.rank]["peak_timestamp_ns"]
        assert row["peak_at_s"] == pytest.approx((peak_ts - t.started_ns) / 1e9)
    p0, p1 = traces[0].peak_bytes(), traces[1].peak_bytes()
    assert p0 == (64 + 20 + 80 - 2) * MiB  # the spike in step 8, on top of 9 leaks
    imb = doc["imbalance"]
    assert imb["ratio"] == pytest.approx(p0 / ((p0 + p1) / 2)) and imb["max_rank"] == 0
    here = os.path.abspath(__file__)
    top = doc["lines"][0]
    assert (top["file"], top["line"]) == (here, line_of(here, "# SPIKE")), doc["lines"]
    assert {(x["line"], x["bytes"]["0"], x["bytes"]["1"]) for x in doc["lines"]} >= {
        (line_of(here, "# BIG"), 64 * MiB, 16 * MiB)}
    assert [s["step"] for s in doc["steps"]] == list(range(10))
    s9 = doc["steps"][9]["ranks"]
    assert s9["1"]["current"] == (16 + 20) * MiB and s9["0"]["current"] == (64 + 20) * MiB
    common = {f["kind"]: f for f in doc["common_findings"]}
    assert "growth" in common and common["growth"]["ranks"] == [0, 1]
    assert any(loc.endswith(f":{line_of(here, '# LEAK')}") for loc in common["growth"]["lines"])
    kinds = [{f["kind"] for f in r["findings"]} for r in doc["ranks"]]
    assert "spike" in kinds[0] and "spike" not in kinds[1] and "spike" not in common

    assert main(["report", str(tmp_path / "run.rank*.memviz")]) == 0  # the pattern, quoted
    text = capsys.readouterr().out
    assert "memviz report: 2 ranks of 2" in text and f"Imbalance: {imb['ratio']:.2f}x" in text
    assert re.search(r"rank 0 \[spike\]", text) and "Findings on every rank (memviz.diagnose): " in text
    assert max(map(len, text.splitlines())) <= 99
    out = tmp_path / "ranks.html"
    assert main(["report", *paths, "--format", "html", "-o", str(out)]) == 0
    page = out.read_text()
    assert "<h2>Imbalance: " in page and "Steps side by side (10)" in page and "<script>" not in page
    data = page.split('class="memviz-rank-data">')[1].split("</script>")[0]
    assert json.loads(data)["imbalance"]["ratio"] == pytest.approx(imb["ratio"])


def test_files_that_are_not_ranks_of_one_run_are_refused(fake, no_launcher, tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.mkdir(), b.mkdir(), c.mkdir()
    r0 = _record(fake, no_launcher, a, 0, steps=1)
    r1 = _record(fake, no_launcher, a, 1, steps=1)
    other0 = _record(fake, no_launcher, b, 0, steps=1, run_id="run-2")
    other1 = _record(fake, no_launcher, b, 1, world=4, steps=1, run_id="run-2")
    mixed1 = _record(fake, no_launcher, c, 1, steps=1, run_id="run-3")
    for k in LAUNCH_ENV:
        no_launcher.delenv(k, raising=False)
    with memviz.track(trace=str(tmp_path / "alone.memviz")):
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    cases = [((r0, other0), "are both rank 0"), ((r0, r0), "are both rank 0"),
             ((r0, mixed1), "different launcher run ids"), ((other0, other1), "different world sizes"),
             ((r0, tmp_path / "alone.memviz"), "records no rank"), ((r0, tmp_path / "nope.memviz"), "nope")]
    for files, why in cases:
        assert main(["report", *map(str, files)]) == 2, files
        err = capsys.readouterr().err
        assert why in err and "What to do" in err and "Traceback" not in err, err
    # -o naming one of the inputs is refused before anything is read
    assert main(["report", r0, r1, "-o", r1]) == 2
    assert "it is a trace being reported" in capsys.readouterr().err
    assert memviz.load(r1).rank == 1


def test_a_missing_rank_is_noted_not_refused(fake, no_launcher, tmp_path, capsys):
    paths = [_record(fake, no_launcher, tmp_path, r, world=3, steps=2) for r in (0, 2)]
    doc = _json(capsys, *paths)
    assert [r["rank"] for r in doc["ranks"]] == [0, 2]
    assert any("1 of the 3 ranks have no file here (rank 1)" in n for n in doc["notes"]), doc["notes"]


def test_one_file_keeps_its_own_report(fake, no_launcher, tmp_path, capsys):
    path = _record(fake, no_launcher, tmp_path, 1, steps=2)
    assert main(["report", path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["memviz_report"] == 1 and doc["trace"] == path
    assert main(["report", path]) == 0
    assert "  rank 1 of 2 (local rank 1 on " in capsys.readouterr().out


def test_save_names_one_file_per_rank(fake, no_launcher, tmp_path):
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "2")
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    written = t.save(str(tmp_path / "saved.memviz"))
    assert written == str(tmp_path / "saved.rank1.memviz") and os.path.exists(written)
    assert memviz.load(written).rank == 1 and memviz.load(written).world_size == 2


def test_a_trace_whose_rank_fields_are_wrong_says_so(tmp_path):
    from memviz.trace.format import META, chunk, header, json_bytes
    path = tmp_path / "bad.memviz"
    meta = {"format": "memviz-trace", "format_version": 1, "mode": "stream", "memviz_version": "0",
            "python_version": "3", "platform": "linux", "pid": 1, "start_wall_time": 0.0, "argv": [],
            "tracker": {}, "capture": {}, "ranks": {"rank": "zero"}}
    path.write_bytes(header() + chunk(META, json_bytes(meta)))
    with pytest.raises(memviz.TraceError, match="ranks.*rank.*'zero'"):
        memviz.load(str(path))


# ---- torchrun, two processes, gloo -------------------------------------------------


TRAIN = """
import os, sys
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
from fake_cupti import FakeCupti
import memviz

lib = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"]).lib
alloc, free = lib.fake_alloc, lib.fake_free
rank = int(os.environ["RANK"])
lib.fake_set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("gloo")
MiB = 1 << 20
t = memviz.active_tracker()
embedding = alloc({cbid}, (96 if rank == 0 else 32) * MiB, 0, 0)  # EMBEDDING
kept = []
for step in range(10):
    kept.append(alloc({cbid}, 2 * MiB, 0, 0))  # KEPT
    free({free_cbid}, alloc({cbid}, 8 * MiB, 0, 0), 0, 0)  # ACTIVATIONS
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)
    assert x.tolist() == [1.0] * 4
    t.step()
dist.barrier()
dist.destroy_process_group()
print(f"rank {{rank}} done", flush=True)
"""


def _torchrun(tmp_path, fake_path, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and k != _capture.ENV_LIBRARY}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               **{_capture.ENV_LIBRARY: fake_path})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", *args]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@pytest.fixture
def distributed():
    pytest.importorskip("torch")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def test_torchrun_memviz_run_writes_one_trace_per_rank_and_merges_them(tmp_path, fake_path, distributed,
                                                                       capsys):
    train = tmp_path / "train.py"
    train.write_text(TRAIN.format(tests=str(ROOT / "tests"), cbid=CBID_cuMemAlloc_v2,
                                  free_cbid=CBID_cuMemFree_v2))
    p = _torchrun(tmp_path, fake_path, "-m", "memviz", "run", "-o", "run.memviz", "--report-file", "report.txt",
                  "train.py")
    assert sorted(x.name for x in tmp_path.glob("*.memviz")) == ["run.rank0.memviz", "run.rank1.memviz"]
    for r in (0, 1):  # --report-file too: one per rank, each headed by its rank
        assert f"  rank {r} of 2 " in (tmp_path / f"report.rank{r}.txt").read_text()
    assert not (tmp_path / "report.txt").exists()
    out = p.stdout + p.stderr
    assert "rank 0 done" in out and "rank 1 done" in out
    for r in (0, 1):  # each rank says its own file, and how to read them all
        assert re.search(rf"memviz: trace written to run\.rank{r}\.memviz \(.*all ranks with "
                         r"`python -m memviz report 'run\.rank\*\.memviz'`", out), out[-3000:]
        assert f"  rank {r} of 2 (local rank {r} on {socket.gethostname()})" in out
    traces = [memviz.load(str(tmp_path / f"run.rank{r}.memviz")) for r in (0, 1)]
    for r, t in enumerate(traces):
        assert (t.rank, t.local_rank, t.world_size, t.host) == (r, r, 2, socket.gethostname())
        assert t.devices == [r] and t.meta["ranks"]["cuda_device"] is None  # CUDA never initialised
        assert t.command.endswith("-m memviz run -o run.memviz --report-file report.txt train.py"), t.command
    assert traces[0].run_id is not None and traces[0].run_id == traces[1].run_id  # --standalone's id

    doc = _json(capsys, tmp_path / "run.rank1.memviz", tmp_path / "run.rank0.memviz")
    for row, t in zip(doc["ranks"], traces):
        assert row["peak"] == t.peak_bytes() and row["current"] == t.current_bytes()
    assert traces[0].peak_bytes() == (96 + 20 + 8) * MiB  # the last step: 10 kept, 8 MiB more
    assert traces[1].peak_bytes() == (32 + 20 + 8) * MiB
    p0, p1 = traces[0].peak_bytes(), traces[1].peak_bytes()
    assert doc["imbalance"]["ratio"] == pytest.approx(p0 / ((p0 + p1) / 2))
    embedding = line_of(str(train), "# EMBEDDING")
    top = doc["lines"][0]
    assert (os.path.basename(top["file"]), top["line"], top["bytes"]) == \
        ("train.py", embedding, {"0": 96 * MiB, "1": 32 * MiB})
    assert len(doc["steps"]) == 10 and all(set(s["ranks"]) == {"0", "1"} for s in doc["steps"])
    growth = [f for f in doc["common_findings"] if f["kind"] == "growth"]
    assert growth and any(loc.endswith(f"train.py:{line_of(str(train), '# KEPT')}")
                          for loc in growth[0]["lines"]), doc["common_findings"]


TRACK = """
import os
import memviz
from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
lib = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"]).lib
rank = int(os.environ["RANK"])
with memviz.track(trace="own.memviz") as t:
    lib.fake_alloc(CBID_cuMemAlloc_v2, (rank + 1) << 20, 0, 0)
# one write of one line: the two ranks share the launcher's stdout, and print()
# with several arguments writes them piece by piece, interleaved with the other rank's
saved = t.save("saved.{rank}.memviz")
os.write(1, f"saved {saved} {t.trace_path}\\n".encode())
"""


def test_torchrun_a_scripts_own_track_and_save(tmp_path, fake_path, distributed):
    (tmp_path / "track.py").write_text(f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n" + TRACK)
    p = _torchrun(tmp_path, fake_path, "track.py")
    # trace_path: the rank's own file, absolute (read back after a chdir too)
    assert f"saved saved.0.memviz {tmp_path / 'own.rank0.memviz'}" in p.stdout
    assert f"saved saved.1.memviz {tmp_path / 'own.rank1.memviz'}" in p.stdout
    for r in (0, 1):
        for name in (f"own.rank{r}.memviz", f"saved.{r}.memviz"):
            t = memviz.load(str(tmp_path / name))
            assert (t.rank, t.world_size) == (r, 2) and t.peak_bytes() == (r + 1) << 20, name


def test_step_files_are_one_per_rank_too(fake, no_launcher, tmp_path):
    """Every rank runs the same on_step(jsonl=..., csv=...): one file each,
    not every rank truncating and writing the same one."""
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("WORLD_SIZE", "2")
    with memviz.track() as t:
        t.on_step(jsonl=str(tmp_path / "steps.jsonl"), csv=str(tmp_path / "steps.csv"))
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        t.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.rank1.csv", "steps.rank1.jsonl"]
    assert json.loads((tmp_path / "steps.rank1.jsonl").read_text())["index"] == 0


def test_categories_side_by_side(fake, no_launcher, tmp_path, capsys):
    """With PyTorch, each rank's bytes by category at its peak and at the end."""
    torch = pytest.importorskip("torch")
    kept = []
    for rank, n in ((0, 4096), (1, 1024)):
        no_launcher.setenv("RANK", str(rank))
        no_launcher.setenv("WORLD_SIZE", "2")
        with memviz.track(trace=str(tmp_path / "run.memviz")):
            p = torch.nn.Parameter(torch.zeros(n))
            s = p.untyped_storage()
            fake.alloc_at(s.data_ptr(), s.nbytes())
            fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))  # the peak; freed by the end
            kept.append(p)
    doc = _json(capsys, tmp_path / "run.rank0.memviz", tmp_path / "run.rank1.memviz")
    for row, n in zip(doc["ranks"], (4096, 1024)):
        assert row["categories_at_end"] == {"parameter": 4 * n}, row
        assert row["categories_at_peak"].get("outside_pytorch") == 3 * MiB, row
    assert main(["report", str(tmp_path / "run.rank0.memviz"), str(tmp_path / "run.rank1.memviz")]) == 0
    text = capsys.readouterr().out
    assert "By category at the end:" in text and re.search(r"  parameter\s+16 KiB\s+4 KiB", text), text


def test_loading_the_path_given_once_points_to_the_ranks_files(fake, no_launcher, tmp_path):
    """Under torchrun, `memviz.load("run.memviz")` after track(trace="run.memviz")
    finds no such file: the error says each rank wrote its own."""
    _record(fake, no_launcher, tmp_path, 0, steps=1)
    with pytest.raises(memviz.TraceError) as e:
        memviz.load(str(tmp_path / "run.memviz"))
    msg = str(e.value)
    assert "run.rank0.memviz" in msg and "each rank" in msg and "memviz report" in msg, msg
    with pytest.raises(memviz.TraceError) as e:  # no rank's file either: the plain error
        memviz.load(str(tmp_path / "other.memviz"))
    assert "rank" not in str(e.value)


def test_the_merged_html_page_reads_in_chromium(fake, no_launcher, tmp_path, capsys):
    """The merged page in a real headless Chromium: no console error (its
    Content-Security-Policy allows no script), every section there, the
    per-rank tables filled, and the imbalance said."""
    from test_html_report import _browser, need_browser

    need_browser()  # skips, saying what to install, before selenium is imported
    from selenium.webdriver.common.by import By

    paths = [_record(fake, no_launcher, tmp_path, 0, big=64, spike=True),
             _record(fake, no_launcher, tmp_path, 1, big=16)]
    out = tmp_path / "ranks.html"
    assert main(["report", *paths, "--format", "html", "-o", str(out)]) == 0
    browser = _browser()
    try:
        browser.get("file://" + str(out))
        heads = [h.text for h in browser.find_elements(By.TAG_NAME, "h2")]
        assert heads[0] == "Ranks" and any(h.startswith("Imbalance: ") for h in heads), heads
        assert any(h.startswith("Steps side by side") for h in heads), heads
        rows = browser.find_elements(By.CSS_SELECTOR, "table tbody tr")
        assert len(rows) >= 2 + 10, len(rows)  # the two ranks, and the steps at least
        first = browser.find_element(By.CSS_SELECTOR, "table tbody tr").text
        assert first.startswith("rank 0") and "MiB" in first, first
        # Charts, not only tables (issue 28, item 3): a bar per rank as tall as its peak,
        # each peak the rank's own report's, and the steps of the highest and lowest ranks.
        charts = browser.find_elements(By.CSS_SELECTOR, "svg.mvz-chart")
        assert len(charts) == 2, len(charts)
        bars = charts[0].find_elements(By.TAG_NAME, "rect")
        peaks = [max(t["peak"] for t in memviz.load(p).totals().values()) for p in paths]
        assert len(bars) == len(peaks) == 2 and peaks[0] > peaks[1]
        heights = [float(b.get_attribute("height")) for b in bars]
        assert heights[1] / heights[0] == pytest.approx(peaks[1] / peaks[0], rel=0.01)
        titles = [b.find_element(By.TAG_NAME, "title").get_attribute("textContent") for b in bars]
        assert [t.split(" at ")[0] for t in titles] == [f"rank {r}: {format_size(p)}" for r, p in enumerate(peaks)]
        lines = charts[1].find_elements(By.TAG_NAME, "polyline")
        assert len(lines) == 3 and all(len(x.get_attribute("points").split()) == 10 for x in lines)
        assert charts[0].size["height"] > 100 and charts[0].size["width"] > 400  # drawn, not collapsed
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        browser.quit()
