"""Which process of a distributed run this is: rank, local rank, world size
and host, from the variables ``torchrun`` (and most launchers) set, and the
file names that carry them.

Nothing here imports torch or asks torch.distributed: the environment is
what a launcher sets before the script runs, so it is right from the first
allocation on, and it works the same for a process that never initialises a
process group (:func:`rank_meta` only asks a torch the program already
imported whether CUDA is initialised, and which device is current).

Per-rank file names (:func:`rank_path`): under a launcher every rank runs
the same command, so a trace path given once (``memviz run -o run.memviz``,
``track(trace="run.memviz")``, ``Tracker.save("run.memviz")``) names one
file per rank, ``run.rank0.memviz``, ``run.rank1.memviz`` ...; a path that
holds ``{rank}`` says itself where the rank goes. ``memviz report
run.rank*.memviz`` merges them (memviz/report/ranks.py).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from typing import Any, Dict, Mapping, Optional

__all__ = ["rank_info", "rank_meta", "rank_of", "rank_path", "rank_glob", "timestamped_name", "RANK_FIELD"]

#: the per-rank pattern a trace path may hold (replaced by the rank, see rank_path)
RANK_FIELD = "{rank}"


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


def rank_meta(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """What a trace's META records of the process's place in a distributed
    run: :func:`rank_info`, the launcher's run id (``TORCHELASTIC_RUN_ID``,
    None where unset or ``"none"``), ``CUDA_VISIBLE_DEVICES`` and the CUDA
    device PyTorch has made current, when PyTorch has already initialised
    CUDA (asked of nothing else: this never initialises CUDA; None
    otherwise, the END chunk's totals say which devices were used)."""
    env = os.environ if env is None else env
    info = rank_info(env)
    run_id = env.get("TORCHELASTIC_RUN_ID") or None
    info["run_id"] = None if run_id in (None, "none") else run_id
    info["cuda_visible_devices"] = env.get("CUDA_VISIBLE_DEVICES")
    info["cuda_device"] = None
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            info["cuda_device"] = int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - metadata must not stop tracking
        pass
    return info


def rank_path(path: str, env: Optional[Mapping[str, str]] = None) -> str:
    """The file this process writes for ``path``, one per rank.

    * ``{rank}`` in the path is replaced by the rank (``0`` where no
      launcher set one: a lone process is rank 0 of 1);
    * otherwise, under a launcher (``RANK`` or ``LOCAL_RANK`` set), a path
      that already names this rank (``rank1``, ``rank_1`` or ``rank-1`` as a
      word, in the file or a folder name: the program named it per rank
      itself, or this function did) is unchanged, and any other gets
      ``.rank<N>`` before its extension: ``run.memviz`` ->
      ``run.rank0.memviz``, ``out/run`` -> ``out/run.rank0``;
    * otherwise (no launcher) the path is unchanged.
    """
    rank = rank_of(env)
    if RANK_FIELD in path:
        return path.replace(RANK_FIELD, str(rank if rank is not None else 0))
    if rank is None or re.search(rf"(?<![A-Za-z0-9])rank[-_]?{rank}(?![0-9])", path, re.IGNORECASE):
        return path
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, f"{stem}.rank{rank}{ext}")


def rank_glob(path: str) -> str:
    """The shell pattern that names every rank's file of ``path`` (as
    :func:`rank_path` names them): ``run.memviz`` -> ``run.rank*.memviz``."""
    if RANK_FIELD in path:
        return path.replace(RANK_FIELD, "*")
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, f"{stem}.rank*{ext}")


def timestamped_name(prefix: str, *, when: Optional[float] = None, pid: Optional[int] = None,
                     rank: Optional[int] = None, suffix: str = ".memviz") -> str:
    """``<prefix>-20261201T142800Z-pid1234[-rank0].memviz``: a name that
    sorts by time and says which process (and rank) wrote the file."""
    when = time.time() if when is None else when
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f"{int(when % 1 * 1000):03d}Z"
    pid = os.getpid() if pid is None else pid
    rank = rank_of() if rank is None else rank
    return f"{prefix}-{stamp}-pid{pid}" + (f"-rank{rank}" if rank is not None else "") + suffix
