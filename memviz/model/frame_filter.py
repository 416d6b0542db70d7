"""Deciding which Python frame is "the user's line".

A captured stack runs from the line that asked for memory (innermost) out to
the program's entry point (a :class:`memviz.Traceback` holds it the other way
round, oldest first, like tracemalloc). Most of the innermost frames belong to libraries
(``torch/nn/modules/module.py``, ``contextlib.py``, ...); what a person wants
to see is the innermost frame of *their* code. :class:`FrameFilter` decides,
per file name, whether a frame is library code:

* files under the Python standard library (``sysconfig`` ``stdlib`` and
  ``platstdlib``);
* files under any site-packages / dist-packages directory (``sysconfig``
  ``purelib``/``platlib``, ``site.getsitepackages()``, the user site, and any
  path with a ``site-packages`` or ``dist-packages`` component, so stacks
  recorded in another environment still classify correctly);
* files of the memviz package itself;
* frozen and built-in pseudo-files (``<frozen importlib._bootstrap>``,
  ``<built-in>``). Other pseudo-files such as ``<string>``, ``<stdin>`` or
  ``<ipython-input-3-...>`` are user code;
* code that ``torch.compile`` generated or runs to compile (see
  :func:`is_generated`): the modules Inductor writes into its cache, wherever
  that is, FX's ``<eval_with_key>.N`` and ``fx_generated_*.py`` code, and
  the compiler's own files (``torch/_dynamo``, ``torch/_inductor``,
  ``torch/_functorch``, ``torch/fx``), even where torch is not installed
  under site-packages (a source checkout). No user can act on a line there;
  memviz.model.compiled maps Inductor's lines back to the model's own.

Users can adjust it with :meth:`FrameFilter.add_library_path` (hide your own
wrapper module) and :meth:`FrameFilter.add_user_path` (treat an installed
package as your own code). Among configured paths the longest matching prefix
wins (a user path wins a tie); configured paths always beat the defaults.

``frames`` is the process-wide default filter that memviz uses when no other
filter is given.
"""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig
import threading
from types import ModuleType
from typing import Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

import memviz._core as _core
from memviz._errors import InvalidArgument, InvalidArgumentType
from memviz._package import PACKAGE_DIR

__all__ = ["FrameFilter", "frames", "is_generated"]

PathLike = Union[str, "os.PathLike[str]", ModuleType]
_F = TypeVar("_F")

_PSEUDO_LIBRARY_PREFIXES = ("<frozen ", "<frozen>", "<built-in", "<eval_with_key>")
_PACKAGE_DIR_NAMES = ("site-packages", "dist-packages")
_MEMVIZ_DIR = PACKAGE_DIR
#: a module Inductor generates: ``<cache>/<xy>/c<xy...>.py``, its name a
#: 52-character base32 hash whose 2nd and 3rd characters name its folder
#: (torch._inductor.codecache.write); the same shape for wrappers and kernels
_INDUCTOR_MODULE = re.compile(r"c([a-z0-9]{2})[a-z0-9]{49}\.py")
#: folders of the compiler's own code, wherever torch lies (a source checkout too)
_COMPILER_DIRS = tuple(f"/torch/{d}/" for d in ("_dynamo", "_inductor", "_functorch", "fx", "_higher_order_ops"))


def is_generated(filename: str) -> bool:
    """True for a file of code that ``torch.compile`` generated: Inductor's
    modules (by their name's shape, in whatever cache folder:
    ``TORCHINDUCTOR_CACHE_DIR``, ``/tmp/torchinductor_<user>``, a test's
    temporary folder; or anything under a ``torchinductor_*`` folder or the
    cache folder named now), FX's ``<eval_with_key>.N`` and
    ``fx_generated_*.py``. Read by name only: the file need not exist."""
    if not filename:
        return False
    if filename.startswith("<"):
        return filename.startswith("<eval_with_key>")
    fn = filename.replace("\\", "/")
    head, _, base = fn.rpartition("/")
    if base.startswith("fx_generated_") and base.endswith(".py"):
        return True
    m = _INDUCTOR_MODULE.fullmatch(base)
    if m is not None and head.rpartition("/")[2] == m.group(1):
        return True
    if "/torchinductor_" in fn:
        return True
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache:
        c = cache.replace("\\", "/").rstrip("/")
        if c and fn.startswith(c + "/"):
            return True
    return False


