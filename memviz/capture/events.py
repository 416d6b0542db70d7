"""What listens to a tracker hears of it: the capture session's typed event
interface. A subscriber (the PyTorch integration, the trace writer, the
flight recorder, the step sinks) subclasses :class:`CaptureEvents` and
subscribes to the session for one tracker
(memviz.capture.session.CaptureSession.subscribe); the session calls it at
start, step, failure, freeze and stop. A failure carries a
:class:`Trigger`: every flight-recorder dump is one.

Imports nothing of memviz: the floors that subscribe and the session itself
import it (docs/architecture.md, the capture floor).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

__all__ = ["CaptureEvents", "Trigger", "OOM", "DRIVER", "EXCEPTION", "SIGNAL", "REQUEST"]

#: the kinds of flight-recorder trigger (Trigger.kind)
OOM = "out of memory"  # PyTorch's observer, on the failing thread, before it raises
DRIVER = "driver call failed"  # a failed driver allocation, seen by the recorder's thread
EXCEPTION = "exception"  # an exception left track() or the script memviz run runs
SIGNAL = "signal"  # SIGUSR1
REQUEST = "request"  # tracker.dump(path): raises where it cannot write


class Trigger(NamedTuple):
    """Why a failure event is sent: ``kind`` (OOM, DRIVER, EXCEPTION, SIGNAL,
    REQUEST), ``reason`` in words (a dump's END record keeps it), and the
    ``path`` a REQUEST asks for (None: a new file)."""
    kind: str
    reason: str
    path: Optional[str] = None


class CaptureEvents:
    """What a subscriber hears of the tracker it subscribed to; every
    method does nothing here, a subscriber overrides those it needs."""

    def on_start(self, tracker: Any) -> None:
        """The tracker started (capture runs; a nested tracker's window is open)."""

    def on_step(self, tracker: Any, record: Any) -> None:
        """The tracker recorded a step (memviz.model.steps.StepRecord)."""

    def on_failure(self, tracker: Any, trigger: Trigger) -> Optional[str]:
        """Something went wrong (or a dump was asked for): ``trigger`` says
        what. Returns the file written, if any. Raises only for REQUEST."""
        return None

    def on_freeze(self, tracker: Any) -> None:
        """The tracker's figures were copied into Python (the store goes on without it)."""

    def on_stop(self, tracker: Any) -> None:
        """The tracker stopped (after the capture did, if it was the last)."""
