"""Categories of distributed training's memory (memviz/torch/categories.py):
NCCL's and the collectives' buffers (``pytorch/nccl``, ``outside_pytorch/nccl``),
and FSDP's parameter and gradient shards, on CPU.

The rules read an allocation's innermost Python frame, the call it was
making and its thread; the first tests hand them allocations with the stacks
distributed training gives them (the files are torch's own, as they appear
under site-packages), the others run real torch.distributed (gloo, one
process) and FSDP2 with the test double firing the "driver" events.
"""

import textwrap

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch category tests need torch (pip install torch)")
dist = pytest.importorskip("torch.distributed", reason="needs torch.distributed")

import memviz  # noqa: E402
from fake_cupti import CBID_cuMemAlloc_v2  # noqa: E402
from memviz.torch import categories  # noqa: E402

SITE = "/env/lib/python3.11/site-packages/"
USER = memviz.Frame("/work/train.py", 12, "train_step")


def _frame(rel, line=1, name="f"):
    return memviz.Frame(SITE + rel, line, name)


def _alloc(frames, kind="block", op=None, thread="MainThread", address=0x7000):
    tb = memviz.Traceback(frames)  # oldest first
    return memviz.Allocation(address, 4096, 0, kind, 0, memviz.ThreadInfo(1, 1, thread), None, 0, tb,
                             op=op)


def _cat(a, cats=None, live=(), segments=None, current=None):
    return categories._category(a, cats or {}, set(live), segments or {}, False, current)


C10D = _frame("torch/distributed/distributed_c10d.py", 2800, "all_reduce")


def test_a_block_a_collective_makes_is_pytorch_nccl():
    a = _alloc([USER, C10D])
    assert _cat(a) == "pytorch/nccl"
    # Reached from Python (the collective's output in a list): still the collective's.
    assert _cat(a, live={a.address}) == "pytorch/nccl"


def test_a_driver_call_inside_a_collective_is_outside_pytorch_nccl():
    """NCCL's own buffers: a cuMemAlloc made inside c10d, not in PyTorch's pool."""
    a = _alloc([USER, C10D], kind="device")
    assert _cat(a) == "outside_pytorch/nccl"
    # Inside one of PyTorch's segments, it is PyTorch's pool (the segment a collective asked for).
    assert _cat(a, segments={0: [(a.address, 1 << 20)]}) == "pytorch_pool"


def test_wrappers_between_the_collective_and_the_allocation_are_looked_through():
    a = _alloc([USER, _frame("torch/distributed/_functional_collectives.py", 200, "all_gather_tensor"),
                _frame("torch/_ops.py", 800, "__call__")])
    assert _cat(a) == "pytorch/nccl"
    fsdp = _alloc([USER, _frame("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 300,
                                "foreach_all_gather")])
    assert _cat(fsdp) == "pytorch/nccl"


@pytest.mark.parametrize("op", [".allreduce", "self.process_group.allgather", "dist.Reducer",
                                "self.reducer._rebuild_buckets",
                                "torch.distributed._broadcast_coalesced",
                                "torch.ops._c10d_functional.all_gather_into_tensor"])
def test_a_line_calling_c10d_itself_names_the_collective(op):
    """A process group's method or DDP's Reducer called from a line: no frame
    of torch.distributed is innermost, the call says it."""
    assert _cat(_alloc([USER], op=op)) == "pytorch/nccl"
    assert _cat(_alloc([USER], kind="device", op=op)) == "outside_pytorch/nccl"


@pytest.mark.parametrize("op", [".gather", "torch.scatter", "x.broadcast_to", "functools.reduce"])
def test_ops_that_only_share_a_name_with_a_collective_are_not_nccl(op):
    assert "nccl" not in _cat(_alloc([USER], op=op))


@pytest.mark.parametrize("thread", ["pt_nccl_watchdg", "pt_nccl_heartbt", "NCCL Service  0"])
def test_a_thread_of_nccl_without_python_frames(thread):
    assert _cat(_alloc([], kind="device", thread=thread)) == "outside_pytorch/nccl"
    assert _cat(_alloc([], kind="device", thread="pt_autograd_0")) == "outside_pytorch"


def test_activations_inside_fsdp1_or_ddp_forward_are_not_collective_memory():
    """FSDP1 and DDP run the module's forward inside their own frames; what
    the model allocates there is the model's (the innermost frame is)."""
    wrapped = [_frame("torch/nn/parallel/distributed.py", 1600, "forward"),
               _frame("torch/distributed/fsdp/fully_sharded_data_parallel.py", 850, "forward"),
               memviz.Frame("/work/model.py", 30, "forward")]
    a = _alloc(wrapped, op="torch.relu")
    assert _cat(a) == "other_pytorch"  # a block no snapshot rule names (not NCCL)
    assert _cat(a, current=set()) == "temporary"
    dtensor_op = _alloc([USER, _frame("torch/distributed/tensor/_dispatch.py", 150, "dispatch")])
    assert "nccl" not in _cat(dtensor_op)


