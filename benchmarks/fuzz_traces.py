"""The long form of the trace fuzzer: a million fuzzed .memviz inputs or more.

    python benchmarks/fuzz_traces.py [--inputs 1000000] [--workers 2] [--seed 0]
                                     [--max-seconds S] [--save DIR]

Each worker process runs the mutation fuzzer of ``tests/fuzz_trace.py`` (its
seeds, mutations and :func:`check`): an iteration mutates one input from the
pool (the seed traces, plus loadable mutants, which breed further ones) and
checks it; when the mutant's chunk CRCs do not already match, its
CRC-repaired twin is checked too, as the atheris harness does, so the
mutation reaches the chunk parsers. Checking means loading it and, when it
loads, running the whole pipeline: the reading API, the text, JSON and HTML
reports, diagnose(), the notebook views and both exports, with every output
required to be valid UTF-8 (and JSON where it is JSON). Anything but
:class:`memviz.TraceError` is a failure; failures are grouped by exception
type and the memviz line that raised it, and one input of each is written to
``--save`` (default: a temporary folder).

Two workers by default (the machine is shared); ``--max-seconds`` stops
early and reports what ran. Prints progress to stderr and one JSON object:
iterations, inputs, loaded, trace_errors, distinct failures (with counts and
an example each), seconds, inputs per second.
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import re
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import fuzz_trace  # noqa: E402

#: stop growing a worker's pool of loadable mutants here
POOL_MAX = 200
#: how often (iterations) a worker reports to the parent
REPORT_EVERY = 2000


def _where(e: BaseException) -> str:
    """The innermost frame in memviz (else the innermost at all) of an exception."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f"{os.sep}memviz{os.sep}" in f.filename] or frames
    f = mine[-1]
    return f"{os.path.relpath(f.filename, os.path.join(HERE, '..'))}:{f.lineno}"


def _worker(index: int, seed: int, inputs: int, deadline: float, save: str, queue,
            level: str = "pipeline") -> None:
    """Fuzz until ``inputs`` inputs ran or ``deadline`` (time.time()); report
    counts and failures through ``queue``."""
    rnd = random.Random(seed)
    pool = fuzz_trace.seeds()
    for s in pool:
        assert fuzz_trace.check(s) is not None, "a seed trace does not load"
    counts = {"iterations": 0, "inputs": 0, "loaded": 0, "trace_errors": 0}
    failures = {}  # key -> [count, message, saved file]

    def run(data: bytes) -> object:
        counts["inputs"] += 1
        try:
            t = fuzz_trace.check(data, level == "pipeline", level in ("pipeline", "reports"),
                                 level != "load")
        except Exception as e:  # noqa: BLE001 - every other exception is what we look for
            key = f"{type(e).__name__} at {_where(e)}"
            if isinstance(e, fuzz_trace.PipelineError):  # raised by the check: say which
                key += ": " + re.sub(r"\d+", "N", str(e))[:100]
            got = failures.get(key)
            if got is None:
                path = os.path.join(save, f"fail-w{index}-{len(failures)}.memviz")
                with open(path, "wb") as f:
                    f.write(data)
                failures[key] = [1, str(e)[:300], path]
            else:
                got[0] += 1
            return None
        if t is None:
            counts["trace_errors"] += 1
        else:
            counts["loaded"] += 1
        return t

    last = 0
    while counts["inputs"] < inputs and time.time() < deadline:
        counts["iterations"] += 1
        data = fuzz_trace.mutate(rnd, rnd.choice(pool))
        t = run(data)
        if len(data) >= fuzz_trace.F.HEADER.size and counts["inputs"] < inputs:
            fixed = fuzz_trace.fix_crcs(data)
            if fixed != data:
                run(fixed)
        if t is not None and len(pool) < POOL_MAX and rnd.random() < 0.05:
            pool.append(data)
        if counts["iterations"] - last >= REPORT_EVERY:
            last = counts["iterations"]
            queue.put(("progress", index, dict(counts), {k: v[:] for k, v in failures.items()}))
    queue.put(("done", index, dict(counts), {k: v[:] for k, v in failures.items()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs to check in all")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="worker i uses seed + i")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop after this long and report what ran")
    ap.add_argument("--save", default=None, help="folder for one input of each failure")
    ap.add_argument("--check", choices=("pipeline", "reports", "reading", "load"),
                    default="pipeline",
                    help="what a loaded input goes through: the whole pipeline (default); the "
                         "reading API and the text, JSON and diff reports; the reading API "
                         "alone (snapshots, statistics, failures, events()); the load alone "
                         "(parsing, the replay, totals, the live set: the reader's own code)")
    opts = ap.parse_args()
    save = opts.save or tempfile.mkdtemp(prefix="memviz-fuzz-")
    os.makedirs(save, exist_ok=True)
    start = time.time()
    deadline = start + opts.max_seconds if opts.max_seconds else float("inf")
    ctx = mp.get_context("spawn")  # a fresh interpreter each: no state from this one
    queue = ctx.Queue()
    share = [opts.inputs // opts.workers + (i < opts.inputs % opts.workers)
             for i in range(opts.workers)]
    procs = [ctx.Process(target=_worker, args=(i, opts.seed + i, share[i], deadline, save, queue,
                                               opts.check))
             for i in range(opts.workers)]
    for p in procs:
        p.start()
    state = {}
    done = set()
    shown = 0.0
    while len(done) < len(procs):
        try:
            kind, i, counts, failures = queue.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty: check the workers are alive
            dead = [p for k, p in enumerate(procs) if k not in done and not p.is_alive()]
            if dead and queue.empty():
                print(f"fuzz_traces: a worker exited without reporting (exit codes "
                      f"{[p.exitcode for p in dead]})", file=sys.stderr)
                return 1
            continue
        state[i] = (counts, failures)
        if kind == "done":
            done.add(i)
        now = time.time()
        if now - shown > 30 or len(done) == len(procs):
            shown = now
            n = sum(c["inputs"] for c, _f in state.values())
            print(f"fuzz_traces: {n:,} inputs in {now - start:.0f} s "
                  f"({n / max(now - start, 1e-9):,.0f}/s)", file=sys.stderr, flush=True)
    for p in procs:
        p.join()
    seconds = time.time() - start
    total = {k: sum(c[k] for c, _f in state.values())
             for k in ("iterations", "inputs", "loaded", "trace_errors")}
    failures = {}
    for _c, fs in state.values():
        for key, (count, message, path) in fs.items():
            got = failures.setdefault(key, {"count": 0, "message": message, "example": path})
            got["count"] += count
    out = dict(total, distinct_failures=len(failures), failures=failures,
               seconds=round(seconds, 1), inputs_per_second=round(total["inputs"] / seconds),
               workers=opts.workers, seed=opts.seed, check=opts.check, stopped_early=total["inputs"] < opts.inputs,
               python=platform.python_version(), machine=platform.machine(),
               cpus=os.cpu_count(), saved_to=save if failures else None)
    print(json.dumps(out, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