def _is_compiler(filename: str) -> bool:
    """A file of the compiler's own code (``torch/_dynamo`` ...) or one it generated."""
    fn = filename.replace("\\", "/")
    return any(d in fn for d in _COMPILER_DIRS) or is_generated(filename)


def _variants(path: str) -> Tuple[str, ...]:
    """Normalised spellings of a real path: as written, and with symlinks resolved."""
    norm = os.path.normcase(os.path.abspath(os.path.expanduser(path)))
    try:
        real = os.path.normcase(os.path.realpath(norm))
    except (OSError, ValueError):  # pragma: no cover - odd paths on odd systems
        real = norm
    return (norm,) if real == norm else (norm, real)


def _to_path_string(path: PathLike) -> str:
    """Accept a str, a path-like object or a module (its package dir or file)."""
    if isinstance(path, ModuleType):
        pkg_path = getattr(path, "__path__", None)
        if pkg_path:
            return list(pkg_path)[0]
        file = getattr(path, "__file__", None)
        if not file:
            raise InvalidArgument(
                f"module {path.__name__!r} has no file on disk (built-in or namespace "
                f"module); pass its directory or file path instead"
            )
        return file
    accepted = "a file or folder path (a non-empty str or os.PathLike) or a module"
    try:
        text = os.fspath(path)
    except TypeError:
        raise InvalidArgumentType(f"a FrameFilter path takes {accepted}, got {path!r}") from None
    if not isinstance(text, str):
        raise InvalidArgumentType(f"a FrameFilter path takes {accepted}, got {path!r} (bytes)")
    if not text:
        raise InvalidArgument(f"a FrameFilter path takes {accepted}, got an empty path")
    return text


def _prefix_matches(candidate: str, prefix: str) -> bool:
    """True when ``candidate`` is ``prefix`` or lies under the directory ``prefix``."""
    if not candidate.startswith(prefix):
        return False
    if len(candidate) == len(prefix) or prefix.endswith(os.sep):
        return True
    nxt = candidate[len(prefix)]
    return nxt == os.sep or (os.altsep is not None and nxt == os.altsep)


def _default_library_dirs() -> List[str]:
    """Directories holding the standard library, installed packages and memviz."""
    dirs: List[str] = []
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    schemes = [sysconfig.get_paths()]
    try:  # the base interpreter's paths, for venvs with system site-packages
        schemes.append(
            sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
        )
    except Exception:  # pragma: no cover - exotic sysconfig setups
        pass
    for paths in schemes:
        dirs.extend(paths[name] for name in names if paths.get(name))
    try:
        dirs.extend(site.getsitepackages())
    except Exception:  # pragma: no cover - old virtualenv's site.py lacks it
        pass
    try:
        user_site = site.getusersitepackages()
        if user_site:
            dirs.append(user_site)
    except Exception:  # pragma: no cover
        pass
    dirs.append(_MEMVIZ_DIR)
    out: List[str] = []
    for d in dirs:
        for v in _variants(d):
            # Never treat a filesystem root as a library directory.
            if v not in out and os.path.dirname(v) != v:
                out.append(v)
    return out


