"""``memviz.label``: names attached to the allocations a thread makes in a
block, kept by the C core's label table (src/labels.h). The table frees the
ids that no block holds when a new outermost tracker starts, once it fills
(per tracker, in effect), so a label interns its name at each enter.

Imports the bottom floor, the model and capture/availability.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import functools
import threading
import warnings

import memviz._args as _args
import memviz._core as _core
from memviz._errors import InvalidArgument
from memviz.capture.availability import CaptureWarning
from memviz.model.frame_filter import warning_site

__all__ = ["label", "user_label_id"]

_label_overflow_warned = False  # written here only (_check_overflow)


def user_label_id(name: str) -> int:
    """The C core's id of a label a user named (until the table next frees
    ids, src/labels.h). Past the label table's size (65,534 labels, 4 MiB of
    text, in one tracker) new names all get the overflow label, with one
    warning per process."""
    if "\0" in name:
        raise InvalidArgument(f"memviz.label() names cannot contain NUL characters ('\\0'), got {name!r}: "
                              "remove them or replace them, e.g. name.replace('\\0', ' ').")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"memviz.label() names must be text that UTF-8 can encode; {name!r} has a "
                              f"lone surrogate at index {e.start}: pass "
                              "name.encode('utf-8', 'backslashreplace').decode() to keep it visible.") from None
    lid = _core.label_intern(name)
    _check_overflow(lid, name)
    return lid


def _check_overflow(lid: int, name: str) -> None:
    global _label_overflow_warned
    if _core.label_name(lid) == _core.LABEL_OVERFLOW and name != _core.LABEL_OVERFLOW:
        if not _label_overflow_warned:
            _label_overflow_warned = True
            warnings.warn(CaptureWarning(
                f"memviz's label table is full (65,534 labels or 4 MiB of text in this tracker); "
                f"{name if len(name) <= 60 else name[:57] + '...'!r} and every new "
                f"label after it are recorded as {_core.LABEL_OVERFLOW!r} (capture_info()['store']"
                "['labels_overflowed'] counts them). Use a few labels that repeat (e.g. 'train step', "
                "not f'step {i}'): memviz.watch(optimizer) records memory per step."),
                stacklevel=warning_site()[0])


class label:
    """Attach a name to every allocation this thread makes inside the block.

    ``with memviz.label("data loading"): ...`` or as a decorator. Labels nest;
    the innermost wins. Thread-local: other threads are not affected.

    Label names are kept while a tracker runs: past 65,534 distinct names
    (or 4 MiB of their text) in one tracker, new ones are recorded as
    ``"<labels overflowed>"``, said once in a :class:`CaptureWarning` and
    counted in ``capture_info()["store"]["labels_overflowed"]``. When a new
    outermost tracker starts, the names no running block holds are
    forgotten (once the table is half full), so a long process never runs
    out. A name
    cannot contain NUL characters or lone surrogates
    (:class:`~memviz.MemvizError`).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise _args.bad_type("memviz.label(name)", name, "a non-empty str")
        self.name = name
        self._gen = _core.label_generation()  # the ids of the table's generation (src/labels.h)
        self._id = user_label_id(name)
        self._saved = threading.local()

    def __enter__(self) -> "label":
        stack = getattr(self._saved, "stack", None)
        if stack is None:
            stack = self._saved.stack = []
        # An id is valid until the table frees ids (between trackers): then the name is interned again.
        lid, prev, gen = _core.label_enter(self.name, self._id, self._gen)  # lid held till exit
        stack.append((lid, prev))
        if gen != self._gen:
            self._id, self._gen = lid, gen
            _check_overflow(lid, self.name)
        return self

    def __exit__(self, *exc) -> None:
        _core.label_exit(*self._saved.stack.pop())

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper
