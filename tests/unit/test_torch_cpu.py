"""The PyTorch integration on CPU (real torch), with the test double firing
the "driver" events: autograd labels on the thread that runs backward,
checkpoint recomputation, categories of a small model, graph residency,
precise-mode configuration and out-of-memory reports."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch integration tests need torch (pip install torch)")

import memviz  # noqa: E402
from conftest import here, line_of  # noqa: E402
from fake_cupti import CBID_cuMemAlloc_v2, CUDA_ERROR_OUT_OF_MEMORY  # noqa: E402
from memviz.torch import precise  # noqa: E402

THIS = os.path.abspath(__file__)
KiB = 1024


class Scale(torch.autograd.Function):
    """A custom op whose backward allocates through the double."""

    fake = None

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # SAVED
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        Scale.fake.alloc(CBID_cuMemAlloc_v2, 64 * KiB)
        return g * 2


class NoSave(torch.autograd.Function):
    fake = None

    @staticmethod
    def forward(ctx, x):
        return x + 1

    @staticmethod
    def backward(ctx, g):
        NoSave.fake.alloc(CBID_cuMemAlloc_v2, 32 * KiB)
        return g


class AllocInForward(torch.autograd.Function):
    """Allocates in forward (after autograd made its node) and in backward."""

    fake = None

    @staticmethod
    def forward(ctx, x):
        AllocInForward.fake.alloc(CBID_cuMemAlloc_v2, 16 * KiB)  # FORWARD OUTPUT
        return x * 3

    @staticmethod
    def backward(ctx, g):
        AllocInForward.fake.alloc(CBID_cuMemAlloc_v2, 48 * KiB)
        return g * 3


def _line_of(marker):
    return line_of(THIS, marker)


@pytest.fixture(params=["callback", "hooks"])
def ops(fake, request, monkeypatch):
    """The double, with autograd labels made by the capture callback itself
    (src/nodes.h) or, as where PyTorch's layout does not check out, by
    per-node pre-hooks."""
    if request.param == "hooks":
        monkeypatch.setenv("MEMVIZ_AUTOGRAD_LABELS", "hooks")
    Scale.fake = NoSave.fake = AllocInForward.fake = fake
    fake.labels = request.param
    yield fake


def _callback_mode(ops):
    if ops.labels != "callback":
        pytest.skip("about the callback's own node labels")
    if not memviz._core.nodes_supported():
        pytest.skip("reading PyTorch's thread-local node needs x86-64 glibc")


def test_callback_names_nodes_with_no_hooks_and_no_walk(ops, monkeypatch):
    _callback_mode(ops)
    from memviz.torch import integration

    walks = []
    monkeypatch.setattr(integration.TorchIntegration, "_hook_graph", lambda self, roots: walks.append(roots))
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        assert t.torch._nodes_attached, "PyTorch's node layout should check out on this torch"
        y = AllocInForward.apply(x)
        NoSave.apply(y).sum().backward()
    assert walks == []
    by_size = {a.size: a for a in t.snapshot()}
    assert by_size[48 * KiB].autograd_node == "AllocInForwardBackward"
    assert by_size[48 * KiB].forward == f"{THIS}:{_line_of('# FORWARD OUTPUT')}"
    assert by_size[32 * KiB].autograd_node == "NoSaveBackward"
    with torch.enable_grad():  # after stop the callback no longer reads PyTorch's node
        z = (torch.ones(2, requires_grad=True) * 2).sum()
        seen = []
        z.grad_fn.register_prehook(lambda g: seen.append(memviz._core.nodes_current()))
        z.backward()
    assert seen == [None]


class Tagged(torch.autograd.Function):
    """Backward allocates a size that names the thread that ran it."""

    fake = None

    @staticmethod
    def forward(ctx, x, size):
        ctx.size = size
        return x * 1

    @staticmethod
    def backward(ctx, g):
        Tagged.fake.alloc(CBID_cuMemAlloc_v2, ctx.size)
        return g, None


def test_backward_on_many_threads_names_each_threads_node(ops):
    """Each thread's allocations carry the node that thread runs (CPU backward
    runs on the calling thread), never a node of another thread."""
    import sys
    import threading

    Tagged.fake = ops
    subclasses = [type(f"Tagged{i}", (Tagged,), {}) for i in range(4)]
    errors = []

    def work(i):
        try:
            for _ in range(25):
                x = torch.randn(4, requires_grad=True)
                y = subclasses[i].apply(x.sin(), (i + 1) * KiB)
                y.cos().sum().backward()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with memviz.track(autograd=True, graph=False) as t:
            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            snap = t.snapshot()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    allocs = [a for a in snap if a.size <= 4 * KiB]
    assert len(allocs) == 100
    for a in allocs:
        assert a.autograd_node == f"Tagged{a.size // KiB - 1}Backward", a


def test_layout_that_does_not_check_out_falls_back_to_hooks(ops, monkeypatch):
    _callback_mode(ops)
    from memviz.torch import probe

    real = memviz._core.nodes_inspect

    def wrong_class(addr, n):
        got = real(addr, n)
        return None if got is None else ("SomethingElse", got[1])

    monkeypatch.setattr(probe, "_NODE_LAYOUT", None)
    monkeypatch.setattr(probe._core, "nodes_inspect", wrong_class)
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        assert not t.torch._nodes_attached
        NoSave.apply(AllocInForward.apply(x)).sum().backward()
    assert probe._NODE_LAYOUT is False
    assert memviz._core.nodes_current() is None
    by_size = {a.size: a for a in t.snapshot()}
    assert by_size[48 * KiB].autograd_node == "AllocInForwardBackward"  # from the pre-hooks
    assert by_size[48 * KiB].forward == f"{THIS}:{_line_of('# FORWARD OUTPUT')}"


def test_backward_allocations_carry_node_and_forward_line(ops):
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True) as t:
        y = Scale.apply(x); fwd = here()  # noqa: E702
        NoSave.apply(y).sum().backward()
        ops.alloc(CBID_cuMemAlloc_v2, 8 * KiB)  # after backward: no node
    by_size = {a.size: a for a in t.snapshot()}
    a = by_size[64 * KiB]
    assert a.autograd_node == "ScaleBackward"
    # The unpack hook names the line where forward saved the tensor (inside Scale.forward
    # is library-free test code, so the user's line is the save line).
    assert a.forward in (f"{THIS}:{_line_of('# SAVED')}", f"{THIS}:{fwd}")
    b = by_size[32 * KiB]
    assert b.autograd_node == "NoSaveBackward" and b.forward is None
    assert by_size[8 * KiB].autograd_node is None
    stats = {s.key: s.size for s in t.snapshot().statistics("autograd_node")}
    assert stats["<not in backward>"] == 8 * KiB
    assert any(k.startswith("ScaleBackward") for k in stats)


def test_forward_line_from_node_numbers_without_saved_tensor_hooks(ops):
    """Precise mode's default: node pre-hooks only; the forward line comes from
    the line that allocated right after autograd numbered the node."""
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        assert t.torch._seq_attached, "this torch should export at::sequence_number::peek"
        assert not t.torch.graph.running and getattr(t, "graph", None) is None
        y = AllocInForward.apply(x)
        z = NoSave.apply(y)
        z.sum().backward()
    by_size = {a.size: a for a in t.snapshot()}
    assert by_size[16 * KiB].autograd_node is None  # forward
    a = by_size[48 * KiB]
    assert a.autograd_node == "AllocInForwardBackward"
    assert a.forward == f"{THIS}:{_line_of('# FORWARD OUTPUT')}"
    b = by_size[32 * KiB]  # NoSave's forward allocated nothing: no line to name
    assert b.autograd_node == "NoSaveBackward" and b.forward is None


class FailInBackward(torch.autograd.Function):
    """Allocates in forward; its backward's allocation fails (out of memory)."""

    fake = None

    @staticmethod
    def forward(ctx, x):
        FailInBackward.fake.alloc(CBID_cuMemAlloc_v2, 24 * KiB)  # FAILING NODE'S FORWARD
        return x * 5

    @staticmethod
    def backward(ctx, g):
        FailInBackward.fake.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY)
        return g * 5