class FrameFilter:
    """Classifies frames as library or user code and picks the user's frame.

    Args:
        library_paths: extra files or directories to treat as library code.
        user_paths: files or directories to always treat as user code.
        use_defaults: when False, only the configured paths and the frozen /
            built-in pseudo-files count as library code (mainly for tests).

    Classification is cached per file name; changing the configuration clears
    the cache. The object is safe to use from several threads.
    """

    def __init__(
        self,
        library_paths: Iterable[PathLike] = (),
        user_paths: Iterable[PathLike] = (),
        *,
        use_defaults: bool = True,
    ) -> None:
        self._lock = threading.Lock()
        self._use_defaults = use_defaults
        self._defaults: Optional[List[str]] = None
        # (prefix-or-pseudo-name, is_library) pairs, in the order added.
        self._rules: List[Tuple[str, bool]] = []
        self._cache: dict = {}
        self._generation = 0
        for p in library_paths:
            self.add_library_path(p)
        for p in user_paths:
            self.add_user_path(p)

    # -- configuration -----------------------------------------------------

    def add_library_path(self, path: PathLike) -> None:
        """Treat ``path`` (a file, a directory or a module) as library code.

        Use it to hide your own wrapper or helper modules so that the reported
        line is the caller of the wrapper. A pseudo-file name such as
        ``"<my-generated-code>"`` is matched exactly.
        """
        self._add_rule(path, True)

    def add_user_path(self, path: PathLike) -> None:
        """Always treat ``path`` (a file, a directory or a module) as user code.

        Use it for a package of your own that is installed into site-packages,
        e.g. ``frames.add_user_path(mypackage)``.
        """
        self._add_rule(path, False)

    def reset(self) -> None:
        """Forget every configured path and the cache; back to the defaults."""
        with self._lock:
            self._rules = []
            self._defaults = None
            self._invalidate()

    @property
    def library_paths(self) -> Tuple[str, ...]:
        """The configured (not default) library paths, normalised."""
        return tuple(p for p, lib in self._rules if lib)

    @property
    def user_paths(self) -> Tuple[str, ...]:
        """The configured user paths, normalised."""
        return tuple(p for p, lib in self._rules if not lib)

    @property
    def default_library_paths(self) -> Tuple[str, ...]:
        """The library directories found from sysconfig/site (empty if disabled)."""
        return tuple(self._get_defaults())

    @property
    def generation(self) -> int:
        """A counter bumped on every configuration change (for callers' caches)."""
        return self._generation

    def _add_rule(self, path: PathLike, is_library: bool) -> None:
        text = _to_path_string(path)
        keys = (text,) if text.startswith("<") else _variants(text)
        with self._lock:
            for key in keys:
                self._rules.append((key, is_library))
            self._invalidate()

    def _invalidate(self) -> None:
        self._cache = {}
        self._generation += 1
        if self is frames:
            _push_rules(self)

    def _get_defaults(self) -> List[str]:
        if not self._use_defaults:
            return []
        defaults = self._defaults
        if defaults is None:
            defaults = self._defaults = _default_library_dirs()
            if self is frames:
                _push_rules(self)
        return defaults

    # -- classification ----------------------------------------------------

    def is_library(self, filename: str) -> bool:
        """True when frames from ``filename`` are library code (cached)."""
        cache = self._cache
        result = cache.get(filename)
        if result is None:
            result = cache[filename] = self._classify(filename)
        return result

    def is_user(self, filename: str) -> bool:
        """True when frames from ``filename`` are user code."""
        return not self.is_library(filename)

    def _classify(self, filename: str) -> bool:
        if not filename:
            return False
        rules = self._rules
        if filename.startswith("<"):
            for key, lib in reversed(rules):
                if key == filename:
                    return lib
            return filename.startswith(_PSEUDO_LIBRARY_PREFIXES)
        candidates = _variants(filename)
        if rules:
            best_len = -1
            best_lib = False
            for key, lib in rules:
                if key.startswith("<"):
                    continue
                for cand in candidates:
                    if _prefix_matches(cand, key):
                        n = len(key)
                        # Longest prefix wins; a user path wins a tie.
                        if n > best_len or (n == best_len and not lib):
                            best_len, best_lib = n, lib
            if best_len >= 0:
                return best_lib
        for prefix in self._get_defaults():
            for cand in candidates:
                if _prefix_matches(cand, prefix):
                    return True
        if self._use_defaults:
            for cand in candidates:
                for name in _PACKAGE_DIR_NAMES:
                    if f"{os.sep}{name}{os.sep}" in cand:
                        return True
            if _is_compiler(filename):
                return True
        return False

    # -- choosing the user's frame -----------------------------------------

    def user_index(self, filenames: Sequence[str]) -> Optional[int]:
        """Index of the user's frame in ``filenames`` (innermost first).

        The innermost non-library frame; if every frame is library code, the
        innermost frame (index 0); ``None`` for an empty sequence.
        """
        if not filenames:
            return None
        cache = self._cache
        for i, fn in enumerate(filenames):
            lib = cache.get(fn)
            if lib is None:
                lib = self.is_library(fn)
            if not lib:
                return i
        return 0

    def pick(self, frames: Sequence[_F]) -> Optional[_F]:
        """The user's frame among ``frames`` (each with ``.filename``).

        A :class:`memviz.Traceback` is read in its own order (oldest to most
        recent, like tracemalloc's); any other sequence is read innermost
        first (the order the C core returns stacks in). The innermost
        non-library frame; if all are library frames, the innermost frame;
        ``None`` when ``frames`` is empty.
        """
        if not frames:
            return None
        oldest_first = getattr(frames, "_oldest_first", False)
        cache = self._cache
        for frame in (reversed(frames) if oldest_first else frames):
            fn = frame.filename  # type: ignore[attr-defined]
            lib = cache.get(fn)
            if lib is None:
                lib = self.is_library(fn)
            if not lib:
                return frame
        return frames[-1] if oldest_first else frames[0]

    def __repr__(self) -> str:
        return (
            f"<FrameFilter {len(self.library_paths)} library path(s), "
            f"{len(self.user_paths)} user path(s), defaults={'on' if self._use_defaults else 'off'}>"
        )


