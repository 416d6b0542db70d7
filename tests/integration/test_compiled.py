"""torch.compile on the CPU (issue 26): Inductor's generated modules are
library code, wherever its cache folder is; an allocation made by compiled
code is attributed to the model's own line (tests/compiled_model.py) that
made the FX node, with the op, "fused with N more", the forward line for
the backward, and the generated file and kernel one level down; what is
allocated while compiling is ``compile`` and keeps the user's line, however
deep the compiler's stack.

The module compiles tests/compiled_model.py once, for real, with Inductor
on the CPU, into a temporary cache folder. The first call (the compile)
runs under a tracker with the libcupti test double, with a custom
post-grad pass that asks the "driver" for memory from inside Inductor's
compile (as its autotuning and padding benchmarks do). The generated
modules' ``empty_strided_cpu`` is then wrapped so that each buffer the
compiled forward and backward allocate is also a driver allocation, made
from the generated ``call`` itself: the C core walks the real frames.
The wrapper and the pass live in ``<frozen ...>`` pseudo-files (library
code), so what decides the line is memviz's rules, not the test's helpers.
"""

import functools
import glob
import os
import re
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch.compile's generated code needs torch (CPU build is enough)")

import memviz  # noqa: E402
from conftest import ROOT, line_of  # noqa: E402
from fake_cupti import CBID_cuMemAlloc_v2, FakeCupti, build  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.model import compiled as C  # noqa: E402
from memviz.model.frame_filter import FrameFilter, frames, is_generated  # noqa: E402
from memviz.model.lines import CompiledFrame, line_frame, location  # noqa: E402
from memviz.report.text import text_report  # noqa: E402
from memviz.torch import categories  # noqa: E402
from memviz.torch import compiled as torch_compiled  # noqa: E402

import compiled_model  # noqa: E402

MODEL = os.path.abspath(compiled_model.__file__)
PROBE = 3 << 20  # what the compile-time pass asks for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Inductor's C++ kernels and the test double: Linux")

# Helpers run from library code, as a real framework's would: their frames are not the user's.
_HELPERS = '''
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

class Probe(CustomGraphPass):
    """A post-grad pass: asks the driver for memory inside Inductor's compile."""
    def __init__(self, alloc):
        self.alloc = alloc
        self.calls = 0
    def __call__(self, graph):
        self.calls += 1
        self.alloc()
    def uuid(self):
        return "memviz-test-probe"
    def __deepcopy__(self, memo):  # Inductor copies its config; the driver call cannot be
        return self

def wrap(real, alloc, cbid):
    def empty_strided_cpu(size, stride, dtype, *args, **kwargs):
        t = real(size, stride, dtype, *args, **kwargs)
        alloc(cbid, max(t.untyped_storage().nbytes(), 1), 0, 0)
        return t
    empty_strided_cpu.memviz_wrapped = True
    return empty_strided_cpu

def rec(k, fn):
    return rec(k - 1, fn) if k > 0 else fn()
'''
_NS: dict = {}
exec(compile(_HELPERS, "<frozen memviz-test-helpers>", "exec"), _NS)