def test_forward_lines_while_the_forward_allocations_still_wait_in_the_queue(ops):
    """The capture path queues a backward allocation with its node's class
    and number; the store adds the forward line as it applies the queue, from
    the forward allocation's note applied before it. With the drainer paused
    the forward allocations are still queued when backward allocates: the
    line is the same. A failure inside a node is read at once, line included."""
    _callback_mode(ops)
    FailInBackward.fake = ops
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        memviz._core._drainer(False)
        try:
            y = AllocInForward.apply(x)
            z = FailInBackward.apply(NoSave.apply(y))
            z.sum().backward()
        finally:
            memviz._core._drainer(True)
        snap = t.snapshot()
        (failure,) = t.failures
    by_size = {a.size: a for a in snap}
    a = by_size[48 * KiB]
    assert a.autograd_node == "AllocInForwardBackward"
    assert a.forward == f"{THIS}:{_line_of('# FORWARD OUTPUT')}"
    assert by_size[32 * KiB].autograd_node == "NoSaveBackward" and by_size[32 * KiB].forward is None
    assert failure.size == 1 << 40 and failure.autograd_node == "FailInBackwardBackward"
    assert failure.forward == f"{THIS}:{_line_of('# FAILING NODE' + chr(39) + 'S FORWARD')}", failure


def _peek():
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    peek = lib._ZN2at15sequence_number4peekEv
    peek.restype, peek.argtypes = ctypes.c_uint64, []
    return peek


