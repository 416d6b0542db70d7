"""Python's names of the threads that allocate while tracking.

Threads often end before a snapshot is taken, so they are noted as they
run (memviz.model.threads' SEEN_THREADS, under the C core's thread serial)
or from outside (SEEN_RUNNING, under ident and native id), and their names
are read when a snapshot or a trace names its threads (again each time,
while the thread object lives: a thread renamed after it started shows its
new name). The tracker switches the watching on when capture starts and
off when the last tracker stops.

Imports the model and the C core only (docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import sys
import threading

import memviz._core as _core
from memviz.model.threads import SEEN_RUNNING, SEEN_THREADS, SeenThread

__all__ = ["note_running_threads", "note_this_thread", "watch", "forget"]

#: SEEN_THREADS may hold this many entries before it is pruned
_SEEN_KEEP = 2 * _core.MAX_THREADS
_seen_prune_at = _SEEN_KEEP  # written here only (note_this_thread)




def _note_thread(t: threading.Thread) -> None:
    """Remember a running thread's name, from any thread."""
    if t.ident is not None:
        SEEN_RUNNING[(t.ident, getattr(t, "native_id", None))] = SeenThread(t)


def note_running_threads() -> None:
    """Remember the names of every thread running now."""
    for t in threading.enumerate():
        _note_thread(t)


def note_this_thread() -> None:
    """Remember the calling thread's name under its serial. Entries of ended
    threads that the C core's table does not hold are dropped as they pile
    up (a process may start threads without end)."""
    global _seen_prune_at
    SEEN_THREADS[_core.thread_serial()] = SeenThread(threading.current_thread())
    if len(SEEN_THREADS) > _seen_prune_at:
        try:
            keep = {row.serial for row in _core.threads().values()}
        except RuntimeError:  # the store is not set up: keep everything
            return
        alive = {(t.ident, getattr(t, "native_id", None)) for t in threading.enumerate()}
        for serial, entry in list(SEEN_THREADS.items()):
            if serial not in keep and (entry.ident, entry.native_id) not in alive:
                SEEN_THREADS.pop(serial, None)
        _seen_prune_at = max(_SEEN_KEEP, 2 * len(SEEN_THREADS))


def _thread_start_hook(frame, event, arg):
    """threading.setprofile hook while tracking: runs once in each new thread
    to remember its name (threads often end before a snapshot is taken),
    then removes itself, so the thread's calls cost nothing afterwards."""
    sys.setprofile(None)
    note_this_thread()


def watch(on: bool) -> None:
    """Start (note the running threads, then each new one as it starts) or
    stop watching threads; another profile hook already set is left alone."""
    if on:
        note_running_threads()
        if getattr(threading, "_profile_hook", None) is None:
            threading.setprofile(_thread_start_hook)
    elif getattr(threading, "_profile_hook", None) is _thread_start_hook:
        threading.setprofile(None)


def forget() -> None:
    """Drop the names noted for the previous capture (the store is reused)."""
    SEEN_THREADS.clear()
    SEEN_RUNNING.clear()