def model_line(marker: str) -> int:
    return line_of(MODEL, f"# {marker}")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiled model, its generated modules and a snapshot of its compile."""
    cache = str(tmp_path_factory.mktemp("inductor_cache"))
    old_env = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "MEMVIZ_CUPTI_LIBRARY")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    from memviz.capture import cupti as _capture

    lib = _capture.loaded()
    fake_path = build()
    if lib is not None and os.path.realpath(lib.path) != os.path.realpath(fake_path):
        pytest.skip(f"a real libcupti ({lib.path}) is already loaded in this process")
    os.environ[_capture.ENV_LIBRARY] = fake_path
    fake = FakeCupti(fake_path)
    fake.reset()
    import torch._inductor.config as iconfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = compiled_model.Model()
    fn = torch.compile(model)
    x = torch.randn(16, 32)
    probe = _NS["Probe"](functools.partial(fake.lib.fake_alloc, CBID_cuMemAlloc_v2, PROBE, 0, 0))
    old_pass = iconfig.post_grad_custom_post_pass
    iconfig.post_grad_custom_post_pass = probe
    try:
        with memviz.track(torch=False) as t:
            loss = fn(x)  # COMPILE
            loss.backward()
            compile_snap = t.snapshot()
    finally:
        iconfig.post_grad_custom_post_pass = old_pass
        fake.reset()
    from torch._inductor.codecache import PyCodeCache

    wrappers = [p for p, m in PyCodeCache.linemaps.items() if p.startswith(cache) and m]
    try:
        yield {"fn": fn, "model": model, "x": x, "cache": cache, "wrappers": wrappers,
               "compile_snap": compile_snap, "probe": probe}
    finally:
        torch._dynamo.reset()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wrap_modules(wrappers, fake):
    """Make each generated module's buffers driver allocations too."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f in wrappers and hasattr(mod, "empty_strided_cpu"):
            real = mod.empty_strided_cpu
            if getattr(real, "memviz_wrapped", False):  # already wrapped (an earlier test)
                continue
            mod.empty_strided_cpu = _NS["wrap"](real, fake.lib.fake_alloc, CBID_cuMemAlloc_v2)


# -- 1. generated code is library code ---------------------------------------


def test_generated_modules_are_library_code_whatever_the_cache_folder(compiled):
    assert len(compiled["wrappers"]) >= 2, compiled["wrappers"]  # a forward and a backward
    generated = glob.glob(os.path.join(compiled["cache"], "*", "c*.py"))
    assert generated
    flt = FrameFilter()  # the defaults, as a fresh process has them
    for path in generated:
        assert is_generated(path), path
        assert flt.is_library(path) and frames.is_library(path), path
        # the same module anywhere: a per-user tmp folder, another cache folder
        rel = os.path.relpath(path, compiled["cache"])
        for elsewhere in (f"/tmp/torchinductor_alice/{rel}", f"/scratch/ci cache/{rel}", f"/home/u/.c/{rel}"):
            assert is_generated(elsewhere) and flt.is_library(elsewhere), elsewhere
    # the shape is the whole test: a user's file named like one, in the wrong folder, is theirs
    base = os.path.basename(generated[0])
    assert not flt.is_library(f"/home/u/proj/zz/{base}")
    assert not flt.is_library(MODEL) and not flt.is_library("/home/u/proj/model.py")
    # FX's generated code and the compiler's own files, also from a source checkout of torch
    gm = torch.fx.symbolic_trace(compiled_model.Block())
    fx_file = gm.forward.__code__.co_filename
    assert fx_file.startswith("<eval_with_key>"), fx_file
    assert flt.is_library(fx_file) and is_generated(fx_file)
    import torch._dynamo.convert_frame as cf
    import torch._inductor.compile_fx as cfx

    for f in (cf.__file__, cfx.__file__, "/src/pytorch/torch/_dynamo/eval_frame.py",
              "/src/pytorch/torch/_inductor/select_algorithm.py", "/src/pytorch/torch/_functorch/aot_autograd.py"):
        assert flt.is_library(f), f
    # a user's override still wins
    flt.add_user_path(compiled["cache"])
    assert not flt.is_library(generated[0])


def test_the_cache_folder_named_by_the_environment_is_library_code(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "my cache"))
    flt = FrameFilter()
    assert flt.is_library(str(tmp_path / "my cache" / "fxgraph" / "helper.py"))
    assert not flt.is_library(str(tmp_path / "mine.py"))


# -- 2. compiled code maps to the model's source ----------------------------


