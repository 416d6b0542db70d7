"""The PyTorch integration on a real GPU (pytest -m gpu): precise mode, autograd
nodes on the engine thread, categories against the ZeRO paper's model-state
accounting, and the out-of-memory report."""

import pytest

import textwrap

from test_gpu_capture import _REASON, PRELUDE, ROOT, run  # noqa: F401  (same runner, same skip)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

MODEL = textwrap.dedent("""
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
    torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()                        # MODEL LINE
opt = torch.optim.Adam(model.parameters())
x = torch.randn(64, 1024, device="cuda")
P = sum(p.numel() for p in model.parameters())
def train_step(autocast=False):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()                                 # FORWARD LINE
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
""")


def script(before, after):
    return textwrap.dedent(before) + MODEL + textwrap.dedent(after)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_precise_mode_model_states_match_the_zero_accounting(autocast):
    r = run(script("""
        t = memviz.track(precise=True).start()
    """, f"""
        for _ in range(2):
            train_step(autocast={autocast})
        torch.cuda.synchronize()
        snap = t.snapshot()
        cats = {{str(s.key): s.size for s in snap.statistics("category")}}
        backend = torch.cuda.get_allocator_backend()
        t.stop()
        out(cats=cats, P=P, backend=backend, n=len(snap))
    """))
    assert r["backend"] == "cudaMallocAsync", r
    P, cats = r["P"], r["cats"]
    for cat, expected in (("parameter", 4 * P), ("gradient", 4 * P), ("optimizer_state", 8 * P)):
        assert abs(cats.get(cat, 0) - expected) <= 0.01 * expected, (cat, cats, P)


@pytest.mark.parametrize("route", ["wrappers", "cupti"])
def test_precise_mode_attributes_every_tensor_of_a_step_to_a_line(route):
    """Both capture routes of precise mode (src/interpose.h): memviz's
    wrappers around PyTorch's cudaMallocAsync/cudaFreeAsync (the default),
    and CUPTI's callbacks (MEMVIZ_PRECISE_CAPTURE=cupti)."""
    r = run(script("""
        t = memviz.track(precise=True).start()
    """, """
        train_step()
        torch.cuda.synchronize()
        snap = t.snapshot()
        peak = t.peak_snapshot(0)
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages |= {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        for st in opt.state.values():
            storages |= {v.untyped_storage().data_ptr() for v in st.values() if v.is_cuda}
        addresses = {a.address for a in snap}
        unexplained = [a for a in peak if not a.traceback and not a.autograd_node]
        script_lines = sorted({a.traceback.user_frame.lineno for a in peak if a.traceback
                               and a.traceback.user_frame.filename == "<string>"})
        live = t.current_bytes(0)
        allocated = torch.cuda.memory_allocated(0)
        pytorchs = sum(a.size for a in snap if a.device == 0 and a.kind == "device"
                       and not (a.category or "").startswith("outside_pytorch"))
        cublas = sum(a.size for a in snap if a.category == "outside_pytorch/cublas")
        capture = t.torch.precise_capture
        t.stop()
        out(live=live, allocated=allocated, capture=capture, pytorchs=pytorchs, cublas=cublas,
            missing=len(storages - addresses), tensors=len(storages), peak=len(peak),
            unexplained=len(unexplained), lines=script_lines,
            nodes=sorted({a.autograd_node for a in peak if a.autograd_node})[:20])
    """), env={"MEMVIZ_PRECISE_CAPTURE": route})
    print(route, {k: r[k] for k in ("capture", "live", "allocated", "pytorchs", "cublas", "peak", "unexplained",
                                    "missing")})
    assert r["capture"].startswith("wrappers" if route == "wrappers" else "CUPTI"), r
    assert r["missing"] == 0 and r["tensors"] > 0, r  # every parameter/grad/state tensor is its own allocation
    assert r["unexplained"] == 0, r  # each allocation has a line or an autograd node
    assert len(r["lines"]) >= 2 and r["nodes"], r
    # Every byte PyTorch counts as allocated is live in memviz too, and what
    # PyTorch does not count is named: cuBLAS's own cudaMalloc'd workspaces
    # (not from the stream-ordered pool) are outside_pytorch/cublas.
    assert r["live"] >= r["allocated"], r
    assert r["pytorchs"] == r["allocated"], r
    assert r["cublas"] > 0, r


