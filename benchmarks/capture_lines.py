"""What the capture path touches per event, counted exactly (valgrind's callgrind).

    python benchmarks/capture_lines.py [--depth 23] [--n 4000] [--gap 131072]
                                       [--mode rec:2] [--mode noop:0] ... [--json OUT]

Inside a step, every cache line the capture path touches is cold and costs
a few nanoseconds (RESULTS.md, ninth session: about 3 ns a line, code or
data), so the number of lines is the capture path's cost model. Timing on
this shared machine cannot resolve a few lines; callgrind's counts are
exact. Each mode runs in its own process under callgrind, collecting only
inside the allocator route's wrappers (wrap_allocate, wrap_delete) while
the stand-in allocator's loop runs (tests/stand_in_allocator: n tensor
allocations and frees through the real allocator route under
memviz.track(), `depth` Python frames deep, with `gap` bytes written
between tensors so that the simulated first-level data cache holds nothing
of the last event). Reported per event (an allocation or a free), for
memviz's extension and, apart, for the code it calls (Python, the C
library; the stand-in allocator's own code is left out, but the C library
functions it calls, its mutex, are counted there in every mode):

- ``code_lines``: distinct 64-byte lines executed at least once per event
  pair, halved;
- ``ir``: instructions;
- ``d1_miss``: first-level data-cache misses (reads and writes): the data
  lines touched that the step's work evicted (``d1_miss_walk``: those of
  the frame walk, Python's frames and the previous stack it compares with;
  inside a real step the interpreter has just used most of the frames);
- per function, the same;
- with ``--misses N``, the N instructions of memviz's extension with the
  most data misses an event pair, disassembled (binutils' objdump): which
  variable or line each event reads cold.

A mode is bench_toggle.py's: ``rec:P[:dN]`` (recording with _core._prefetch(P),
optionally _core._depth(N)), ``noop:P`` (the route, nothing recorded), or
``off`` (the route bypassed: nothing of memviz runs, so nothing is counted).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WALK = ("mvz_frames_capture_at", "mvz_frames_capture_cmp")


def child(depth, n, gap, mode):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import FakeCupti, build

    path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    import ctypes as c

    import memviz
    import stand_in_allocator as sa
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import memviz._core as core
    from bench_toggle import apply, parse_modes

    mode = parse_modes(mode)[0]
    default = parse_modes("rec:2")[0]

    fake = FakeCupti(path)
    fake.reset()
    lib = sa.build(Path(tempfile.mkdtemp()) / "lines")
    ans = sa.StandInAnswers(lib, fake.lib.fake_alloc)
    ans.lib.sa_loop_gap.restype, ans.lib.sa_loop_gap.argtypes = c.c_uint64, [c.c_int, c.c_size_t, c.c_size_t]

    def at_depth(k, fn):
        return at_depth(k - 1, fn) if k > 0 else fn()

    here = len(__import__("inspect").stack())
    with memviz.track(depth=64) as t:
        r = t.torch.use_answers(ans)
        assert r.route == "allocator", r.reason
        depth_set = core._depth(64)
        apply(core, mode, depth_set, bypass=mode[1] == "off")
        at_depth(depth - here - 1, lambda: ans.lib.sa_loop_gap(200, 4096, gap))  # warm: threads, labels
        at_depth(depth - here - 1, lambda: ans.lib.sa_loop_gap(n, 4096, gap))
        apply(core, default, depth_set, bypass=mode[1] == "off")
        frames = at_depth(depth - here - 1, lambda: memviz._core._capture_depth(64))
    print(json.dumps({"frames": frames}))


def parse(path, exclude, misses=None):
    """{(object, function): {"ir", "d1", "lines": {line: ir}}}, objects whose name
    holds a string of `exclude` left out. `misses`, a dict, gets
    {(object path, function, address): first-level data misses} for memviz's
    extension."""
    fns = defaultdict(lambda: {"ir": 0, "d1": 0, "lines": defaultdict(int)})
    events = None
    npos = 1
    ob = fn = None
    skip = False
    names = {}

    def name(v):  # "(id) name" or "(id)"
        v = v.strip()
        if v.startswith("("):
            k, _, rest = v.partition(")")
            if rest.strip():
                names[k] = rest.strip()
            return names.get(k, v)
        return v

    for raw in open(path):
        line = raw.rstrip("\n")
        if not line:
            continue
        if line.startswith("positions:"):
            npos = len(line.split()) - 1
            continue
        if line.startswith("events:"):
            events = line.split()[1:]
            continue
        if line.startswith("ob="):
            ob = name(line[3:])
            continue
        if line.startswith("fn="):
            fn = name(line[3:])
            continue
        if line.startswith(("cob=", "cfi=", "cfl=", "cfn=")):
            name(line[4:])
            continue
        if line.startswith("calls="):
            skip = True  # the next cost line is the call's inclusive cost
            continue
        if not (line[0].isdigit() or line[0] in "+-*"):
            continue
        if skip:
            skip = False
            continue
        if not ob or any(x in ob for x in exclude):
            continue
        parts = line.split()
        addr = int(parts[0], 16)
        costs = dict(zip(events, (int(x) for x in parts[npos:])))
        f = fns[(os.path.basename(ob), fn)]
        ir = costs.get("Ir", 0)
        f["ir"] += ir
        f["d1"] += costs.get("D1mr", 0) + costs.get("D1mw", 0)
        if misses is not None and "_core" in ob and costs.get("D1mr", 0) + costs.get("D1mw", 0):
            key = (ob, fn, addr)
            misses[key] = misses.get(key, 0) + costs.get("D1mr", 0) + costs.get("D1mw", 0)
        f["lines"][addr >> 6] += ir
    return fns


def summarise(fns, pairs):
    """Per event (half a pair): code lines (those run at least once in two
    events), instructions and first-level data misses, for memviz's
    extension (``_core``) and for the rest (Python, the C library, the
    loader) that the capture path calls."""
    total = {}
    per_fn = {}
    for who in ("memviz", "other"):
        lines = set()
        ir = d1 = walk = 0.0
        for (ob, fn), f in fns.items():
            if ("_core" in ob) != (who == "memviz"):
                continue
            hot = [ln for ln, n in f["lines"].items() if n >= pairs * 0.5]
            lines.update(hot)
            ir += f["ir"]
            d1 += f["d1"]
            if fn in WALK:
                walk += f["d1"]
            if f["ir"] >= pairs * 0.5:
                per_fn[f"{fn} ({ob.split('.')[0]})"] = {
                    "lines_per_pair": len(hot), "ir_per_event": round(f["ir"] / pairs / 2, 1),
                    "d1_miss_per_event": round(f["d1"] / pairs / 2, 2)}
        total[who] = {"code_lines": len(lines) / 2, "ir": round(ir / pairs / 2, 1),
                      "d1_miss": round(d1 / pairs / 2, 2), "d1_miss_walk": round(walk / pairs / 2, 2)}
    total["functions"] = dict(sorted(per_fn.items(), key=lambda kv: -kv[1]["lines_per_pair"]))
    return total


def run_mode(mode, a):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--dump-instr=yes", "--cache-sim=yes",
               "--I1=32768,8,64", "--D1=32768,8,64", "--LL=2097152,16,64",
               "--toggle-collect=wrap_allocate*", "--toggle-collect=wrap_delete*", "--compress-strings=no", "--compress-pos=no",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--child",
               "--depth", str(a.depth), "--n", str(a.n), "--gap", str(a.gap), "--mode", mode]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:  # the child's own output, without valgrind's "==pid==" lines
            own = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("=="))
            raise SystemExit(f"{mode}: callgrind run failed (exit status {p.returncode}):\n"
                             f"{own[-3000:]}\nstdout: {p.stdout[-1000:]}")
        frames = json.loads(p.stdout.strip().splitlines()[-1])["frames"]
        misses = {} if a.misses else None
        r = summarise(parse(out, ("standin", "libc10_cuda"), misses), a.n + 200)
        r["frames"] = frames
        if misses:
            r["misses"] = where_missed(misses, a.n + 200, a.misses)
        return r


def where_missed(misses, pairs, top):
    """The `top` instructions of memviz's extension with the most first-level
    data misses per event pair, each with its disassembly (binutils' objdump,
    where installed): which variable or line each event reads cold."""
    rows = sorted(misses.items(), key=lambda kv: -kv[1])[:top]
    text = {}
    for obj in {ob for (ob, _, _), _ in rows}:
        if shutil.which("objdump") and os.path.exists(obj):
            dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True,
                                 text=True).stdout
            for ln in dis.splitlines():
                head, sep, rest = ln.partition(":")
                if sep and head.strip() and all(c in "0123456789abcdef" for c in head.strip()):
                    text[(obj, int(head, 16))] = rest.strip()
    return [{"per_pair": round(n / pairs, 2), "function": fn, "address": hex(addr),
             "instruction": text.get((ob, addr), "")} for (ob, fn, addr), n in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=23)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--gap", type=int, default=131072)
    ap.add_argument("--mode", action="append")
    ap.add_argument("--json")
    ap.add_argument("--misses", type=int, default=0, metavar="N",
                    help="also list the N instructions with the most data misses, disassembled")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.depth, a.n, a.gap, (a.mode or ["rec:2"])[0])
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("capture_lines.py counts with valgrind's callgrind, which is not installed here "
                         "(Debian/Ubuntu: apt install valgrind)")
    res = {"depth": a.depth, "n": a.n, "gap": a.gap, "modes": {}}
    for m in a.mode or ["rec:2", "noop:0"]:
        r = run_mode(m, a)
        res["modes"][m] = r
        fn = ", ".join(f"{k} {v['lines_per_pair']}" for k, v in list(r["functions"].items())[:14])
        m1, m2 = r["memviz"], r["other"]
        print(f"{m:10s} per event: memviz's code lines {m1['code_lines']:5.1f}, instructions {m1['ir']:6.1f}, "
              f"data misses {m1['d1_miss']:5.2f} (walk {m1['d1_miss_walk']:.2f}); called code (Python, libc) "
              f"lines {m2['code_lines']:4.1f}, instructions {m2['ir']:5.1f}, data misses {m2['d1_miss']:5.2f}; "
              f"frames {r['frames']}\n           code lines a pair: {fn}", flush=True)
        for m in r.get("misses", []):
            print(f"           {m['per_pair']:6.2f} misses a pair  {m['function']:30s} {m['address']}  "
                  f"{m['instruction']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