def test_provenance_of_generated_lines_is_the_models_lines(compiled):
    lines = {model_line(m) for m in ("UP", "ACT", "DOWN", "LOSS")}
    seen = {"forward": set(), "backward": set()}
    ops = set()
    for path in compiled["wrappers"]:
        src = open(path).read().splitlines()
        for i, text in enumerate(src, 1):
            if not re.match(r"\s*buf\d+ = empty_strided_cpu\(", text):
                continue
            prov = C.provenance(path, i)
            assert prov is not None, (path, i, text)
            top = prov.frames[-1]
            assert top.filename == MODEL and top.lineno in lines, (text, prov)
            assert prov.buffer == text.split("=")[0].strip() and prov.kernel, prov
            seen["backward" if prov.backward else "forward"].add(top.lineno)
            ops.add(prov.op)
    assert model_line("UP") in seen["forward"] and seen["backward"], seen
    assert "aten.addmm" in ops and "aten.mm" in ops, ops
    # the model's nested call is kept: Model.forward's BLOCK line outside Block.forward's
    prov = next(C.provenance(p, i) for p in compiled["wrappers"] for i in range(1, 400)
                if C.provenance(p, i) is not None)
    assert [f.lineno for f in prov.frames][0] == model_line("BLOCK"), prov.frames


def test_an_unknown_line_or_file_has_no_provenance(compiled):
    assert C.provenance(MODEL, model_line("UP")) is None
    assert C.provenance(compiled["wrappers"][0], 1) is None  # the imports: no node
    assert C.expand([(MODEL, 3, "f"), ("/x/site-packages/torch/nn/modules/module.py", 1, "g")]) is None


def test_compiled_buffers_are_attributed_to_the_models_lines(compiled, fake):
    """The real capture path: the driver allocations come from the generated
    ``call`` (forward and backward); every view reads the model's lines."""
    _wrap_modules(compiled["wrappers"], fake)
    fn, x = compiled["fn"], compiled["x"]
    with memviz.track(torch=False) as t:
        loss = fn(x)  # RUN
        loss.backward()
        snap = t.snapshot()
        report = text_report(t)
    compiled_allocs = [a for a in snap.allocations
                       if any(is_generated(f.filename) for f in a.traceback)]
    total = sum(a.size for a in compiled_allocs)
    assert compiled_allocs and total > 0
    ours = [a for a in compiled_allocs if line_frame(a).filename == MODEL]
    share = sum(a.size for a in ours) / total
    print(f"compiled code allocated {total:,} B in {len(compiled_allocs)} buffers; "
          f"{share:.1%} attributed to {os.path.basename(MODEL)}")
    assert share >= 0.95
    tags = set()
    for a in ours:
        lf = line_frame(a)
        assert isinstance(lf, CompiledFrame), lf
        tags.add(lf.compiled.split(":")[0])
        # one level down: the generated frame, named with the buffer and the kernel
        tb = list(a.traceback)
        i = tb.index(lf)
        below = tb[i + 1]
        assert is_generated(below.filename) and re.search(r"\[buf\d+ = \S+\]", below.name), below
        assert a.op, a
    assert tags == {"compiled", "compiled backward"}, tags
    up = [a for a in ours if line_frame(a).lineno == model_line("UP") and "backward" not in line_frame(a).compiled]
    assert up and all(a.op == "aten.addmm" for a in up)
    assert location(line_frame(up[0])) == f"{MODEL}:{model_line('UP')} (compiled: aten.addmm)"
    # the top lines: the model's, no generated file, no torch file
    top = snap.statistics("lineno")[:10]
    for s in top:
        assert not is_generated(s.key.filename) and "/torch/" not in s.key.filename, s
    assert f"compiled_model.py:{model_line('UP')} (compiled: aten.addmm)" in report
    assert "torchinductor" not in report and compiled["cache"] not in report
    # one level down: the traceback view and the HTML icicle name the generated file and the kernel
    text = "\n".join(up[0].traceback.format())
    assert re.search(r"in forward\n.*\n.*File \".*/c[a-z0-9]{51}\.py\", line \d+, in .*call \[buf\d+ = extern_kernels\.addmm\]",
                     text), text
    from memviz.report._data import _buckets, _flame, _Names

    names = _Names()
    _flame(_buckets(snap.allocations), names)
    shown = [n[0] for n in names.table]
    assert "forward (compiled: aten.addmm)" in shown
    assert any(re.fullmatch(r".*call \[buf\d+ = extern_kernels\.addmm\]", n) for n in shown), shown