def test_parameters_and_gradients_win_over_the_frame_that_made_them():
    """A parameter FSDP made inside torch.distributed is a parameter."""
    a = _alloc([USER, _frame("torch/distributed/fsdp/_flat_param.py", 600, "flatten_tensors")],
               kind="device")
    assert _cat(a, cats={a.address: "parameter"}) == "parameter"
    b = _alloc([USER, C10D])
    assert _cat(b, cats={b.address: "gradient"}) == "gradient"


def test_fsdp_unsharded_parameters_are_parameters_even_once_freed():
    """At a past peak, the unsharded parameters FSDP allocated before a layer
    ran are freed again (no tensor names them any more): their frame does."""
    fsdp2 = _alloc([USER, _frame("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", 825,
                                 "alloc_all_gather_outputs"),
                    _frame("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", 1069, "alloc_storage")])
    fsdp1 = _alloc([USER, _frame("torch/distributed/fsdp/_flat_param.py", 1408, "alloc_unsharded_flat_param"),
                    _frame("torch/distributed/utils.py", 180, "_alloc_storage")])
    for a in (fsdp2, fsdp1):
        assert _cat(a, current=set()) == "parameter"
    # The same function name elsewhere is not FSDP's.
    other = _alloc([USER, memviz.Frame("/work/mylib/utils.py", 3, "alloc_storage")])
    assert _cat(other, current=set()) == "temporary"


# ---- through the tracker, with real torch.distributed ---------------------------


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (in-process store: no port)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mark(fake, t):
    """Tell the double that a tensor's storage is a device allocation."""
    local = getattr(t, "_local_tensor", t)
    s = local.untyped_storage()
    fake.alloc_at(s.data_ptr(), s.nbytes())
    return s.data_ptr()


def test_fsdp2_parameter_and_gradient_shards(fake, one_rank_group):
    """fully_shard's parameters and gradients are DTensors (no storage of
    their own): their local shards are parameters and gradients."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    with memviz.track() as t:
        model(torch.randn(3, 16)).sum().backward()
        params = list(model.parameters())
        assert all(type(p).__name__ == "DTensor" for p in params)
        for p in params:
            _mark(fake, p)
            _mark(fake, p.grad)
        snap = t.snapshot()
    cats = {s.key: s.size for s in snap.statistics("category")}
    def storages(tensors):  # gradient shards may share one reduce-scatter output
        return sum({t._local_tensor.untyped_storage().data_ptr(): t._local_tensor.untyped_storage().nbytes()
                    for t in tensors}.values())

    nbytes, grads = storages(params), storages(p.grad for p in params)
    assert cats.get("parameter") == nbytes and cats.get("gradient") == grads, cats


def test_collective_buffers_through_the_double(fake, fake_path, tmp_path, one_rank_group):
    """A driver call made from inside c10d's file and one from a c10d thread
    are NCCL's; an all_reduce of the group runs beside them."""
    pkg = tmp_path / "torch" / "distributed"
    pkg.mkdir(parents=True)
    (pkg / "distributed_c10d.py").write_text(textwrap.dedent(f"""
        import ctypes
        _lib = ctypes.CDLL({fake_path!r})
        _lib.fake_alloc.restype = ctypes.c_uint64
        _lib.fake_alloc.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
        def comm_init(size):
            return _lib.fake_alloc({CBID_cuMemAlloc_v2}, size, 0, 0)  # like ncclCommInitRank's buffers
    """))
    ns = {}
    code = compile((pkg / "distributed_c10d.py").read_text(), str(pkg / "distributed_c10d.py"), "exec")
    exec(code, ns)
    with memviz.track() as t:
        x = torch.ones(4)
        dist.all_reduce(x)
        ns["comm_init"](3 << 20)
        fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 1 << 20, thread_name="pt_nccl_watchdg")
        fake.alloc(CBID_cuMemAlloc_v2, 5 << 20)  # the user's own
        snap = t.snapshot()
    cats = {s.key: s.size for s in snap.statistics("category")}
    assert cats.get("outside_pytorch/nccl") == 4 << 20, cats
    assert cats.get("outside_pytorch") == 5 << 20, cats
    assert x.tolist() == [1.0] * 4


def test_fsdp1_flat_parameter_copies(fake):
    """FSDP1's FlatParameter keeps its padded unsharded data, low-precision
    shard and gradient shard as attributes beside its own data (the names
    torch/distributed/fsdp/_flat_param.py gives them)."""
    flat = torch.nn.Parameter(torch.zeros(64))
    flat._local_shard = flat.data
    flat._full_param_padded = torch.empty(128)
    flat._mp_shard = torch.empty(64, dtype=torch.float16)
    flat._saved_grad_shard = torch.empty(64)
    with memviz.track() as t:
        for x in (flat, flat._full_param_padded, flat._mp_shard, flat._saved_grad_shard):
            _mark(fake, x)
        snap = t.snapshot()
    cats = {s.key: s.size for s in snap.statistics("category")}
    assert cats == {"parameter": 64 * 4 + 128 * 4 + 64 * 2, "gradient": 64 * 4}, cats
