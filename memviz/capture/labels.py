"""``memviz.label``: names attached to the allocations a thread makes in a
block, kept by the C core's label table (src/labels.h) for the process's life.

Imports the bottom floor, the model and capture/hints.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import functools
import threading
import warnings

import memviz._args as _args
import memviz._core as _core
from memviz._errors import InvalidArgument
from memviz.capture.hints import CaptureWarning
from memviz.model.frame_filter import warning_site

__all__ = ["label", "user_label_id"]

_label_overflow_warned = False  # written here only (user_label_id)


def user_label_id(name: str) -> int:
    """The C core's id of a label a user named. Past the label table's size
    (65,534 labels, 4 MiB of text: labels are never forgotten) new names all
    get the overflow label, with one warning per process."""
    global _label_overflow_warned
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
    if _core.label_name(lid) == _core.LABEL_OVERFLOW and name != _core.LABEL_OVERFLOW:
        if not _label_overflow_warned:
            _label_overflow_warned = True
            warnings.warn(CaptureWarning(
                f"memviz's label table is full (65,534 labels or 4 MiB of text); "
                f"{name if len(name) <= 60 else name[:57] + '...'!r} and every new "
                f"label after it are recorded as {_core.LABEL_OVERFLOW!r} (capture_info()['store']"
                "['labels_overflowed'] counts them). Use a few labels that repeat (e.g. 'train step', "
                "not f'step {i}'): memviz.watch(optimizer) records memory per step."),
                stacklevel=warning_site()[0])
    return lid


class label:
    """Attach a name to every allocation this thread makes inside the block.

    ``with memviz.label("data loading"): ...`` or as a decorator. Labels nest;
    the innermost wins. Thread-local: other threads are not affected.

    Label names are kept for the life of the process: past 65,534 distinct
    names (or 4 MiB of their text) new ones are recorded as
    ``"<labels overflowed>"``, said once in a :class:`CaptureWarning` and
    counted in ``capture_info()["store"]["labels_overflowed"]``. A name
    cannot contain NUL characters or lone surrogates
    (:class:`~memviz.MemvizError`).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise _args.bad_type("memviz.label(name)", name, "a non-empty str")
        self.name = name
        self._id = user_label_id(name)
        self._saved = threading.local()

    def __enter__(self) -> "label":
        stack = getattr(self._saved, "stack", None)
        if stack is None:
            stack = self._saved.stack = []
        stack.append(_core.label_get())
        _core.label_set(self._id)
        return self

    def __exit__(self, *exc) -> None:
        _core.label_set(self._saved.stack.pop())

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper
