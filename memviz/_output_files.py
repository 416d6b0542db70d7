"""How memviz writes an output file (a report, an export, a trace) without
losing the old one: :func:`output_file` and :func:`write_output` write
through a temporary file in the target's folder, locked while written, that
replaces the target only once complete; :func:`remove_stale_temps` removes
the ones a killed process left. :func:`refuse_inputs`, :func:`same_file`
and :func:`own_files` refuse an output path that is a file being read (the
trace a Tracker streams to or a loaded trace came from); :func:`output_error`
turns an OSError into an OutputError with a hint (also for the step files,
which are written as steps come, not through here). What a recording is
turned into (to_html, to_perfetto, ...) is memviz/outputs.py's.

Imports the bottom floor and memviz/_args.py only (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import secrets
import stat
import time
from typing import IO, Any, Iterable, Iterator, List, Optional

try:
    import fcntl
except ImportError:  # not POSIX: temporary files are neither locked nor cleaned up
    fcntl = None  # type: ignore[assignment]

from memviz._args import path as _path_arg
from memviz._errors import OutputError

__all__ = ["output_file", "write_output", "same_file", "refuse_inputs", "own_files", "remove_stale_temps",
           "output_error"]

#: the end of a temporary file's name (".<target>.<random>.memviz-tmp")
TEMP_SUFFIX = ".memviz-tmp"
#: a temporary file nobody holds is stale once unchanged this long (seconds)
STALE_AFTER_S = 600.0


def same_file(a: Any, b: Any) -> bool:
    """Whether two paths name one file (through symlinks and hard links)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError, TypeError):
        try:
            return os.path.realpath(a) == os.path.realpath(b)
        except (OSError, ValueError, TypeError):
            return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def refuse_inputs(path: str, inputs: Iterable[Any], what: str, hint: Optional[str] = None) -> None:
    """Raise OutputError when ``path`` is one of ``inputs`` ((name, file) pairs)."""
    for name, file in inputs:
        if file is not None and same_file(path, file):
            raise OutputError(what, path, f"it is {name}, which writing there would destroy",
                              hint=hint or "choose another output path")


def own_files(obj: Any) -> List[tuple]:
    """The files a Tracker or a loaded trace reads from (its trace file)."""
    out = []
    for attr, name in (("path", "the trace file this was loaded from"),
                       ("trace_path", "the trace file this tracker streams to")):
        value = getattr(obj, attr, None)
        if isinstance(value, (str, os.PathLike)):
            out.append((name, value))
    return out


def output_error(what: str, path: str, e: OSError, hint: Optional[str] = None) -> OutputError:
    """The OutputError for writing ``what`` at ``path`` that failed with ``e``,
    with a hint for the usual causes (a full disk, a file too large, no
    permission, a folder, a missing folder) unless ``hint`` is given."""
    reason = e.strerror or str(e)
    if hint is None:
        if e.errno in (_errno.ENOSPC, _errno.EDQUOT):
            hint = "free some disk space, or choose a path on another disk"
        elif e.errno == _errno.EFBIG:
            hint = ("the file is larger than this process may write (ulimit -f) or the file "
                    "system allows: raise the limit, or choose a path on another disk")
        elif e.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
            hint = "choose a path in a folder you may write to"
        elif e.errno == _errno.EISDIR:
            hint = "give a file name, not a folder"
        elif e.errno in (_errno.ENOENT, _errno.ENOTDIR):
            hint = "create the folder first, or choose another path"
    return OutputError(what, path, reason, hint=hint, errno=e.errno)


