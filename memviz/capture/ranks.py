"""Which process of a distributed run this is: rank, local rank, world size
and host, from the variables ``torchrun`` (and most launchers) set, and the
file names that carry them.

Nothing here imports torch or asks torch.distributed: the environment is
what a launcher sets before the script runs, so it is right from the first
allocation on, and it works the same for a process that never initialises a
process group.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, Mapping, Optional

__all__ = ["rank_info", "rank_of", "timestamped_name"]


def _int_env(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n >= 0 else None


def rank_of(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's global rank (``RANK``), else its ``LOCAL_RANK``, else None."""
    env = os.environ if env is None else env
    rank = _int_env(env, "RANK")
    return rank if rank is not None else _int_env(env, "LOCAL_RANK")


def rank_info(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``{"rank", "local_rank", "world_size", "host"}``; the first three are
    None where the launcher did not set them."""
    env = os.environ if env is None else env
    try:
        host = socket.gethostname()
    except OSError:
        host = None
    return {"rank": _int_env(env, "RANK"), "local_rank": _int_env(env, "LOCAL_RANK"),
            "world_size": _int_env(env, "WORLD_SIZE"), "host": host}


def timestamped_name(prefix: str, *, when: Optional[float] = None, pid: Optional[int] = None,
                     rank: Optional[int] = None, suffix: str = ".memviz") -> str:
    """``<prefix>-20261201T142800Z-pid1234[-rank0].memviz``: a name that
    sorts by time and says which process (and rank) wrote the file."""
    when = time.time() if when is None else when
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f"{int(when % 1 * 1000):03d}Z"
    pid = os.getpid() if pid is None else pid
    rank = rank_of() if rank is None else rank
    return f"{prefix}-{stamp}-pid{pid}" + (f"-rank{rank}" if rank is not None else "") + suffix
