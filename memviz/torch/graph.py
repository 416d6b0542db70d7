"""What the autograd graph keeps alive, through saved-tensor hooks.

Every tensor an autograd graph saves for backward passes through the pack
hook at the moment it is saved, on the forward line that saved it. The hook
records the tensor's storage (bytes, device, dtype, shape), the user's line
and the time, and returns a small :class:`_Packed` wrapper that the graph
then holds in place of the tensor; the unpack hook, called when backward
needs it, returns the tensor. So:

* a record is *graph-resident* while its wrapper is alive (the graph that
  holds it has not been freed or run);
* a wrapper still alive after a test returned and ``gc.collect()`` ran means
  a graph made inside the test is still reachable: a graph leak;
* the unpack hook runs on the thread that executes the backward node (the
  autograd engine's thread for CUDA tensors), which is where the PyTorch
  integration labels that thread with the node and its forward line.

This works on any device, CPU included.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import memviz._core as _core
from memviz._package import PACKAGE_DIR
from memviz._units import format_size
from memviz.model.frame_filter import frames as _default_filter
from memviz.model.traceback import Frame
from memviz.torch.hooks import listed

__all__ = ["SavedRecord", "GraphRecorder", "Holder", "holders", "describe_holders", "keep_line"]

_MEMVIZ_DIR = PACKAGE_DIR


@dataclass
class SavedRecord:
    """One tensor saved by an autograd graph for backward."""

    nbytes: int
    device: str
    dtype: str
    shape: tuple
    data_ptr: int
    line: Optional[Frame]  # the user's line that saved it
    timestamp_ns: int
    seq: int

    def __str__(self) -> str:
        where = f"{self.line.filename}:{self.line.lineno}" if self.line else "<no Python frame>"
        return (f"{where}: {format_size(self.nbytes)} {self.dtype}{list(self.shape)} on "
                f"{self.device} held by the autograd graph")


class _Packed:
    """What the graph holds instead of the tensor (weak-referenceable).

    Kept small: the pack hook runs for every tensor a graph saves, so it only
    notes the tensor, the user's (code, line) and a sequence number; sizes
    and file names are worked out when someone asks (resident())."""

    __slots__ = ("tensor", "code", "lineno", "seq", "timestamp_ns", "version", "__weakref__")

    def __init__(self, tensor, code, lineno, seq, timestamp_ns, version):
        self.tensor = tensor
        self.code = code
        self.lineno = lineno
        self.seq = seq
        self.timestamp_ns = timestamp_ns
        self.version = version  # the tensor's version counter when saved (None: it keeps none)

    @property
    def line(self) -> Optional[Frame]:
        if self.code is None:
            return None
        c = self.code
        return Frame(c.co_filename, self.lineno, getattr(c, "co_qualname", c.co_name))

    def record(self) -> SavedRecord:
        t = self.tensor
        try:
            storage = t.untyped_storage()
            nbytes, ptr = storage.nbytes(), storage.data_ptr()
        except Exception:  # noqa: BLE001 - sparse, meta, tensor subclasses
            nbytes, ptr = t.numel() * t.element_size(), 0
        return SavedRecord(nbytes, str(t.device), str(t.dtype).replace("torch.", ""),
                           tuple(t.shape), ptr, self.line, self.timestamp_ns, self.seq)


#: per thread, the stopped recorders whose hooks could not be popped (another
#: thread stopped them, or the user's own hooks were above), with their
#: contexts: inert, but their presence still turns PyTorch's torch.func away
_inert: Dict[int, list] = {}
_inert_lock = threading.Lock()


def pop_inert() -> None:
    """Pop this thread's inert hooks that are innermost now (called when a
    recorder or a tracker starts on it)."""
    me = threading.get_ident()
    with _inert_lock:
        alive = {t.ident for t in threading.enumerate()}
        for ident in [i for i in _inert if i not in alive]:  # their hook stacks went with them
            del _inert[ident]
        mine = _inert.get(me)
        while mine:
            top = next((i for i, (rec, _) in enumerate(mine) if rec._on_top()), None)
            if top is None:
                break
            _, ctx = mine.pop(top)
            ctx.__exit__(None, None, None)
        if not mine:
            _inert.pop(me, None)


def _version(tensor) -> Optional[int]:
    """The tensor's version counter (bumped by each in-place change); None
    for a tensor that keeps none (inference mode)."""
    try:
        return tensor._version
    except Exception:  # noqa: BLE001 - inference tensors, some subclasses
        return None


def _check_version(packed: _Packed) -> None:
    """PyTorch's own check on a saved tensor, which it leaves out for every
    tensor a saved-tensor hook packed: changed in place since it was saved,
    its backward would compute wrong gradients without a word."""
    if packed.version is None:
        return
    t = packed.tensor
    now = _version(t)
    if now is not None and now != packed.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {now}; expected version "
            f"{packed.version} instead. (memviz's saved-tensor hooks, on with track(autograd=True) "
            f"or graph=True, make PyTorch's own check, which hooks turn off.) Hint: the operation "
            f"that changed it in place is after the line that saved it"
            + (f" ({packed.line.filename}:{packed.line.lineno})" if packed.line else "")
            + "; change it to an out-of-place one (x = x.mul(2), not x.mul_(2)), or clone the "
              "tensor before changing it.")


def user_line(depth: int = 2, flt=None) -> Optional[Frame]:
    """The innermost non-library frame of the calling thread."""
    flt = flt or _default_filter
    f = sys._getframe(1)
    for _ in range(depth - 1):
        if f.f_back is None:
            break
        f = f.f_back
    first = f
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        if not fn.startswith(_MEMVIZ_DIR) and not flt.is_library(fn):
            return Frame(fn, f.f_lineno, getattr(code, "co_qualname", code.co_name))
        f = f.f_back
    if first is not None:
        return Frame(first.f_code.co_filename, first.f_lineno, first.f_code.co_name)
    return None


class GraphRecorder:
    """Records what autograd graphs save, while started.

    ``on_unpack(packed)`` (optional) is called in the unpack hook, on the
    thread running the backward node, with the GIL held; ``packed.code`` /
    ``packed.lineno`` are the user's forward line.
    """

    def __init__(self, on_unpack: Optional[Callable[[_Packed], None]] = None, frame_filter=None):
        self.on_unpack = on_unpack
        self.frame_filter = frame_filter or _default_filter
        self._live: Dict[int, "weakref.ref[_Packed]"] = {}
        self._is_user: Dict[Any, bool] = {}  # code object -> user code?
        self._seq = 0
        self._ctx = None
        self._thread: Optional[int] = None  # the thread whose hook stack holds the hooks
        self._inert = False  # stopped from another thread: the hooks there pass tensors through

    # -- hooks (called by autograd, with the GIL) --------------------------

    def _pack(self, tensor):
        # Runs for every saved tensor: a cached walk to the user's frame,
        # one small object and one weak reference.
        if self._inert:  # stopped, not popped (stop()): nothing recorded, the version still checked
            return _Packed(tensor.detach(), None, 0, 0, 0, _version(tensor))
        is_user = self._is_user
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            u = is_user.get(code)
            if u is None:
                fn = code.co_filename
                u = is_user[code] = not fn.startswith(_MEMVIZ_DIR) and not self.frame_filter.is_library(fn)
            if u:
                break
            f = f.f_back
        self._seq += 1  # the GIL serialises pack hooks
        seq = self._seq
        # detach(): a saved *output* packed as itself would hold its own grad_fn,
        # a reference cycle through C++ that gc cannot see, so every graph that
        # is dropped without backward would leak. Autograd restores the grad_fn
        # on unpack, so the detached tensor is all it needs.
        packed = _Packed(tensor.detach(), f.f_code if f is not None else None,
                         f.f_lineno if f is not None else 0, seq, time.monotonic_ns(), _version(tensor))
        live = self._live
        live[seq] = weakref.ref(packed, lambda _r, seq=seq, live=live: live.pop(seq, None))
        return packed

    def _unpack(self, packed):
        if type(packed) is not _Packed:  # saved before we started
            return packed
        _check_version(packed)
        cb = self.on_unpack
        if cb is not None and packed.seq:
            try:
                cb(packed)
            except Exception:  # noqa: BLE001 - never break the user's backward
                pass
        return packed.tensor

    # -- control --------------------------------------------------------------

    def start(self) -> "GraphRecorder":
        import torch

        if self._ctx is not None:
            return self
        pop_inert()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        self._thread, self._inert = threading.get_ident(), False
        return self

    def stop(self) -> None:
        """Take the hooks off. PyTorch keeps a hook stack per thread, and a
        pop takes its innermost entry: on another thread than the one that
        started (that thread's hooks, or none: PyTorch's internal assert), or
        under the user's own hooks pushed after these (theirs), popping took
        the wrong ones. Then these stay, inert (nothing recorded; the in-place
        check kept; a graph saved under them still unpacks), until a start on
        their thread finds them innermost (pop_inert)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            if threading.get_ident() == self._thread and self._on_top():
                ctx.__exit__(None, None, None)
            else:  # another thread, or the user's own hooks above ours: theirs to pop
                self._inert = True
                with _inert_lock:  # popped when they are on top there again (pop_inert)
                    _inert.setdefault(self._thread, []).append((self, ctx))

    def _on_top(self) -> bool:
        """Whether this thread's innermost saved-tensor hooks are these (a
        user's own pushed after them, save_on_cpu say, would be popped in
        their place)."""
        import torch

        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:
            return True
        try:
            hooks = top(False)
        except Exception:  # noqa: BLE001 - another signature: pop as before
            return True
        return hooks is not None and hooks[0] == self._pack

    @property
    def running(self) -> bool:
        return self._ctx is not None

    # -- reading --------------------------------------------------------------

    def resident(self) -> List[SavedRecord]:
        """Tensors that autograd graphs still hold, oldest first; a storage
        saved several times is listed once."""
        out, seen = [], set()
        for seq in sorted(list(self._live)):
            ref = self._live.get(seq)
            p = ref() if ref is not None else None
            if p is None:
                continue
            rec = p.record()
            key = (rec.device, rec.data_ptr) if rec.data_ptr else ("seq", seq)
            if key in seen:
                continue
            seen.add(key)
            out.append(rec)
        return out

    def mark(self) -> int:
        """A point to compare against with :meth:`resident_since`."""
        return self._seq

    def resident_since(self, mark: int) -> List[SavedRecord]:
        """Graph-resident tensors saved after ``mark``."""
        return [r for r in self.resident() if r.seq > mark]

    @staticmethod
    def autograd_mark() -> int:
        """The calling thread's autograd sequence number now: nodes created
        later have larger numbers (used to find graphs made after a point)."""
        import torch

        peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
        if peek is not None:  # the next number to be given out: ~0.1 us, creates nothing
            return peek() - 1
        with torch.enable_grad():
            return torch.ones(1, requires_grad=True).mul(1).grad_fn._sequence_nr()

    @staticmethod
    def roots_since(seq_nr: int, limit: int = 20) -> list:
        """Live tensors whose grad_fn was created after ``seq_nr``: the tensors
        through which a graph made after that point is still reachable."""
        import torch

        out = []
        # The tensors among the collector's objects, sorted in C, which also keeps
        # gc.get_objects()' list from Python code (src/module_heap.c); by their
        # MRO, so a weakref.proxy (torch.compile makes them) is not one.
        tensors = _core.heap_kinds(None, torch.Tensor, None, None)[0]
        for obj in tensors:
            try:
                fn = obj.grad_fn
                if fn is None or fn._sequence_nr() <= seq_nr:
                    continue
            except Exception:  # noqa: BLE001 - sparse, meta, subclasses
                continue
            # Tensors a graph saved are inside it, not what keeps it alive.
            if all(isinstance(r, _Packed) or r is tensors for r in _core.referrers(obj)):
                continue
            out.append(obj)
        del tensors
        # Keep roots: drop tensors that are inputs of another kept tensor's graph
        # is expensive; the largest sequence numbers are the outputs.
        out.sort(key=lambda t: -t.grad_fn._sequence_nr())
        return out[:limit]


