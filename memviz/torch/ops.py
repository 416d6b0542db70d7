"""Torch-function labels: forward allocations name the torch function that
made them (``torch.nn.functional.linear``, ``torch.Tensor.add``...).

A ``TorchFunctionMode`` pushed on the thread that starts tracking sets the
thread's memviz label to the function for the length of each outermost
torch-function call (PyTorch does not re-enter a mode from inside its own
handler), keeping any user label, and puts the previous label back after.
The capture path reads that label like any other. It costs about 1.7 µs per
torch-function call on the CPU machine (benchmarks/bench_op_modes.py; a GPT
forward makes about 250 of them: ~1.5% of its H200 step by estimate); off by
default (``track(ops=True)``, ``--ops``) until measured on a GPU. Inside a
backward node the node's own label wins.

Under ``torch.compile`` the handler does nothing but call the function
(``torch.compiler.is_compiling()``), so compiled code traces it away."""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

from .. import _core
from .._snapshot import AUTOGRAD_LABEL, OP_LABEL, encode_op_label

__all__ = ["OpLabels"]


def _function_name(func) -> str:
    try:
        from torch.overrides import resolve_name

        name = resolve_name(func)
    except Exception:  # noqa: BLE001 - very old torch
        name = None
    if not name:
        name = f"{getattr(func, '__module__', '') or ''}.{getattr(func, '__qualname__', repr(func))}".lstrip(".")
    return name


def _make_mode_class():
    import torch
    from torch.overrides import TorchFunctionMode

    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
    label_get, label_set = _core.label_get, _core.label_set

    class OpLabelMode(TorchFunctionMode):
        """memviz's torch-function labels (see memviz.torch.ops)."""

        def __init__(self, owner: "OpLabels") -> None:
            super().__init__()
            self.owner = owner

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if kwargs is None:
                kwargs = {}
            owner = self.owner
            if not owner.on or is_compiling():
                return func(*args, **kwargs)
            prev = label_get()
            lid = owner.ids.get((prev, func))
            if lid is None:
                lid = owner.intern(prev, func)
            if not lid:  # inside a backward node (pre-hook label): the node's label stays
                return func(*args, **kwargs)
            label_set(lid)
            try:
                return func(*args, **kwargs)
            finally:
                label_set(prev)

    return OpLabelMode


class OpLabels:
    """Installs the mode on the calling thread; ``remove()`` takes it off."""

    def __init__(self) -> None:
        self.on = False
        self.ids: Dict[Tuple[int, Any], int] = {}
        self._names: Dict[Any, str] = {}
        self._mode = None
        self._thread: Optional[int] = None
        self._lock = threading.Lock()

    def intern(self, prev: int, func) -> int:
        """Label id for ``func`` under the thread's current label ``prev``
        (0: leave the label alone)."""
        with self._lock:
            name = self._names.get(func)
            if name is None:
                name = self._names[func] = _function_name(func)
            user = _core.label_name(prev) if prev else None
            if user and user[0] == AUTOGRAD_LABEL:
                lid = 0
            else:
                if user and user[0] == OP_LABEL:  # nested by another thread's mode: keep the user part
                    user = user[1:].partition("\x1f")[2] or None
                lid = _core.label_intern(encode_op_label(name, user))
            self.ids[(prev, func)] = lid
            return lid

    def install(self) -> bool:
        try:
            self._mode = _make_mode_class()(self)
            self._mode.__enter__()
        except Exception:  # noqa: BLE001 - a torch without modes: labels stay off
            self._mode = None
            return False
        self._thread = threading.get_ident()
        self.on = True
        return True

    def remove(self) -> Optional[str]:
        """Take the mode off. Returns why it had to stay (inert) or None."""
        self.on = False
        mode, self._mode = self._mode, None
        if mode is None:
            return None
        if threading.get_ident() != self._thread:
            return "tracking stopped on another thread than it started on: the mode stays there, inert"
        try:
            from torch.overrides import _get_current_function_mode_stack

            stack = _get_current_function_mode_stack()
            if not stack or stack[-1] is not mode:
                return "another torch function mode was pushed after memviz's: memviz's stays, inert"
        except ImportError:
            pass
        mode.__exit__(None, None, None)
        return None