@pytest.mark.parametrize("labels", ["callback", "hooks"])
def test_backward_allocations_carry_node_names_and_forward_lines(labels):
    """The engine thread's allocations carry the node and the line that ran
    forward, named by the capture callback itself (src/nodes.h) or, with
    MEMVIZ_AUTOGRAD_LABELS=hooks, by per-node pre-hooks."""
    body = script("""
        t = memviz.track(precise=True).start()
    """, """
        train_step()
        torch.cuda.synchronize()
        allocs = [a for a in t.peak_snapshot(0) if a.autograd_node]
        attached = t.torch._nodes_attached  # (stop detaches)
        t.stop()
        out(nodes=sorted({a.autograd_node for a in allocs}),
            forwards=sorted({a.forward for a in allocs if a.forward}),
            threads=sorted({a.thread.name for a in allocs}),
            nodes_attached=attached)
    """)
    r = run(body, env={"MEMVIZ_AUTOGRAD_LABELS": labels})
    print("labels", labels, r)
    assert r["nodes_attached"] == (labels == "callback"), r
    assert any(n.startswith(("AddmmBackward", "MmBackward")) for n in r["nodes"]), r
    # Precise mode records no saved tensors: the forward line comes from the
    # node numbers (src/seqmap.h) and must be the line that ran the model.
    code = (PRELUDE.format(root=str(ROOT)) + textwrap.dedent(body)).splitlines()
    fwd = 1 + next(i for i, ln in enumerate(code) if ln.rstrip().endswith("# FORWARD LINE"))
    assert f"<string>:{fwd}" in r["forwards"], (fwd, r)


def test_planted_oom_produces_the_report():
    r = run("""
        import torch
        torch.ones(1, device="cuda")
        keep = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        with memviz.track() as t:
            line = here() + 2
            try:
                torch.empty(1 << 48, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as e:
                msg = str(e)
        rep = t.oom_report
        out(requested=rep.requested if rep else None, line=rep.line if rep else None, expected=line,
            source=rep.source if rep else None, text=str(rep), msg_kept="Tried to allocate" in msg)
    """)
    assert r["requested"] == 1 << 48, r
    assert r["line"] == f"<string>:{r['expected']}", r
    assert r["msg_kept"], r  # the user's exception is untouched
    print(r["text"])


def test_oom_report_names_the_call_that_failed():
    """torch.cdist is Python (torch/functional.py) calling _VF.cdist: the
    failing call is named from that frame, with the module spelled out."""
    r = run("""
        import torch
        a = torch.ones(1 << 20, 1, device="cuda")
        with memviz.track() as t:
            try:
                torch.cdist(a, a)  # a 4 TiB result
            except torch.OutOfMemoryError:
                pass
        rep = t.oom_report
        out(call=rep.call if rep else None, requested=rep.requested if rep else None, text=str(rep))
    """)
    print("oom call", r)
    assert r["call"] and "cdist" in r["call"], r
    assert r["requested"] >= 1 << 42, r


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "default"])
def test_allocations_name_the_call_that_made_them(precise):
    """Allocation.op: the model's nn.Linear layers call F.linear, named with
    its module (torch.nn.functional.linear), in precise mode (every tensor)
    and in the default mode (the caching allocator's segments)."""
    r = run(script(f"""
        t = memviz.track(precise={precise}).start()
    """, """
        train_step()
        torch.cuda.synchronize()
        peak = t.peak_snapshot(0)
        t.stop()
        framed = [a for a in peak if a.traceback]
        out(ops=sorted({a.op for a in peak if a.op}), framed=len(framed),
            framed_with_op=sum(1 for a in framed if a.op),
            by_op=[(s.key, s.size, s.count) for s in peak.statistics("op")[:10]])
    """))
    print("ops", precise, r)
    assert "torch.nn.functional.linear" in r["ops"], r
    # most allocations made from Python are named (the script itself runs
    # from a string, with no source to read: calls on its own lines go unnamed)
    assert r["framed_with_op"] >= 0.5 * r["framed"] > 0, r