def test_the_node_counter_is_read_in_place_and_a_place_that_disagrees_is_not_used(ops):
    """The capture path reads PyTorch's node counter in libtorch's TLS block
    (src/nodes.h: mvz_nodes_counter) rather than calling peek() per
    allocation; the place is found once and checked against peek() at every
    attach. A place that disagrees leaves peek() attached."""
    _callback_mode(ops)
    from memviz.torch import probe

    peek = _peek()
    with memviz.track(autograd=True) as t:
        assert t.torch._seq_attached
        assert probe._COUNTER_PLACE, "libtorch_cpu's node counter should be found in its TLS block"
        x = torch.zeros(1, requires_grad=True)
        for _ in range(3):
            assert memviz._core.seqmap_counter() == peek()
            x * 2
    modid, offset = probe._COUNTER_PLACE
    probe._COUNTER_PLACE = (modid, offset + 8)  # another slot: the C side refuses to move
    try:
        with memviz.track(autograd=True) as t:
            assert t.torch._seq_attached  # through peek()
            for _ in range(3):
                assert memviz._core.seqmap_counter() == peek()
                x * 2
    finally:
        probe._COUNTER_PLACE = (modid, offset)


def test_backward_allocations_are_not_taken_for_forward_lines(ops):
    """CPU backward runs on the caller's thread, where the node counter still
    stands just past the last forward node: allocations made inside backward
    nodes must not become that node's forward line (second backward shows it)."""
    x = torch.randn(16, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        y = AllocInForward.apply(x)
        z = NoSave.apply(y)  # the last node made in forward; allocates only in backward
        for _ in range(2):
            z.backward(torch.ones_like(z), retain_graph=True)
        snap = t.snapshot()
    nosave = [a for a in snap if a.autograd_node == "NoSaveBackward"]
    assert len(nosave) == 2 and all(a.forward is None for a in nosave), nosave
    fwd = f"{THIS}:{_line_of('# FORWARD OUTPUT')}"
    assert [a.forward for a in snap if a.autograd_node == "AllocInForwardBackward"] == [fwd, fwd]


def test_node_numbers_attach_when_tracking_starts_under_no_grad(ops):
    with torch.no_grad():
        t = memviz.track(autograd=True, graph=False).start()
    try:
        assert t.torch._seq_attached
    finally:
        t.stop()


def test_walks_on_two_threads_leave_register_hook_as_it_was(ops):
    import threading

    Function = torch.autograd.Function
    original = Function._register_hook
    errors = []

    def work():
        try:
            for _ in range(20):
                x = torch.randn(8, requires_grad=True)
                y = x
                for _ in range(30):
                    y = y * 1.01
                y.sum().backward()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the walks interleave
    try:
        with memviz.track(autograd=True, graph=False):
            threads = [threading.Thread(target=work) for _ in range(3)]
            for th in threads:
                th.start()
            work()
            for th in threads:
                th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert Function._register_hook is original and "_register_hook" not in Function.__dict__


def test_node_numbers_detach_when_tracking_stops(ops):
    from memviz import _core

    with memviz.track(autograd=True, graph=False):
        AllocInForward.apply(torch.randn(4, requires_grad=True))
    # Detached: a lookup finds nothing, and allocations note nothing.
    assert _core.seqmap_lookup([0, 1, 2, 2**64 - 1]) == [0, 0, 0, 0]


def test_activations_categorised_from_the_graph_itself(ops):
    """Without saved-tensor hooks (graph=False), what a live graph keeps is read
    from its nodes when the snapshot is categorised."""
    a = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        held = (a @ w).sum()  # MmBackward0 keeps `a` for w's gradient
        s = a.untyped_storage()
        ops.alloc_at(s.data_ptr(), s.nbytes())
        cats = {s.key: s.size for s in t.snapshot().statistics("category")}
    assert cats == {"activation": 64 * 64 * 4}
    assert held.grad_fn is not None


def test_categorising_never_runs_unpack_hooks(ops):
    """Reading what a graph keeps must not unpack it: that would run the
    user's hooks, or re-run a checkpointed forward."""
    from torch.utils.checkpoint import checkpoint

    runs, unpacked = [], []
    w = torch.randn(32, 32, requires_grad=True)

    def block(x):
        runs.append(1)
        return (x @ w).sin()

    with memviz.track(autograd=True, graph=False) as t:
        ckpt = checkpoint(block, torch.randn(4, 32), use_reentrant=False).sum()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: unpacked.append(1) or x):
            hooked = (torch.randn(4, 32) @ w).sum()
        t.snapshot()
    assert runs == [1] and unpacked == []
    assert ckpt.grad_fn is not None and hooked.grad_fn is not None


def test_autograd_grad_and_double_backward(ops):
    x = torch.randn(8, requires_grad=True)
    with memviz.track(autograd=True) as t:
        y = Scale.apply(x).pow(2).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
    nodes = [a.autograd_node for a in t.snapshot()]
    assert nodes.count("ScaleBackward") >= 1
    assert all(n is not None for n in nodes)