def _temp_in(folder: str, base: str) -> "tuple[int, str]":
    """A new file next to the target, created exclusively (never through a
    link someone planted), mode 0666 less the umask as open() gives, and
    locked (flock) while this process writes it: the lock is how
    :func:`remove_stale_temps` knows that its writer is alive."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f".{base[:80]}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a file system without locks: only the age guard protects it
                pass
        return fd, tmp
    raise FileExistsError(_errno.EEXIST, "could not create a temporary file", folder)


def remove_stale_temps(folder: str, older_than_s: Optional[float] = None) -> List[str]:
    """Remove the temporary files (``.*.memviz-tmp``) in ``folder`` that a
    killed process left (SIGKILL in the middle of a write); returns their paths.

    A live writer's file is never removed: it holds a lock on it for as long
    as it writes (:func:`_temp_in`), so a file is removed only when its lock
    can be taken, and only when it has not changed for ``older_than_s``
    seconds (STALE_AFTER_S), which also covers the instants between creating
    the file and locking it, between closing and renaming it, and file
    systems whose locks are not shared. Anything unexpected (another
    user's file, a link, a folder, a file replaced meanwhile) is left alone.
    Never raises."""
    if fcntl is None:
        return []
    older_than_s = STALE_AFTER_S if older_than_s is None else older_than_s
    try:
        names = os.listdir(folder)
    except (OSError, ValueError, TypeError):
        return []
    removed = []
    flags = os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for name in names:
        if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < older_than_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live process is writing it
                continue
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def output_file(path: Any, what: str, *, binary: bool = False, inputs: Iterable[Any] = (),
                hint: Optional[str] = None) -> Iterator[IO[Any]]:
    """``with output_file(path, "the HTML report") as f: f.write(...)``.

    The data goes to a temporary file created exclusively in the target's
    folder, which replaces the target only once everything is written; on any
    failure the temporary file is removed and the target stays as it was. A
    symlink at ``path`` is followed (its target is replaced); a device or a
    pipe (``/dev/stdout``) is written into, never replaced. An existing file
    keeps its permission bits. ``inputs``: (name, path) pairs of files this
    output must not be. Every OSError becomes an :class:`OutputError`."""
    path = _path_arg(path, f"the path of {what}")
    refuse_inputs(path, inputs, what)
    try:
        st: Optional[os.stat_result] = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise output_error(what, path, e, hint) from e
    mode = ("w" if not binary else "wb")
    text_kw = {} if binary else {"encoding": "utf-8"}
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(what, path, "it is a folder", hint="give a file name, not a folder",
                          errno=_errno.EISDIR)
    if st is not None and not stat.S_ISREG(st.st_mode):  # a device or a pipe: write into it
        yield from _in_place(path, path, mode, text_kw, what, hint)
        return
    real = os.path.realpath(path)
    if st is not None and not os.access(real, os.W_OK):  # as open() would refuse it
        raise OutputError(what, path, "the file is read-only (permission denied)",
                          hint=hint or "make it writable, or choose another path", errno=_errno.EACCES)
    folder = os.path.dirname(real) or "."
    if not os.path.isdir(folder):
        raise OutputError(what, path, f"the folder {folder!r} does not exist",
                          hint=hint or "create it first, or choose another path", errno=_errno.ENOENT)
    try:
        fd, tmp = _temp_in(folder, os.path.basename(real))
    except OSError as e:
        if st is not None and e.errno in (_errno.EACCES, _errno.EPERM) and os.access(real, os.W_OK):
            yield from _in_place(real, path, mode, text_kw, what, hint)  # a writable file in a locked folder
            return
        raise output_error(what, path, e, hint) from e
    f = None
    try:
        if st is not None:
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        f = os.fdopen(fd, mode, **text_kw)
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, real)
    except BaseException as e:
        if f is not None:
            _close_quietly(f)
        else:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, OutputError):
            raise output_error(what, path, e, hint) from e
        raise


def _in_place(real: str, path: str, mode: str, text_kw: dict, what: str,
              hint: Optional[str]) -> Iterator[IO[Any]]:
    try:
        f = open(real, mode, **text_kw)
    except OSError as e:
        raise output_error(what, path, e, hint) from e
    try:
        yield f
        f.close()
    except OutputError:
        raise
    except OSError as e:
        raise output_error(what, path, e, hint) from e
    finally:
        _close_quietly(f)


def _close_quietly(f: IO[Any]) -> None:
    try:
        f.close()
    except (OSError, ValueError):
        pass


def write_output(path: Any, data: "str | bytes", what: str, **kwargs: Any) -> None:
    """Write ``data`` (text as UTF-8, or bytes) with :func:`output_file`."""
    with output_file(path, what, binary=isinstance(data, bytes), **kwargs) as f:
        f.write(data)