class Holder(NamedTuple):
    """Something that keeps a tensor alive: a description ("list `history` in
    module train") and, when it can be found, the line that stores into it."""

    description: str
    location: Optional[str] = None  # "file:line" of e.g. `history.append(...)`


def describe_holders(tensor, limit: int = 3, exclude=()) -> List[str]:
    """Who refers to ``tensor``: 'list `history` in module test_x' and the like.

    ``exclude``: containers of the caller's own (e.g. its list of roots)."""
    return [h.description for h in holders(tensor, limit, exclude)]


def holders(tensor, limit: int = 3, exclude=(), near=None) -> List[Holder]:
    """Like :func:`describe_holders`, with the line that stores into the
    holding container when the source shows one (``history.append(loss)``).

    ``near``: ``(filename, line)`` of code that made the tensor; a store in
    the same function is preferred."""
    import types

    skip = {id(x) for x in exclude}
    out: List[Holder] = []
    for ref in _core.referrers(tensor):  # not gc's: see src/module_heap.c
        if id(ref) in skip or isinstance(ref, (_Packed, types.CellType)):
            continue
        if isinstance(ref, types.FrameType):
            code = ref.f_code
            names = [k for k, v in listed(ref.f_locals.items()) or () if v is tensor]
            out.append(Holder(
                f"local `{names[0] if names else '?'}` of "
                f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"
                f" ({code.co_filename}:{ref.f_lineno})", f"{code.co_filename}:{ref.f_lineno}"))
        elif isinstance(ref, dict) and isinstance(ref.get("__name__"), str) and "__builtins__" in ref:
            names = [k for k, v in listed(ref.items()) or () if v is tensor]
            out.append(Holder(f"global `{names[0] if names else '?'}` in module {ref['__name__']}"))
        elif isinstance(ref, (list, dict, set, tuple)):
            owner = _owner(ref)
            if owner is None:
                out.append(Holder(f"a {type(ref).__name__}"))
            else:
                text, name, filename, start, end = owner
                hint = near[1] if near and filename and near[0] == filename else None
                line = keep_line(name, filename, start, end, near=hint) if filename else None
                out.append(Holder(f"{type(ref).__name__} {text}", f"{filename}:{line}" if line else None))
        else:
            out.append(Holder(f"a {type(ref).__name__} object"))
        if len(out) >= limit:
            break
    return out


