"""When another tool holds CUPTI, on a real GPU (pytest -m gpu): torch.profiler
before, around and inside track(); the profiler's own trace keeps its CUDA
events; memviz's blocks equal memory_allocated() and its pool (blocks plus
the rest of each segment) memory_reserved(); cupti=False; Lightning's and
Hugging Face's profilers beside memviz's callbacks. Each script runs in a
process of its own: Kineto keeps its CUPTI subscription for the rest of one."""

import textwrap

import pytest

from test_gpu_capture import _REASON, run  # noqa: F401  (same runner, same skip)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

WORK = textwrap.dedent("""
import warnings
import torch
from torch.profiler import profile, ProfilerActivity, schedule
warnings.simplefilter("always")
x = torch.randn(2048, 2048, device="cuda")
def work(n=3):
    keep = []
    for i in range(n):
        keep.append(x @ x + i)
        keep.append(torch.empty((i + 1) << 22, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    return keep
def cuda_events(prof):
    return sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))
def in_pool(a):
    # PyTorch's pool as memviz reports it: its blocks and the unused rest of
    # each segment; a driver allocation of another library (CUPTI's, the
    # profiler's) is device memory outside PyTorch, in another category
    return a.kind == "block" or a.category == "unused_pool"
def pool(snap):
    return sum(a.size for a in snap.allocations if in_pool(a))
def figures(t):
    s = t.snapshot()
    blocks = sum(a.size for a in s.allocations if a.kind == "block")
    info = t.capture_info()
    others = [(a.size, a.kind, a.category, str(a.traceback.user_frame) if a.traceback else None, a.before_tracking)
              for a in s.allocations if not in_pool(a)]
    return dict(blocks=blocks, allocated=torch.cuda.memory_allocated(), pool=pool(s),
                reserved=torch.cuda.memory_reserved(), cupti=t.cupti_enabled, why=t.cupti_off_reason,
                sources=info["sources"], route=info["pytorch"]["route"], others=others)
""")


def _exact(r):
    assert r["route"] == "allocator", r
    assert r["blocks"] == r["allocated"], r
    # PyTorch's segments made before tracking are not in memviz's pool (the report
    # names them from PyTorch's own figure): the pool is at most what is reserved
    assert r["pool"] <= r["reserved"], r


def test_a_profiler_run_before_tracking_leaves_memviz_on_the_allocator_route():
    r = run(WORK + textwrap.dedent("""
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            work(1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with memviz.track() as t:
                keep = work()
                fig = figures(t)
        out(**fig, events=cuda_events(prof), warned=[str(x.message)[:300] for x in w])
    """))
    print(r)
    assert r["events"] > 0, r
    assert r["cupti"] is False and "held by" in r["why"], r
    assert any("tracking without CUPTI" in m for m in r["warned"]), r
    _exact(r)
    assert r["sources"]["allocator"]["segments"] == "allocator", r


def test_a_profiler_inside_tracking_gets_cupti_and_keeps_its_cuda_events():
    r = run(WORK + textwrap.dedent("""
        with memviz.track() as t:
            first = work()
            before = t.cupti_enabled
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
                during = work()
            after = work()
            fig = figures(t)
        out(**fig, before=before, events=cuda_events(prof))
    """))
    print(r)
    assert r["before"] is True and r["cupti"] is False and "torch.profiler started at" in r["why"], r
    assert r["events"] > 0, r
    _exact(r)


def test_memviz_inside_a_profiler():
    r = run(WORK + textwrap.dedent("""
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with memviz.track() as t:
                keep = work()
                fig = figures(t)
        out(**fig, events=cuda_events(prof))
    """))
    print(r)
    assert r["events"] > 0 and r["cupti"] is False, r
    _exact(r)


def test_a_scheduled_profiler_inside_tracking():
    # The profiler clears its events when a cycle ends: count them when the
    # cycle's trace is ready, as a user's on_trace_ready handler sees them.
    r = run(WORK + textwrap.dedent("""
        ready = []
        with memviz.track() as t:
            with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                         on_trace_ready=lambda p: ready.append(cuda_events(p))) as prof:
                for _ in range(5):
                    keep = work(1)
                    prof.step()
            fig = figures(t)
        out(**fig, events=sum(ready), cycles=len(ready))
    """))
    print(r)
    assert r["events"] > 0, r
    _exact(r)


def test_cupti_false_uses_no_cupti_and_stays_exact():
    r = run(WORK + textwrap.dedent("""
        import memviz.capture.cupti as c
        with memviz.track(cupti=False) as t:
            keep = work()
            fig = figures(t)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            work(1)
        out(**fig, loaded=c.loaded() is not None, events=cuda_events(prof))
    """))
    print(r)
    assert r["cupti"] is False and r["why"] == "cupti=False was passed" and not r["loaded"], r
    assert r["events"] > 0, r
    _exact(r)
    assert r["pool"] == r["reserved"], r  # CUDA first used inside: every segment seen


def test_lightning_profiler_beside_memviz_callback(tmp_path):
    pytest.importorskip("lightning", reason="needs lightning")
    r = run(textwrap.dedent(f"""
        import torch, lightning as L
        from memviz.integrations.lightning import MemvizCallback
        class M(L.LightningModule):
            def __init__(self):
                super().__init__(); self.l = torch.nn.Linear(256, 256)
            def training_step(self, b, i):
                return self.l(b[0]).square().mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 256)), batch_size=8)
        cb = MemvizCallback()
        tr = L.Trainer(max_steps=6, accelerator="gpu", devices=1, profiler="pytorch", callbacks=[cb],
                       logger=False, enable_checkpointing=False, default_root_dir={str(tmp_path)!r})
        tr.fit(M(), data)
        out(steps=len(cb.tracker.steps) if getattr(cb, "tracker", None) else -1)
    """), timeout=300)
    print(r)
    assert r["steps"] != 0, r


def test_huggingface_profiler_callback_beside_memviz_callback(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers")
    r = run(textwrap.dedent(f"""
        import torch
        from torch.profiler import profile, ProfilerActivity
        from transformers import Trainer, TrainingArguments, TrainerCallback
        from memviz.integrations.huggingface import MemvizCallback
        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.l = torch.nn.Linear(64, 2)
            def forward(self, x, labels=None):
                y = self.l(x); return {{"loss": torch.nn.functional.cross_entropy(y, labels), "logits": y}}
        class Data(torch.utils.data.Dataset):
            def __len__(self): return 64
            def __getitem__(self, i): return {{"x": torch.randn(64), "labels": torch.tensor(i % 2)}}
        class Prof(TrainerCallback):
            def on_train_begin(self, *a, **k):
                self.p = profile(activities=[ProfilerActivity.CUDA]); self.p.__enter__()
            def on_train_end(self, *a, **k):
                self.p.__exit__(None, None, None)
        prof = Prof()
        args = TrainingArguments({str(tmp_path)!r}, max_steps=5, per_device_train_batch_size=8,
                                 report_to=[], save_strategy="no", logging_strategy="no")
        cb = MemvizCallback()
        Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=[cb, prof]).train()
        out(events=sum(1 for e in prof.p.events() if str(e.device_type).endswith("CUDA")))
    """), timeout=300)
    print(r)
    assert r["events"] > 0, r