def test_checkpoint_recomputation_is_marked(ops):
    from torch.utils.checkpoint import checkpoint

    def block(x):
        ops.alloc(CBID_cuMemAlloc_v2, 16 * KiB)  # FORWARD ALLOC
        return Scale.apply(x).sin()

    x = torch.randn(8, requires_grad=True)
    with memviz.track(autograd=True) as t:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    allocs = [a for a in t.snapshot() if a.size == 16 * KiB]
    assert len(allocs) == 2  # forward, then the recomputation during backward
    first, second = sorted(allocs, key=lambda a: a.seq)
    assert first.autograd_node is None
    assert second.autograd_node and second.autograd_node.endswith("(recomputation)")
    assert second.forward == f"{THIS}:{_line_of('# FORWARD ALLOC')}"


def test_reentrant_checkpoint_backward_is_not_called_recomputation(ops):
    """checkpoint(use_reentrant=True) re-runs the forward, then runs a backward
    of its own from inside checkpoint.py: what that backward allocates is
    gradient work under its own node and forward line, not recomputation."""
    from torch.utils.checkpoint import checkpoint

    def block(x):
        ops.alloc(CBID_cuMemAlloc_v2, 16 * KiB)  # REENTRANT FORWARD ALLOC
        return Scale.apply(x).sin()  # REENTRANT SCALE

    x = torch.randn(8, requires_grad=True)
    with memviz.track(autograd=True) as t:
        checkpoint(block, x, use_reentrant=True).sum().backward()
    snap = list(t.snapshot())
    fwd = sorted((a for a in snap if a.size == 16 * KiB), key=lambda a: a.seq)
    assert len(fwd) == 2  # forward, then the recomputation during backward
    assert fwd[1].autograd_node and fwd[1].autograd_node.endswith("(recomputation)")
    assert fwd[1].forward == f"{THIS}:{_line_of('# REENTRANT FORWARD ALLOC')}"
    (grad,) = [a for a in snap if a.size == 64 * KiB]  # Scale.backward, in the inner backward
    assert grad.autograd_node == "ScaleBackward", grad.autograd_node
    assert grad.forward == f"{THIS}:{_line_of('# REENTRANT SCALE')}", grad.forward


def test_hooks_are_removed_when_tracking_stops(ops):
    import torch.autograd.graph as agraph

    before = agraph._engine_run_backward
    with memviz.track(autograd=True) as t:
        assert agraph._engine_run_backward is not before
    assert agraph._engine_run_backward is before
    seq = t.graph.mark()
    x = torch.randn(4, requires_grad=True)
    (x * x).sum().backward()
    assert t.graph.mark() == seq  # the pack hook no longer runs
    assert memviz._core.label_get() == 0


def test_node_hooks_leave_pytorch_hook_machinery_as_it_was(ops):
    """The walk's fast registration: torch's own _register_hook is back after
    it, hooks the user adds later to the same nodes run and can be removed,
    and memviz's hooks go inert when tracking stops (retained graph)."""
    Function = torch.autograd.Function
    original = Function._register_hook
    x = torch.randn(8, requires_grad=True)
    ran = []
    with memviz.track(autograd=True, graph=False):
        y = (x * 2).sin().sum()
        y.backward(retain_graph=True)  # memviz hooks every node of y's graph
        assert Function._register_hook is original and "_register_hook" not in Function.__dict__
        node = y.grad_fn.next_functions[0][0]  # SinBackward0, already hooked by memviz
        handle = node.register_prehook(lambda g: ran.append("user"))
        y.backward(retain_graph=True)
        assert ran == ["user"]
        handle.remove()
        label = memviz._core.label_get()
    y.backward(retain_graph=True)  # after stop: memviz's hooks stay on the graph but do nothing
    assert ran == ["user"]
    assert memviz._core.label_get() == label


def test_a_retained_graph_run_again_keeps_one_memviz_hook_per_node(ops, monkeypatch):
    """The hooks route: each backward walks the graph and hooks its nodes; a
    node hooked before (retain_graph=True, run again) has its hook replaced,
    not one more added (each run added one: a training loop's retained graph
    ran every hook of every earlier backward)."""
    if ops.labels != "hooks":
        pytest.skip("about the pre-hooks route")
    calls = []
    real = memviz._core.label_set
    monkeypatch.setattr(memviz._core, "label_set", lambda lid: calls.append(lid) or real(lid))
    x = torch.randn(8, requires_grad=True)
    users = []
    with memviz.track(autograd=True, graph=False):
        y = (x * 2).sin().cos().sum()
        user_node = y.grad_fn.next_functions[0][0]
        user_node.register_prehook(lambda g: users.append(1))  # the user's first: a dict not memviz's
        per_run = []
        for _ in range(5):
            del calls[:]
            y.backward(retain_graph=True)
            per_run.append(len(calls))
    assert per_run[0] > 0 and per_run == [per_run[0]] * 5, per_run
    assert users == [1] * 5


