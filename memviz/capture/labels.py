"""``memviz.label``: names attached to the allocations a thread makes in a
block, kept by the C core's label table (src/labels.h). The table frees the
ids that no block holds when a new outermost tracker starts, once it fills
(per tracker, in effect), so a label interns its name at each enter.

Imports the bottom floor, the model and capture/availability.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import functools
import inspect
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


class _Entry:
    """One label block open on a thread: its id (pinned until the block
    ends), the label to put back when it ends, the thread's stack."""

    __slots__ = ("owner", "lid", "prev", "stack", "ended")

    def __init__(self, owner: "label", lid: int, prev: int, stack: list) -> None:
        self.owner, self.lid, self.prev, self.stack, self.ended = owner, lid, prev, stack, False


_blocks = threading.local()  # .stack: this thread's open label blocks, innermost last


def _stack() -> list:
    stack = getattr(_blocks, "stack", None)
    if stack is None:
        stack = _blocks.stack = []
    return stack


def _close(stack: list, entry: _Entry) -> None:
    """End ``entry``, open on this thread. Innermost: the thread's label goes
    back to what it was before the block (and so on past blocks that ended on
    another thread). Not innermost (blocks of two generators or two asyncio
    tasks ending out of order): the label stays the innermost block's, and
    the block just above takes over what to put back, so that the last block
    to end leaves the label as it was before them all."""
    i = next(k for k in range(len(stack) - 1, -1, -1) if stack[k] is entry)
    if i == len(stack) - 1:
        stack.pop()
        _core.label_exit(entry.lid, entry.prev)
        while stack and stack[-1].ended:
            gone = stack.pop()
            _core.label_exit(gone.lid, gone.prev)
    else:
        stack[i + 1].prev = entry.prev
        del stack[i]
        _core.label_exit(entry.lid, _core.label_get())  # unpinned; the label left as it is


def _step(target, lab: "label"):
    """Drive a generator, a coroutine or an awaitable's iterator (``target``:
    send/throw/close) with ``lab`` on only while it runs, never while it is
    suspended: the decorator's way to label a generator or async function
    without labelling what the thread does between its steps."""
    send, exc = None, None
    while True:
        with lab:
            try:
                item = target.send(send) if exc is None else target.throw(exc)
            except StopIteration as e:
                return e.value
        try:
            send, exc = (yield item), None
        except GeneratorExit:
            target.close()
            raise
        except BaseException as e:  # noqa: BLE001 - thrown in by the caller: passed on
            send, exc = None, e


class _Labelled:
    """An awaitable that runs ``target`` (a coroutine, an async generator's
    asend/athrow) under ``lab`` one step at a time (_step)."""

    __slots__ = ("target", "lab")

    def __init__(self, target, lab: "label") -> None:
        self.target, self.lab = target, lab

    def __await__(self):
        return _step(self.target, self.lab)


class label:
    """Attach a name to every allocation this thread makes inside the block.

    ``with memviz.label("data loading"): ...`` or as a decorator. Labels nest;
    the innermost wins. Thread-local: other threads are not affected.

    A label is the thread's: a ``with`` block inside a generator or a
    coroutine that suspends inside it (``yield``, ``await``) labels what the
    thread runs meanwhile too, until the block ends. As a decorator of a
    generator function, an ``async def`` or an async generator, the label is
    on only while the function itself runs, step by step, and off while it is
    suspended. Blocks that end out of order (two generators, two asyncio
    tasks) leave the thread's label as it was once the last of them ends.

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
        self._open: list = []  # this label's blocks open on any thread (_Entry)

    def __enter__(self) -> "label":
        stack = _stack()
        while stack and stack[-1].ended:  # ended on another thread: the label they set goes
            gone = stack.pop()
            _core.label_exit(gone.lid, gone.prev)
        # An id is valid until the table frees ids (between trackers): then the name is interned again.
        lid, prev, gen = _core.label_enter(self.name, self._id, self._gen)  # lid held till exit
        entry = _Entry(self, lid, prev, stack)
        stack.append(entry)
        self._open.append(entry)
        if gen != self._gen:
            self._id, self._gen = lid, gen
            _check_overflow(lid, self.name)
        return self

    def __exit__(self, *exc) -> None:
        stack = _stack()
        entry = next((e for e in reversed(stack) if e.owner is self and not e.ended), None)
        if entry is None:
            # Entered on another thread (a generator resumed elsewhere): that thread's
            # label is put back when it next enters or leaves a label block
            entry = next((e for e in reversed(self._open) if not e.ended), None)
            if entry is None:
                return  # never entered: nothing to end
            entry.ended = True
            self._remove_open(entry)
            return
        self._remove_open(entry)
        _close(stack, entry)

    def _remove_open(self, entry: _Entry) -> None:
        for k in range(len(self._open) - 1, -1, -1):
            if self._open[k] is entry:
                del self._open[k]
                return

    def __call__(self, fn):
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def agen_wrapper(*args, **kwargs):
                agen = fn(*args, **kwargs)
                send, exc = None, None
                try:
                    while True:
                        try:
                            step = agen.asend(send) if exc is None else agen.athrow(exc)
                            item = await _Labelled(step, self)
                        except StopAsyncIteration:
                            return
                        try:
                            send, exc = (yield item), None
                        except GeneratorExit:
                            raise
                        except BaseException as e:  # noqa: BLE001 - thrown in: passed on
                            send, exc = None, e
                finally:
                    await _Labelled(agen.aclose(), self)
            return agen_wrapper
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def coro_wrapper(*args, **kwargs):
                return await _Labelled(fn(*args, **kwargs), self)
            return coro_wrapper
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen_wrapper(*args, **kwargs):
                return (yield from _step(fn(*args, **kwargs), self))
            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper
