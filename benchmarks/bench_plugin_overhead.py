"""What the memviz pytest plugin adds to a CPU test suite that uses none of its markers.

    python benchmarks/bench_plugin_overhead.py [--tests 500] [--rounds 7]

Generates a suite of ``--tests`` trivial tests (10 files, plain and
parametrized) in a temporary folder and runs it with ``python -m pytest -q``
in fresh processes, alternating:

* ``off``: the plugin not loaded (``-p no:memviz``);
* ``on``: the plugin loaded (its entry point when memviz is installed, else
  ``-p memviz.integrations.pytest_plugin``), no marker used.

Prints one JSON object: per arm the wall times and the CPU times of the
child (user+sys: steadier on a shared machine), each with median, spread
(max-min) and the ratio of the medians. The budget is 5%. Bytecode caching is on (as
for a normal user; into the temporary folder); ``--no-bytecode-cache``
measures the worst case, every module compiled in every run.
"""

import argparse
import importlib.metadata
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CACHE_BYTECODE = True
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FILE = '''
import pytest

def test_a():
    assert 1 + 1 == 2

def test_b():
    assert "memviz".upper() == "MEMVIZ"

@pytest.mark.parametrize("n", range({n}))
def test_param(n):
    assert n * 2 == n + n

class TestGroup:
    def test_method(self):
        assert [1, 2][0] == 1
'''


def installed() -> bool:
    eps = importlib.metadata.entry_points(group="pytest11")
    return any(ep.value == "memviz.integrations.pytest_plugin" for ep in eps)


def make_suite(folder: str, tests: int) -> None:
    per_file = tests // 10
    for i in range(10):
        with open(os.path.join(folder, f"test_gen_{i}.py"), "w") as f:
            f.write(FILE.format(n=per_file - 3))


def run_once(folder: str, args) -> tuple:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Bytecode caching on, as for a normal user (into the temporary folder,
    # not the repository), unless --no-bytecode-cache asked for the worst case.
    if CACHE_BYTECODE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(folder, ".pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                       cwd=folder, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"the generated suite failed (pytest {' '.join(args)}):\n{p.stdout[-2000:]}")
    return wall, cpu, p.stdout.strip().splitlines()[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="compile every module from source in every run (PYTHONDONTWRITEBYTECODE=1)")
    a = ap.parse_args()
    global CACHE_BYTECODE
    CACHE_BYTECODE = not a.no_bytecode_cache
    on_args = [] if installed() else ["-p", "memviz.integrations.pytest_plugin"]
    arms = {"off": ["-p", "no:memviz"], "on": on_args}
    wall = {"off": [], "on": []}
    cpu = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="memviz-plugin-bench-") as folder:
        make_suite(folder, a.tests)
        summary = run_once(folder, arms["on"])[2]  # warm the file system and bytecode caches
        run_once(folder, arms["off"])
        for r in range(a.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for arm in order:
                w, c, _ = run_once(folder, arms[arm])
                wall[arm].append(w)
                cpu[arm].append(c)
    out = {"tests": a.tests, "rounds": a.rounds, "suite_summary": summary,
           "plugin_loaded_by": "entry point" if installed() else "-p memviz.integrations.pytest_plugin",
           "bytecode_cache": CACHE_BYTECODE, "python": sys.version.split()[0], "budget": 0.05}
    for name, times in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {
            "median_off_s": round(med["off"], 4), "median_on_s": round(med["on"], 4),
            "spread_off_s": round(max(times["off"]) - min(times["off"]), 4),
            "spread_on_s": round(max(times["on"]) - min(times["on"]), 4),
            "overhead": round(med["on"] / med["off"] - 1, 4),
            "off_s": [round(x, 4) for x in times["off"]], "on_s": [round(x, 4) for x in times["on"]]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