def test_runtime_buffers_are_not_compile_memory(compiled, fake):
    _wrap_modules(compiled["wrappers"], fake)
    with memviz.track(torch=False) as t:
        compiled["fn"](compiled["x"]).backward()
        snap = t.snapshot()
    assert snap.allocations
    bad = [a for a in snap.allocations if categories.is_compile(a)]
    assert not bad, [f for f in bad[0].traceback if categories._compile_file(f.filename)]


def test_reduce_overhead_calls_are_not_compile_memory():
    """mode="reduce-overhead" runs every call of the compiled model through
    compile_fx.cudagraphify's ``run`` (a compile-time file): those frames
    run compiled code, so what they allocate (the CUDA-graph trees' warm-up,
    recording, their pools' blocks) is not ``compile``; a compiler frame of
    that file still is. The names are the installed torch's own functions."""
    import inspect
    import types

    from memviz.model.traceback import Frame
    import torch._inductor.compile_fx as cfx

    src = inspect.getsource(cfx)
    for name in ("cudagraphify", "cudagraphify_impl", "static_input", "run"):
        assert f"def {name}(" in src, name
    fx = cfx.__file__
    gen = "/tmp/torchinductor_me/ab/cabcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrst.py"
    runtime = [Frame(gen, 40, "call"), Frame("/x/torch/_inductor/cudagraph_trees.py", 900, "run_eager"),
               Frame(fx, 1925, "cudagraphify.<locals>.run"), Frame("/x/torch/_inductor/output_code.py", 600, "__call__"),
               Frame("/home/me/model.py", 24, "forward")]
    assert not categories.is_compile(types.SimpleNamespace(traceback=runtime))
    compiling = runtime[:2] + [Frame(fx, 800, "fx_codegen_and_compile")] + runtime[2:]
    assert categories.is_compile(types.SimpleNamespace(traceback=compiling))


def test_the_rest_of_a_graph_pools_segment_is_the_graph_pools():
    """CUDA-graph trees keep a recorded graph's outputs in its private pool
    without a block of the allocator's (torch.cuda.memory_snapshot() shows
    the pool's segments with nothing allocated): the rest of such a segment
    is the graph pool's memory (cuda_graph_pool, or private_pool for a
    user's MemPool), not cache that empty_cache() gives back."""
    import types

    raw = [{"device": 0, "address": 1 << 30, "total_size": 64 << 20, "segment_pool_id": (0, 1)},
           {"device": 0, "address": 2 << 30, "total_size": 2 << 20, "segment_pool_id": (0, 2)},
           {"device": 0, "address": 3 << 30, "total_size": 2 << 20, "segment_pool_id": (0, 0)}]
    private = categories.private_segments(raw, graph_pools={(0, 1)})

    def rest(address):
        a = types.SimpleNamespace(kind="device", category="unused_pool", address=address, device=0, size=1 << 20)
        return categories._category(a, {}, set(), {}, False, None, None, private)

    assert rest((1 << 30) + (8 << 20)) == "cuda_graph_pool"
    assert rest(2 << 30) == "private_pool"
    assert rest(3 << 30) == "unused_pool"
    assert categories._category(types.SimpleNamespace(kind="device", category="unused_pool", address=1 << 30,
                                                      device=0, size=1), {}, set(), {}, False, None) == "unused_pool"
    stats = categories.private_segments(raw)  # without the graphs alive: told by the id only
    assert [c for _, _, c in stats[0]] == ["private_pool", "private_pool"]


