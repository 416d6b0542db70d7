"""memviz's own memory per live allocation.

    python benchmarks/bench_memory.py [--live 1000000]

Makes N live allocations through the capture path (memviz._core._synthetic:
the store, stack capture and interning exactly as a CUPTI callback runs them)
from a handful of call sites, then reads the store's accounting and the
process's resident memory growth.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--live", type=int, default=1_000_000)
    a = ap.parse_args()
    from memviz import _core

    _core.init()
    _core.clear()
    before = _core.stats()["bytes_used"]
    rss0 = rss()
    per_site = a.live // 4

    def site_a():
        _core._synthetic(0x10000000000, 4096, False, per_site)

    def site_b():
        _core._synthetic(0x20000000000, 8192, False, per_site)

    def site_c():
        _core._synthetic(0x30000000000, 512, False, per_site)

    def site_d():
        _core._synthetic(0x40000000000, 1 << 20, False, a.live - 3 * per_site)

    for f in (site_a, site_b, site_c, site_d):
        f()
    s = _core.stats()
    grown = s["bytes_used"] - before
    print(json.dumps({
        "live": s["live"], "stacks": s["stacks"],
        "store_bytes_per_live": grown / s["live"],
        "rss_growth_bytes_per_live": (rss() - rss0) / s["live"],
        "bytes_used": s["bytes_used"], "note": "entries 48 B + live index (4 B slots, load 1/4..1/2)",
    }, indent=1))


if __name__ == "__main__":
    main()
