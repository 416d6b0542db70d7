"""Naming the call behind an allocation, from its innermost Python frame.

When memory is allocated from Python, the innermost Python frame of the
allocating thread is in the middle of one instruction: the call into native
code that asked for the memory (``F.linear(input, self.weight, self.bias)``
in ``torch/nn/modules/linear.py``), or an operator (``q @ k``). The capture
callback already records that frame's code object and instruction offset, so
the name costs nothing while the program runs: it is worked out here, when a
snapshot or a trace needs it, from the instruction's source span (Python
3.11+ keeps column positions per instruction):

* ``CALL`` and friends: the called expression as written (``x.float``,
  ``linear``), except that a global bound to a module is spelled out with
  the module's own name (``F.linear`` -> ``torch.nn.functional.linear``;
  globals are read from the code's module, from what ``memviz run`` kept
  of its script's, or, for a notebook cell, from ``__main__``);
  a method of a computed object keeps its name only (``f(x).float`` ->
  ``.float``). memviz never evaluates user expressions, so the type of
  ``x`` is not known;
* ``BINARY_OP``: ``operator @`` (``+``, ``*=``, ...); ``BINARY_SUBSCR``:
  ``operator []``; ``STORE_SUBSCR``: ``operator []=``;
* anything else, Python 3.10 (no column positions), or source that cannot
  be read: no name (None).

Names are cached per (code object, offset).
"""

from __future__ import annotations

import ast
import dis
import linecache
import sys
from types import CodeType, ModuleType
from typing import Dict, Iterable, Mapping, Optional, Tuple

import memviz._core as _core

__all__ = ["add_namespace", "call_name", "calls_of", "Resolved", "resolve"]

_CALL_OPS = frozenset(("CALL", "CALL_KW", "CALL_FUNCTION_EX", "PRECALL"))
_SUBSCR = {"BINARY_SUBSCR": "operator []", "STORE_SUBSCR": "operator []="}
_NB_OPS = getattr(dis, "_nb_ops", ())  # [(name, symbol)] by BINARY_OP's argument (3.11+)
_MAX_NAME = 80
_CACHE_LIMIT = 20000

_names: Dict[Tuple[int, int], Tuple[CodeType, Optional[str]]] = {}  # (id(code), offset) -> (code, name)
_positions: Dict[int, Tuple[CodeType, list]] = {}  # id(code) -> (code, positions)
_modules: Dict[str, Optional[ModuleType]] = {}
_modules_seen = [0]
_namespaces: Dict[str, dict] = {}  # file name -> globals of code that ran outside any module


class Resolved(dict):
    """``{stack id: frames}`` as the C core's ``resolve`` returns them, plus
    ``calls``: ``{stack id: call name}`` for the stacks whose innermost call
    could be named."""

    calls: Dict[int, str]

    def __init__(self, frames: Mapping = (), calls: Optional[Dict[int, str]] = None) -> None:
        super().__init__(frames)
        self.calls = calls if calls is not None else {}


def resolve(ids: Iterable[int]) -> Resolved:
    """The C core's ``resolve(ids)``, with the innermost calls named."""
    ids = list(ids)
    return Resolved(_core.resolve(ids), calls_of(ids))


def calls_of(ids: Iterable[int]) -> Dict[int, str]:
    """``{stack id: call name}`` for stacks of the live store."""
    out = {}
    for sid, site in _core.call_sites(ids).items():
        if isinstance(site, _DyingName):  # named as its code died, an alias's module unknown then
            name = site.now()
        else:
            name = site if isinstance(site, str) else call_name(*site)  # a str: named when its code died
        if name:
            out[sid] = name
    return out


def call_name(code: CodeType, offset: int) -> Optional[str]:
    """The name of what the instruction at ``offset`` of ``code`` calls (see
    the module's docstring), or None."""
    # Keyed by the code object's identity: hashing a code object hashes its
    # bytecode and constants, each time (a million lookups into 1,000-line
    # functions took seconds). The entry holds the code, so its id stays its.
    key = (id(code), offset)
    hit = _names.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    try:
        name = _name(code, offset)
    except Exception:  # never let naming break a snapshot: source may be odd or changed
        name = None
    if len(_names) >= _CACHE_LIMIT:
        _names.clear()
        _positions.clear()
    _names[key] = (code, name)
    return name


class _DyingName(str):
    """A call named as its code object died (``G.alloc``) whose root is a
    global that no namespace known then bound to a module: ``memviz run``'s
    script dies as ``runpy`` returns, before the run hands its globals to
    :func:`add_namespace` (3.12+ watch code objects die). :meth:`now`
    spells the root out once the namespace is known."""

    filename: str
    root: str
    rest: str

    def now(self) -> str:
        ns = _namespaces.get(self.filename)
        value = ns.get(self.root) if ns is not None else None
        mod = getattr(value, "__name__", None) if isinstance(value, ModuleType) else None
        if not mod:
            return str(self)
        text = f"{mod}.{self.rest}"
        return text if len(text) <= _MAX_NAME else text[:_MAX_NAME - 3] + "..."


