"""Distributed runs on real GPUs (pytest -m gpu): one trace per rank and the
merged report, checked against PyTorch's own figures of each rank.

* DDP and FSDP2 on two GPUs, NCCL, under ``torch.distributed.run
  --nproc-per-node 2 -m memviz run -o run.memviz``: skipped, with the
  reason, with fewer than two GPUs;
* two processes sharing one GPU (``WORLD_SIZE=2``, both on cuda:0; gloo for
  the collectives, since NCCL cannot put two ranks on one device): runs on a
  machine with one GPU.

Each rank allocates differently (rank 0 holds an extra buffer, as rank 0
often does: logging, gathering a checkpoint) and writes its
``torch.cuda.max_memory_allocated()`` and model sizes to ``torch.rankN.json``;
the tests compare those with the merged report (``memviz report
run.rank*.memviz --format json``) and with each rank's own trace. Skipped,
with the reason, without CUDA.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_gpu_capture import _REASON  # noqa: E402  (one definition of "no CUDA here")

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _gpu_count() -> int:
    if _REASON is not None:
        return 0
    import torch
    return torch.cuda.device_count()


two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason=f"needs 2 CUDA GPUs; this machine has {_gpu_count()}")


def _env(extra=None):
    e = {k: v for k, v in os.environ.items()
         if k not in ("MEMVIZ_CUPTI_LIBRARY", "PYTORCH_CUDA_ALLOC_CONF", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e["OMP_NUM_THREADS"] = "1"
    e["NCCL_SET_THREAD_NAME"] = "1"  # NCCL's own threads named "NCCL ...": their buffers are NCCL's
    e.update(extra or {})
    return e


# What every scenario's script shares: the extra buffer of rank 0, the
# steps, and PyTorch's figures written for the test.
COMMON = """
import json, os, sys
import torch, torch.distributed as dist
import memviz

rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
device = DEVICE
torch.cuda.set_device(device)
MiB = 1 << 20
tracker = memviz.active_tracker()

def report(**extra):
    torch.cuda.synchronize()
    with open(f"torch.rank{rank}.json", "w") as f:
        json.dump(dict(rank=rank, device=device, max_allocated=torch.cuda.max_memory_allocated(device),
                       max_reserved=torch.cuda.max_memory_reserved(device),
                       allocated=torch.cuda.memory_allocated(device), **extra), f)
"""

MODEL = """
def model_and_steps(wrap, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    P = sum(p.numel() for p in model.parameters())
    model = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    extra = torch.empty((256 if rank == 0 else 32) * MiB, dtype=torch.uint8, device="cuda")  # EXTRA
    for step in range(steps):
        x = torch.randn(256, 2048, device="cuda")
        model(x).pow(2).mean().backward()
        opt.step()
        if step < steps - 1:
            opt.zero_grad(set_to_none=True)  # the last step keeps its gradients
        tracker.step()
    return P, extra
"""

DDP = COMMON.replace("DEVICE", "local") + MODEL + """
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
P, extra = model_and_steps(lambda m: DDP(m, device_ids=[local]))
report(params=P)
dist.barrier()
dist.destroy_process_group()
"""

FSDP2 = COMMON.replace("DEVICE", "local") + MODEL + """
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl", device_id=torch.device("cuda", local))

def wrap(model):
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)

P, extra = model_and_steps(wrap)
report(params=P)
dist.barrier()
dist.destroy_process_group()
"""

SHARED = COMMON.replace("DEVICE", "0") + """
dist.init_process_group("gloo")
buf = torch.empty((512 if rank == 0 else 128) * MiB, dtype=torch.uint8, device="cuda")  # BUFFER
kept = []
for step in range(6):
    kept.append(torch.empty(4 * MiB, dtype=torch.uint8, device="cuda"))  # KEPT
    tmp = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    del tmp
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)  # gloo, on the CPU
    assert x.tolist() == [float(sum(range(world)))] * 4
    tracker.step()