_KEEP_METHODS = frozenset(("append", "extend", "insert", "add", "update", "setdefault", "appendleft"))
_PLAIN_METHODS = frozenset(("item", "tolist", "detach", "numpy"))
_PLAIN_FUNCS = frozenset(("float", "int", "str", "round", "len", "bool"))


def keep_line(name: str, filename: str, start: int = 1, end: Optional[int] = None,
              near: Optional[int] = None) -> Optional[int]:
    """The first code line of ``filename`` (from ``start`` to ``end``) that
    stores into the container ``name`` (a variable or an attribute):
    ``name.append(...)``, ``name += ...``, ``name[k] = ...``, not counting
    values that hold no graph (``x.item()``, ``float(x)``). With ``near`` (a
    line), lines in the function around it are preferred. Strings and
    comments never match: the source is parsed."""
    import ast
    import linecache

    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None

    def named(expr) -> bool:
        return ((isinstance(expr, ast.Name) and expr.id == name)
                or (isinstance(expr, ast.Attribute) and expr.attr == name))

    def plain(expr) -> bool:
        """A value that cannot hold a graph: x.item(), float(x), x.detach()..."""
        if not isinstance(expr, ast.Call):
            return isinstance(expr, ast.Constant)
        f = expr.func
        return ((isinstance(f, ast.Attribute) and f.attr in _PLAIN_METHODS)
                or (isinstance(f, ast.Name) and f.id in _PLAIN_FUNCS))

    if near is not None:  # the innermost function around `near`, if any has a match
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.lineno <= near <= (n.end_lineno or n.lineno)]
        if funcs:
            f = max(funcs, key=lambda n: n.lineno)
            inner = keep_line(name, filename, max(start, f.lineno), min(end or f.end_lineno, f.end_lineno))
            if inner is not None:
                return inner
    best = None
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        if line is None or line < start or (end is not None and line > end):
            continue
        if isinstance(node, ast.Call):
            hit = (isinstance(node.func, ast.Attribute) and node.func.attr in _KEEP_METHODS
                   and named(node.func.value) and not (node.args and all(plain(a) for a in node.args)))
        elif isinstance(node, ast.AugAssign):
            hit = named(node.target) and not plain(node.value)
        elif isinstance(node, ast.Assign):
            hit = (any(isinstance(tg, ast.Subscript) and named(tg.value) for tg in node.targets)
                   and not plain(node.value))
        else:
            hit = False
        if hit and (best is None or line < best):
            best = line
    return best


