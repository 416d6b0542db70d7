"""The stage build (src/clock.h, CFLAGS=-DMVZ_STAGES): the allocator route's
path cut at named points, each thread's ticks summed per stage, which
benchmarks/bench_in_step.py --stages reads on the GPU machine. Built here
from this tree into a folder of its own and driven through the stand-in
allocator (tests/stand_in_allocator) on the real wrappers, so the points stay
where the benchmark expects them; a plain build has none."""

import json
import platform
import subprocess
import sys

import pytest

from conftest import ROOT, build_variant
from memviz import _core

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route patches a C++ vtable on x86-64 glibc only")

DRIVE = """
import io, contextlib, json, sys
sys.path.insert(0, {bench!r})
import bench_allocator_route as b
with contextlib.redirect_stdout(io.StringIO()):
    b.child(20, {n}, 1, root={root!r})
import memviz._core as c
print(json.dumps({{"core": c.__file__, "stages": c._stage_timings()}}))
"""


def test_a_plain_build_has_no_stage_points():
    assert _core._stage_timings() is None


def test_a_stage_build_counts_every_point_of_each_allocation_and_free(tmp_path):
    pytest.importorskip("torch")  # the stand-in route attaches with torch imported
    tree = build_variant(tmp_path / "stages", "-DMVZ_STAGES")
    n = 3000
    code = DRIVE.format(bench=str(ROOT / "benchmarks"), n=n, root=str(tree))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["core"].startswith(str(tree)), out["core"]
    rows = out["stages"]
    assert rows, "no thread took a stage slot"
    # the thread that ran the loop: the most allocations
    tid, st = max(rows, key=lambda r: r[1]["a_enter"][0])
    # Each group of points is passed once per event of its kind: none is
    # skipped or counted twice. The capture path's points see every event
    # (the stand-in's segments too, from the test double's driver); the
    # route's wrapper points see its blocks; the wrapper's first part runs
    # for every call, recorded or not (the probe's).
    groups = {"capture allocations": ["a_enter", "a_label", "a_note", "a_walk", "a_compare", "a_claim",
                                      "a_fill", "a_publish"],
              "route allocations": ["a_wrap", "a_exit"],
              "capture frees": ["f_enter", "f_tick", "f_claim", "f_publish"],
              "route frees": ["f_exit", "f_release"]}
    assert sorted([k for g in groups.values() for k in g] + ["a_before", "null"]) == sorted(st), sorted(st)
    counts = {}
    for name, keys in groups.items():
        seen = {st[k][0] for k in keys}
        assert len(seen) == 1, (name, {k: st[k][0] for k in keys})
        counts[name] = seen.pop()
    assert counts["route allocations"] >= n and counts["route frees"] >= n, counts
    assert counts["capture allocations"] >= counts["route allocations"], counts
    assert counts["capture frees"] >= counts["route frees"], counts
    assert st["a_before"][0] >= counts["route allocations"]
    assert all(ns >= 0 for _, ns in st.values())
    if _core._clock()[0]:  # read as ns where the ticks are the TSC's (src/clock.h)
        assert st["a_walk"][1] > 0 and st["f_claim"][1] > 0