def test_categories_of_a_small_model_match_model_states(ops):
    """fp32 Adam: parameters = gradients = 4P bytes, optimizer state = 8P bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    with memviz.track(autograd=True) as t:
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        # Tell the double that each tensor's storage is a device allocation.
        P = sum(p.numel() for p in model.parameters())
        for p in model.parameters():
            for tensor in (p, p.grad, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
                s = tensor.untyped_storage()
                ops.alloc_at(s.data_ptr(), s.nbytes())
        held = model(torch.randn(4, 32)).relu().sum()  # a graph kept alive: activations
        for rec in t.graph.resident():
            ops.alloc_at(rec.data_ptr, rec.nbytes)
        ops.alloc(CBID_cuMemAlloc_v2, 4096)  # some other library
        snap = t.snapshot()
    cats = {s.key: s.size for s in snap.statistics("category")}
    assert cats["parameter"] == 4 * P
    assert cats["gradient"] == 4 * P
    assert cats["optimizer_state"] == 8 * P
    assert cats["activation"] > 0
    assert cats["outside_pytorch"] == 4096
    # Categories combine with lines: activations by line.
    act = snap.filter(lambda a: a.category == "activation").statistics("lineno")
    assert act and act[0].key.filename == THIS
    assert held.grad_fn is not None


def test_graph_residency_on_cpu(ops):
    x = torch.randn(256, 256, requires_grad=True)
    with memviz.track(autograd=True) as t:
        y = (x @ x).relu(); line = here()  # noqa: E702
        res = t.snapshot().graph_resident()
        assert res and all(r.line.lineno == line for r in res)
        assert sum(r.nbytes for r in res) >= 2 * 256 * 256 * 4
        y.sum().backward()
        del y
        assert t.snapshot().graph_resident() == []


def test_precise_mode_configuration(monkeypatch):
    assert precise.merged_conf("") == "backend:cudaMallocAsync"
    assert precise.merged_conf("expandable_segments:True,backend:native") == \
        "backend:cudaMallocAsync,expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    with pytest.raises(memviz.MemvizError, match="before `import torch`"):
        memviz.track(precise=True, gpu=False).start()
    assert memviz.active_tracker() is None
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert precise.enable() == "already active"

    def no_cuda():
        raise RuntimeError("no CUDA in this build")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", no_cuda)
    assert precise.enable().startswith("PYTORCH_CUDA_ALLOC_CONF=")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync,max_split_size_mb:128"


def test_oom_report_from_a_failed_driver_call(ops):
    with memviz.track(autograd=True) as t:
        ops.alloc(CBID_cuMemAlloc_v2, 1 << 20)
        ops.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY); line = here()  # noqa: E702
    r = t.oom_report
    assert r is not None and r.requested == 1 << 40 and r.line == f"{THIS}:{line}"
    assert r.by_line and r.by_line[0][1] == 1 << 20
    assert "Out of memory on cuda:0: 1 TiB requested" in str(r)
    if sys.version_info >= (3, 11):  # the double's helper made the failing call
        assert r.call == "self._c.fake_alloc" and f":{line} by self._c.fake_alloc (" in str(r), str(r)


def test_integration_installs_when_torch_is_imported_later():
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import memviz\n"
        "t = memviz.start(gpu=False, autograd=True)\n"
        "assert 'torch' not in sys.modules\n"
        "import torch, torch.autograd.graph as g\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "(x * x).sum()\n"
        "print(t.graph.running, g._engine_run_backward.__module__, len(t.graph.resident()))\n"
        "t.stop()\n" % os.path.dirname(os.path.dirname(os.path.dirname(THIS))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    running, module, resident = p.stdout.split()
    assert running == "True" and module == "memviz.torch.integration"


def test_default_tracking_installs_no_autograd_hooks(ops):
    import torch.autograd.graph as agraph

    before = agraph._engine_run_backward
    with memviz.track() as t:
        # only the counter of running backward passes (hooks.BACKWARD): no per-node hooks
        assert agraph._engine_run_backward.__module__ == "memviz.torch.integration"
        x = torch.randn(4, requires_grad=True)
        y = x * x
        (x * x).sum().backward()
        assert t.torch._node_hooks == {}
    assert agraph._engine_run_backward is before
    assert getattr(t, "graph", None) is None
    with pytest.raises(memviz.GraphNotRecorded, match=r"memviz.track\(graph=True\)"):
        t.snapshot().graph_resident()
    assert y.grad_fn is not None


class FwdAlloc(torch.autograd.Function):
    """Allocates through the double in forward (as an op's output would)."""

    fake = None

    @staticmethod
    def forward(ctx, x):
        FwdAlloc.fake.alloc(CBID_cuMemAlloc_v2, 24 * KiB)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        FwdAlloc.fake.alloc(CBID_cuMemAlloc_v2, 40 * KiB)
        return g


def test_allocations_name_their_call_beside_the_autograd_node(ops):
    """Allocation.op names what the innermost Python frame was calling (here
    the double's helper calls its native fake_alloc), in forward and in a
    Python backward alike; the node label stays; a thread with no Python
    frames has no call to name."""
    FwdAlloc.fake = ops
    x = torch.randn(4, requires_grad=True)
    with memviz.track(autograd=True, graph=False) as t:
        FwdAlloc.apply(x).sum().backward()
        ops.alloc_in_native_thread(CBID_cuMemAlloc_v2, 8 * KiB)
        snap = t.snapshot()
    by_size = {a.size: a for a in snap}
    call = "self._c.fake_alloc" if sys.version_info >= (3, 11) else None  # 3.10 has no column positions
    assert by_size[24 * KiB].op == call and by_size[24 * KiB].autograd_node is None
    assert by_size[40 * KiB].op == call and by_size[40 * KiB].autograd_node == "FwdAllocBackward"
    assert by_size[8 * KiB].op is None and not by_size[8 * KiB].traceback



SNAPSHOT_WHILE_ANOTHER_THREAD_TRAINS = """
import sys, threading, time
sys.path.insert(0, %r)
import torch, memviz
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
opt = torch.optim.AdamW(model.parameters())
stop, steps = threading.Event(), [0]
def train():
    while not stop.is_set():
        model(torch.randn(32, 64)).sum().backward()
        opt.step(); opt.zero_grad(set_to_none=True); steps[0] += 1
with memviz.track(gpu=False) as t:
    model(torch.randn(32, 64)).sum().backward()   # this thread trains: it may read its own gradients
    t.snapshot(); mine = t.torch.categories_partial
    th = threading.Thread(target=train); th.start()
    t0, n = time.time(), 0
    # 4 s, at least 20 training steps and 11 snapshots (a loaded machine may give fewer in 4 s).
    # A back-to-back snapshot loop holds the GIL nearly all the time and starved the trainer
    # (17 steps in 60 s on CI): a pause between snapshots lets both threads run, as in real use.
    try:  # a snapshot that raises must not leave the trainer running (the process would never exit)
        while (time.time() - t0 < 4 or steps[0] < 20 or n <= 10) and time.time() - t0 < 100:
            t.snapshot(); n += 1
            time.sleep(0.002)
    finally:
        stop.set(); th.join()
    other = t.torch.categories_partial
print("RESULT", mine, other, n, steps[0])
"""

SNAPSHOT_WHILE_OPTIMIZERS_TAKE_FIRST_STEPS = """
import sys, threading
sys.path.insert(0, %r)
sys.setswitchinterval(1e-6)  # hand the GIL over as often as the interpreter can
import torch, memviz
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(30)])
# each optimizer's first step() fills its state, a dict the snapshots read
opts = [torch.optim.AdamW(model.parameters()) for _ in range(%d)]
stop = threading.Event()
def train():
    for opt in opts:
        if stop.is_set():
            break
        model(torch.randn(4, 16)).sum().backward()
        opt.step(); opt.zero_grad(set_to_none=True)
with memviz.track(gpu=False) as t:
    th = threading.Thread(target=train); th.start()
    n = 0
    try:
        while th.is_alive():
            t.snapshot(); n += 1
    finally:
        stop.set(); th.join()
print("RESULT", n, t.torch.categories_partial)
"""


def test_snapshots_while_another_thread_trains_never_touch_its_gradients():
    """Reading p.grad while another thread runs backward or the optimizer
    crashed the process inside PyTorch (a segfault, seen on the H200 and
    here): such snapshots leave gradients and saved tensors unread, and say
    so (categories_partial); the training thread's own snapshots read them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SNAPSHOT_WHILE_ANOTHER_THREAD_TRAINS % root],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    _, mine, other, n, steps = p.stdout.split()[-5:]
    assert (mine, other) == ("False", "True") and int(n) > 10 and int(steps) >= 20, p.stdout


def test_snapshots_while_another_thread_fills_an_optimizers_state_do_not_raise():
    """A snapshot read opt.state with a Python loop while the training
    thread's first optimizer step added to it: "dictionary changed size
    during iteration" (CI, stop 47; three runs in three here with the GIL
    handed over often), and the test's trainer then kept the process alive.
    The state is now copied in C (memviz.torch.hooks.listed)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                        SNAPSHOT_WHILE_OPTIMIZERS_TAKE_FIRST_STEPS % (root, 120)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    _, n, partial = p.stdout.split()[-3:]
    assert int(n) > 10 and partial == "True", p.stdout


