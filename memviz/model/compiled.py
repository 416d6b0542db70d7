"""The model's own lines behind ``torch.compile``'s generated code.

Inductor turns a model's forward and backward into Python modules it writes
into its cache folder (``/tmp/torchinductor_<user>/xy/cxy....py``); their
``call`` allocates every buffer (``buf3 = empty_strided_cuda(...)``) and
launches the kernels. A line there means nothing to a user, and the frame
filter counts those files as library code (memviz.model.frame_filter).

What maps them back is PyTorch's own: when Inductor loads a module it keeps,
per module, which of its lines came from which FX node's stack trace
(``torch._inductor.codecache.PyCodeCache.linemaps``, the table
``stack_frames_for_code`` reads): the model's source lines that made the
node. This module reads that table when a snapshot or a report is made
(never on the capture path: the C core records only code objects and
offsets), and only when torch's codecache is already imported (it never
imports torch).

A stack that holds a frame of a generated ``call`` with a known node is
rewritten, once per stack:

* the node's source frames (oldest first, as in the stack trace) are put in
  just outside the generated frame; the innermost of them is a
  :class:`~memviz.model.lines.CompiledFrame`, so the allocation's line reads
  ``model.py:42 (compiled: aten.addmm)``, ``(compiled: aten.mul, fused with
  2 more)`` for a buffer of a kernel that fused several nodes, and
  ``(compiled backward: aten.mm)`` for a buffer of the backward (whose nodes
  carry their forward lines);
* the generated frame stays, one level down, its function named with the
  buffer and the kernel that writes it (``call [buf3 = triton_poi_fused_mul_0]``),
  so the traceback view and the HTML icicle show the generated file and the
  kernel under the model's line;
* the allocation's ``op`` becomes the ATen op (``aten.addmm``) or, when
  Inductor wrote none down, the kernel's name.

What it cannot do: a trace read back in another process has no such table
(the generated frame is library code there, so the line is the caller of
the compiled model); a stack cut before the generated frame (deeper than
``depth``) is not rewritten.

The model floor (docs/architecture.md): imports nothing above it.
"""

from __future__ import annotations

import linecache
import re
import sys
from bisect import bisect_right
from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence, Tuple

from memviz.model.frame_filter import is_generated
from memviz.model.lines import CompiledFrame
from memviz.model.traceback import Frame

__all__ = ["Provenance", "active", "expand", "provenance"]