# Rule kinds of the C walk (src/frames.h: MVZ_RULE_*).
_RULE_USER, _RULE_LIBRARY, _RULE_DEFAULT, _RULE_PART, _RULE_PSEUDO = range(5)


def _push_rules(flt: "FrameFilter") -> None:
    """Hand the process-wide filter's rules down to the C core's frame walk,
    which, for a stack deeper than the capture depth, looks past the
    innermost frames for the user's (src/frames.c). Its defaults, until
    first asked for (sysconfig costs milliseconds), are the cheap part of
    them: the standard library's folder, memviz's, and the markers. The C
    walk reads ASCII names as they are (no symlinks resolved); Python's
    choice of the user's frame among the frames kept stays the filter's."""
    rules: List[Tuple[int, str]] = []
    for key, lib in flt._rules:
        rules.append((_RULE_LIBRARY if lib else _RULE_USER, key.replace(os.sep, "/")))
    if flt._use_defaults:
        dirs = flt._defaults if flt._defaults is not None else [
            os.path.dirname(os.__file__), _MEMVIZ_DIR]
        rules.extend((_RULE_DEFAULT, d.replace(os.sep, "/")) for d in dirs)
        rules.extend((_RULE_PART, f"/{name}/") for name in _PACKAGE_DIR_NAMES)
        rules.extend((_RULE_PART, d) for d in _COMPILER_DIRS)
        rules.append((_RULE_PART, "/torchinductor_"))
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if cache:
            rules.append((_RULE_DEFAULT, cache.replace(os.sep, "/").rstrip("/")))
    rules.extend((_RULE_PSEUDO, p) for p in _PSEUDO_LIBRARY_PREFIXES)
    rules = [(k, t) for k, t in rules if t and t.isascii()]
    try:
        _core._frame_rules(rules)
    except (AttributeError, MemoryError):  # pragma: no cover - an older core
        pass


#: The process-wide default filter, e.g. ``memviz.frames.add_user_path(mypkg)``.
frames = FrameFilter()
_push_rules(frames)


def _in_memviz(filename: str) -> bool:
    return _prefix_matches(os.path.normcase(os.path.abspath(filename)), os.path.normcase(_MEMVIZ_DIR))


def warning_site() -> Tuple[int, Optional[str]]:
    """Where a warning that the caller is about to give should point.

    Returns ``(stacklevel, entry)`` for a ``warnings.warn`` call in the
    function that calls this one: ``stacklevel`` points at the user's line
    (the first frame beyond memviz's own that :data:`frames` counts as user
    code; the first frame outside memviz when none is), and ``entry`` is the
    file of the outermost memviz frame of the call (which of memviz's entry
    points was used: ``_tracker.py`` for ``track()``, ``_ipython.py`` for the
    magic, ...), or None when the caller was not called from memviz."""
    f = sys._getframe(1)
    level, entry = 1, None
    while f is not None and _in_memviz(f.f_code.co_filename):
        entry = f.f_code.co_filename
        f, level = f.f_back, level + 1
    if f is None:  # memviz all the way down (its own command line's main)
        return max(1, level - 1), entry
    outside = level
    while f is not None and frames.is_library(f.f_code.co_filename):
        f, level = f.f_back, level + 1
    return (level if f is not None else outside), entry
