"""What a runtime setting of memviz's capture path costs inside a real step,
switched every step within one tracking session.

    python benchmarks/bench_toggle.py [--procs 5] [--rounds 200] [--model alloc_bound|gpt]
                                      [--track plain|trace|flight]
                                      [--modes rec:2,rec:0,noop:0] [--against DIR] --out F.json

The paired protocol (run_alternate_bench.py) compares configurations a block
of steps apart, each block with its own attach: on the H200's host its
per-block ratios spread ±5%, so two configurations a fraction of a per cent
apart cannot be told apart. What can be switched without stopping the
tracker is switched here every step instead: each round runs one step in
each mode, the order rotated every round, so the pairs are milliseconds
apart and the host's drift cancels.

A mode is ``rec:P`` (recording, the capture path's prefetches set to P,
``_core._prefetch``: 1 the walk's frames and stacks, 2 the queue's unit
before a claim, 4 the next unit after a publish, 8 an entry's lines
demoted to the shared cache once published, 16 entries written to the
thread's own room and never queued, so that what is left is the capture
path without the shared queue and the drain; 32 and 64, weights: 32 more
cold code lines, or data lines, an event, so that the step says what a
cold line costs; 2 is the default, 3 was until 2026-12-04; on an
ablation build, CFLAGS=-DMVZ_ABLATE, also 128, no autograd node, node
label or sequence number read, and 256, no clock read), with
``:dN`` the stack cut to N frames (``_core._depth``), or
``noop:P`` (the allocator route attached, its capture path returning at
once, ``_core._capture_noop``), or ``off`` (the route bypassed: the
allocator's slots hold PyTorch's own entries, ``_core.allocator_bypass``, so
nothing of memviz runs for a block and none is recorded, while CUPTI and
memviz's threads run as ever). The first mode is the baseline every other
is divided by, per round; each process reports the median of its rounds'
ratios, and the summary the median over processes, their spread, and the
median of all rounds.

Two builds (``--against DIR``, another checkout with its extension built):
each pair of fresh processes runs this tree's script and DIR's own, the
first of the pair rotated, so that the host's drift falls on both; a pair
where either process failed is dropped whole. Each build is summarised as
above, and per mode the difference of the pair's per-process ratios (this
build's minus the other's), with its median and how many pairs are above
zero: for ``off`` over ``rec:2``, above zero means this build's recording
takes a smaller share of the step.

What it cannot give: untracked against tracked (that needs the route
attached and detached; run_alternate_bench.py does it). A ``noop`` step's
frees of blocks a ``rec`` step recorded go unrecorded: the store keeps
those blocks as live, which changes the drain thread's work, not the
capture path's; an ``off`` step's blocks are not recorded at all, nor their
frees.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


from run_alternate_bench import fresh_process  # noqa: E402  (after the path is set)


def parse_modes(text):
    """[(name, kind, prefetch bits, depth or None)]"""
    modes = []
    for m in text.split(","):
        if m == "off":
            modes.append((m, "off", 0, None))
            continue
        kind, _, rest = m.partition(":")
        pf, _, depth = rest.partition(":d")
        if kind not in ("rec", "noop") or not pf.isdigit() or not 0 <= int(pf) <= 511 or \
                (depth and not (depth.isdigit() and 0 <= int(depth) <= 256)):
            raise SystemExit(f"--modes: {m!r} is not rec:P or noop:P (P from 0 to 127, or to 511 "
                             f"on an ablation build), optionally :dN (N frames, at most 256), or off")
        modes.append((m, kind, int(pf), int(depth) if depth else None))
    if len({m[0] for m in modes}) != len(modes):
        raise SystemExit("--modes: a mode is named twice")
    return modes


def apply(core, mode, depth, bypass):
    """Switch the running tracker to `mode` (a parse_modes tuple); `depth`:
    the stack depth when the mode names none. `bypass`: whether the route's
    bypass is switched (only with the allocator route, for an ``off``
    mode; else the route may be another)."""
    _, kind, pf, d = mode
    if bypass:
        core.allocator_bypass(kind == "off")
    core._capture_noop(kind == "noop")
    core._prefetch(pf)
    core._depth(depth if d is None else d)


def child(a):
    import torch

    from bench_train_step import make_step

    import memviz
    import memviz._core as core

    modes = parse_modes(a.modes)
    step = make_step(torch, a.model)
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    import tempfile
    tmp = tempfile.mkdtemp(prefix="memviz-toggle-")
    kwargs = {"plain": {}, "trace": {"trace": os.path.join(tmp, "toggle.memviz")},
              "flight": {"flight_recorder": "256 MiB", "flight_dir": tmp}}[a.track]
    tracker = memviz.track(**kwargs).start()
    route = getattr(getattr(tracker, "torch", None), "route", None)
    if any(m[1] == "off" for m in modes) and (route is None or str(route.route) != "allocator"):
        tracker.stop()
        raise SystemExit(f"--modes off needs the allocator route; this run has {route}")
    for _ in range(5):  # the route's first blocks and the stacks' first sight
        step()
    torch.cuda.synchronize()
    times = {m[0]: [] for m in modes}
    depth = core._depth(32)  # track()'s own, as set at start
    core._depth(depth)
    try:
        for r in range(a.rounds):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                m = mode[0]
                apply(core, mode, depth, bypass=any(x[1] == "off" for x in modes))
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                step()
                torch.cuda.synchronize()
                times[m].append(time.perf_counter_ns() - t0)
    finally:
        core._prefetch(True)
        core._depth(depth)
        core._capture_noop(False)
        if any(m[1] == "off" for m in modes):
            core.allocator_bypass(False)
        tracker.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"model": a.model, "track": a.track, "route": str(route.route) if route else None, "times_ns": times}))


def round_ratios(run, m, b0):
    """One process's per-round ratios of mode m over the baseline b0."""
    return [x / b for x, b in zip(run["times_ns"][m], run["times_ns"][b0])]


