"""Record the sample trace memviz ships (memviz/data/sample.memviz + sample.json).

Where there is no GPU, ``python -m memviz run examples/basic.py`` prints the
report of this sample after its own (empty) report, headed by the machine,
date and script it was recorded from, so that a first run shows what memviz
reports on a GPU. Re-record it on a GPU machine, from the repository root:

    python examples/record_sample.py                  # runs examples/basic.py on the GPU

It runs the example under ``memviz.track(trace=...)`` and writes both files
(each to a temporary file first, then renamed over the old one). Options:

    --example PATH     the example to run (default: examples/basic.py)
    --machine TEXT     what to call the machine (default: the GPU's name, CUDA
                       and PyTorch versions, as PyTorch reports them)
    --out-dir DIR      where to write (default: memviz/data)
    --warmup           run the example once first, as it runs on its own (kernels loaded, cuBLAS
                       up), then record its second run: the sample shows the run,
                       not the seconds CUDA takes to load kernels the first time
    --fake-cupti       no GPU: drive the CPU test double (tests/fake_cupti) with
                       a stand-in for PyTorch that makes the example's CUDA
                       allocations through the double's cuMemAlloc; the result
                       is a placeholder, and sample.json says so

The example's lines are recorded as paths relative to the repository root
(``examples/basic.py``), and its text goes into sample.json
("script_source"), so the sample's report shows its lines as they were
recorded, wherever it is read. The trace must stay under 1 MB (checked here, and by
tests/integration/test_packaging.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BYTES = 1 << 20  # the sample ships in the wheel: keep it small
FAKE_MACHINE = "the CPU test double tests/fake_cupti (a placeholder, not a GPU)"


# The stand-in's code is compiled under a "<built-in ...>" name: memviz counts
# such frames as library code, as it would see nothing of PyTorch's (its
# torch.empty is C, with no Python frame), so the line recorded for each
# allocation is the example's, as on a GPU. It calls the double's ctypes
# functions directly for the same reason.
_STAND_IN_NAME = "<built-in stand-in for torch (examples/record_sample.py)>"
_STAND_IN = """
class Scalar:
    def item(self):
        return 0.0

class Tensor:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self._address = lib.fake_alloc(CBID_ALLOC, nbytes, 0, 0)

    def sum(self):
        return Scalar()

    def __del__(self):
        lib.fake_free(CBID_FREE, self._address, 0, 0)

def make(n, dtype="float32", device="cuda"):
    if device != "cuda" or dtype != "float32":
        raise ValueError(f"the stand-in makes float32 CUDA tensors only, not {dtype} on {device}")
    return Tensor(int(n) * 4)

class cuda:
    def synchronize():
        pass

    def empty_cache():
        pass

    def get_device_name(device=None):
        return "the CPU test double"

class Torch:
    __version__ = "stand-in"
    float32 = "float32"
    cuda = cuda
    empty = zeros = ones = staticmethod(make)
"""


def _stand_in_torch(fake):
    """The part of PyTorch examples/basic.py uses; each CUDA tensor's memory
    comes from the double's cuMemAlloc and goes back through its cuMemFree."""
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

    ns = {"lib": fake.lib, "CBID_ALLOC": CBID_cuMemAlloc_v2, "CBID_FREE": CBID_cuMemFree_v2}
    exec(compile(_STAND_IN, _STAND_IN_NAME, "exec"), ns)
    return ns["Torch"]


def _machine_name():
    import torch

    name = torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{name} (CUDA {torch.version.cuda}, PyTorch {torch.__version__.split('+')[0]})"


def _run_example(rel_example, fake):
    """Run the example (its lines named by rel_example) as __main__, or, with
    the test double, call its main() with the stand-in PyTorch."""
    if fake is None:
        try:
            runpy.run_path(rel_example, run_name="__main__")
        except SystemExit as e:  # an example that ends with sys.exit(main()): 0 is its normal end
            if e.code not in (None, 0):
                raise SystemExit(f"record_sample.py: {rel_example} exited with {e.code!r}; "
                                 "nothing was written") from None
        return
    ns = runpy.run_path(rel_example, run_name="memviz_sample")
    if "cuda_torch" not in ns or "main" not in ns:
        raise SystemExit(f"record_sample.py: --fake-cupti runs examples shaped like "
                         f"examples/basic.py (a cuda_torch() and a main()); {rel_example} "
                         "is not. Run it on a GPU without --fake-cupti.")
    stand_in = _stand_in_torch(fake)
    ns["main"].__globals__["cuda_torch"] = lambda: (stand_in, None)
    ns["main"]()