_TRACE_FRAME = re.compile(r'File "(.+)", line (\d+), in ([^\n]+)\n')
_BUFFER = re.compile(r"\s*(\w+)\s*=\s*(.*)$")
_ALLOC_CALL = re.compile(r"(empty_strided\w*|alloc_from_pool|torch\.empty\w*)\(")
_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\(")
_SOURCES = re.compile(r"#\s*(?:Topologically Sorted )?Source Nodes:\s*\[([^\]]*)\](?:,\s*Original ATen:\s*\[([^\]]*)\])?")
_AOT_ID = re.compile(r"#\s*AOT ID:\s*\[([^\]]*)\]")
#: ATen ops that only view (no memory, no arithmetic): not counted as fused nodes
_VIEWS = frozenset(("t", "permute", "view", "expand", "reshape", "_unsafe_view", "squeeze", "unsqueeze",
                    "transpose", "slice", "select", "as_strided", "alias", "detach", "split", "unbind",
                    "clone", "_to_copy", "convert_element_type", "full", "full_default", "lift_fresh_copy"))


class Provenance(NamedTuple):
    """What a generated line of a compiled ``call`` came from.

    ``frames``: the model's source frames of the FX node (oldest first);
    ``buffer``: the buffer that line allocates (``buf3``) or None;
    ``kernel``: the kernel that writes it (``triton_poi_fused_mul_0``,
    ``extern_kernels.mm``) or None; ``op``: the ATen op (``aten.mm``) or
    None; ``fused``: how many other (non-view) nodes the kernel fused;
    ``backward``: the line is in a compiled backward."""

    frames: Tuple[Frame, ...]
    buffer: Optional[str]
    kernel: Optional[str]
    op: Optional[str]
    fused: int
    backward: bool

    @property
    def tag(self) -> str:
        """``compiled: aten.mul, fused with 2 more`` (the line's suffix)."""
        head = "compiled backward" if self.backward else "compiled"
        what = self.op or self.kernel
        text = f"{head}: {what}" if what else head
        if self.fused > 0:
            text += f", fused with {self.fused} more"
        return text


def _linemaps() -> Optional[dict]:
    codecache = sys.modules.get("torch._inductor.codecache")
    cache = getattr(codecache, "PyCodeCache", None)
    maps = getattr(cache, "linemaps", None)
    return maps if isinstance(maps, dict) else None


#: is_generated's answers by file name (a snapshot asks for every frame of every stack)
_generated: dict = {}


def active() -> bool:
    """True when torch has loaded a compiled module in this process (only
    then can a stack hold one): a dict lookup, checked once per snapshot."""
    return bool(_linemaps())


def _parse_trace(text: str) -> Tuple[Frame, ...]:
    return tuple(Frame(f, int(n), name.strip()) for f, n, name in _TRACE_FRAME.findall(text))


def _node_frames(path: str, lineno: int) -> Optional[Tuple[Frame, ...]]:
    """The source frames (oldest first) of the FX node behind ``path:lineno``,
    as torch's ``PyCodeCache.stack_frames_for_code`` finds them."""
    maps = _linemaps()
    if not maps:
        return None
    entry = maps.get(path)
    if not entry or len(entry) != 2:
        return None
    lines, traces = entry
    p = bisect_right(lines, lineno)
    if p == 0:
        return None
    trace = traces[p - 1]
    if not trace or not isinstance(trace, str):
        return None
    return _parse_trace(trace) or None


def _names(text: Optional[str]) -> List[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _op_of(aten: List[str]) -> Optional[str]:
    """The ATen op that makes a kernel's output: the last one that is not a view."""
    for op in reversed(aten):
        if op.rsplit(".", 1)[-1] not in _VIEWS:
            return op
    return aten[-1] if aten else None


def _kernel_of(lines: Sequence[str], start: int, buffer: str) -> Tuple[Optional[str], int]:
    """(kernel, its line index) of the first call after line index ``start``
    that takes ``buffer`` (the kernel that writes it)."""
    word = re.compile(rf"\b{re.escape(buffer)}\b")
    indent = len(lines[start]) - len(lines[start].lstrip())
    for i in range(start + 1, min(len(lines), start + 400)):
        s = lines[i]
        body = s.strip()
        if not body or body.startswith("#"):
            continue
        if len(s) - len(s.lstrip()) < indent or body.startswith("return"):
            break
        if body.startswith(("del ", "assert_")) or not word.search(body):
            continue
        if re.match(rf"\w+\s*=\s*{re.escape(buffer)}\s*;", body):  # buf5 = buf1; del buf1  # reuse
            continue
        m = _CALL.match(s)
        if m is None:
            m = _BUFFER.match(s)
            m = _CALL.match(m.group(2)) if m else None
        if m is not None:
            name = m.group(1)
            if name.endswith(".run"):
                name = name[:-4]
            if name in ("reinterpret_tensor", "get_raw_stream"):
                continue
            return name, i
    return None, -1


def _sources_near(lines: Sequence[str], kernel_line: int, kernel: Optional[str]):
    """(source nodes, ATen ops) from Inductor's comment just above the
    kernel's call, or above the kernel's definition in the module."""
    for i in range(kernel_line - 1, max(-1, kernel_line - 6), -1):
        s = lines[i].strip()
        m = _SOURCES.search(s)
        if m:
            return _names(m.group(1)), _names(m.group(2))
        if s and not s.startswith("#") and not re.match(r"stream\d*\s*=", s):
            break
    if kernel and "." not in kernel:
        head = re.compile(rf"{re.escape(kernel)}\s*=")
        for i, s in enumerate(lines):
            if head.match(s):
                for j in range(i - 1, max(-1, i - 12), -1):
                    m = _SOURCES.search(lines[j])
                    if m:
                        return _names(m.group(1)), _names(m.group(2))
                    if lines[j].strip() and not lines[j].lstrip().startswith("#"):
                        break
                break
    return [], []


def _is_backward(lines: Sequence[str]) -> bool:
    for s in lines[:5]:
        m = _AOT_ID.search(s)
        if m:
            return "backward" in m.group(1)
    return False


@lru_cache(maxsize=8192)
def _provenance(path: str, lineno: int, generation: int) -> Optional[Provenance]:
    frames = _node_frames(path, lineno)
    if not frames:
        return None
    lines = linecache.getlines(path)
    buffer = kernel = op = None
    fused = 0
    if 0 < lineno <= len(lines):
        i = lineno - 1
        m = _BUFFER.match(lines[i])
        sources: List[str] = []
        aten: List[str] = []
        if m is not None:
            buffer, rhs = m.group(1), m.group(2)
            if _ALLOC_CALL.match(rhs):
                kernel, k = _kernel_of(lines, i, buffer)
            else:  # the op allocates its own output: buf3 = torch.ops.aten.foo.default(...)
                c = _CALL.match(rhs)
                kernel, k = (c.group(1) if c else None), i
            if k >= 0:
                sources, aten = _sources_near(lines, k, kernel)
        else:
            c = _CALL.match(lines[i])
            kernel = c.group(1) if c else None
            sources, aten = _sources_near(lines, i, kernel)
        op = _op_of(aten)
        if op is None and kernel and kernel.startswith(("torch.ops.", "aten.")):
            op = kernel.replace("torch.ops.", "", 1)
        real = [n for n in aten if n.rsplit(".", 1)[-1] not in _VIEWS]
        fused = max(0, len(real) - 1)
    return Provenance(frames, buffer, kernel, op, fused, _is_backward(lines))


def _generation() -> int:
    """Changes when Inductor loads another module (its table grows)."""
    maps = _linemaps()
    return len(maps) if maps else 0


def provenance(path: str, lineno: int) -> Optional[Provenance]:
    """What line ``lineno`` of the generated module ``path`` came from, or
    None (not a generated module torch loaded in this process, or a line no
    FX node made)."""
    if not is_generated(path) or _linemaps() is None:
        return None
    return _provenance(path, lineno, _generation())


def expand(raw: Sequence[Tuple[str, int, str]]) -> Optional[Tuple[List[Frame], Optional[str]]]:
    """A stack (innermost first, as the C core resolves it: ``(filename,
    lineno, name)`` triples) with its innermost compiled ``call`` frame
    mapped to the model's source (the module docstring): ``(frames
    innermost first, op)``, or None when the stack holds no such frame."""
    if _linemaps() is None:
        return None
    memo = _generated
    for i, rf in enumerate(raw):
        filename, lineno, name = rf[0], rf[1], rf[2]
        gen = memo.get(filename)
        if gen is None:
            if len(memo) > 50000:
                memo.clear()
            gen = memo[filename] = bool(filename) and is_generated(filename)
        if not gen:
            continue
        prov = provenance(filename, lineno or 0)
        if prov is None:
            continue
        out: List[Frame] = [Frame(f or "<unknown>", (n if n and n > 0 else 0), nm or "") for f, n, nm in raw[:i]]
        label = f"{name or 'call'} [{prov.buffer} = {prov.kernel}]" if prov.buffer and prov.kernel else (
            f"{name or 'call'} [{prov.kernel}]" if prov.kernel else (name or "call"))
        out.append(Frame(filename, lineno or 0, label))
        model = list(reversed(prov.frames))  # innermost first
        top = model[0]
        out.append(CompiledFrame(top.filename, top.lineno, top.name, prov.tag))
        out.extend(model[1:])
        out.extend(Frame(f or "<unknown>", (n if n and n > 0 else 0), nm or "") for f, n, nm in raw[i + 1:])
        return out, (prov.op or prov.kernel)
    return None

