"""Which trackers are running, for the layers that act on "the running
tracker" without importing the tracker (step hooks, the integrations).

The tracker (memviz/tracker.py) appends itself to :data:`running` when it
starts and removes itself when it stops, under :data:`lock` (the trackers'
state lock, held while any tracker starts, stops or shares its step marks);
readers take a copy of the list, so they need no lock.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

__all__ = ["running", "active_tracker", "lock"]

#: the trackers' state lock (reentrant: a tracker's plugins may read others)
lock = threading.RLock()

#: every running tracker, in start order (all threads)
running: List[Any] = []


def active_tracker() -> Optional[Any]:
    """The running tracker: the latest one this thread started, else the
    latest one started (trackers nest, also across threads); None if none runs."""
    now = list(running)
    me = threading.get_ident()
    for t in reversed(now):
        if t._thread == me:
            return t
    return now[-1] if now else None
