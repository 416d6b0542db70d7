"""The allocator route on a real GPU (pytest -m gpu): PyTorch's native caching
allocator seen block by block. Every script imports torch and uses CUDA
first, then starts tracking, as a notebook user does."""

import textwrap

import pytest

from test_gpu_capture import _REASON, run  # noqa: F401  (same runner, same skip)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

SETUP = textwrap.dedent("""
import torch
torch.cuda.init()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
    torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(256, 1024, device="cuda")
P = sum(p.numel() for p in model.parameters())
def train_step():
    loss = model(x).square().mean()                                     # FORWARD
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
train_step()  # before tracking: the optimizer state exists already
torch.cuda.synchronize()
def blocks(snap):
    return [a for a in snap.allocations if a.kind == "block"]
def script_line(a):
    for f in reversed(a.traceback):  # the innermost line of the script
        if f.filename == "<string>":
            return f.lineno
    return None
""")


def test_route_attaches_after_import_and_totals_equal_memory_allocated():
    r = run(SETUP + textwrap.dedent("""
        t = memviz.track().start()
        info = memviz.capture_info()["pytorch"]
        state = memviz._core.allocator_state()
        train_step(); train_step()
        keep = model(x)
        torch.cuda.synchronize()
        snap = t.snapshot()
        b = blocks(snap)
        frag = snap.fragmentation()
        t.stop()
        out(info=info, state={k: v for k, v in state.items() if k not in ("deleter", "memviz_deleter")},
            blocks=sum(a.size for a in b), allocated=torch.cuda.memory_allocated(),
            reserved=torch.cuda.memory_reserved(), seg_reserved=sum(s.size for s in snap.segments or ()),
            before=sum(a.size for a in b if a.before_tracking), n=len(b),
            cats={str(s.key): s.size for s in snap.statistics("category")}, frag=frag,
            total=snap.total_bytes())
    """))
    print("allocator route:", r)
    assert r["info"]["route"] == "allocator", r["info"]
    assert r["blocks"] == r["allocated"], r
    assert r["seg_reserved"] == r["reserved"], r
    assert r["before"] > 0


def test_per_line_bytes_equal_pytorchs_own_snapshot():
    r = run(SETUP + textwrap.dedent("""
        torch.cuda.memory._record_memory_history(stacks="python")
        t = memviz.track().start()
        keep = []
        for i in range(3):
            keep.append(model(x + i))                                          # KEEP
            big = torch.empty(3 << 20, device="cuda"); keep.append(big)          # BIG
        train_step()
        torch.cuda.synchronize()
        snap = t.snapshot()
        ts = torch.cuda.memory._snapshot()
        t.stop()
        torch.cuda.memory._record_memory_history(enabled=None)
        mine, theirs = {}, {}
        for a in blocks(snap):
            ln = script_line(a)
            if ln is not None:
                mine[ln] = mine.get(ln, 0) + a.size
        for seg in ts["segments"]:
            for blk in seg["blocks"]:
                if blk["state"] != "active_allocated":
                    continue
                lines = [f["line"] for f in blk.get("frames", []) if f["filename"] == "<string>"]
                if lines:
                    theirs[lines[0]] = theirs.get(lines[0], 0) + blk["size"]
        out(mine=mine, theirs=theirs, allocated=torch.cuda.memory_allocated(),
            total=sum(a.size for a in blocks(snap)))
    """))
    print("per line:", r)
    assert r["mine"] and r["mine"] == r["theirs"], r
    assert r["total"] == r["allocated"]


def test_backward_bytes_carry_node_and_forward_line_and_zero_accounting_holds():
    r = run(SETUP + textwrap.dedent("""
        import time
        t = memviz.track().start()
        loss = model(x).square().mean()
        t0 = time.monotonic_ns()
        loss.backward()
        torch.cuda.synchronize()
        snap = t.snapshot()
        bw = [a for a in blocks(snap) if a.timestamp_ns >= t0]
        named = sum(a.size for a in bw if a.autograd_node and a.forward)
        total = sum(a.size for a in bw)
        nodes = sorted({a.autograd_node for a in bw if a.autograd_node})
        opt.step()
        torch.cuda.synchronize()
        cats = {str(s.key): s.size for s in t.snapshot().statistics("category")}
        t.stop()
        out(named=named, total=total, nodes=nodes, cats=cats, P=P)
    """))
    print("backward:", r)
    assert r["total"] > 0 and r["named"] >= 0.99 * r["total"], r
    P, cats = r["P"], r["cats"]
    for cat, expected in (("parameter", 4 * P), ("gradient", 4 * P), ("optimizer_state", 8 * P)):
        assert abs(cats.get(cat, 0) - expected) <= 0.01 * expected, (cat, cats, P)