TUPLES_WHILE_ANOTHER_THREAD_LOOKS = """
import sys, threading, time
sys.path.insert(0, %r)
sys.setswitchinterval(1e-6)
import torch, memviz
from memviz.torch.graph import holders
leaked = torch.ones(3, requires_grad=True) * 2
history = [leaked]
stop, n = threading.Event(), [0, 0]
def look(t):
    while not stop.is_set():
        t.snapshot(); n[0] += 1                                   # the heap pass
        assert any("history" in h.description for h in holders(leaked)); n[1] += 1   # the referrers
with memviz.track(gpu=False) as t:
    th = threading.Thread(target=look, args=(t,)); th.start()
    t0 = time.time()
    try:
        while time.time() - t0 < 60 and min(n) < 25 and th.is_alive():
            tuple(leaked for _ in range(30))   # suspended in the generator, mid-build
    finally:
        stop.set(); th.join()
print("RESULT", *n)
"""


def test_snapshots_and_holders_on_one_thread_leave_another_threads_tuples_alone():
    """A snapshot (its heap pass) or a leak's holder search on one thread
    held gc.get_objects()' or gc.get_referrers()' list while another thread
    ran, and that thread's tuple() of a generator then failed: "SystemError:
    bad argument to internal function", in the user's code. Both lists are
    now read in C (src/module_heap.c)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", TUPLES_WHILE_ANOTHER_THREAD_LOOKS % root],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    _, snaps, looks = p.stdout.split()[-3:]
    assert int(snaps) >= 25 and int(looks) >= 24, p.stdout


def test_listed_copies_a_changing_dict_or_gives_up_and_says_so():
    from memviz.torch.hooks import listed

    d = {i: i for i in range(5)}
    assert listed(d.items()) == list(d.items())

    class Changing:
        """A view whose every copy finds the container changed."""
        tries = 0

        def __iter__(self):
            Changing.tries += 1
            raise RuntimeError("dictionary changed size during iteration")

    assert listed(Changing(), tries=3) is None and Changing.tries == 3


def test_library_outside_pytorch_is_the_innermost_one_on_the_stack():
    """A JAX call made from inside a CuPy helper is JAX's memory: the innermost
    library of the (oldest-first) traceback names it."""
    from memviz.torch import categories

    tb = memviz.Traceback([memviz.Frame("/env/site-packages/cupy/_core.py", 1, "helper"),
                           memviz.Frame("/env/site-packages/jax/_src/array.py", 2, "put")])
    a = memviz.Allocation(1, 1, 0, "device", 0, memviz.ThreadInfo(1, 1, "main"), None, 0, tb)
    assert categories._library_of(a) == "JAX"


def test_trackers_starting_and_stopping_leave_pytorchs_optimizer_hooks_alone():
    """Each tracker registered an optimizer pre-hook at start and removed it
    at stop: PyTorch's dict of global pre-hooks changed while another
    thread's step() looped over it ("OrderedDict mutated during iteration"
    in that thread's opt.step(); three threads with trackers of their own,
    six runs in six). One hook now serves every tracker and stays. Here a
    user's own pre-hook runs inside that loop and starts and stops a
    tracker there, which raised on the same thread every time."""
    import torch
    from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

    with memviz.track(gpu=False):  # the process's first tracker registers the one hook
        pass
    before = list(_global_optimizer_pre_hooks)

    def mine(opt, args, kwargs):
        with memviz.track(gpu=False) as t:
            seen.append(t)

    seen = []
    handle = register_optimizer_step_pre_hook(mine)
    # a hook after it: the loop reads on after `mine` (past the last one it would not look)
    after = register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)
    try:
        m = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.step()
    finally:
        handle.remove()
        after.remove()
    assert len(seen) == 2 and list(_global_optimizer_pre_hooks) == before
    # the hook still tells a running tracker of the optimizers that step
    with memviz.track(gpu=False) as t:
        opt.step()
        assert opt in set(t.torch._optimizers)
    assert not seen[0].running


@pytest.mark.parametrize("opts", [{"graph": True}, {"autograd": True}])
def test_a_tracker_stopped_on_another_thread_leaves_that_threads_saved_tensor_hooks(opts):
    """PyTorch keeps saved-tensor hooks per thread. A graph-recording tracker
    started on one thread and stopped on another popped the stopping
    thread's hooks: none there raised PyTorch's internal assert from stop(),
    and a user's own hooks were taken (their pack hook stopped running, their
    block then failed on exit). The hooks now stay on the starting thread
    and pass tensors through."""
    import threading

    held = {}
    th = threading.Thread(target=lambda: held.setdefault("t", memviz.track(gpu=False, **opts).start()))
    th.start()
    th.join()
    held["t"].stop()  # no hooks of this thread's own: nothing popped here
    assert not held["t"].running

    th = threading.Thread(target=lambda: held.__setitem__("t", memviz.track(gpu=False, **opts).start()))
    th.start()
    th.join()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: (packed.append(1), x)[1], lambda x: x):
        held["t"].stop()
        a = torch.ones(3, requires_grad=True)
        (a * a).sum().backward()
    assert len(packed) == 2 and torch.equal(a.grad, 2 * a.detach())


TORCH_IMPORTED_LATER = """
import sys
sys.path.insert(0, %r)
import memviz
with memviz.track(gpu=False):        # stopped before torch comes: hears nothing of it
    pass
