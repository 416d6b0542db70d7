"""Holding Ctrl-C (and SIGTERM) back while memviz closes what must be closed.

``with deferred_interrupt(): close()`` runs the block with SIGINT's handler
replaced by one that only notes the signal (it takes no lock and raises
nothing). When the block ends, the old handler is put back and, if SIGINT
came meanwhile, called once: Python's default handler raises
KeyboardInterrupt there, after the block, so a Ctrl-C while a tracker stops
still stops the program, but only once the trace writer's thread has
stopped and its file is closed (with its END record).

SIGTERM is held the same way: under its default action the process ends
once the block ends; a handler of the program's own (``sys.exit()``, the
usual graceful stop) runs then. Only the main thread may change a handler,
and only it gets KeyboardInterrupt: elsewhere, and where a signal's handler
was not installed from Python, the block runs as it is. Used by the capture session's stop and the
trace subscribers' on_stop (memviz/trace/writer.py, memviz/trace/flight.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List

__all__ = ["deferred_interrupt"]


#: the signals held: Ctrl-C, and the polite stop of a job scheduler or a
#: container (SIGTERM; under Python's default action, or a handler of the
#: program's own that calls sys.exit(): either cut a trace's END record off)
_HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block without KeyboardInterrupt (or a SIGTERM's exit); a
    Ctrl-C or SIGTERM during it is delivered (the old handler called, or
    the default action taken) when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: List[Any] = []  # (signal, frame), in the order they came

    def note(signum: int, frame: Any) -> None:
        caught.append((signum, frame))

    olds = {}
    for sig in _HELD:
        try:
            old = signal.getsignal(sig)
            if old is None:  # installed outside Python: it could not be put back
                continue
            signal.signal(sig, note)
        except (ValueError, OSError, TypeError, AttributeError):
            continue
        olds[sig] = old
    try:
        yield
    finally:
        for sig, old in olds.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        done = set()
        for sig, frame in caught:
            if sig not in done:  # each signal once, as the OS merges a pending signal
                done.add(sig)
                _deliver(sig, olds[sig], frame)


def _deliver(sig: int, handler: Any, frame: Any) -> None:
    """What ``sig`` would have done under ``handler`` (raises
    KeyboardInterrupt under Python's default SIGINT handler)."""
    if handler == signal.SIG_IGN:
        return
    if handler == signal.SIG_DFL:
        signal.raise_signal(sig)
        return
    if callable(handler):
        handler(sig, frame)
