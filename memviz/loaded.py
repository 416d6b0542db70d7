"""The face of a recording read back from a file: :class:`LoadedTrace` and
:func:`load` (``memviz.load``).

The trace layer (memviz/trace/reader.py) reads the file into a
:class:`~memviz.trace.reader.TraceReader`; this module, on the top floor
beside the tracker, adds what needs the floors above the trace layer: the
diagnoses and the outputs (HTML report, exports, notebook display).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Any, Dict, List, Optional

import memviz._args as _args
from memviz._errors import TraceError
from memviz.outputs import Outputs
from memviz.trace.reader import TraceReader

__all__ = ["LoadedTrace", "load", "shipped_sample"]


class LoadedTrace(TraceReader, Outputs):
    """A trace file read back (``memviz.load``), with the reading API of a
    Tracker (a :class:`memviz.model.recording.Recording`, as a Tracker is):
    snapshot(), peak_snapshot(), totals(), failures, timeline(), threads(),
    steps, events(), capture_info(), diagnose(), and the outputs.

    Where the recording process ran under a launcher (``torchrun``), ``rank``,
    ``local_rank``, ``world_size``, ``host``, ``run_id`` and ``cuda_device``
    say which process of the run it was (None where not known, as for a
    trace of a single process, or one of a memviz that did not record it);
    ``devices`` are the GPUs it allocated on.

    ``sample`` is the description of the sample trace shipped with memviz
    (memviz/data/sample.json: "machine", "date", "script", "script_source")
    when this file is that sample or a copy of it, else None: its reports
    say it is a sample, recorded elsewhere, and show none of the recording
    machine's paths."""

    sample: Optional[Dict[str, str]] = None

    def _rank_field(self, name: str) -> Any:
        ranks = (self.meta or {}).get("ranks")
        return ranks.get(name) if isinstance(ranks, dict) else None

    @property
    def rank(self) -> Optional[int]:
        """The global rank (RANK, else LOCAL_RANK, as the file was named), or None."""
        rank = self._rank_field("rank")
        return rank if rank is not None else self._rank_field("local_rank")

    local_rank = property(lambda self: self._rank_field("local_rank"),
                          doc="the rank on its host (LOCAL_RANK), or None")
    world_size = property(lambda self: self._rank_field("world_size"),
                          doc="how many ranks the run had (WORLD_SIZE), or None")
    host = property(lambda self: self._rank_field("host"), doc="the recording host's name, or None")
    run_id = property(lambda self: self._rank_field("run_id"),
                      doc="the launcher's run id (TORCHELASTIC_RUN_ID), or None")
    cuda_device = property(lambda self: self._rank_field("cuda_device"),
                           doc="the CUDA device PyTorch had made current when tracking "
                               "started (only when CUDA was initialised by then), or None")

    @property
    def devices(self) -> List[int]:
        """The GPUs (CUDA device numbers) this process allocated on."""
        return sorted(d for d, t in self.totals().items()
                      if d >= 0 and (t.get("allocs", 0) or t.get("peak", 0)))

    def to_parquet(self, path: str, *, rank: Any = "auto", force: bool = False) -> List[str]:
        """Write this trace's tables as Parquet into the folder ``path``
        (events, stacks, steps, peaks and what was live at each, findings,
        the rank's row: docs/parquet.md), streaming the events; returns the
        files written. Needs pyarrow (``pip install 'memviz-gpu[parquet]'``).
        ``rank``: the ``rank`` column (default: the trace's, None without a
        launcher). Tables of the same rank already in ``path`` are replaced
        only with ``force=True`` (else InvalidArgument says so)."""
        from memviz.export.parquet import write_trace
        path = _args.path(path, "LoadedTrace.to_parquet(path)")
        return write_trace(self, path, rank=rank, force=force)

    def diagnose(self) -> List[Any]:
        """Findings about the recorded run (see :func:`memviz.diagnose`)."""
        from memviz.analysis.diagnose import diagnose
        return diagnose(self)


