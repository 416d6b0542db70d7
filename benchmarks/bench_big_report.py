"""``memviz report`` on a 20-million-event trace: wall time and peak RSS.

    python benchmarks/bench_big_report.py [--events 20000000] [--rounds 3]
        [--trace PATH] [--formats text,html] [--profile text|html]
        [--memviz-root CHECKOUT]

Builds (once, then reuses: the file name carries the event count and the
generator's version) a training-like trace written directly with
memviz.trace.format's ``chunk()``, ``events_payload()`` and ``EVENT``, as the
streaming writer frames it: one EVENTS chunk per 50 steps (about 200,000
events, what a writer draining every 0.5 s sees from a fast precise-mode
run), each starting with a TIME record, compressed at the writer's level.

Each step (about 4,000 events) is:

* a data batch in pinned host memory from the loader thread (label
  "data loading");
* a forward pass on the main thread: 24 layers, each allocating activations
  from its own lines (a few dozen stacks in all), freeing the attention
  scores at once; addresses come from a size-class pool, so they repeat
  from step to step (two layouts, alternating);
* a backward pass on the autograd engine thread (no Python frames, an
  autograd label per layer): a gradient temporary per activation, then the
  activation and the temporary freed;
* an optimizer step on the allocator route: PyTorch's blocks (kind "block")
  inside two device segments made in the first step (each segment followed
  in the file by the blocks of the optimizer's state, which stay live, as
  the route records them), 64 blocks asked for and freed;
* every 100 steps a step record (STEPS chunk).

One step in the middle asks for a 6 GiB temporary that fails (a FAILED
event), then a 3 GiB one that succeeds: the peak. The END chunk holds the
totals the store would have written, computed here from the events.

Then times ``python -m memviz report TRACE --format text`` (stdout to
/dev/null) and ``--format html -o OUT.html`` in fresh processes,
interleaved, ``--rounds`` times each, and reads each child's peak RSS from
``os.wait4`` (``ru_maxrss``). Prints one JSON object: per format every
round's wall seconds and peak MB, the median and the minimum.

``--profile text|html`` instead runs the report once in this process under
tracemalloc (peak of Python's allocations, by line, at the point it peaks)
and cProfile (cumulative time), and prints both: where time and memory go.

numpy is used here only, to build the file quickly; memviz does not need it.
"""

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from memviz.trace import format as F  # noqa: E402

GENERATOR_VERSION = 3  # 3: format 2 (48-byte records)
MiB = 1 << 20
GiB = 1 << 30
STEPS_PER_CHUNK = 50
# The file's record (src/record.h), with the short names this generator uses.
_NAMES = {"ts_delta": "delta", "device": "dev", "stack_id": "stack", "thread_idx": "thread",
          "label_id": "label", "address": "addr"}
_CODES = {"I": "<u4", "B": "u1", "b": "i1", "H": "<u2", "Q": "<u8"}
_offsets, _at = [], 0
for _code in F._core.EVENT_FORMAT[1:]:
    _offsets.append(_at)
    _at += np.dtype(_CODES[_code]).itemsize
RECORD = np.dtype({"names": [_NAMES.get(n, n) for n in F.EVENT_FIELDS],
                   "formats": [_CODES[c] for c in F._core.EVENT_FORMAT[1:]],
                   "offsets": _offsets, "itemsize": F.EVENT.size})
assert F.EVENT.size == RECORD.itemsize

DEVICE, HOST, BLOCK = 0, 1, 5
MAIN, AUTOGRAD, LOADER = 0, 1, 2
LAYERS = 24


# ---- the tables: strings, frames, stacks, threads, labels -------------------------


class Tables:
    def __init__(self):
        self.strings, self.frames, self.stacks = [], [], []
        self._s, self._f = {}, {}

    def string(self, s):
        if s not in self._s:
            self._s[s] = len(self.strings)
            self.strings.append(s)
        return self._s[s]

    def frame(self, filename, line, name):
        key = (filename, line, name)
        if key not in self._f:
            self._f[key] = len(self.frames)
            self.frames.append([self.string(filename), line, self.string(name)])
        return self._f[key]

    def stack(self, *frames):
        """A stack id (from 1) of frames given outermost first."""
        ids = [self.frame(*f) for f in frames]
        self.stacks.append([len(self.stacks) + 1, ids[::-1]])  # innermost first in the file
        return len(self.stacks)