def test_fragmentation_figures_equal_pytorchs_snapshot():
    r = run(SETUP + textwrap.dedent("""
        t = memviz.track().start()
        keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in
                [5 << 20, 700_000, 3 << 20, 12 << 20, 1000, 6 << 20, 2 << 20] * 4]
        del keep[::3]
        torch.cuda.synchronize()
        snap = t.snapshot()
        ts = torch.cuda.memory.memory_snapshot()
        t.stop()
        theirs = {}
        for seg in ts:
            free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
            theirs[seg["address"]] = [seg["allocated_size"], max(free, default=0), len(free)]
        mine = {s.address: [s.allocated, s.largest_free, s.free_gaps] for s in snap.segments}
        out(mine={str(k): v for k, v in mine.items()}, theirs={str(k): v for k, v in theirs.items()})
    """))
    assert r["mine"] == r["theirs"], r


def test_compiled_model_cuda_graph_and_mempool_are_attributed():
    r = run(SETUP + textwrap.dedent("""
        t = memviz.track().start()
        cmodel = torch.compile(model)
        for _ in range(3):
            cmodel(x).square().mean().backward()
        torch.cuda.synchronize()
        s1 = t.snapshot()
        compiled_ok = sum(a.size for a in blocks(s1)) == torch.cuda.memory_allocated()
        static_x = x.clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            static_y = model(static_x)                                       # CAPTURED
        captured_line = here() - 1
        g.replay(); g.replay()
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            in_pool = torch.empty(4 << 20, device="cuda")                   # MEMPOOL
        pool_line = here() - 1
        ro = torch.compile(model, mode="reduce-overhead")
        for _ in range(4):
            with torch.no_grad():
                ro(x)
        torch.cuda.synchronize()
        snap = t.snapshot()
        b = blocks(snap)
        by_addr = {a.address: a for a in b}
        y = by_addr.get(static_y.untyped_storage().data_ptr())
        p = by_addr.get(in_pool.data_ptr())
        t.stop()
        out(compiled_ok=compiled_ok, graph_line=script_line(y) if y else None, captured_line=captured_line,
            pool_line=script_line(p) if p else None, expected_pool=pool_line,
            total=sum(a.size for a in b), allocated=torch.cuda.memory_allocated(),
            route=snap.pytorch)
    """), timeout=400)
    print("compiled/graphs:", r)
    assert r["compiled_ok"], r
    assert r["graph_line"] == r["captured_line"], r
    assert r["pool_line"] == r["expected_pool"], r
    assert r["total"] == r["allocated"], r


