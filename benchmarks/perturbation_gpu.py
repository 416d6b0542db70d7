"""Does tracking change what PyTorch's caching allocator reserves? (issue 30)

    python benchmarks/perturbation_gpu.py [--out DIR] [--workloads transformer,cnn_amp]

For each workload of whatif_gpu.py, fresh processes run it:
- ``untracked``;
- ``tracked``: under memviz.track();
- ``tracked_empty``: under memviz.track(), with torch.cuda.empty_cache()
  right after tracking started (what memviz's own probe left cached goes).

Each process also keeps PyTorch's own allocator history (context=None,
no stacks: no device memory of its own), so the order and addresses of
the segments PyTorch made can be compared between the modes. Prints and
writes DIR/perturbation_gpu.json: per mode, the reserved and allocated
peaks and the segments made (size, address, stream), in order.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from whatif_gpu import ROOT, WORKLOADS  # noqa: E402

CHILD = """
import os, sys, json, torch
sys.path.insert(0, {root!r})
torch.manual_seed(0)
torch.cuda.init()
torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=2_000_000)
import memviz
mode = {mode!r}
def work():
{body}
if mode == "untracked":
    work()
else:
    with memviz.track():
        if mode == "tracked_empty":
            torch.cuda.empty_cache()
        work()
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
segs = [(e["size"], e["addr"], e.get("stream", 0)) for t in snap["device_traces"] for e in t
        if e["action"] == "segment_alloc"]
print("RESULT", json.dumps(dict(reserved_peak=torch.cuda.max_memory_reserved(),
                                allocated_peak=torch.cuda.max_memory_allocated(), segments=segs)))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workloads", default="transformer")
    ap.add_argument("--modes", default="untracked,tracked,tracked_empty")
    o = ap.parse_args()
    report = {}
    for name in o.workloads.split(","):
        body = "\n".join("    " + ln for ln in WORKLOADS[name].strip("\n").splitlines())
        report[name] = {}
        for mode in o.modes.split(","):
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            p = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, mode=mode, body=body)],
                               capture_output=True, text=True, env=env, timeout=600)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else {"error": p.stderr[-2000:]}
            report[name][mode] = r
            print(name, mode, {k: v for k, v in r.items() if k != "segments"},
                  "segments:", len(r.get("segments", ())), flush=True)
    os.makedirs(o.out, exist_ok=True)
    with open(os.path.join(o.out, "perturbation_gpu.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