report()
dist.barrier()
dist.destroy_process_group()
"""


def _line_of(text, marker):
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith(marker))


def _run(tmp_path, body, nproc=2, timeout=600):
    (tmp_path / "train.py").write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "memviz", "run", "-o", "run.memviz", "train.py"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert sorted(x.name for x in tmp_path.glob("*.memviz")) == [f"run.rank{r}.memviz" for r in range(nproc)]
    m = subprocess.run([sys.executable, "-m", "memviz", "report", "run.rank*.memviz", "--format", "json"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert m.returncode == 0, m.stderr[-3000:]
    import memviz
    traces = [memviz.load(str(tmp_path / f"run.rank{r}.memviz")) for r in range(nproc)]
    torch_figures = [json.loads((tmp_path / f"torch.rank{r}.json").read_text()) for r in range(nproc)]
    return json.loads(m.stdout), traces, torch_figures, p


def _check_common(doc, traces, figures, devices, extra_bytes, marker, body):
    """What every scenario shares: the ranks' figures against their own
    traces and PyTorch's, the imbalance, the differing line, the steps."""
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["world_size"] == 2 and doc["notes"] == []
    for row, t, fig, dev in zip(doc["ranks"], traces, figures, devices):
        assert (t.rank, t.world_size, t.host) == (row["rank"], 2, socket.gethostname())
        assert row["device"] == dev == fig["device"] and dev in t.devices, (row, t.devices)
        assert row["peak"] == t.peak_bytes() and row["current"] == t.current_bytes()
        # memviz counts at the driver: every segment PyTorch reserved, and more (NCCL, the context's)
        assert row["peak"] >= fig["max_reserved"] >= fig["max_allocated"] > extra_bytes[row["rank"]], (row, fig)
        assert row["peak"] <= fig["max_reserved"] + 4096 * MiB, (row, fig)  # NCCL's buffers: not GiBs more
        cats = row["categories_at_peak"]
        assert cats and abs(sum(cats.values()) - row["peak"]) <= row["peak"] // 100, (cats, row["peak"])
        assert row["peak_at_s"] is not None and 0 <= row["peak_at_s"] <= row["duration_s"], row
    peaks = [r["peak"] for r in doc["ranks"]]
    assert doc["imbalance"]["ratio"] == pytest.approx(max(peaks) / (sum(peaks) / 2))
    assert doc["imbalance"]["max_rank"] == 0 and peaks[0] > peaks[1]
    top = doc["lines"][0]
    assert (os.path.basename(top["file"]), top["line"]) == ("train.py", _line_of(body, marker)), doc["lines"]
    assert top["bytes"] == {"0": extra_bytes[0], "1": extra_bytes[1]}, top
    assert len(doc["steps"]) == 6 and all(set(s["ranks"]) == {"0", "1"} for s in doc["steps"])


@two_gpus
def test_ddp_two_gpus_merged_report_against_torch(tmp_path):
    doc, traces, figs, p = _run(tmp_path, DDP)
    _check_common(doc, traces, figs, [0, 1], {0: 256 * MiB, 1: 32 * MiB}, "# EXTRA", DDP)
    for row, fig in zip(doc["ranks"], figs):
        P4 = 4 * fig["params"]
        end = row["categories_at_end"]
        assert end["parameter"] == P4 and P4 * 2 <= end["optimizer_state"] < P4 * 2 + MiB, end
        assert end.get("gradient", 0) >= P4 * 0.99, end  # the last step's gradients
        # DDP's buckets (one copy of the gradients, made by its Reducer) are collective memory,
        # and NCCL's own buffers are named too
        assert P4 <= end.get("pytorch/nccl", 0) <= P4 + 64 * MiB, end
        assert end.get("outside_pytorch/nccl", 0) > 0, end


@two_gpus
def test_fsdp2_two_gpus_merged_report_against_torch(tmp_path):
    doc, traces, figs, p = _run(tmp_path, FSDP2)
    _check_common(doc, traces, figs, [0, 1], {0: 256 * MiB, 1: 32 * MiB}, "# EXTRA", FSDP2)
    for row, fig in zip(doc["ranks"], figs):
        half = 4 * fig["params"] // 2  # each rank's shard (2048-wide layers split evenly in two)
        end = row["categories_at_end"]
        assert end["parameter"] == half and end["optimizer_state"] == 2 * half, end
        assert end["gradient"] == half, end  # the last step's gradient shards (DTensors)
        assert end.get("outside_pytorch/nccl", 0) > 0, end


def test_two_processes_sharing_one_gpu(tmp_path):
    """WORLD_SIZE=2 on a machine with one GPU: both ranks on cuda:0, each
    with its own trace, CUPTI subscription and peak."""
    doc, traces, figs, p = _run(tmp_path, SHARED)
    _check_common(doc, traces, figs, [0, 0], {0: 512 * MiB, 1: 128 * MiB}, "# BUFFER", SHARED)
    for row in doc["ranks"]:
        assert row["devices"] == [0], row
    kept = _line_of(SHARED, "# KEPT")
    assert all(x["line"] != kept for x in doc["lines"]), doc["lines"]  # the same on both ranks
    out = p.stdout + p.stderr
    for r in (0, 1):
        assert f"memviz: trace written to run.rank{r}.memviz" in out