# -- 3 and 4. compile-time memory: named, on the user's line, however deep ----


def test_compile_time_memory_is_compile_on_the_users_line(compiled):
    snap = compiled["compile_snap"]
    assert compiled["probe"].calls >= 2  # the forward's compile and the backward's
    probes = [a for a in snap.allocations if a.size == PROBE]
    assert len(probes) == compiled["probe"].calls
    here = os.path.abspath(__file__)
    for a in probes:
        assert categories.is_compile(a)
        assert categories._category(a, {}, set(), {}, False, None) == "compile"
        uf = a.traceback.user_frame
        # the line that called the compiled model (the forward's compile) or its loss.backward()
        assert uf.filename == here, (uf, len(a.traceback), a.traceback.format()[-6:])
        assert uf.lineno in (line_of(here, "# COMPILE"), line_of(here, "# COMPILE") + 1), uf
    deepest = max(len(a.traceback) for a in probes)
    print(f"compile-time probe: {len(probes)} allocations, stacks of {deepest} frames kept of depth 32")


# -- 5. CUDA graphs: what can be decided without a GPU ------------------------


def test_private_pool_segments_are_named():
    raw = [{"device": 0, "address": 0x1000, "total_size": 0x1000, "segment_pool_id": (0, 0)},
           {"device": 0, "address": 0x4000, "total_size": 0x2000, "segment_pool_id": (3, 0)},
           {"device": 0, "address": 0x8000, "total_size": 0x1000, "segment_pool_id": (0, 2)}]
    private = categories.private_segments(raw)
    assert private == {0: [(0x4000, 0x2000, "cuda_graph_pool"), (0x8000, 0x1000, "private_pool")]}
    # a pool a CUDA graph alive holds is the graph's, whatever its id
    assert categories.private_segments(raw, {(0, 2)})[0][1] == (0x8000, 0x1000, "cuda_graph_pool")
    from memviz.model.snapshot import Allocation
    from memviz.model.traceback import Traceback

    def block(addr):
        return Allocation(addr, 256, 0, "block", 0, None, None, 0, Traceback(), 0)

    assert categories._category(block(0x4100), {}, set(), {}, False, None, None, private) == "cuda_graph_pool"
    assert categories._category(block(0x8100), {}, set(), {}, False, None, None, private) == "private_pool"
    assert categories._category(block(0x1100), {}, set(), {}, False, None, None, private) != "cuda_graph_pool"


def test_graph_trees_from_before_tracking_are_said(monkeypatch):
    class Container:
        tree_manager = object()

    class Local:
        tree_manager_containers = {0: Container()}

    fake_trees = type(sys)("torch._inductor.cudagraph_trees")
    fake_trees.local = Local()
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", fake_trees)
    assert torch_compiled.graph_trees_exist()
    with pytest.warns(memviz.CaptureWarning, match="reduce-overhead"):
        assert torch_compiled.warn_if_trees_exist("allocator")
    assert not torch_compiled.warn_if_trees_exist("segments")
    Local.tree_manager_containers = {0: type("C", (), {"tree_manager": None})()}
    assert not torch_compiled.graph_trees_exist()


def test_a_steps_growing_line_is_the_models_compiled_line(compiled, fake):
    """Step records pick lines from the C core's stacks themselves
    (memviz.analysis.steps): the same model lines as a snapshot."""
    _wrap_modules(compiled["wrappers"], fake)
    keep = []
    with memviz.track(torch=False) as t:
        t.step()
        for _ in range(3):
            keep.append(compiled["fn"](compiled["x"]))  # the losses keep their graphs' buffers
            rec = t.step()
    files = {g.location.split(" (")[0].rsplit(":", 1)[0] for g in rec.lines}
    assert files == {MODEL}, [str(g) for g in rec.lines]
    assert all("(compiled: " in g.location for g in rec.lines), [str(g) for g in rec.lines]
