"""Deep stacks keep the user's line (issue 26; src/frames.c): a stack
deeper than the capture depth keeps its innermost frames as before when one
of them is the user's; else its last quarter is the first user frame
beyond them and its callers, or, with none, the outermost frames. Which
files are a library's is the frame filter's rule, handed down to C
(memviz.model.frame_filter._push_rules), configured paths included.

The recursions run in a ``<frozen ...>`` pseudo-file (library code), and
the driver calls below them are C-level (functools.partial of the libcupti
test double's functions), so no frame of this file is among the innermost.
No torch needed."""

import functools
import os
import threading

import memviz
from conftest import line_of
from fake_cupti import CBID_cuMemAlloc_v2
from memviz import _core

_HELPERS = """
def rec(k, fn):
    return rec(k - 1, fn) if k > 0 else fn()
"""
_NS: dict = {}
exec(compile(_HELPERS, "<frozen memviz-test-helpers>", "exec"), _NS)


def _deep(fake, depth_frames: int, size: int):
    """Allocate at the bottom of a recursion in library code, from this file."""
    _NS["rec"](depth_frames, functools.partial(fake.lib.fake_alloc, CBID_cuMemAlloc_v2, size, 0, 0))


def test_a_deep_library_stack_keeps_the_users_line(fake):
    here = os.path.abspath(__file__)
    with memviz.track(torch=False, depth=32) as t:
        _deep(fake, 100, 1 << 20)  # DEEP
        _deep(fake, 5, 2 << 20)  # SHALLOW
        snap = t.snapshot()
    deep = next(a for a in snap.allocations if a.size == 1 << 20)
    shallow = next(a for a in snap.allocations if a.size == 2 << 20)
    assert len(deep.traceback) == 32
    # the innermost three quarters as before, the last quarter from the user's frame out
    assert [f.filename for f in deep.traceback[-24:]] == ["<frozen memviz-test-helpers>"] * 24
    # the user's frame: _deep's call into the recursion; its caller, the DEEP line, is next
    uf = deep.traceback.user_frame
    assert (uf.filename, uf.name) == (here, "_deep")
    i = list(deep.traceback).index(uf)
    assert deep.traceback[i - 1].lineno == line_of(here, "# DEEP")
    assert shallow.traceback.user_frame.name == "_deep"
    # a stack no deeper than the depth is read whole, as before
    assert shallow.traceback[-1].filename == "<frozen memviz-test-helpers>"


def _recursion_in(mod):
    """rec(k, fn): a recursion k deep written in file `mod`, then fn()."""
    mod.write_text("def rec(k, fn):\n    return rec(k - 1, fn) if k > 0 else fn()\n")
    ns: dict = {}
    exec(compile(mod.read_text(), str(mod), "exec"), ns)
    return ns["rec"]


def test_the_walk_follows_the_filters_configured_paths(fake, tmp_path):
    """A recursion in a file of the user's is the user's line (the innermost
    frames kept); once that file is made a library's, the walk looks past it."""
    mod = tmp_path / "deep_helper.py"
    rec = _recursion_in(mod)
    here = os.path.abspath(__file__)
    alloc = functools.partial(fake.lib.fake_alloc, CBID_cuMemAlloc_v2, 1 << 20, 0, 0)
    with memviz.track(torch=False, depth=32) as t:
        rec(80, alloc)  # MINE
        snap = t.snapshot()
    a = snap.allocations[0]
    assert a.traceback.user_frame.filename == str(mod)
    memviz.frames.add_library_path(str(tmp_path))
    with memviz.track(torch=False, depth=32) as t:
        rec(80, alloc)  # LIBRARY
        snap = t.snapshot()
    a = snap.allocations[0]
    assert (a.traceback.user_frame.filename, a.traceback.user_frame.lineno) == (here, line_of(here, "# LIBRARY"))


def test_with_no_user_frame_the_outermost_frames_are_kept(fake):
    """A thread whose every frame is a library's (threading.py runs it)."""
    done = []

    def run():
        done.append(1)

    with memviz.track(torch=False, depth=32) as t:
        th = threading.Thread(target=_NS["rec"], args=(60, functools.partial(
            fake.lib.fake_alloc, CBID_cuMemAlloc_v2, 1 << 20, 0, 0)))
        th.start()
        th.join()
        snap = t.snapshot()
    a = next(a for a in snap.allocations if a.size == 1 << 20)
    assert len(a.traceback) == 32
    assert a.traceback[0].filename.endswith("threading.py")  # the outermost: _bootstrap
    assert a.traceback[0].name.endswith("_bootstrap")


def test_deep_walk_directly():
    """_core._capture_stack: the walk's own answer, without a tracker."""
    kept = _NS["rec"](90, functools.partial(_core._capture_stack, 32))
    files = [code.co_filename for code, _ in kept]
    assert len(kept) <= 32 and files[:24] == ["<frozen memviz-test-helpers>"] * 24
    assert files[24] == os.path.abspath(__file__)
    # the user's frame among the innermost 32: the walk keeps those, as before
    short = _NS["rec"](3, functools.partial(_core._capture_stack, 32))
    assert [code.co_filename for code, _ in short][3:5] == ["<frozen memviz-test-helpers>", os.path.abspath(__file__)]


def test_a_configured_user_path_wins_over_site_packages_in_the_walk(fake, tmp_path):
    pkg = tmp_path / "site-packages" / "mypkg"
    pkg.mkdir(parents=True)
    mod = pkg / "deep.py"
    rec = _recursion_in(mod)
    here = os.path.abspath(__file__)
    alloc = functools.partial(fake.lib.fake_alloc, CBID_cuMemAlloc_v2, 1 << 20, 0, 0)
    with memviz.track(torch=False, depth=32) as t:
        rec(80, alloc)  # INSTALLED
    uf = t.snapshot().allocations[0].traceback.user_frame
    assert (uf.filename, uf.lineno) == (here, line_of(here, "# INSTALLED"))
    memviz.frames.add_user_path(str(pkg))
    with memviz.track(torch=False, depth=32) as t:
        rec(80, alloc)
    tb = t.snapshot().allocations[0].traceback
    assert tb.user_frame.filename == str(mod) and tb[0].filename == str(mod)  # the innermost 32, as before


def test_other_depths(fake):
    """depth=64 gives the user 16 frames; a depth under 8 keeps the innermost only."""
    here = os.path.abspath(__file__)
    alloc = functools.partial(fake.lib.fake_alloc, CBID_cuMemAlloc_v2, 1 << 20, 0, 0)
    with memviz.track(torch=False, depth=64) as t:
        _NS["rec"](200, alloc)  # SIXTY-FOUR
    tb = t.snapshot().allocations[0].traceback
    assert len(tb) == 64 and [f.filename for f in tb[-48:]] == ["<frozen memviz-test-helpers>"] * 48
    assert tb.user_frame.lineno == line_of(here, "# SIXTY-FOUR")
    assert _NS["rec"](50, functools.partial(_core._capture_stack, 4))[-1][0].co_filename == "<frozen memviz-test-helpers>"
