"""Precise mode's wrappers (src/interpose.h) on the CPU: a stand-in for
PyTorch's libc10_cuda.so calls cudaMallocAsync/cudaFreeAsync of a stand-in
CUDA runtime through its PLT, and the runtime "calls the driver" through the
libcupti test double (so CUPTI's callbacks fire as they would on a GPU)."""

import ctypes
import os
import platform
import shlex
import subprocess
import sys
import textwrap

import pytest

import memviz
from conftest import here
from fake_cupti import CBID_cuMemAllocAsync, CBID_cuMemFreeAsync, DOMAIN_DRIVER_API

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the wrappers patch a library's GOT on x86-64 glibc only")

RUNTIME = textwrap.dedent(f"""
    #include <stddef.h>
    #include <stdint.h>
    typedef uint64_t (*alloc_fn)(int, uint64_t, uint64_t, int);
    typedef void (*free_fn)(int, uint64_t, uint64_t, int);
    static alloc_fn A;
    static free_fn F;
    static int fail_next;
    void fakert_init(alloc_fn a, free_fn f) {{ A = a; F = f; }}
    void fakert_fail_next(void) {{ fail_next = 1; }}
    int cudaMallocAsync(void **p, size_t n, void *s) {{
        int r = fail_next ? 2 : 0; /* cudaErrorMemoryAllocation */
        fail_next = 0;
        uint64_t a = A({CBID_cuMemAllocAsync}, n, (uint64_t)(uintptr_t)s, r);
        if (!r) *p = (void *)(uintptr_t)a;
        return r;
    }}
    int cudaFreeAsync(void *p, void *s) {{
        F({CBID_cuMemFreeAsync}, (uint64_t)(uintptr_t)p, (uint64_t)(uintptr_t)s, 0);
        return 0;
    }}
""")

TORCH = textwrap.dedent("""
    #include <stddef.h>
    #include <stdint.h>
    int cudaMallocAsync(void **p, size_t n, void *s);
    int cudaFreeAsync(void *p, void *s);
    uint64_t torch_alloc(uint64_t n) {
        void *p = 0;
        return cudaMallocAsync(&p, (size_t)n, (void *)7) ? 0 : (uint64_t)(uintptr_t)p;
    }
    int torch_free(uint64_t p) { return cudaFreeAsync((void *)(uintptr_t)p, (void *)7); }
""")


