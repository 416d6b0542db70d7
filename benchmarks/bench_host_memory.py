"""memviz's own host memory (issue 27, item 5): per million live allocations,
per million distinct stacks, and what a flight recorder holds per million
events, through the libcupti test double (the C store's real path).

    python benchmarks/bench_host_memory.py [--live 1000000] [--events 10000000]
                                           [--budget "256 MiB"]

Each measurement runs in a fresh process and reads the process's resident
set (/proc/self/statm) before and after, beside the store's own count of
the bytes it uses (``_core.stats()["bytes_used"]``, ``bytes_reserved``: the
address space reserved up front and touched only as it fills) and the
flight recorder's ``stats()["memory"]``. Prints one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CHILD = r"""
import json, os, sys
sys.path[:0] = [{root!r}, {tests!r}]
from fake_cupti import FakeCupti, build
path = build(); os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
import memviz
from memviz import _core
fake = FakeCupti(path)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
mode, n, budget = {mode!r}, {n}, {budget!r}
out = {{"mode": mode, "n": n}}
if mode == "live":
    with memviz.track(torch=False) as t:
        r0 = rss(); fake.alloc_loop(n, 4096); r1 = rss()
        s = _core.stats()
        out.update(live=s["live"], rss_delta=r1 - r0, bytes_used=s["bytes_used"],
                   bytes_reserved=s["bytes_reserved"])
elif mode == "stacks":
    # n distinct stacks: one allocation from each of 4,000 lines at n / 4,000 depths (at most 25)
    from fake_cupti import CBID_cuMemAlloc_v2
    ns = {{}}
    src = "def f(k, fake):\n" + "".join(f"    if k == {{i}}: return fake.alloc({{CBID_cuMemAlloc_v2}}, 4096)\n" for i in range(4000))
    exec(compile(src, "<stacks>", "exec"), ns)
    f = ns["f"]
    def deep(d, k):
        return deep(d - 1, k) if d else f(k, fake)
    with memviz.track(torch=False) as t:
        r0 = rss()
        for j in range(min(25, max(1, n // 4000))):
            for k in range(4000):
                deep(j, k)
        r1 = rss()
        s = _core.stats()
        out.update(stacks=s["stacks"], frames=s["frames"], rss_delta=r1 - r0, bytes_used=s["bytes_used"])
else:  # ring: n alloc+free pairs (2n events) through a flight recorder of `budget`
    r0 = rss()
    with memviz.track(torch=False, flight_recorder=budget) as t:
        fake.alloc_free_loop(n // 2, 4096)
        fr = t.flight_recorder
        fr.stats()
        r1 = rss(); st = fr.stats()
    out.update(events=st["events"], kept_events=st["kept_events"], kept_bytes=st["kept_bytes"],
               recorder_memory=st["memory"], budget=st["budget"], rss_delta=r1 - r0,
               dropped=st["dropped_events"], folded=st["folded_events"])
print("RESULT " + json.dumps(out))
"""


def run(mode, n, budget):
    code = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), mode=mode, n=n, budget=budget)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    return json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--live", type=int, default=1_000_000)
    ap.add_argument("--stacks", type=int, default=100_000)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--budget", default="256 MiB")
    a = ap.parse_args()
    live = run("live", a.live, a.budget)
    stacks = run("stacks", a.stacks, a.budget)
    ring = run("ring", a.events, a.budget)
    M = 1_000_000
    print(json.dumps({
        "live": live, "per_million_live_allocations_rss_MB": live["rss_delta"] / live["n"] * M / 1e6,
        "per_million_live_allocations_store_MB": live["bytes_used"] / live["n"] * M / 1e6,
        "stacks": stacks, "per_million_stacks_rss_MB": stacks["rss_delta"] / max(stacks["stacks"], 1) * M / 1e6,
        "ring": ring,
        "per_million_kept_events_MB": ring["kept_bytes"] / max(ring["kept_events"], 1) * M / 1e6,
    }, indent=1))


if __name__ == "__main__":
    main()