def _owner(container):
    """(text, name, filename, first line, last line) of what names ``container``:
    a module global, a local of a running function, or an object's attribute."""
    import sys
    import types

    # The best name first: a module's global, a running function's local, an
    # object's attribute; a dict that is none of these (a frame's cached
    # f_locals, say, left by whatever read it last) only when nothing better
    # refers to it. the collector's order of referrers is not the program's.
    best, rank = None, 9
    for ref in _core.referrers(container):  # not gc's: see src/module_heap.c
        if isinstance(ref, dict):
            for k, v in listed(ref.items()) or ():
                if v is container and isinstance(k, str):
                    mod = ref.get("__name__") if isinstance(ref.get("__name__"), str) else None
                    fn = ref.get("__file__") if isinstance(ref.get("__file__"), str) else None
                    r = 0 if mod else 3
                    if r < rank:
                        best, rank = (f"`{k}`" + (f" in module {mod}" if mod else ""), k, fn, 1, None), r
                    break
        elif isinstance(ref, types.FrameType) and rank > 1:
            for k, v in listed(ref.f_locals.items()) or ():
                if v is container:
                    code = ref.f_code
                    best, rank = (f"`{k}` (a local of {code.co_name})", k, code.co_filename,
                                  code.co_firstlineno, None), 1
                    break
        elif rank > 2 and not isinstance(ref, (list, tuple, set, types.FunctionType, type)):
            attrs = getattr(ref, "__dict__", None)
            if isinstance(attrs, dict):
                for k, v in listed(attrs.items()) or ():
                    if v is container:
                        mod = sys.modules.get(type(ref).__module__)
                        fn = getattr(mod, "__file__", None)
                        best, rank = (f"`{k}` of a {type(ref).__name__} object", k, fn, 1, None), 2
                        break
        if rank == 0:
            break
    if rank <= 2:
        return best
    local = _local_owner(container)
    return local if local is not None else best


def _local_owner(container):
    """A running function's local variable that is ``container`` (frames of
    running functions are not gc referrers since Python 3.11)."""
    import sys

    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if not code.co_filename.startswith(_MEMVIZ_DIR):
                for k, v in listed(frame.f_locals.items()) or ():
                    if v is container:
                        return (f"`{k}` (a local of {code.co_name})", k, code.co_filename,
                                code.co_firstlineno, None)
            frame = frame.f_back
    return None