def summarize(runs, modes, label=""):
    """Per mode: the median over processes of each process's median round
    ratio over the first mode, their spread, and all rounds' median and
    quartiles; printed one line a mode (prefixed with `label`)."""
    summary = {}
    b0 = modes[0][0]
    for m, *_ in modes:
        per = [statistics.median(round_ratios(r, m, b0)) for r in runs]
        every = sorted(x for r in runs for x in round_ratios(r, m, b0))
        q = statistics.quantiles(every, n=4) if len(every) > 1 else every * 3
        summary[m] = {"median_ratio": statistics.median(per), "ratio_spread": [min(per), max(per)],
                      "per_process_ratio": per, "rounds_median": statistics.median(every),
                      "rounds_quartiles": [q[0], q[2]], "rounds": len(every),
                      "median_ms": statistics.median(statistics.median(r["times_ns"][m]) for r in runs) / 1e6,
                      "min_of_min_ms": min(min(r["times_ns"][m]) for r in runs) / 1e6}
        s = summary[m]
        print(f"{label}{m:8s} over {b0}: {s['median_ratio']:.4f} ({min(per):.4f}-{max(per):.4f})  every round "
              f"{s['rounds_median']:.4f} ({q[0]:.4f}-{q[2]:.4f}, {len(every)})  median {s['median_ms']:.2f} ms  "
              f"min-of-min {s['min_of_min_ms']:.2f} ms", flush=True)
    return summary


def pieces(runs, modes, label=""):
    """With ``off`` among the modes: each mode's time saved against the
    baseline, as a share of the step with nothing of memviz's on the route
    (``off``), round by round: (baseline - mode) / off; the median of each
    process's median, and their spread. For the baseline itself, what
    ``off`` saves: its whole share. So an ablation build's modes read as
    points of the step, each piece's own (printed, prefixed with `label`)."""
    names = [m for m, *_ in modes]
    if "off" not in names:
        return {}
    b0 = names[0]
    out = {}
    for m in names:
        if m == "off":
            continue
        other = "off" if m == b0 else m
        per = []
        for r in runs:
            t = r["times_ns"]
            per.append(statistics.median((b - x) / o for b, x, o in zip(t[b0], t[other], t["off"])))
        out[m] = {"median_share": statistics.median(per), "share_spread": [min(per), max(per)],
                  "per_process_share": per}
        what = "recording's share (off saves)" if m == b0 else "saved"
        print(f"{label}{m:10s} {what}: {100 * out[m]['median_share']:+.2f}% of the step "
              f"({100 * min(per):+.2f} to {100 * max(per):+.2f})", flush=True)
    return out


