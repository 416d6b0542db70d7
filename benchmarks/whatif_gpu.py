"""What if, against real runs (issue 30), on a GPU machine.

    python benchmarks/whatif_gpu.py [--out DIR] [--workloads transformer,varlen,kvcache,cnn_amp,churn]

For each workload: one fresh process records it under the default settings
with memviz.track(trace=...), and reports torch.cuda.max_memory_reserved();
then `memviz whatif` predicts each setting from that one trace; then one
fresh process per setting runs the same seeded workload for real with
PYTORCH_CUDA_ALLOC_CONF set (untracked) and reports its reserved peak. And
the out-of-memory verdict: at a fraction 8% under the default reserved peak
(torch.cuda.set_per_process_memory_fraction), under the defaults and each
--oom-settings setting, predicted and real (the failing line; where both
fit, the reserved peaks, which the allocator's free-and-retry shapes).
Prints one JSON document; writes it to DIR/whatif_gpu.json.

Targets: the recorded settings reproduce the reserved peak exactly; the
others within 2%; the OOM verdict and its line match.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SETTINGS = ["expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4",
            "garbage_collection_threshold:0.8"]

WORKLOADS = {
    "transformer": """
m = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 6).cuda()
opt = torch.optim.AdamW(m.parameters())
for i in range(6):
    x = torch.randn(16, 256, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(x).float().square().mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
""",
    "varlen": """
conv = torch.nn.Sequential(torch.nn.Conv1d(64, 128, 5, padding=2), torch.nn.ReLU(), torch.nn.Conv1d(128, 64, 5, padding=2)).cuda()
g = torch.Generator().manual_seed(0)
for i in range(40):
    n = int(torch.randint(2000, 60000, (1,), generator=g))
    x = torch.randn(8, 64, n, device="cuda")
    conv(x).sum().backward()
""",
    "kvcache": """
layers = [torch.nn.Linear(1024, 3072).cuda().half() for _ in range(8)]
cache = [[] for _ in layers]
x = torch.randn(4, 1, 1024, device="cuda", dtype=torch.half)
with torch.no_grad():
    for t in range(300):
        for l, c in zip(layers, cache):
            kv = l(x)
            c.append(kv)
            if t % 50 == 49:
                c[:] = [torch.cat(c, dim=1)]
""",
    "cnn_amp": """
import torchvision
m = torchvision.models.resnet50().cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()
for i in range(5):
    x = torch.randn(64, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = m(x).float().mean()
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
""",
    "churn": """
g = torch.Generator().manual_seed(1)
live = []
for i in range(4000):
    n = int(torch.randint(1, 40 << 20, (1,), generator=g)) | 1
    live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
    if len(live) > 60:
        live.pop(int(torch.randint(0, len(live), (1,), generator=g)))
""",
}

# the variable-length loop giving its cache back every 8 steps (its loop body goes on)
WORKLOADS["varlen_empty"] = WORKLOADS["varlen"] + """    if i % 8 == 7:
        del x
        torch.cuda.empty_cache()
"""

CHILD = """
import os, sys, json, torch
sys.path.insert(0, {root!r})
torch.manual_seed(0)
frac = {fraction!r}
if frac:
    torch.cuda.set_per_process_memory_fraction(frac)
torch.cuda.init()
import memviz
out = {{"oom": None}}
def work():
{body}
try:
    if {trace!r}:
        with memviz.track(trace={trace!r}):
            work()
    else:
        work()
except torch.OutOfMemoryError as e:
    import traceback
    tb = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<string>"]
    out["oom"] = f"<string>:{{tb[-1].lineno}}" if tb else str(e)[:200]
torch.cuda.synchronize()
out["reserved_peak"] = torch.cuda.max_memory_reserved()
out["allocated_peak"] = torch.cuda.max_memory_allocated()
out["total"] = torch.cuda.get_device_properties(0).total_memory
print("RESULT", json.dumps(out))
"""


def child(body, conf=None, trace=None, fraction=None):
    code = CHILD.format(root=ROOT, fraction=fraction, trace=trace,
                        body="\n".join("    " + ln for ln in body.strip("\n").splitlines()))
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": p.stderr[-2000:]}
    return json.loads(lines[-1][7:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--settings", default=";".join(SETTINGS),
                    help="the settings to predict and run, separated by ';' (one setting may hold commas)")
    ap.add_argument("--keep", action="store_true", help="copy each recorded trace into --out")
    ap.add_argument("--oom-settings", default="expandable_segments:True",
                    help="settings checked, beside the defaults, at the fraction 8%% under the default "
                         "reserved peak (';'-separated)")
    ap.add_argument("--only-oom", action="store_true", help="skip the settings sweep: the fraction's check alone")
    opts = ap.parse_args()
    settings = [x for x in opts.settings.split(";") if x]
    sys.path.insert(0, ROOT)
    import memviz

    report = {}
    for name in opts.workloads.split(","):
        body = WORKLOADS[name]
        path = os.path.join(tempfile.mkdtemp(), f"{name}.memviz")
        rec = child(body, trace=path)
        entry = {"recorded": rec}
        if opts.keep and os.path.exists(path):
            os.makedirs(opts.out, exist_ok=True)
            shutil.copy(path, os.path.join(opts.out, f"{name}.memviz"))
        if "error" in rec:
            report[name] = entry
            continue
        frac = round(0.92 * rec["reserved_peak"] / rec["total"], 6)
        oom_settings = [x for x in opts.oom_settings.split(";") if x]
        preds = memviz.load(path).whatif(*oom_settings, device_memory=frac)
        entry["oom_fraction"] = {"fraction": frac}
        for conf, pred in zip(["defaults"] + oom_settings, preds):
            real = child(body, conf=None if conf == "defaults" else conf, fraction=frac)
            entry["oom_fraction"][conf] = {
                "predicted_oom": pred.oom.line if pred.oom else None, "real_oom": real.get("oom"),
                "predicted_reserved_peak": pred.reserved_peak, "real_reserved_peak": real.get("reserved_peak"),
                "predicted_retries": pred.retries}
        if opts.only_oom:
            report[name] = entry
            print(name, json.dumps(entry), flush=True)
            continue
        rows = memviz.load(path).whatif(*settings)
        entry["predicted"] = {r.setting or "defaults": r.reserved_peak for r in rows if r.device == 0}
        entry["real"] = {"defaults": rec["reserved_peak"]}
        # the same run untracked: what tracking itself changed in PyTorch's reservations
        entry["untracked_defaults"] = child(body).get("reserved_peak")
        for conf in settings:
            entry["real"][conf] = child(body, conf=conf).get("reserved_peak")
        entry["error_pct"] = {k: round(100.0 * (entry["predicted"][k] - v) / v, 2)
                              for k, v in entry["real"].items() if v and k in entry["predicted"]}
        report[name] = entry
        print(name, json.dumps(entry), flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "whatif_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