def make_tables():
    t = Tables()
    train = ("/home/user/project/train.py", 120, "<module>")
    loop = ("/home/user/project/train.py", 88, "train_step")
    model = "/home/user/project/model.py"
    stacks = {}
    for j, (line, name) in enumerate([(41, "q"), (42, "k"), (43, "v"), (47, "scores"),
                                      (48, "probs"), (52, "attn_out"), (60, "mlp_up"),
                                      (61, "gelu"), (62, "mlp_down"), (66, "norm")]):
        for half in range(3):  # the layers' calls come from three lines of forward()
            stacks[(name, half)] = t.stack(train, loop, (model, 30 + half, "forward"),
                                           (model, line, "Layer.forward"))
    stacks["optim"] = t.stack(train, loop, ("/home/user/project/optim.py", 17, "step"))
    stacks["optim_state"] = t.stack(train, loop, ("/home/user/project/optim.py", 23, "step"))
    stacks["batch"] = t.stack(train, ("/home/user/project/data.py", 55, "__next__"))
    stacks["weights"] = t.stack(train, (model, 12, "Model.__init__"))
    stacks["spike"] = t.stack(train, loop, ("/home/user/project/train.py", 95, "log_embeddings"))
    labels = {1: "data loading", 2: "forward", 3: "optimizer"}
    for i in range(LAYERS):
        labels[4 + i] = f"\x01AddmmBackward0\x1f{model}:{41 + i % 10}"
    threads = {str(MAIN): [4242, 140000000000001, "MainThread"],
               str(AUTOGRAD): [4243, None, "pt_autograd_0"],
               str(LOADER): [4244, 140000000000003, "loader-1"]}
    return t, stacks, labels, threads


# ---- one step's events, as a template ---------------------------------------------


class Pool:
    """Size-class address recycling (the stream-ordered pool does this)."""

    def __init__(self, base):
        self.free, self.next = {}, base

    def get(self, size):
        lst = self.free.get(size)
        if lst:
            return lst.pop()
        a = self.next
        self.next += (size + 511) & ~511
        return a

    def put(self, addr, size):
        self.free.setdefault(size, []).append(addr)


def step_template(stacks, layout):
    """[(op, kind, dev, stack, thread, label, addr, size, delta_ns)] of one step."""
    ev = []
    pool = Pool(0x7F00_0000_0000 + layout * 64 * GiB)
    host = Pool(0x2000_0000_0000)
    batch = 8

    def alloc(size, stack, thread=MAIN, label=2, kind=DEVICE, dev=0, p=pool, delta=3000):
        a = p.get(size)
        ev.append((F.OP_ALLOC, kind, dev, stack, thread, label, a, size, delta))
        return (a, size, kind, dev, stack, thread, label, p)

    def free(x, thread=None, label=None, delta=1500):
        a, size, kind, dev, stack, th, lab, p = x
        ev.append((F.OP_FREE, kind, dev, stack, th if thread is None else thread,
                   lab if label is None else label, a, size, delta))
        p.put(a, size)

    data = [alloc(batch * 512 * 4, stacks["batch"], LOADER, 1, HOST, -1, host, 20000)
            for _ in range(4)]
    acts = []
    for i in range(LAYERS):
        h = i % 3
        act = lambda size, name: alloc(size, stacks[(name, h)])  # noqa: E731
        q, k, v = act(batch * 512 * 2048 * 2, "q"), act(batch * 512 * 2048 * 2, "k"), \
            act(batch * 512 * 2048 * 2, "v")
        scores = act(batch * 16 * 512 * 512 * 2, "scores")
        probs = act(batch * 16 * 512 * 512 * 2, "probs")
        free(scores)
        o = act(batch * 512 * 2048 * 2, "attn_out")
        up = act(batch * 512 * 8192 * 2, "mlp_up")
        g = act(batch * 512 * 8192 * 2, "gelu")
        down = act(batch * 512 * 2048 * 2, "mlp_down")
        norm = act(batch * 512 * 2048 * 2, "norm")
        small = [act(4096 * (1 + j % 4), "norm") for j in range(40)]  # bias, stats, masks
        for s in small[::2]:
            free(s)
        acts.append([q, k, v, probs, o, up, g, down, norm] + small[1::2])
    for i, layer in enumerate(reversed(acts)):
        label = 4 + (LAYERS - 1 - i)
        for a in reversed(layer):
            tmp = alloc(a[1], 0, AUTOGRAD, label)
            free(a, AUTOGRAD, label)
            free(tmp, AUTOGRAD, label)
    for d in data:
        free(d)
    return ev


