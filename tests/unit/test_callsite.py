"""Naming the call behind an allocation (``Allocation.op``).

The double's allocation function is native code called straight from these
tests' lines, as a torch op is called from ``F.linear(...)``: the real
capture path records the innermost frame's instruction, and memviz names
the call from the source's column positions when a snapshot or trace is
made.
"""

import functools
import sys
import types

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CUDA_ERROR_OUT_OF_MEMORY
from memviz.capture import callsite as _callsite

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11),
                                reason="column positions per instruction arrive in Python 3.11")

KiB = 1024
CB = CBID_cuMemAlloc_v2
gpu_ops = types.ModuleType("gpu_ops")  # a module of native functions, as torch.nn.functional
G = gpu_ops  # bound under another name, as `import torch.nn.functional as F`
torch = types.SimpleNamespace()  # a global named like a module, bound to something else


class Zero:
    """Passes as 0 to a ctypes argument (stream, result)."""

    _as_parameter_ = 0


@pytest.fixture
def dbl(fake):
    gpu_ops.alloc = torch.fake_alloc = fake._c.fake_alloc
    yield fake
    del gpu_ops.alloc, torch.fake_alloc


def test_snapshot_names_the_call_each_allocation_came_from(dbl):
    c = dbl._c

    class Tensorish(Zero):
        # native code behind an operator: `a @ b` calls fake_alloc(CB, 7 KiB, 0, b)
        # (a static partial: the operator passes only the other operand)
        __matmul__ = staticmethod(functools.partial(c.fake_alloc, CB, 7 * KiB, 0))
        __getitem__ = staticmethod(functools.partial(c.fake_alloc, CB, 8 * KiB, 0))
        lib = staticmethod(lambda c: c)

    a = Tensorish()
    with memviz.track() as t:
        G.alloc(CB, 1 * KiB, 0, 0)
        c.fake_alloc(CB, 2 * KiB, 0, 0)
        alloc = c.fake_alloc
        alloc(CB, 3 * KiB, 0, 0)
        s = "é… ✓"; G.alloc(CB, 4 * KiB, 0, 0)  # noqa: E702 - columns count UTF-8 bytes
        (c
            .fake_alloc(CB, 5 * KiB, 0, 0))  # a method call across lines
        dbl.alloc(CB, 6 * KiB)  # the double's helper makes the call: its line is innermost
        a @ a
        a[Zero()]
        torch.fake_alloc(CB, 9 * KiB, 0, 0)  # a global that is no module here: as written
        Tensorish.lib(c).fake_alloc(CB, 10 * KiB, 0, 0)  # a method of a computed object
        snap = t.snapshot()
    assert s
    got = {a.size // KiB: a.op for a in snap}
    assert got == {1: "gpu_ops.alloc", 2: "c.fake_alloc", 3: "alloc", 4: "gpu_ops.alloc",
                   5: ".fake_alloc", 6: "self._c.fake_alloc", 7: "operator @", 8: "operator []",
                   9: "torch.fake_alloc", 10: ".fake_alloc"}, got
    by_op = {st.key: st.size // KiB for st in snap.statistics("op")}
    assert by_op["gpu_ops.alloc"] == 5 and by_op[".fake_alloc"] == 15, by_op


def test_names_survive_stop_traces_saves_and_failures(dbl, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path)) as t:
        G.alloc(CB, 8 * KiB, 0, 0)
        G.alloc(CB, 1 << 40, 0, CUDA_ERROR_OUT_OF_MEMORY)  # refused by the "driver"
    assert [a.op for a in t.snapshot()] == ["gpu_ops.alloc"]  # frozen at stop
    assert [a.op for a in t.peak_snapshot()] == ["gpu_ops.alloc"]
    (failure,) = t.failures
    assert failure.op == "gpu_ops.alloc" and "(gpu_ops.alloc): failed to allocate" in str(failure)
    t.save(tmp_path / "saved.memviz")
    for p in (path, tmp_path / "saved.memviz"):
        loaded = memviz.load(p)
        assert [a.op for a in loaded.snapshot()] == ["gpu_ops.alloc"], p
        assert [f.op for f in loaded.failures] == ["gpu_ops.alloc"], p


def test_report_lists_the_calls_at_the_peak(dbl):
    from memviz.report.text import text_report

    with memviz.track() as t:
        G.alloc(CB, 40 * KiB, 0, 0)
    text = text_report(t, outside={})
    assert "By call at the peak of cuda:0" in text and "gpu_ops.alloc" in text, text


def _site(depth=1):
    f = sys._getframe(depth + 1)
    return _callsite.call_name(f.f_code, f.f_lasti)


def test_call_name_of_instructions():
    seen = []

    def cb(*args):
        seen.append(_site())
        return 0

    class Box:
        __matmul__ = __imul__ = __getitem__ = __setitem__ = staticmethod(functools.partial(cb))

    b = Box()
    list(map(cb, [1]))
    b @ b
    d = Box()
    d *= b
    b[1]
    b[1] = 2
    sorted([2, 1], key=cb)
    assert seen == ["list", "operator @", "operator *=", "operator []", "operator []=", "sorted", "sorted"]


def test_no_name_without_source_or_a_call():
    seen = []

    def cb(*args):
        seen.append(_site())
        return 0

    ns = {"cb": cb, "map": map, "list": list}
    exec(compile("list(map(cb, [1]))", "<no source>", "exec"), ns)  # nothing to read the call from
    exec(compile("for x in map(cb, [1]): pass", "<no source either>", "exec"), ns)
    assert seen == [None, None]
    code = compile("x = 1", "<s>", "exec")
    assert _callsite.call_name(code, 0) is None  # not a call
    assert _callsite.call_name(code, 10_000) is None  # past the end


def test_module_alias_of_a_module_no_longer_importable_stays_as_written():
    """`python -m memviz run script.py` runs the script in a module that is
    gone from sys.modules by report time: its aliases cannot be looked up."""
    import linecache

    seen = []

    def cb(*args):
        seen.append(_site())
        return 0

    src = "import builtins as B\nB.list(B.map(cb, [1]))\n"
    linecache.cache["<gone module>"] = (len(src), None, src.splitlines(True), "<gone module>")
    try:
        exec(compile(src, "<gone module>", "exec"), {"cb": cb})
    finally:
        del linecache.cache["<gone module>"]
    assert seen == ["B.list"]
