"""The past, exactly, on a real GPU (pytest -m gpu): the peak, a trace and a
flight dump hold every byte, at PyTorch's own block sizes. Each script
imports torch first and builds the model before track(), as a notebook does."""

import textwrap

import pytest

from test_gpu_capture import _REASON, run  # noqa: F401  (same runner, same skip)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

MiB = 1 << 20

MODEL = textwrap.dedent("""
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(512, 4096, device="cuda")
params = sum(p.numel() * p.element_size() for p in model.parameters())
def step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
def blocks(snap):
    return [a for a in snap.allocations if a.kind == "block"]
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
""")


def test_the_peak_holds_the_parameters_and_the_tensor_peak_is_max_memory_allocated(tmp_path):
    path = tmp_path / "run.memviz"
    r = run(MODEL + textwrap.dedent(f"""
        with memviz.track(trace={str(path)!r}) as t:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            live_alloc = torch.cuda.memory_allocated()
            live_blocks = sum(a.size for a in blocks(t.snapshot()))
        tp = t.peak_snapshot(peak="tensor")
        dp = t.peak_snapshot()
        loaded = memviz.load({str(path)!r})
        ltp = loaded.peak_snapshot(peak="tensor")
        ldp = loaded.peak_snapshot()
        key = lambda s: sorted((a.address, a.size, a.kind) for a in s.allocations)
        lines = lambda s: sorted((str(st.key), st.size) for st in s.statistics("lineno"))
        out(max_alloc=torch.cuda.max_memory_allocated(), params=params,
            tensor_peak=t.tensor_totals()[0]["peak"],
            tp_blocks=sum(a.size for a in blocks(tp)),
            tp_before=sum(a.size for a in blocks(tp) if a.before_tracking),
            dp_blocks=sum(a.size for a in blocks(dp)), live_alloc=live_alloc, live_blocks=live_blocks,
            same_tensor=key(tp) == key(ltp), same_device=key(dp) == key(ldp),
            same_lines=lines(tp) == lines(ltp), peak_names=[tp.peak, dp.peak, ltp.peak],
            loaded_tensor_peak=loaded.tensor_totals()[0]["peak"],
            estimated=sum(1 for a in blocks(tp) if a.size_estimated))
    """))
    print("peaks:", r)
    assert r["tensor_peak"] == r["max_alloc"] == r["tp_blocks"], r
    assert r["tp_before"] >= r["params"], r  # the parameters, made before track()
    assert r["live_blocks"] == r["live_alloc"], r
    assert r["same_tensor"] and r["same_device"] and r["same_lines"], r
    assert r["loaded_tensor_peak"] == r["max_alloc"], r
    assert r["peak_names"] == ["tensor", "device", "tensor"] and r["estimated"] == 0, r


def test_a_flight_dump_after_a_real_oom_holds_memory_allocated_at_the_failure(tmp_path):
    r = run(MODEL + textwrap.dedent(f"""
        step()
        with memviz.track(flight_recorder="32 MiB", flight_dir={str(tmp_path)!r}) as t:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            at_failure = torch.cuda.memory_allocated()
            try:
                huge = torch.empty(400 << 30, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                pass
            dumps = sorted(f for f in os.listdir({str(tmp_path)!r})
                           if f.endswith(".memviz") and not f.startswith("."))  # the OOM's first
        d = memviz.load(os.path.join({str(tmp_path)!r}, dumps[0]))
        end = d.snapshot()
        out(at_failure=at_failure, dump_blocks=sum(a.size for a in blocks(end)),
            before=sum(a.size for a in blocks(end) if a.before_tracking), params=params,
            dumps=len(dumps))
    """))
    print("flight dump:", r)
    assert r["dumps"] >= 1
    assert r["dump_blocks"] == r["at_failure"], r
    assert r["before"] >= r["params"], r


def test_fragmentation_at_a_known_peak_equals_memory_snapshot_then(tmp_path):
    path = tmp_path / "churn.memviz"
    r = run(textwrap.dedent(f"""
        import random, torch
        torch.cuda.init()
        rnd = random.Random(5)
        keep = []
        with memviz.track(trace={str(path)!r}) as t:
            for i in range(600):  # 1-29 MiB tensors, mixed, with holes
                n = rnd.randrange(1, 30) * (1 << 20) - rnd.randrange(0, 4096)
                keep.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                if len(keep) > 150:
                    keep.pop(rnd.randrange(len(keep)))
            small = [torch.empty(rnd.randrange(1, 1 << 20), dtype=torch.uint8, device="cuda")
                     for _ in range(200)]
            torch.cuda.synchronize()
            big = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")  # the peak, on purpose
            torch.cuda.synchronize()
            truth = torch.cuda.memory_snapshot()
            del big, small
            keep = keep[::2]
            torch.cuda.synchronize()
        def seg_figs(segments):
            out = {{}}
            for s in segments:
                out[s["address"]] = s
            return out
        def torch_figs(seg):
            blocks = sorted(seg["blocks"], key=lambda b: b["address"])
            alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            free = [b["size"] for b in blocks if b["state"] != "active_allocated"]
            # adjacent free blocks are one gap
            gaps, largest, run_ = 0, 0, 0
            for b in blocks:
                if b["state"] != "active_allocated":
                    run_ += b["size"]
                else:
                    if run_:
                        gaps += 1; largest = max(largest, run_)
                    run_ = 0
            if run_:
                gaps += 1; largest = max(largest, run_)
            return (seg["total_size"], alloc, seg["total_size"] - alloc, largest, gaps)
        want = {{s["address"]: torch_figs(s) for s in truth if any(
            b["state"] == "active_allocated" for b in s["blocks"])}}
        def ours(snap):
            return {{s.address: (s.size, s.allocated, s.unused, s.largest_free, s.free_gaps)
                    for s in snap.segments if s.allocated}}
        live_peak = ours(t.peak_snapshot(peak="tensor"))
        loaded_peak = ours(memviz.load({str(path)!r}).peak_snapshot(peak="tensor"))
        diff = [a for a in want if live_peak.get(a) != want[a]]
        out(segments=len(truth), compared=len(want), differ=len(diff),
            examples=[(want[a], live_peak.get(a)) for a in diff[:5]],
            trace_same=loaded_peak == live_peak, missing=len(set(want) - set(live_peak)))
    """), timeout=400)
    print("fragmentation:", r)
    assert r["compared"] >= 100, r
    assert r["differ"] == 0 and r["missing"] == 0, r
    assert r["trace_same"], r


def test_generation_with_a_kv_cache_tensor_peak_is_pytorchs():
    r = run(textwrap.dedent("""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=5000, n_positions=1024)
        model = GPT2LMHeadModel(cfg).cuda().eval()
        ids = torch.randint(0, 5000, (8, 32), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with memviz.track() as t:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=200, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        tp = t.peak_snapshot(peak="tensor")
        out(max_alloc=torch.cuda.max_memory_allocated(), start=start,
            tensor_peak=t.tensor_totals()[0]["peak"],
            blocks=sum(a.size for a in tp.allocations if a.kind == "block"))
    """), timeout=400)
    print("generate:", r)
    assert r["tensor_peak"] == r["max_alloc"] == r["blocks"], r


def test_the_demo_line_is_256_mib_in_one_allocation(tmp_path):
    path = tmp_path / "demo.memviz"
    r = run(textwrap.dedent(f"""
        import subprocess
        p = subprocess.run([sys.executable, "-m", "memviz", "run", "-o", {str(path)!r},
                            "examples/basic.py"], capture_output=True, text=True)
        t = memviz.load({str(path)!r})
        stats = t.peak_snapshot().statistics("lineno")
        row = [s for s in stats if "basic.py" in s.key.filename and s.size >= 200 * (1 << 20)
               and s.size < 400 * (1 << 20)]
        out(rc=p.returncode, rows=[(str(s.key), s.size, s.count) for s in row],
            memviz=sum(a.size for a in t.snapshot().allocations if a.category == "memviz"))
    """))
    print("demo:", r)
    assert r["rc"] == 0, r
    assert [(size, count) for _k, size, count in r["rows"]] == [(256 * MiB, 1)], r