def load(path: str, *, recover: bool = False) -> LoadedTrace:
    """Read a .memviz trace file; returns a :class:`LoadedTrace` with the
    reading API of a Tracker (snapshot(), peak_snapshot(), totals(),
    failures, timeline(), steps, capture_info(), diagnose()).

    Raises :class:`memviz.TraceError` (naming the file and byte offset) for a
    file that is not a trace or is corrupted; with ``recover=True`` a
    corrupted chunk ends the trace there instead, as a cut-off tail does.
    """
    path = _args.path(path, "memviz.load(path)")
    _args.flag(recover, "memviz.load(recover=...)")
    try:
        # Non-blocking: opening a FIFO must not wait for a writer; the mode is
        # read from the open file, so what is checked is what is read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if isinstance(e, IsADirectoryError) or os.path.isdir(path):
            raise _special_file("a directory", path) from e
        raise TraceError(f"cannot read the file: {e.strerror or e}", path,
                         hint=_ranks_hint(path, e) or "check the path and that you may read it") from e
    try:
        what = _not_a_file(os.fstat(fd).st_mode)
    except OSError:
        what = None
    if what is not None:
        os.close(fd)
        raise _special_file(what, path)
    # Read where it lies, a chunk at a time (the reader keeps the descriptor
    # to read the events again, and closes it when it goes).
    trace = LoadedTrace.from_fd(fd, path, recover=recover)
    trace.sample = shipped_sample(path)
    return trace


_SAMPLE_DESCRIPTION = ("machine", "date", "script", "script_source")


def _shipped(name: str) -> Optional[str]:
    """The path of a file of memviz/data, as installed, or None."""
    try:
        from importlib import resources

        path = os.fspath(resources.files("memviz").joinpath("data", name))
    except (ImportError, TypeError, OSError):  # pragma: no cover - a zipped or broken install
        return None
    return path if os.path.isfile(path) else None


@lru_cache(maxsize=4)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def shipped_sample(path: str) -> Optional[Dict[str, str]]:
    """The shipped sample's description (sample.json's "machine", "date",
    "script" and "script_source" strings; those it lacks left out) when
    ``path`` is memviz's sample trace or a copy of it (the same bytes), else
    None. Costs a stat unless the sizes are equal."""
    sample = _shipped("sample.memviz")
    if sample is None:
        return None
    try:
        mine, theirs = os.stat(path), os.stat(sample)
        same = os.path.samefile(path, sample) or (
            mine.st_size == theirs.st_size
            and _digest(os.path.realpath(path), mine.st_size, mine.st_mtime_ns)
            == _digest(sample, theirs.st_size, theirs.st_mtime_ns))
    except OSError:
        return None
    if not same:
        return None
    meta: Any = None
    described = _shipped("sample.json")
    if described is not None:
        try:
            with open(described, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = None
    meta = meta if isinstance(meta, dict) else {}
    return {k: meta[k] for k in _SAMPLE_DESCRIPTION if isinstance(meta.get(k), str) and meta[k]}


def _ranks_hint(path: str, e: OSError) -> Optional[str]:
    """For a missing file that a distributed run wrote once per rank
    (memviz.capture.rank_files.rank_path): which files there are instead."""
    if not isinstance(e, FileNotFoundError):
        return None
    import glob

    from memviz.capture.rank_files import rank_glob
    pattern = rank_glob(path)
    found = sorted(glob.glob(glob.escape(pattern).replace("[*]", "*")))
    if not found:
        return None
    listed = ", ".join(os.path.basename(f) for f in found[:3]) + (", ..." if len(found) > 3 else "")
    return (f"under a launcher (torchrun) each rank writes its own file ({listed}): load one of "
            f"them, or read them all with `python -m memviz report '{pattern}'`")


def _special_file(what: str, path: str) -> TraceError:
    """The error for a path that is not a regular file, said before reading."""
    if what == "a directory":
        return TraceError("it is a directory, not a trace file", path,
                          hint="give the .memviz file inside it (memviz.track(trace=...), "
                               "Tracker.save() or `memviz run -o` write one)")
    return TraceError(f"it is {what}, not a trace file: memviz reads only regular files, "
                      "since reading this could block or never end", path,
                      hint="give the .memviz file written by memviz.track(trace=...), "
                           "Tracker.save() or `memviz run -o`; to read a trace from a pipe, "
                           "save it to a file first")


def _not_a_file(mode: int) -> Optional[str]:
    """What a file of ``mode`` is, when it is not a regular file."""
    import stat

    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"
