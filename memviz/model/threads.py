"""Thread names: the C core's thread table (``_core.ThreadRow``: native id,
ident, native name, serial) joined with Python's names of its threads, live
ones and those the tracker saw while tracking (memviz/capture/threads.py
fills :data:`SEEN_THREADS` and :data:`SEEN_RUNNING`).

The model floor (docs/architecture.md): imports nothing above it."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union

from memviz.model.snapshot import ThreadInfo


class PyThread(NamedTuple):
    """Python's view of a thread: its name, and what tells it from others."""

    name: str
    native_id: Optional[int]
    dummy: bool  # a threading._DummyThread: Python made the name up
    ident: Optional[int]

    @classmethod
    def of(cls, t: threading.Thread) -> "PyThread":
        return cls(t.name, getattr(t, "native_id", None),
                   isinstance(t, getattr(threading, "_DummyThread", ())), t.ident)


class SeenThread:
    """A thread seen while tracking: its :class:`PyThread` as last read, and
    the thread itself (weakly), so that a name given after it started is the
    one shown (:meth:`now` reads it again while the thread object lives)."""

    __slots__ = ("last", "_ref")

    def __init__(self, t: threading.Thread) -> None:
        self.last = PyThread.of(t)
        try:
            self._ref: Optional[weakref.ref] = weakref.ref(t)
        except TypeError:  # pragma: no cover - a thread type without weak references
            self._ref = None

    @property
    def ident(self) -> Optional[int]:
        return self.last.ident

    @property
    def native_id(self) -> Optional[int]:
        return self.last.native_id

    def now(self) -> PyThread:
        """The thread's names as they are now (as last seen, once it is gone)."""
        t = self._ref() if self._ref is not None else None
        if t is not None:
            name = t.name
            if name != self.last.name:
                self.last = self.last._replace(name=name)
        return self.last


#: Threads seen while tracking, kept after they end (filled by the tracker),
#: so that their allocations keep a name (a :class:`SeenThread` each, which
#: reads the name again when a snapshot or a trace names the thread).
#: A thread that starts while tracking notes itself under its serial (the C
#: core's thread_serial(), which no other thread of the process ever gets;
#: threading.get_ident() is not unique: glibc hands an ended thread's ident
#: to the next thread); threads already running are noted from outside under
#: (ident, native_id).
SEEN_THREADS: Dict[int, SeenThread] = {}
SEEN_RUNNING: Dict[Tuple[int, Optional[int]], SeenThread] = {}


class _PythonThreads:
    """Python's names of threads: the live ones and those seen while tracking."""

    def __init__(self) -> None:
        self.live: Dict[int, PyThread] = {}
        try:
            active = dict(getattr(threading, "_active", {}))
        except Exception:  # pragma: no cover
            active = {}
        threads = list(active.values())
        try:
            threads += threading.enumerate()
        except Exception:  # pragma: no cover
            pass
        dummy_cls = getattr(threading, "_DummyThread", ())
        for t in threads:
            ident = getattr(t, "ident", None)
            if ident is not None and ident not in self.live:
                self.live[ident] = PyThread(t.name, getattr(t, "native_id", None), isinstance(t, dummy_cls), ident)
        # names read now: a thread renamed after it started shows its new name
        self.by_serial = {k: _now(v) for k, v in list(SEEN_THREADS.items())}
        self.running = {k: _now(v) for k, v in list(SEEN_RUNNING.items())}

    def find(self, ident: Optional[int], native_id: Optional[int], serial: Optional[int]):
        """Python's :class:`PyThread` of that thread, or None."""
        if serial is not None and serial in self.by_serial:
            return self.by_serial[serial]
        if ident is None:
            return None
        py = self.live.get(ident)
        # A different native id means the ident was reused by another thread.
        if py is not None and (py.native_id is None or native_id is None or py.native_id == native_id):
            return py
        return self.running.get((ident, native_id))


def _now(entry: Union[SeenThread, PyThread]) -> PyThread:
    return entry.now() if isinstance(entry, SeenThread) else entry


def _python_thread_names() -> _PythonThreads:
    return _PythonThreads()


def _thread_info(idx: int, entry: Any, py_names: _PythonThreads) -> ThreadInfo:
    """The ThreadInfo of thread table entry ``idx`` (a ``_core.ThreadRow``)."""
    if entry is None:
        return ThreadInfo(None, None, f"thread#{idx}")
    native_id, ident, native_name = entry.native_id, entry.ident, entry.name
    name = native_name or (f"tid {native_id}" if native_id is not None else f"thread#{idx}")
    py = py_names.find(ident, native_id, entry.serial)
    if py is not None and not (py.dummy and native_name):
        name = py.name
    return ThreadInfo(native_id, ident, name)


class _ThreadMap(dict):
    def __init__(self, raw: Mapping[int, Any], py_names: _PythonThreads):
        super().__init__()
        self._raw = raw
        self._py = py_names

    def __missing__(self, idx):
        info = self[idx] = _thread_info(idx, self._raw.get(idx), self._py)
        return info
