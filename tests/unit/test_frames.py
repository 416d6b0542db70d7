"""Tests for memviz.model.frame_filter (which frame is the user's line)."""

import os
import sysconfig
import types

import pytest

import memviz.model.frame_filter as frames_mod
from memviz._package import PACKAGE_DIR
from memviz.model.frame_filter import FrameFilter, frames as default_frames
from memviz.model.traceback import Frame

STDLIB = sysconfig.get_paths()["stdlib"]
PURELIB = sysconfig.get_paths()["purelib"]
USER_FILE = "/home/alice/proj/train.py"
TORCH_MODULE = os.path.join(PURELIB, "torch", "nn", "modules", "module.py")
# A site-packages directory of some other environment (e.g. the GPU box).
FOREIGN_TORCH = "/opt/venvs/gpu/lib/python3.12/site-packages/torch/nn/modules/module.py"
CONTEXTLIB = os.path.join(STDLIB, "contextlib.py")


def stack(*filenames):
    """Frames innermost first, with made-up line numbers."""
    return [Frame(fn, 10 + i, f"f{i}") for i, fn in enumerate(filenames)]


@pytest.fixture
def flt():
    return FrameFilter()


def test_stdlib_site_packages_and_user(flt):
    assert flt.is_library(CONTEXTLIB)
    assert flt.is_library(os.__file__)
    assert flt.is_library(TORCH_MODULE)
    assert flt.is_library(FOREIGN_TORCH)
    assert flt.is_library("/usr/lib/python3/dist-packages/numpy/core/numeric.py")
    assert not flt.is_library(USER_FILE)
    assert flt.is_user(USER_FILE)
    assert not flt.is_library(__file__)  # this test file is user code


def test_memviz_package_is_library(flt):
    assert flt.is_library(frames_mod.__file__)
    pkg_dir = PACKAGE_DIR
    assert flt.is_library(os.path.join(pkg_dir, "tracker.py"))
    assert flt.is_library(os.path.join(pkg_dir, "model", "snapshot.py"))
    # ...but a sibling directory whose name merely starts the same is not.
    assert not flt.is_library(pkg_dir + "_extras/foo.py")


def test_pseudo_files(flt):
    assert flt.is_library("<frozen importlib._bootstrap>")
    assert flt.is_library("<frozen runpy>")
    assert flt.is_library("<built-in>")
    assert not flt.is_library("<string>")
    assert not flt.is_library("<stdin>")
    assert not flt.is_library("<ipython-input-3-abc>")
    assert not flt.is_library("")


def test_prefix_is_component_boundary():
    f = FrameFilter(library_paths=["/opt/lib"], use_defaults=False)
    assert f.is_library("/opt/lib/x.py")
    assert f.is_library("/opt/lib")
    assert not f.is_library("/opt/library/x.py")


def test_pick_user_line_through_torch_and_stdlib(flt):
    # user train.py -> torch module.py (site-packages) -> contextlib (stdlib)
    frames = stack(CONTEXTLIB, TORCH_MODULE, USER_FILE, "<frozen runpy>")
    picked = flt.pick(frames)
    assert picked is frames[2]
    assert str(picked) == f"{USER_FILE}:12"
    assert flt.user_index([f.filename for f in frames]) == 2


def test_pick_foreign_site_packages(flt):
    frames = stack(FOREIGN_TORCH, FOREIGN_TORCH, "/work/run.py")
    assert flt.pick(frames).filename == "/work/run.py"


def test_all_library_gives_innermost(flt):
    frames = stack(CONTEXTLIB, TORCH_MODULE, "<frozen runpy>")
    assert flt.pick(frames) is frames[0]
    assert flt.user_index([f.filename for f in frames]) == 0


def test_empty(flt):
    assert flt.pick([]) is None
    assert flt.user_index([]) is None


def test_innermost_user_frame_wins(flt):
    frames = stack(TORCH_MODULE, "/home/alice/proj/model.py", USER_FILE)
    assert flt.pick(frames).filename == "/home/alice/proj/model.py"


def test_add_user_path_overrides_site_packages(flt):
    frames = stack(CONTEXTLIB, TORCH_MODULE, USER_FILE)
    assert flt.pick(frames).filename == USER_FILE
    flt.add_user_path(os.path.join(PURELIB, "torch"))
    assert flt.is_user(TORCH_MODULE)
    assert flt.pick(frames).filename == TORCH_MODULE
    # other packages in site-packages stay library code
    assert flt.is_library(os.path.join(PURELIB, "numpy", "x.py"))
    flt.reset()
    assert flt.pick(frames).filename == USER_FILE
    assert flt.user_paths == () and flt.library_paths == ()