def segments():
    """The two segments of the allocator route (made in the first step)."""
    return [(0x7E00_0000_0000, 64 * MiB), (0x7E00_1000_0000, 64 * MiB)]


def optimizer_blocks(stacks, ev):
    """The optimizer step: PyTorch's blocks inside the segments."""
    (s0, _), (s1, _) = segments()
    for rep in range(2):
        live = []
        for j in range(32):
            seg = s0 if j % 2 == 0 else s1
            addr, size = seg + (j // 2) * (2 * MiB), 2 * MiB
            st = stacks["optim"] if j % 3 else stacks["optim_state"]
            ev.append((F.OP_ALLOC, BLOCK, 0, st, MAIN, 3, addr, size, 2000))
            live.append((addr, size, st))
        for addr, size, st in live:
            ev.append((F.OP_FREE, BLOCK, 0, st, MAIN, 3, addr, size, 800))
    return ev


def template_array(ev):
    arr = np.zeros(len(ev), RECORD)
    cols = list(zip(*ev))
    for name, col in zip(("op", "kind", "dev", "stack", "thread", "label", "addr", "size",
                          "delta"), cols):
        arr[name] = col
    return arr


# ---- the file --------------------------------------------------------------------------


def default_path(events):
    return os.path.join(tempfile.gettempdir(),
                        f"memviz-big-report-{events // 1_000_000}M-v{GENERATOR_VERSION}.memviz")


def build(path, events, seed=0, mark_every=None):
    """Write the trace; returns (events written, seconds). ``mark_every``:
    a step record every that many steps, dated at the step's last event (as
    ``t.step()`` would be); default: every 100 steps, dated 10 ms apart."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    tables, stacks, labels, threads = make_tables()
    templates = [template_array(optimizer_blocks(stacks, step_template(stacks, layout)))
                 for layout in (0, 1)]
    per_step = len(templates[0])
    steps = max(1, events // per_step)
    spike_step = steps // 2
    start_ns = 1_000_000_000_000
    meta = {"format": "memviz-trace", "format_version": F.FORMAT_VERSION, "mode": "stream",
            "memviz_version": "bench", "python_version": platform.python_version(),
            "platform": sys.platform, "pid": 4242, "start_wall_time": 1.8e9,
            "start_monotonic_ns": start_ns, "written_monotonic_ns": start_ns,
            "command": "python train.py", "argv": ["train.py"],
            "tracker": {"gpu_requested": True, "gpu_enabled": True, "activity_enabled": True,
                        "gpu_off_reason": None, "activity_error": None, "depth": 0,
                        "precise": True},
            "capture": {"available": True, "gpu_enabled": True}}
    # the store's totals, kept as the events are made (END)
    tot = {d: dict(current=0, peak=0, peak_timestamp_ns=0, allocs=0, frees=0, failed=0,
                   alloc_bytes=0, live_count=0, peak_count=0, window_peak=0) for d in (0, -1)}
    written = 0
    now = start_ns
    with open(path + ".part", "wb") as out:
        out.write(F.header() + F.chunk(F.META, F.json_bytes(meta)))
        out.write(F.chunk(F.STRINGS, F.json_bytes(tables.strings)))
        out.write(F.chunk(F.FRAMES, F.json_bytes(tables.frames)))
        out.write(F.chunk(F.STACKS, F.json_bytes(tables.stacks)))
        out.write(F.chunk(F.THREADS, F.json_bytes(threads)))
        out.write(F.chunk(F.LABELS, F.json_bytes({str(k): v for k, v in labels.items()})))
        step = 0
        step_records = []
        while step < steps:
            parts = [np.zeros(1, RECORD)]  # the TIME record every drain starts with
            parts[0]["op"] = F.OP_TIME
            parts[0]["addr"] = now
            if step == 0:  # the weights and the allocator route's segments, once
                first = [(F.OP_ALLOC, DEVICE, 0, stacks["weights"], MAIN, 0,
                          0x7D00_0000_0000 + i * 16 * MiB, 8 * MiB, 500) for i in range(96)]
                for a, size in segments():  # a segment, then the optimizer state's blocks in it
                    first.append((F.OP_ALLOC, DEVICE, 0, stacks["optim"], MAIN, 3, a, size, 4000))
                    first += [(F.OP_ALLOC, BLOCK, 0, stacks["optim_state"], MAIN, 3,
                               a + 32 * MiB + k * 2 * MiB, 2 * MiB, 0) for k in range(16)]
                parts.append(template_array(first))
            for s in range(step, min(step + STEPS_PER_CHUNK, steps)):
                arr = templates[s % 2].copy()
                arr["delta"] = (arr["delta"] * rng.uniform(0.5, 1.5, len(arr))).astype("<u4")
                if s == spike_step:  # a failed 6 GiB request, then 3 GiB: the peak
                    mid = int(np.flatnonzero(arr["thread"] == AUTOGRAD)[0])
                    extra = template_array([
                        (F.OP_FAILED, DEVICE, 0, stacks["spike"], MAIN, 2, 2, 6 * GiB, 100),
                        (F.OP_ALLOC, DEVICE, 0, stacks["spike"], MAIN, 2, 0x7C00_0000_0000,
                         3 * GiB, 100),
                        (F.OP_FREE, DEVICE, 0, stacks["spike"], MAIN, 2, 0x7C00_0000_0000,
                         3 * GiB, 100)])
                    arr = np.concatenate([arr[:mid - 1], extra[:2], arr[mid - 1:mid + 40],
                                          extra[2:], arr[mid + 40:]])
                parts.append(arr)
                if mark_every and s % mark_every == mark_every - 1:
                    step_records.append((s, now + int(sum(int(p["delta"].astype(np.uint64).sum())
                                                          for p in parts[1:]))))
                elif not mark_every and s % 100 == 99:
                    step_records.append(s)
            rows = np.concatenate(parts)
            rows["delta"][0] = 0
            _account(rows, now, tot)
            now = int(now + rows["delta"].astype(np.uint64).sum())
            payload = F.events_payload(rows.tobytes())
            out.write(F.chunk(F.EVENTS, payload, compress=F.EVENT_LEVEL))
            written += len(rows)
            step = min(step + STEPS_PER_CHUNK, steps)
            if step_records:
                recs = [{"index": i[0] if mark_every else i,
                         "timestamp_ns": i[1] if mark_every else now - (step - 1 - i) * 10_000_000,
                         "duration_ns": 10_000_000,
                         "devices": {"0": {"current": tot[0]["current"], "peak": tot[0]["peak"]}},
                         "lines": [], "info": {"loss": 2.5 - (i[0] if mark_every else i) * 1e-4}}
                        for i in step_records]
                out.write(F.chunk(F.STEPS, F.json_bytes(recs)))
                step_records = []
        end = {"stopped_monotonic_ns": now + 1000, "stopped_wall_time": 1.8e9 + 60,
               "totals": {str(d): v for d, v in tot.items()},
               "failures": sum(v["failed"] for v in tot.values()), "stats": {},
               "outside": {}, "events": written, "dropped_events": 0}
        out.write(F.chunk(F.END, F.json_bytes(end)))
    os.replace(path + ".part", path)
    return written, time.perf_counter() - t0


def _account(rows, base, tot):
    """The store's totals over one chunk's rows (blocks count in no device total)."""
    ts = base + np.cumsum(rows["delta"].astype(np.int64))
    for d, t in tot.items():
        on = (rows["dev"] == d) & (rows["kind"] != BLOCK)
        a, f = on & (rows["op"] == F.OP_ALLOC), on & (rows["op"] == F.OP_FREE)
        t["failed"] += int((on & (rows["op"] == F.OP_FAILED)).sum())
        t["allocs"] += int(a.sum())
        t["frees"] += int(f.sum())
        sizes = rows["size"].astype(np.int64)
        t["alloc_bytes"] += int(sizes[a].sum())
        signed = np.where(a, sizes, 0) - np.where(f, sizes, 0)
        cur = t["current"] + np.cumsum(signed)
        cnt = t["live_count"] + np.cumsum(a.astype(np.int64) - f.astype(np.int64))
        if cur.size and int(cur.max()) > t["peak"]:
            k = int(np.argmax(cur))
            t.update(peak=int(cur[k]), window_peak=int(cur[k]), peak_timestamp_ns=int(ts[k]),
                     peak_count=int(cnt[k]))
        if cur.size:
            t["current"], t["live_count"] = int(cur[-1]), int(cnt[-1])


# ---- measuring -------------------------------------------------------------------------


def run_child(argv, root=ROOT):
    """(wall seconds, peak RSS in MB, exit status) of one fresh process."""
    env = dict(os.environ, PYTHONPATH=root)
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        # cwd: `python -m` puts it first on sys.path, so it picks the memviz that runs
        p = subprocess.Popen(argv, stdout=null, stderr=subprocess.PIPE, env=env, cwd=root)
        err = p.stderr.read()
        _pid, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.stderr.write(err.decode(errors="replace"))
    return wall, usage.ru_maxrss / 1024, p.returncode


def measure(path, formats, rounds, root=ROOT):
    out_html = os.path.join(tempfile.gettempdir(), f"memviz-big-report-{os.getpid()}.html")
    cmds = {"text": [sys.executable, "-m", "memviz", "report", path, "--format", "text"],
            "html": [sys.executable, "-m", "memviz", "report", path, "--format", "html", "-o",
                     out_html]}
    got = {f: [] for f in formats}
    for _ in range(rounds):
        for f in formats:
            wall, rss, rc = run_child(cmds[f], root)
            if rc:
                raise SystemExit(f"memviz report --format {f} failed with status {rc}")
            got[f].append({"wall_s": round(wall, 2), "peak_rss_mb": round(rss, 1)})
    if os.path.exists(out_html):
        os.remove(out_html)
    res = {}
    for f, runs in got.items():
        walls, rss = [r["wall_s"] for r in runs], [r["peak_rss_mb"] for r in runs]
        res[f] = {"runs": runs, "wall_s_median": statistics.median(walls),
                  "wall_s_min": min(walls), "peak_rss_mb_median": statistics.median(rss),
                  "peak_rss_mb_max": max(rss)}
    return res


def profile(path, fmt):
    """Where time and memory go, in this process: tracemalloc over the two
    phases (memviz.load, then the report of the loaded trace: the peak of
    Python's allocations in each, and what the loaded trace holds, by line),
    then cProfile over the whole command (cumulative time)."""
    import cProfile
    import gc
    import io
    import pstats
    import tracemalloc
    import warnings

    import memviz
    from memviz.cli import report

    out_html = os.path.join(tempfile.gettempdir(), f"memviz-big-profile-{os.getpid()}.html")
    argv = [path, "--format", fmt] + (["-o", out_html] if fmt == "html" else [])
    devnull = open(os.devnull, "w")
    real = sys.stdout

    def render(trace):
        if fmt == "text":
            from memviz.report.text import text_report
            return text_report(trace, top=10, outside=trace.outside, command=trace.command)
        from memviz.report import html
        return html.render(trace)

    tracemalloc.start(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = memviz.load(path)
    _cur, load_peak = tracemalloc.get_traced_memory()
    held = tracemalloc.take_snapshot()
    tracemalloc.reset_peak()
    render(trace)
    cur, report_peak = tracemalloc.get_traced_memory()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    print(f"tracemalloc: load peak {load_peak / MiB:.0f} MiB; report peak {report_peak / MiB:.0f} "
          f"MiB; held after the report {cur / MiB:.0f} MiB")
    print("held by the loaded trace, by line:")
    for st in held.statistics("lineno")[:8]:
        print(f"  {st.size / MiB:8.1f} MiB  {st.count:>11,}  {st.traceback}")
    print("held after the report, by line:")
    for st in after.statistics("lineno")[:8]:
        print(f"  {st.size / MiB:8.1f} MiB  {st.count:>11,}  {st.traceback}")
    del trace, held, after
    gc.collect()
    prof = cProfile.Profile()
    sys.stdout = devnull
    try:
        prof.runcall(report.main, argv)
    finally:
        sys.stdout = real
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
    print(s.getvalue())
    if os.path.exists(out_html):
        os.remove(out_html)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=20_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", help="the trace file (default: a cached file in the temp folder)")
    ap.add_argument("--formats", default="text,html")
    ap.add_argument("--profile", choices=("text", "html"))
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--memviz-root", default=ROOT,
                    help="the checkout whose memviz runs the reports (default: this one); "
                         "the trace is always built with this one's format module")
    args = ap.parse_args()
    path = args.trace or default_path(args.events)
    built = None
    if args.rebuild or not os.path.exists(path):
        n, secs = build(path, args.events)
        built = {"events": n, "seconds": round(secs, 1)}
    if args.profile:
        profile(path, args.profile)
        return
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    res = {"trace": path, "file_mb": round(os.path.getsize(path) / 1e6, 1),
           "first_mib_sha256": digest, "built": built, "events_asked": args.events,
           "machine": platform.node(), "cpus": os.cpu_count(),
           "python_version": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
           "memviz_root": os.path.abspath(args.memviz_root),
           "results": measure(path, args.formats.split(","), args.rounds, args.memviz_root)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