def test_expandable_segments_and_workspaces():
    r = run(SETUP + textwrap.dedent("""
        t = memviz.track().start()
        keep = [model(x) for _ in range(3)]
        def side():
            keep.append(model(x))
        th = threading.Thread(target=side); th.start(); th.join()
        torch.cuda.synchronize()
        snap = t.snapshot()
        b = blocks(snap)
        unreached = [(a.size, a.category, a.op, a.autograd_node) for a in b
                     if a.category not in ("parameter", "gradient", "optimizer_state", "activation")
                     and a.size >= 1 << 20][:20]
        t.stop()
        out(route=snap.pytorch, total=sum(a.size for a in b), allocated=torch.cuda.memory_allocated(),
            unreached=unreached, cats={str(s.key): s.size for s in snap.statistics("category")})
    """), env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    print("expandable/workspaces:", r)
    assert r["route"]["route"] == "allocator", r
    assert r["total"] == r["allocated"], r


def test_amp_gradscaler_and_activation_checkpointing_are_attributed():
    """AMP with a GradScaler and non-reentrant activation checkpointing on the
    route: totals equal PyTorch's, backward bytes (recomputation included)
    carry a node and a forward line, and the fp32 ZeRO table still holds."""
    r = run(SETUP + textwrap.dedent("""
        import time
        from torch.utils.checkpoint import checkpoint
        scaler = torch.amp.GradScaler("cuda")
        blocks_ = list(model)
        def forward(inp):
            h = checkpoint(lambda z: blocks_[1](blocks_[0](z)), inp, use_reentrant=False)   # CKPT
            return blocks_[4](blocks_[3](blocks_[2](h)))
        t = memviz.track().start()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = forward(x).float().square().mean()
        t0 = time.monotonic_ns()
        scaler.scale(loss).backward()
        torch.cuda.synchronize()
        snap = t.snapshot()
        bw = [a for a in blocks(snap) if a.timestamp_ns >= t0]
        named = sum(a.size for a in bw if a.autograd_node and a.forward)
        nodes = sorted({a.autograd_node for a in bw if a.autograd_node})
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        s2 = t.snapshot()
        cats = {str(s.key): s.size for s in s2.statistics("category")}
        total2, allocated2 = sum(a.size for a in blocks(s2)), torch.cuda.memory_allocated()
        t.stop()
        out(named=named, total=sum(a.size for a in bw), nodes=nodes, cats=cats, P=P,
            total2=total2, allocated2=allocated2,
            first=(sum(a.size for a in blocks(snap)), torch.cuda.memory_allocated()))
    """))
    print("amp/checkpoint:", r)
    assert r["total"] > 0 and r["named"] >= 0.99 * r["total"], r
    assert any("recomputation" in n for n in r["nodes"]), r["nodes"]
    assert r["total2"] == r["allocated2"], r
    P, cats = r["P"], r["cats"]
    for cat, expected in (("parameter", 4 * P), ("gradient", 4 * P), ("optimizer_state", 8 * P)):
        assert abs(cats.get(cat, 0) - expected) <= 0.01 * expected, (cat, cats, P)


def test_detach_with_live_blocks_drains_then_gives_pytorch_its_vtable_back():
    """stop() while blocks made during tracking live: new blocks are PyTorch's
    at once, a stream use on an old block still holds it, and the vtable comes
    back when the last one is freed. Tracking again attaches again."""
    r = run(SETUP + textwrap.dedent("""
        t = memviz.track().start()
        live = [torch.empty(n << 20, device="cuda") for n in (1, 3, 5)]
        s = torch.cuda.Stream()
        t.stop()
        st1 = memviz._core.allocator_state()
        after = torch.empty(7 << 20, device="cuda")            # PyTorch's own, untracked
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)
            live[1].mul_(2)
        live[1].record_stream(s)
        addr = live[1].data_ptr()
        del live[1]
        reuse = torch.empty(3 << 20, device="cuda")           # must not take the block in use on s
        reused_early = reuse.data_ptr() == addr
        s.synchronize()
        del live
        torch.cuda.synchronize()
        st2 = memviz._core.allocator_state()
        ok = torch.cuda.memory_allocated() == sum(
            b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
            if b["state"] == "active_allocated")
        t2 = memviz.track().start()
        again = torch.empty(2 << 20, device="cuda")
        torch.cuda.synchronize()
        snap = t2.snapshot()
        found = any(a.address == again.data_ptr() for a in blocks(snap))
        t2.stop()
        out(st1=[st1["vtable"], st1["outstanding"]], st2=[st2["vtable"], st2["outstanding"]],
            reused_early=reused_early, ok=ok, found=found, route=snap.pytorch["route"])
    """))
    print("detach/drain:", r)
    assert r["st1"] == ["draining", 3], r
    assert r["st2"] == ["pytorch", 0], r
    assert not r["reused_early"], r
    assert r["ok"] and r["found"] and r["route"] == "allocator", r


def test_tracking_started_before_import_torch_attaches_at_cuda_init():
    """`memviz run` and scripts that track first: the route waits for
    PyTorch's lazy CUDA init, probes there, and sees every block after it."""
    r = run("""
        t = memviz.track().start()
        import torch
        waiting = t.torch.route.as_dict() if t.torch and t.torch.route else None
        x = torch.empty(5 << 20, device="cuda"); line = here()
        torch.cuda.synchronize()
        snap = t.snapshot()
        mine = [a for a in snap.allocations if a.kind == "block"]
        t.stop()
        out(waiting=waiting, route=snap.pytorch, total=sum(a.size for a in mine),
            allocated=torch.cuda.memory_allocated(),
            lines=[f.lineno for a in mine for f in a.traceback[-1:] if f.filename == "<string>"], line=line)
    """)
    print("before import:", r)
    assert r["route"]["route"] == "allocator", r
    assert r["total"] == r["allocated"] and r["line"] in r["lines"], r