with memviz.track(gpu=False, graph=True) as t:
    import torch                     # the watcher installs this tracker's integration now
    a = torch.ones(3, requires_grad=True)
    b = (a * a).sum()
    saved = len(t.snapshot().graph_resident())
    patched = torch.autograd.graph._engine_run_backward.__module__
after = torch.autograd.graph._engine_run_backward.__module__
watchers = [f for f in sys.meta_path if type(f).__name__ == "PostImport"]
print("RESULT", saved, patched, after, len(watchers))
"""


def test_torch_imported_after_tracking_starts_is_hooked_by_one_watcher_that_stays():
    """Tracking started before `import torch` (python -m memviz run) hooks
    in when torch is imported, through one import watcher for the process.
    It stays in sys.meta_path (inert once torch is in): removing it while
    another thread's import looped over sys.meta_path would skip the next
    finder. A tracker that stopped before the import hears nothing of it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    p = subprocess.run([sys.executable, "-c", TORCH_IMPORTED_LATER % root],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    _, saved, patched, after, watchers = p.stdout.split()[-5:]
    assert int(saved) >= 1 and patched.startswith("memviz") and not after.startswith("memviz"), p.stdout
    assert watchers == "1", p.stdout


@pytest.mark.parametrize("opts", [{"graph": True}, {"autograd": True}])
def test_a_saved_tensor_changed_in_place_raises_as_without_memviz(opts):
    """PyTorch leaves its in-place check out for every tensor a saved-tensor
    hook packed: under memviz's hooks, a saved tensor changed in place gave
    wrong gradients without a word, where PyTorch alone raises. memviz's
    unpack hook makes the check."""
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    with memviz.track(gpu=False, **opts):
        a = x * 2
        b = a.sin()
        a.mul_(2)  # marker: changed in place
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            b.sum().backward()
        assert "expected version 0" in str(e.value) and "test_torch_cpu.py" in str(e.value)
        a = x * 2
        a.sin().sum().backward()  # unchanged: the gradient PyTorch gives alone
    assert torch.allclose(x.grad, 2 * torch.cos(2 * x.detach()))


def test_stopping_inside_the_users_own_saved_tensor_hooks_leaves_them_working():
    """stop() popped the innermost saved-tensor hooks, which were the user's
    (save_on_cpu, say) pushed after memviz's: their pack hook stopped
    running. memviz's go inert where they are not innermost, and come off at
    the next start on that thread once they are."""
    calls = []
    t = memviz.track(gpu=False, autograd=True).start()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: (calls.append(1), x)[1], lambda x: x):
        t.stop()
        a = torch.ones(3, requires_grad=True)
        (a * a).sum().backward()
    assert len(calls) == 2
    top = torch._C._autograd._top_saved_tensors_default_hooks
    assert top(False) is not None  # memviz's, inert, were below the user's
    with memviz.track(gpu=False):
        pass
    assert top(False) is None
    x = torch.ones(2, requires_grad=True)
    assert torch.equal(torch.func.grad(lambda v: (v * v).sum())(x), 2 * x.detach())