def _write_atomic(path, data):
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".sample.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the files are shipped
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def record(example, out_dir, machine=None, fake_cupti=False, warmup=False):
    """Record ``example`` and write sample.memviz and sample.json to ``out_dir``.
    With ``warmup``, run it once first, as it runs on its own (its kernels loaded, cuBLAS
    up, as in a session that ran it before) and record its second run.

    Returns the two paths."""
    example, out_dir = os.path.abspath(example), os.path.abspath(out_dir)
    if not os.path.isfile(example):
        raise SystemExit(f"record_sample.py: no such example: {example}")
    if not os.path.isdir(out_dir):
        raise SystemExit(f"record_sample.py: the folder {out_dir} does not exist; create it first")
    rel_example = os.path.relpath(example, ROOT)
    with open(example, encoding="utf-8") as f:
        source = f.read()  # shipped with the trace: its lines stay readable as recorded
    here = os.getcwd()
    os.chdir(ROOT)  # the example's frames are recorded as "examples/basic.py"
    try:
        import memviz

        fake = None
        if fake_cupti:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from fake_cupti import FakeCupti, build

            from memviz.capture import cupti as _capture

            lib = build()
            os.environ[_capture.ENV_LIBRARY] = lib
            fake = FakeCupti(lib)
            fake.reset()
            machine = machine or FAKE_MACHINE
        else:
            # Where a notebook user's tracking starts: PyTorch imported and CUDA
            # up (the seconds those take are not the sample's to show).
            try:
                import torch
            except ImportError:
                torch = None
            if torch is not None and torch.cuda.is_available():
                torch.cuda.init()
                if warmup:
                    _run_example(rel_example, None)
                    import gc

                    gc.collect()
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "sample.memviz")
            with memviz.track(trace=trace, **({"torch": False} if fake else {})) as t:
                _run_example(rel_example, fake)
            if not t.gpu_enabled:
                raise SystemExit(f"record_sample.py: GPU capture was off ({t.gpu_off_reason}); "
                                 "record on a GPU machine, or pass --fake-cupti for a placeholder")
            if not any(v.get("allocs") for v in t.totals().values()):
                raise SystemExit("record_sample.py: the example made no GPU allocation; "
                                 "nothing worth shipping was recorded")
            with open(trace, "rb") as f:
                data = f.read()
        if len(data) >= MAX_BYTES:
            raise SystemExit(f"record_sample.py: the trace is {len(data):,} bytes; the sample "
                             f"must stay under {MAX_BYTES:,}. Record a smaller example.")
        if machine is None:
            machine = _machine_name()
        meta = {"machine": machine,
                "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                "script": rel_example.replace(os.sep, "/"),
                "script_source": source}
        paths = (os.path.join(out_dir, "sample.memviz"), os.path.join(out_dir, "sample.json"))
        _write_atomic(paths[0], data)
        _write_atomic(paths[1], (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        return paths
    finally:
        os.chdir(here)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="record_sample.py", description=__doc__.split("\n")[0])
    parser.add_argument("--example", default=os.path.join(ROOT, "examples", "basic.py"))
    parser.add_argument("--machine", default=None)
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "memviz", "data"))
    parser.add_argument("--fake-cupti", action="store_true")
    parser.add_argument("--warmup", action="store_true",
                        help="run the example once first, as it runs on its own, then record its second run")
    opts = parser.parse_args(argv)
    if opts.warmup and opts.fake_cupti:
        parser.error("--warmup runs the example on the GPU; it does not go with --fake-cupti")
    trace, meta = record(opts.example, opts.out_dir, opts.machine, opts.fake_cupti, opts.warmup)
    with open(meta, encoding="utf-8") as f:
        said = {k: v for k, v in json.load(f).items() if k != "script_source"}
    print(f"record_sample.py: wrote {trace} ({os.path.getsize(trace):,} bytes) and {meta}: {said}")

if __name__ == "__main__":
    main()
