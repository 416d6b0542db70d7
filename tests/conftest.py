"""Shared fixtures: the libcupti test double, and a clean tracker state.

This one conftest serves tests/unit, tests/integration and tests/gpu: a
second conftest.py would be imported under the same module name, and tests
import ``here``, ``line_of``, ``ROOT``, ``HANG``, ``complete``,
``child_env`` and ``build_variant`` from this one."""

import inspect
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests/ holds the test doubles (fake_cupti, stand_in_allocator) and the
# helpers (rank_traces, fuzz_trace, compiled_model); unit/ and integration/
# hold test modules that others import helpers and fixtures from (their
# names are unique across the three folders: none has an __init__.py).
for _folder in (ROOT / "tests" / "integration", ROOT / "tests" / "unit", ROOT / "tests"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import memviz  # noqa: E402
from memviz.capture import cupti as _capture
from memviz import tracker as _tracker  # noqa: E402


#: seconds a child process may run: only to tell a hang from a slow machine
HANG = 120


def complete(path):
    """The trace loaded, failing on a warning that it is incomplete."""
    import warnings

    from memviz.trace import format as F

    with warnings.catch_warnings():
        warnings.simplefilter("error", F.TraceWarning)  # a truncated file fails
        return memviz.load(path)


def child_env(fake_path, **extra):
    """A child process's environment: this tree's memviz and test doubles,
    capture through the libcupti double at ``fake_path``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                MEMVIZ_CUPTI_LIBRARY=fake_path, PYTHONDONTWRITEBYTECODE="1", **extra)


def build_variant(dest: Path, cflags: str) -> Path:
    """This tree's extension built at ``dest`` (a new folder: setup.py, src,
    memviz without its built cores) with ``CFLAGS=cflags``: a benchmark
    build (the stage build, the ablation build). Fails on a build error or
    a compiler warning; returns ``dest``, to import memviz from."""
    import shutil
    import subprocess

    dest.mkdir()
    shutil.copy(ROOT / "setup.py", dest)
    shutil.copytree(ROOT / "src", dest / "src")
    shutil.copytree(ROOT / "memviz", dest / "memviz", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest,
                           env=dict(os.environ, CFLAGS=cflags), capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "warning" not in built.stderr.lower(), built.stderr[-3000:]
    return dest


def here() -> int:
    """The caller's current line number: `x = f(); L = here()` on one line."""
    return inspect.currentframe().f_back.f_lineno


def line_of(path: str, marker: str) -> int:
    """The number of the line of ``path`` that ends with ``marker``."""
    with open(path) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(marker):
                return i
    raise AssertionError(f"{marker!r} not found in {path}")


@pytest.fixture(scope="session")
def fake_path():
    from fake_cupti import build

    return build()


@pytest.fixture
def fake(fake_path, monkeypatch):
    """The libcupti test double, reset, with memviz pointed at it."""
    from fake_cupti import FakeCupti

    lib = _capture.loaded()
    if lib is not None and os.path.realpath(lib.path) != os.path.realpath(fake_path):
        pytest.skip(f"a real libcupti ({lib.path}) is already loaded in this process")
    monkeypatch.setenv(_capture.ENV_LIBRARY, fake_path)
    f = FakeCupti(fake_path)
    f.reset()
    # The wrapper's own frames are not the user's line.
    memviz.frames.add_library_path(str(ROOT / "tests" / "fake_cupti"))
    yield f
    t = memviz.active_tracker()
    if t is not None:
        t.stop()
    memviz.frames.reset()
    f.reset()


@pytest.fixture(autouse=True)
def _no_tracker_left():
    yield
    t = _tracker._session.active()
    if t is not None:
        t.stop()
        pytest.fail("a test left a memviz tracker running")
    agraph = sys.modules.get("torch.autograd.graph")
    if agraph is not None and agraph._engine_run_backward.__module__ == "memviz.torch.integration":
        pytest.fail("a test left memviz's autograd hooks installed")
    torch = sys.modules.get("torch")
    top = getattr(getattr(getattr(torch, "_C", None), "_autograd", None), "_top_saved_tensors_default_hooks", None)
    if top is not None and top(False) is not None:
        pytest.fail("a test left saved-tensor hooks installed")


@pytest.fixture(scope="session")
def stand_in_root(tmp_path_factory):
    """One folder for every stand-in allocator library of the session: they
    share libc10_standin.so (a second copy of its soname would not load)."""
    return tmp_path_factory.mktemp("stand_in_allocator")