def _name_dying(code: CodeType, offset: int) -> Optional[str]:
    """``call_name`` for a code object being destroyed (the C core watches
    code objects die: src/module.c): nothing may keep a reference to it, so
    nothing is cached. A global root no module was found for is kept, to be
    spelled out later (:class:`_DyingName`)."""
    try:
        unresolved = []
        name = _name(code, offset, cache=False, unresolved=unresolved)
    except Exception:
        return None
    if name is None or not unresolved:
        return name
    out = _DyingName(name)
    out.filename, (out.root, out.rest) = code.co_filename, unresolved[0]
    return out


def _name(code: CodeType, offset: int, cache: bool = True, unresolved: Optional[list] = None) -> Optional[str]:
    raw = code.co_code
    if not 0 <= offset < len(raw) or offset % 2:
        return None
    while offset > 0 and dis.opname[raw[offset]] == "CACHE":
        offset -= 2
    opname = dis.opname[raw[offset]]
    if opname == "BINARY_OP":
        arg = raw[offset + 1]
        return f"operator {_NB_OPS[arg][1]}" if arg < len(_NB_OPS) else "operator"
    if opname in _SUBSCR:
        return _SUBSCR[opname]
    if opname not in _CALL_OPS and not opname.startswith("CALL_FUNCTION") and opname != "CALL_METHOD":
        return None
    seg = _segment(code, offset, cache)
    if seg is None:
        return None
    source, after_dot = seg
    tree = ast.parse(f"(\n{source}\n)", mode="eval").body
    if not isinstance(tree, ast.Call):
        return None
    if after_dot and isinstance(tree.func, ast.Name):
        # a method call across lines: Python starts its span at the name
        return "." + tree.func.id
    return _called(tree.func, code, unresolved)


def _segment(code: CodeType, offset: int, cache: bool = True) -> Optional[Tuple[str, bool]]:
    """The source text of the instruction at ``offset`` (3.11+ positions),
    and whether a ``.`` comes right before it."""
    hit = _positions.get(id(code)) if cache else None
    positions = hit[1] if hit is not None and hit[0] is code else None
    if positions is None:
        if not hasattr(code, "co_positions"):
            return None  # Python 3.10: line numbers only
        positions = list(code.co_positions())
        if cache:
            _positions[id(code)] = (code, positions)
    start, end, col, end_col = positions[offset // 2]
    if start is None or end is None or col is None or end_col is None:
        return None
    lines = linecache.getlines(code.co_filename)
    if not lines or end > len(lines):
        return None
    # column offsets count UTF-8 bytes
    chunk = [ln.encode("utf-8") for ln in lines[start - 1:end]]
    before = chunk[0][:col].rstrip()
    if not before and start >= 2:
        before = lines[start - 2].rstrip()
    after_dot = before.endswith(b".") if isinstance(before, bytes) else before.endswith(".")
    if len(chunk) == 1:
        return chunk[0][col:end_col].decode("utf-8", "replace"), after_dot
    chunk[0] = chunk[0][col:]
    chunk[-1] = chunk[-1][:end_col]
    return b"".join(chunk).decode("utf-8", "replace"), after_dot


def _called(func: ast.expr, code: CodeType, unresolved: Optional[list] = None) -> str:
    parts = []
    node = func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        root = node.id
        local = root in code.co_varnames or root in code.co_cellvars or root in code.co_freevars
        mod = _global_module(code, root) if parts and not local else None
        text = ".".join([mod or root] + parts[::-1])
        if mod is None and parts and not local and unresolved is not None:
            unresolved.append((root, ".".join(parts[::-1])))
    elif parts:
        text = "." + parts[0]  # a method of a computed object: f(x).float(...) -> .float
    else:
        text = ast.unparse(func)
    return text if len(text) <= _MAX_NAME else text[:_MAX_NAME - 3] + "..."


def add_namespace(filename: str, namespace: dict) -> None:
    """The globals that the code of ``filename`` ran with, for naming its
    calls after its module is gone (``memviz run`` runs a script in a
    temporary ``__main__``)."""
    _namespaces[filename] = namespace


def forget_namespaces() -> None:
    """Let go of every namespace add_namespace kept (``memviz run``, once its
    report is written), and collect the script's objects now."""
    import gc

    _namespaces.clear()
    gc.collect()


def _global_module(code: CodeType, name: str) -> Optional[str]:
    """The module name a global ``name`` of ``code``'s module is bound to
    (``F`` -> ``torch.nn.functional``), or None. Reads module dicts only.

    Code whose file is no module's (a notebook cell, exec'd source) is
    looked up in ``__main__``, where IPython keeps the user's names."""
    filename = code.co_filename
    ns = _namespaces.get(filename)
    if ns is None:
        module = _module_of(filename)
        if module is None:
            module = sys.modules.get("__main__")
        ns = vars(module) if isinstance(module, ModuleType) else {}
    value = ns.get(name)
    if isinstance(value, ModuleType):
        return getattr(value, "__name__", None)
    return None


def _module_of(filename: str) -> Optional[ModuleType]:
    if filename.startswith("<"):
        return None  # <string>, <stdin>, <frozen ...>: no module file to match
    mod = _modules.get(filename)
    if mod is not None or (filename in _modules and _modules_seen[0] == len(sys.modules)):
        return mod
    _modules_seen[0] = len(sys.modules)
    for m in list(sys.modules.values()):
        f = vars(m).get("__file__") if isinstance(m, ModuleType) else None
        if isinstance(f, str) and _modules.get(f) is None:
            _modules[f] = m
    _modules.setdefault(filename, None)
    return _modules[filename]


_core.set_call_namer(_name_dying)