def compare(this, against, modes):
    """Two builds' processes, paired in the order they ran: per mode other
    than the baseline, this build's per-process ratio minus the other's, the
    median of those differences and how many pairs are above zero (for
    ``off`` over ``rec``: this build's recording costs less)."""
    b0 = modes[0][0]
    out = {}
    for m, *_ in modes[1:]:
        diffs = [statistics.median(round_ratios(a, m, b0)) - statistics.median(round_ratios(b, m, b0))
                 for a, b in zip(this, against)]
        if not diffs:
            continue
        out[m] = {"median_difference": statistics.median(diffs), "pairs": len(diffs),
                  "pairs_above_zero": sum(d > 0 for d in diffs), "differences": diffs}
        print(f"{m:8s} over {b0}, this build minus the other: {out[m]['median_difference']:+.4f} "
              f"(pairs {len(diffs)}, {out[m]['pairs_above_zero']} above zero)", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=5, help="processes (with --against: a build)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--model", default="alloc_bound", choices=["alloc_bound", "gpt"])
    ap.add_argument("--modes", default="rec:2,rec:3,rec:18,noop:0",
                    help="comma-separated rec:P[:dN] / noop:P / off (P: _core._prefetch's bits, N: frames); the first is the baseline")
    ap.add_argument("--track", default="plain", choices=["plain", "trace", "flight"],
                    help="the session the modes run in: track(), track(trace=...) or "
                         "track(flight_recorder='256 MiB')")
    ap.add_argument("--against", metavar="DIR",
                    help="another checkout, its extension built: its own bench_toggle.py runs in "
                         "processes alternating with this tree's, pair by pair, the first of each "
                         "pair rotated, and the two builds' ratios are compared pair by pair")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="toggle.json")
    a = ap.parse_args()
    modes = parse_modes(a.modes)
    if a.child:
        return child(a)
    scripts = {"this": os.path.abspath(__file__)}
    if a.against:
        other = os.path.join(os.path.abspath(a.against), "benchmarks", "bench_toggle.py")
        if not os.path.exists(other):
            sys.exit(f"--against: {other} does not exist; give the root of a checkout of memviz "
                     "(with its extension built there)")
        scripts["against"] = other
    runs = {who: [] for who in scripts}
    for i in range(a.procs):
        order = list(scripts) if i % 2 == 0 else list(reversed(list(scripts)))
        got = {}
        for who in order:
            r = fresh_process([scripts[who], "--child", "--model", a.model, "--track", a.track,
                               "--rounds", str(a.rounds), "--modes", a.modes], i)
            if r is None:
                continue
            got[who] = r
            line = []
            for m, *_ in modes:
                ratios = round_ratios(r, m, modes[0][0])
                line.append(f"{m} {statistics.median(r['times_ns'][m]) / 1e6:.2f} ms ({statistics.median(ratios):.4f})")
            name = f"{who} " if a.against else ""
            print(f"{name}process {i} (route {r['route']}): " + "  ".join(line), flush=True)
        if len(got) == len(scripts):  # a pair is kept whole or not at all
            for who, r in got.items():
                runs[who].append(r)
    if not runs["this"]:
        sys.exit("no process finished" if not a.against else "no pair of processes finished")
    result = {"model": a.model, "rounds": a.rounds, "modes": a.modes}
    if a.against:
        result["against"] = os.path.abspath(a.against)
        result["summary"] = summarize(runs["this"], modes, "this    ")
        result["against_summary"] = summarize(runs["against"], modes, "against ")
        result["comparison"] = compare(runs["this"], runs["against"], modes)
        result["pieces"] = pieces(runs["this"], modes, "this    ")
        result["against_pieces"] = pieces(runs["against"], modes, "against ")
        result["runs"], result["against_runs"] = runs["this"], runs["against"]
    else:
        result["summary"] = summarize(runs["this"], modes)
        result["pieces"] = pieces(runs["this"], modes)
        result["runs"] = runs["this"]
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
