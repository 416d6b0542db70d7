"""The merge of many ranks' traces (issue 29): wall time and peak memory of
``memviz report run.rank*.memviz`` (text, JSON, HTML; the Python and the
DuckDB merge), and the size of the Parquet export against the .memviz files.

    python benchmarks/bench_ranks_scale.py [--ranks 64] [--distinct 8] [--events 1000000]
        [--steps 50] [--jobs N] [--rounds 1] [--folder DIR] [--out results/....json]

The ranks are made through the real writer with the libcupti test double
(tests/rank_traces.py: a buffer per rank, a temporary per step, one rank
leaking, and ``--events`` alloc/free events per rank fired from C by the
double's loop). ``--distinct`` ranks are recorded; the others are copies of
them with their META chunk's rank rewritten (the merge reads every file in
full either way; copies only save the recording time).

Peak memory is the highest sum of the resident sizes of the report's
process and its worker processes, sampled every 20 ms from /proc.

The Parquet size is measured on the rank traces made here and on the
training-like trace of bench_big_report.py (varied sizes, addresses, stacks
and threads; ``--big-events``, 0: none), whose events compress less alike:
as that script writes it (a step record every 100 steps) and with a step
mark per step (as ``t.step()`` in the loop records them).
``--export-only``: the export alone, not the reports.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and its descendants (from /proc)."""
    parent, rss = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/statm") as f:
                rss[int(d)] = int(f.read().split()[1]) * PAGE
            parent[int(d)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    kids = {}
    for p, pp in parent.items():
        kids.setdefault(pp, []).append(p)
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += kids.get(p, [])
    return total


def run_measured(cmd, env=None):
    """(wall seconds, peak resident bytes of the process tree, returncode)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(p.pid))
            done.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _out, err = p.communicate()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    if p.returncode:
        sys.stderr.write(err.decode(errors="replace")[-2000:])
    return wall, peak[0], p.returncode


def make_ranks(folder, ranks, distinct, events, steps):
    """``ranks`` rank traces in ``folder``: ``distinct`` recorded, the rest copies."""
    from fake_cupti import FakeCupti, build
    from memviz.capture import cupti as _capture

    fake_path = build()
    os.environ[_capture.ENV_LIBRARY] = fake_path
    import memviz
    from rank_traces import record_rank

    fake = FakeCupti(fake_path)
    fake.reset()
    memviz.frames.add_library_path(os.path.join(ROOT, "tests", "fake_cupti"))
    t0 = time.perf_counter()
    made = [record_rank(fake, folder, r, ranks, steps=steps, bulk=events, leak=(r == 3))
            for r in range(min(distinct, ranks))]
    recorded = time.perf_counter() - t0
    for r in range(len(made), ranks):
        copy_as_rank(made[r % len(made)], os.path.join(folder, f"run.rank{r}.memviz"), r, ranks)
    return recorded


def copy_as_rank(src, dst, rank, world):
    from memviz.trace import format as F

    data = open(src, "rb").read()
    at = F.HEADER.size
    kind, length = F.CHUNK_HEAD.unpack_from(data, at)
    payload = data[at + F.CHUNK_HEAD.size: at + F.CHUNK_HEAD.size + length]
    meta = json.loads(zlib.decompress(payload) if kind & F.COMPRESSED else payload)
    meta["ranks"].update(rank=rank, local_rank=rank % 8, world_size=world)
    with open(dst, "wb") as f:
        f.write(F.header() + F.chunk(F.META, F.json_bytes(meta)) + data[at + F.CHUNK_HEAD.size + length + F.CRC.size:])


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=8)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", default="python,duckdb")
    ap.add_argument("--formats", default="text,json,html")
    ap.add_argument("--export-only", action="store_true", help="only the Parquet export, not the reports")
    ap.add_argument("--big-events", type=int, default=1_000_000)
    ap.add_argument("--folder", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    folder = args.folder or tempfile.mkdtemp(prefix="memviz-ranks-bench-")
    os.makedirs(folder, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, {platform.machine()}",
              "python": platform.python_version(), "ranks": args.ranks, "distinct": args.distinct,
              "events_per_rank": args.events, "steps": args.steps, "jobs": args.jobs or os.cpu_count()}
    try:
        if not os.path.exists(os.path.join(folder, f"run.rank{args.ranks - 1}.memviz")):
            result["record_s"] = make_ranks(folder, args.ranks, args.distinct, args.events, args.steps)
        files = [os.path.join(folder, f"run.rank{r}.memviz") for r in range(args.ranks)]
        memviz_bytes = sum(os.path.getsize(f) for f in files)
        result["memviz_bytes"] = memviz_bytes
        env = dict(os.environ, PYTHONPATH=ROOT)
        runs = {}
        for engine in ([] if args.export_only else args.engines.split(",")):
            for fmt in args.formats.split(","):
                for k in range(args.rounds):
                    out = os.path.join(folder, f"report.{engine}.{fmt}")
                    cmd = [sys.executable, "-m", "memviz", "report", os.path.join(folder, "run.rank*.memviz"),
                           "--format", fmt, "-o", out, "--engine", engine]
                    if args.jobs:
                        cmd += ["--jobs", str(args.jobs)]
                    wall, peak, rc = run_measured(cmd, env)
                    runs.setdefault(f"{engine}/{fmt}", []).append(
                        {"wall_s": round(wall, 2), "peak_mb": round(peak / 2**20), "rc": rc,
                         "output_bytes": os.path.getsize(out) if rc == 0 else None})
                    print(engine, fmt, runs[f"{engine}/{fmt}"][-1], flush=True)
        result["report"] = runs
        # the Parquet export: the distinct ranks (copies would compress the same)
        pq_dir = os.path.join(folder, "parquet")
        shutil.rmtree(pq_dir, ignore_errors=True)
        distinct = files[:args.distinct]
        wall, peak, rc = run_measured([sys.executable, "-m", "memviz", "export", "--parquet", pq_dir, *distinct]
                                      + (["--jobs", str(args.jobs)] if args.jobs else []), env)
        src = sum(os.path.getsize(f) for f in distinct)
        result["export_ranks"] = {"files": len(distinct), "wall_s": round(wall, 2), "peak_mb": round(peak / 2**20),
                                  "rc": rc, "memviz_bytes": src, "parquet_bytes": folder_bytes(pq_dir),
                                  "ratio": round(folder_bytes(pq_dir) / src, 3)}
        print("export", result["export_ranks"], flush=True)
        # bench_big_report.py's trace as it writes it (a step record every 100 steps), and with
        # a step mark per step (t.step() in the loop: each step's allocations numbered apart)
        for key, name, every in (("export_training_like", "big", None),
                                 ("export_training_like_marked", "big_marked", 1)):
            if not args.big_events:
                break
            import bench_big_report as big
            path = os.path.join(folder, f"{name}.memviz")
            big.build(path, args.big_events, mark_every=every)
            big_dir = os.path.join(folder, f"parquet_{name}")
            shutil.rmtree(big_dir, ignore_errors=True)
            wall, peak, rc = run_measured([sys.executable, "-m", "memviz", "export", "--parquet", big_dir, path],
                                          env)
            result[key] = {
                "events": args.big_events, "wall_s": round(wall, 2), "peak_mb": round(peak / 2**20), "rc": rc,
                "memviz_bytes": os.path.getsize(path), "parquet_bytes": folder_bytes(big_dir),
                "events_table_bytes": folder_bytes(os.path.join(big_dir, "events")),
                "ratio": round(folder_bytes(big_dir) / os.path.getsize(path), 3)}
            print(key.replace("_", " "), result[key], flush=True)
    finally:
        if not args.folder:
            shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