def test_add_library_path_hides_wrapper(flt):
    wrapper = "/home/alice/proj/utils/alloc_wrapper.py"
    frames = stack(TORCH_MODULE, wrapper, USER_FILE)
    assert flt.pick(frames).filename == wrapper
    flt.add_library_path(wrapper)
    assert flt.pick(frames).filename == USER_FILE
    assert flt.library_paths == (wrapper,)


def test_longest_configured_prefix_wins():
    f = FrameFilter(use_defaults=False)
    f.add_library_path("/home/alice/proj")
    f.add_user_path("/home/alice/proj/app")
    f.add_library_path("/home/alice/proj/app/vendored")
    assert f.is_library("/home/alice/proj/lib.py")
    assert f.is_user("/home/alice/proj/app/main.py")
    assert f.is_library("/home/alice/proj/app/vendored/x.py")
    # a tie goes to the user path
    f.add_user_path("/home/alice/proj/app/vendored")
    assert f.is_user("/home/alice/proj/app/vendored/x.py")


def test_pseudo_file_rules():
    f = FrameFilter()
    f.add_library_path("<my-generated>")
    assert f.is_library("<my-generated>")
    assert not f.is_library("<my-generated-2>")
    f.add_user_path("<frozen runpy>")
    assert f.is_user("<frozen runpy>")
    assert f.is_library("<frozen importlib._bootstrap>")


def test_module_objects_accepted(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mod = types.ModuleType("mypkg")
    mod.__path__ = [str(pkg)]
    mod.__file__ = str(pkg / "__init__.py")
    single = types.ModuleType("wrap")
    single.__file__ = str(tmp_path / "wrap.py")
    f = FrameFilter(use_defaults=False)
    f.add_library_path(mod)
    f.add_library_path(single)
    assert f.is_library(str(pkg / "sub" / "x.py"))
    assert f.is_library(str(tmp_path / "wrap.py"))
    assert not f.is_library(str(tmp_path / "other.py"))
    with pytest.raises(ValueError, match="no file"):
        f.add_user_path(types.ModuleType("builtin_like"))
    with pytest.raises(ValueError):
        f.add_user_path("")


def test_symlinked_library_dir(tmp_path):
    real = tmp_path / "real_lib"
    real.mkdir()
    (real / "m.py").write_text("")
    link = tmp_path / "link_lib"
    link.symlink_to(real)
    f = FrameFilter(use_defaults=False)
    f.add_library_path(str(link))
    # a file reported through the real path is still recognised
    assert f.is_library(str(real / "m.py"))
    assert f.is_library(str(link / "m.py"))


def test_classification_is_cached(monkeypatch):
    f = FrameFilter()
    calls = []
    orig = FrameFilter._classify

    def counting(self, filename):
        calls.append(filename)
        return orig(self, filename)

    monkeypatch.setattr(FrameFilter, "_classify", counting)
    frames = stack(CONTEXTLIB, TORCH_MODULE, USER_FILE)
    for _ in range(50):
        assert f.pick(frames).filename == USER_FILE
        f.is_library(CONTEXTLIB)
    assert sorted(calls) == sorted([CONTEXTLIB, TORCH_MODULE, USER_FILE])
    gen = f.generation
    f.add_library_path("/nowhere")  # config change clears the cache
    assert f.generation > gen
    f.pick(frames)
    assert len(calls) == 6


def test_without_defaults_only_pseudo_files_are_library():
    f = FrameFilter(use_defaults=False)
    assert f.default_library_paths == ()
    assert not f.is_library(CONTEXTLIB)
    assert not f.is_library(FOREIGN_TORCH)
    assert f.is_library("<frozen os>")


def test_default_library_paths_cover_stdlib_and_site():
    paths = FrameFilter().default_library_paths
    norm = lambda p: os.path.normcase(os.path.abspath(p))
    assert norm(STDLIB) in paths or os.path.realpath(STDLIB) in paths
    assert norm(PURELIB) in paths or os.path.realpath(PURELIB) in paths
    assert all(os.path.dirname(p) != p for p in paths)  # never a filesystem root


def test_default_instance():
    assert isinstance(default_frames, FrameFilter)
    default_frames.add_user_path("/tmp/memviz-test-user-path")
    try:
        assert "/tmp/memviz-test-user-path" in default_frames.user_paths
    finally:
        default_frames.reset()
    assert default_frames.user_paths == ()
    assert "FrameFilter" in repr(default_frames)