def test_a_tracker_started_where_saved_tensor_hooks_are_off_tracks_without_graphs():
    """Started under disable_saved_tensors_hooks (as a torch.func transform
    runs), the graph hooks raised the user's own message out of track(),
    and the half-done start left PyTorch's backward entry patched for the
    rest of the process. Now the tracker runs without graph recording and
    says why."""
    import torch.autograd.graph as agraph

    original = agraph._engine_run_backward
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.warns(memviz.CaptureWarning, match="graph recording .* is off"):
            with memviz.track(gpu=False, autograd=True) as t:
                assert t.running
    assert agraph._engine_run_backward is original


def test_a_failed_start_of_the_pytorch_integration_undoes_what_it_put_in(monkeypatch):
    import torch.autograd.graph as agraph
    from memviz.torch import integration

    original = agraph._engine_run_backward

    def boom(self):
        raise RuntimeError("a part of the start failed")
    monkeypatch.setattr(integration.TorchIntegration, "_patch_profiler", boom)
    with pytest.raises(RuntimeError, match="a part of the start failed"):
        memviz.track(gpu=False, autograd=True).start()
    assert agraph._engine_run_backward is original and memviz.active_tracker() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    monkeypatch.undo()
    with memviz.track(gpu=False, autograd=True):
        assert agraph._engine_run_backward is not original
    assert agraph._engine_run_backward is original
