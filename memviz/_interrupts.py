"""Holding Ctrl-C back while memviz closes what must be closed.

``with deferred_interrupt(): close()`` runs the block with SIGINT's handler
replaced by one that only notes the signal (it takes no lock and raises
nothing). When the block ends, the old handler is put back and, if SIGINT
came meanwhile, called once: Python's default handler raises
KeyboardInterrupt there, after the block, so a Ctrl-C while a tracker stops
still stops the program, but only once the trace writer's thread has
stopped and its file is closed (with its END record).

Only the main thread may change a handler, and only it gets
KeyboardInterrupt: elsewhere, and where SIGINT's handler was not installed
from Python, the block runs as it is. Used by the capture session's stop and the
trace subscribers' on_stop (memviz/trace/writer.py, memviz/trace/flight.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List

__all__ = ["deferred_interrupt"]


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block without KeyboardInterrupt; a Ctrl-C during it is
    delivered (the old handler called) when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: List[Any] = []

    def note(signum: int, frame: Any) -> None:
        caught.append(frame)

    try:
        old = signal.getsignal(signal.SIGINT)
        if old is None:  # installed outside Python: it could not be put back
            raise ValueError("foreign handler")
        signal.signal(signal.SIGINT, note)
    except (ValueError, OSError, TypeError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        try:
            signal.signal(signal.SIGINT, old)
        except (ValueError, OSError, TypeError):
            pass
        if caught:
            _deliver(old, caught[-1])


def _deliver(handler: Any, frame: Any) -> None:
    """What SIGINT would have done under ``handler`` (raises KeyboardInterrupt
    under Python's default one)."""
    if handler == signal.SIG_IGN:
        return
    if handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
        return
    if callable(handler):
        handler(signal.SIGINT, frame)
