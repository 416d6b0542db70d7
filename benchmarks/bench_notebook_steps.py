"""How long a tracker with many steps takes to show in a notebook
(``t._repr_html_()``) and to read its steps (``memviz.report.read.steps``),
through the CUPTI test double (no GPU needed).

    python benchmarks/bench_notebook_steps.py [--steps 30000] [--repeat 5] [--tree DIR]

``--tree`` runs another checkout's memviz (its extension built) the same way,
in this process's place, for a side-by-side figure: run both trees in turn.
Prints a JSON line: the median and minimum of each over ``--repeat`` displays.
"""

import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=30000)
ap.add_argument("--repeat", type=int, default=5)
ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
args = ap.parse_args()
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [args.tree, os.path.join(here, "tests")]

from fake_cupti import CBID_cuMemAlloc_v2, FakeCupti, build  # noqa: E402

path = build()
os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
fake = FakeCupti(path)
import memviz  # noqa: E402
from memviz.report import read  # noqa: E402

t = memviz.track(torch=False).start()
kept = []
for i in range(args.steps):
    if i % 10 == 0:
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, 4096))
    t.step()
shown, steps = [], []
for _ in range(args.repeat):
    t0 = time.perf_counter()
    t._repr_html_()
    shown.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    read.steps(t)
    steps.append(time.perf_counter() - t0)
t.stop()
print(json.dumps({"tree": args.tree, "memviz": memviz.__file__, "steps": args.steps,
                  "repr_html_s": {"median": statistics.median(shown), "min": min(shown)},
                  "read_steps_s": {"median": statistics.median(steps), "min": min(steps)}}))