def _cc(args):
    cc = shlex.split(os.environ.get("CC") or "cc")
    extra = shlex.split(os.environ.get("CFLAGS_EXTRA", ""))
    p = subprocess.run([*cc, "-std=c11", "-O1", "-fPIC", "-shared", "-Wall", "-Werror", *extra, *args],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def _runtime(d, source, name, version):
    """Build a stand-in runtime lib{name}.so in `d` whose symbols carry the
    version `version`. A library linked against it then asks for
    cudaMallocAsync@{version}, which a real libcudart in the global scope
    (torch's CUDA build puts one there; its symbols are
    cudaMallocAsync@@libcudart.so.N) cannot satisfy: the stand-ins bind to
    each other with a plain dlopen, so no RTLD_DEEPBIND (which ASan
    refuses) is needed. test_stand_ins_bind_to_their_runtime checks it."""
    (d / f"{name}.c").write_text(source)
    (d / f"{name}.map").write_text(f"{version} {{ global: *; }};\n")
    _cc([str(d / f"{name}.c"), "-o", str(d / f"lib{name}.so"), f"-Wl,--version-script={d / (name + '.map')}"])


def _load(path):
    """A stand-in torch library (bound to its stand-in runtime: _runtime)."""
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{"now"/"lazy": the stand-in libc10_cuda.so}, bound eagerly (its GOT
    read-only after relocation) or lazily."""
    d = tmp_path_factory.mktemp("interpose")
    (d / "torch.c").write_text(TORCH)
    _runtime(d, RUNTIME, "fakert", "FAKERT_1")
    out = {}
    for binding in ("now", "lazy"):
        (d / binding).mkdir()
        lib = d / binding / "libc10_cuda.so"
        _cc([str(d / "torch.c"), "-o", str(lib), f"-L{d}", "-lfakert", f"-Wl,-rpath,{d}",
             f"-Wl,-z,{binding}", "-Wl,-z,relro"])
        out[binding] = lib
    return d, out


@pytest.fixture(params=["now", "lazy"])
def torchlib(libs, fake, request):
    d, built = libs
    rt = ctypes.CDLL(str(d / "libfakert.so"))
    rt.fakert_init(ctypes.cast(fake.lib.fake_alloc, ctypes.c_void_p),
                   ctypes.cast(fake.lib.fake_free, ctypes.c_void_p))
    lib = _load(built[request.param])
    lib.torch_alloc.restype = ctypes.c_uint64
    lib.torch_alloc.argtypes = [ctypes.c_uint64]
    lib.torch_free.argtypes = [ctypes.c_uint64]
    lib.rt = rt
    lib.suffix = f"/{request.param}/libc10_cuda.so"
    yield lib
    memviz._core.interpose_detach()


def test_wrappers_record_on_the_line_with_no_cupti_callback(torchlib, fake):
    with memviz.track() as t:
        n, reason = memviz._core.interpose_attach(torchlib.suffix)
        assert n >= 2, reason
        assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync)  # until committed
        assert memviz._core.interpose_commit()
        assert not fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync)
        assert not fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemFreeAsync)
        calls = fake.callback_count()
        addr = torchlib.torch_alloc(3 << 20); line = here()  # noqa: E702
        keep = torchlib.torch_alloc(1 << 20)
        assert addr and keep and fake.callback_count() == calls  # CUPTI never called back
        snap = t.snapshot()
        torchlib.torch_free(addr)
        after = t.snapshot()
        memviz._core.interpose_detach()
        assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync)
        again = torchlib.torch_alloc(5 << 20)  # back through CUPTI, recorded once
        assert fake.callback_count() == calls + 2  # entry and exit
        final = t.snapshot()
    (a,) = [a for a in snap if a.size == 3 << 20]
    assert a.address == addr and a.stream == 7 and a.device == 0
    assert (a.traceback[-1].filename, a.traceback[-1].lineno) == (__file__, line)
    assert sorted(a.size for a in after) == [1 << 20]
    assert sorted(a.size for a in final) == [1 << 20, 5 << 20]
    assert [a.address for a in final if a.size == 5 << 20] == [again]


def test_failed_call_through_a_wrapper_is_a_failure_not_an_allocation(torchlib, fake):
    with memviz.track() as t:
        assert memviz._core.interpose_attach(torchlib.suffix)[0] >= 2
        assert memviz._core.interpose_commit()
        torchlib.rt.fakert_fail_next()
        assert torchlib.torch_alloc(7 << 20) == 0; line = here()  # noqa: E702
        totals = t.totals()[0]
        assert list(t.snapshot()) == []
        report = t.oom_report
    assert totals["failed"] == 1, totals
    assert report is not None and report.requested == 7 << 20 and report.line.endswith(f":{line}"), report
    assert report.call == ("torchlib.torch_alloc" if sys.version_info >= (3, 11) else None), report


def test_detach_puts_the_library_back(torchlib, fake):
    """After stop the GOT holds what it held: a later plain tracker sees each
    call exactly once, through CUPTI."""
    with memviz.track():
        assert memviz._core.interpose_attach(torchlib.suffix)[0] >= 2
        assert memviz._core.interpose_commit()
        torchlib.torch_alloc(1 << 20)
        memviz._core.interpose_detach()
    with memviz.track() as t:
        torchlib.torch_alloc(2 << 20)
        sizes = [a.size for a in t.snapshot()]
    assert sizes == [2 << 20]


def test_attach_refuses_what_it_cannot_patch(torchlib, fake):
    with memviz.track():
        n, reason = memviz._core.interpose_attach("/no/such/libc10_cuda.so")
        assert n == 0 and "no loaded library" in reason
        n, reason = memviz._core.interpose_attach("/libfakert.so")  # defines them, imports neither
        assert n == 0 and "imports neither" in reason
        assert not memviz._core.interpose_commit()  # nothing wrapped: nothing switched off
        assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync)  # CUPTI route untouched
        assert memviz._core.interpose_attach(torchlib.suffix)[0] >= 2
        n, reason = memviz._core.interpose_attach(torchlib.suffix)
        assert n == 0 and "already wrapped" in reason


def test_precise_mode_attaches_the_wrappers_and_stop_removes_them(torchlib, fake, monkeypatch):
    torch = pytest.importorskip("torch", reason="the integration needs torch")
    from memviz.torch import precise

    monkeypatch.setattr(precise, "LIBRARY", torchlib.suffix)
    monkeypatch.setattr(precise, "active", lambda: True)
    monkeypatch.setattr(precise, "enable", lambda: "already active")
    with memviz.track(precise=True) as t:
        assert t.torch.precise_capture.startswith("wrappers"), t.torch.precise_capture
        torchlib.torch_alloc(4 << 20); line = here()  # noqa: E702
        (a,) = list(t.snapshot())
    assert a.traceback[-1].lineno == line
    assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync) or not fake.is_subscribed()
    monkeypatch.setenv("MEMVIZ_PRECISE_CAPTURE", "cupti")
    with memviz.track(precise=True) as t:
        assert t.torch.precise_capture == "CUPTI callbacks (MEMVIZ_PRECISE_CAPTURE=cupti)"
        torchlib.torch_alloc(4 << 20)
        assert [a.size for a in t.snapshot()] == [4 << 20]
    del torch


def test_several_libraries_wrapped_at_once(libs, fake):
    """PyTorch's other libraries that call the runtime are wrapped too: an
    allocation made through one and freed through another leaves nothing."""
    d, built = libs
    rt = ctypes.CDLL(str(d / "libfakert.so"))
    rt.fakert_init(ctypes.cast(fake.lib.fake_alloc, ctypes.c_void_p),
                   ctypes.cast(fake.lib.fake_free, ctypes.c_void_p))
    a, b = (_load(built[k]) for k in ("now", "lazy"))
    a.torch_alloc.restype = ctypes.c_uint64
    a.torch_alloc.argtypes = [ctypes.c_uint64]
    b.torch_free.argtypes = [ctypes.c_uint64]
    try:
        with memviz.track() as t:
            assert memviz._core.interpose_attach("/now/libc10_cuda.so")[0] >= 2
            assert memviz._core.interpose_attach("/lazy/libc10_cuda.so")[0] >= 2
            assert memviz._core.interpose_commit()
            calls = fake.callback_count()
            addr = a.torch_alloc(1 << 20)
            live = [x.size for x in t.snapshot()]
            b.torch_free(addr)
            assert fake.callback_count() == calls
            assert live == [1 << 20] and list(t.snapshot()) == []
    finally:
        memviz._core.interpose_detach()


IMPOSTOR = """
int cudaMallocAsync(void **p, unsigned long n, void *s) { (void)p; (void)n; (void)s; return 999; }
int cudaFreeAsync(void *p, void *s) { (void)p; (void)s; return 999; }
"""

BIND = """
import ctypes, json, sys
sys.path.insert(0, {tests!r})
from fake_cupti import FakeCupti
fake = FakeCupti({fake_path!r})
ctypes.CDLL({impostor!r}, mode=ctypes.RTLD_GLOBAL)  # first in every library's lookup scope
out = []
for rt, lib in {pairs!r}:
    ctypes.CDLL(rt).fakert_init(ctypes.cast(fake.lib.fake_alloc, ctypes.c_void_p),
                                ctypes.cast(fake.lib.fake_free, ctypes.c_void_p))
    torch = ctypes.CDLL(lib, mode=ctypes.RTLD_LOCAL)  # as _load does
    torch.torch_alloc.restype = ctypes.c_uint64
    torch.torch_alloc.argtypes = [ctypes.c_uint64]
    out.append(torch.torch_alloc(4096) != 0)
print("RESULT " + json.dumps(out))
"""


def test_stand_ins_bind_to_their_runtime_with_a_real_one_in_the_global_scope(libs, fake_path, tmp_path):
    """What RTLD_DEEPBIND ensured, without it: a runtime in the global scope
    with the real libcudart's symbol versions (cudaMallocAsync@@libcudart.so.13,
    here failing every call) does not capture the stand-in's calls, while a
    stand-in linked against an unversioned runtime (the control) is captured.
    In a subprocess: the global scope cannot be undone."""
    import json

    d, built = libs
    _runtime(tmp_path, IMPOSTOR, "cudart", "libcudart.so.13")
    (tmp_path / "plainrt.c").write_text(RUNTIME)
    _cc([str(tmp_path / "plainrt.c"), "-o", str(tmp_path / "libplainrt.so")])
    plain = tmp_path / "libc10_cuda_plain.so"
    _cc([str(d / "torch.c"), "-o", str(plain), f"-L{tmp_path}", "-lplainrt", f"-Wl,-rpath,{tmp_path}"])
    pairs = [(str(d / "libfakert.so"), str(built["now"])), (str(tmp_path / "libplainrt.so"), str(plain))]
    code = BIND.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), fake_path=fake_path,
                       impostor=str(tmp_path / "libcudart.so"), pairs=pairs)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    result, = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert result == [True, False]


def test_a_torch_library_that_cannot_be_wrapped_keeps_cupti_for_all(libs, fake, tmp_path, monkeypatch):
    """Another library of PyTorch's that calls cudaMallocAsync from a second
    runtime cannot share the wrappers: rather than lose its calls once
    CUPTI's callbacks are off, memviz keeps the CUPTI route for everything."""
    import types

    from memviz.torch import precise

    d, built = libs
    _runtime(tmp_path, RUNTIME.replace("fakert_", "fakert2_"), "fakert2", "FAKERT2_1")
    libdir = tmp_path / "torch" / "lib"
    libdir.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    _cc([str(d / "torch.c"), "-o", str(libdir / "libother_cuda.so"), f"-L{tmp_path}", "-lfakert2",
         f"-Wl,-rpath,{tmp_path}"])
    ctypes.CDLL(str(d / "libfakert.so"))
    _load(built["now"])
    _load(libdir / "libother_cuda.so")
    monkeypatch.setitem(__import__("sys").modules, "torch",
                        types.SimpleNamespace(__file__=str(tmp_path / "torch" / "__init__.py")))
    try:
        with memviz.track(torch=False):
            how = precise.attach_wrappers("/now/libc10_cuda.so")
            assert how.startswith("CUPTI callbacks (") and "another CUDA runtime" in how, how
            assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAllocAsync)
            assert memviz._core.interpose_attach("/now/libc10_cuda.so")[0] >= 2  # it was undone
    finally:
        memviz._core.interpose_detach()
