"""Checks of the arguments of memviz's public API.

Each check raises :class:`memviz.InvalidArgumentType` (also a TypeError) for
a value of the wrong type and :class:`memviz.InvalidArgument` (also a
ValueError) for a value out of range, with a message that names the argument,
shows what was given and says what is accepted. ``bool`` is an ``int``
subclass in Python; where a number is expected, True and False are refused.

:func:`whole_option` is the one argparse ``type=`` for whole-number options
of memviz's command lines and of the ``%%memviz`` magic.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterable, Optional

from memviz._errors import InvalidArgument, InvalidArgumentType

__all__ = ["given", "whole", "flag", "choice", "path", "bad_value", "bad_type", "whole_option"]


def given(value: Any) -> str:
    """What was passed, for a message: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = type(value).__name__
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{text} ({kind})"
    return text if text.startswith(("<", kind)) else f"{text} (a {kind})"


def recording(value: Any, name: str) -> Any:
    """``value`` where it is a recording a report reads (a Tracker or a
    loaded trace: what has ``totals``); else InvalidArgumentType saying what
    to pass (a path: memviz.load(path) first)."""
    if callable(getattr(value, "totals", None)):
        return value
    hint = ""
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        hint = " (a file: read it first, memviz.load(path), or run `python -m memviz report PATH`)"
    raise InvalidArgumentType(f"{name} takes a memviz Tracker or a loaded trace{hint}, got {given(value)}")


def bad_type(name: str, value: Any, accepted: str) -> InvalidArgumentType:
    return InvalidArgumentType(f"{name} takes {accepted}, got {given(value)}")


def bad_value(name: str, value: Any, accepted: str) -> InvalidArgument:
    return InvalidArgument(f"{name} takes {accepted}, got {given(value)}")


def whole(value: Any, name: str, low: Optional[int] = None, high: Optional[int] = None, *,
          none: bool = False) -> Optional[int]:
    """An int (not a bool) in [low, high]; None too when ``none``."""
    if value is None and none:
        return None
    if low is not None and high is not None:
        accepted = f"a whole number from {low} to {high}"
    elif low is not None:
        accepted = f"a whole number >= {low}"
    elif high is not None:
        accepted = f"a whole number <= {high}"
    else:
        accepted = "a whole number"
    if none:
        accepted += " or None"
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(name, value, accepted)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_value(name, value, accepted)
    return value


def flag(value: Any, name: str, *, none: bool = False) -> Optional[bool]:
    """True or False (None too when ``none``)."""
    if value is None and none:
        return None
    if not isinstance(value, bool):
        raise bad_type(name, value, "True or False" + (" (or None for the default)" if none else ""))
    return value


def choice(value: Any, name: str, choices: Iterable[str]) -> str:
    """One of ``choices`` (strings)."""
    options = tuple(choices)
    accepted = "one of " + ", ".join(repr(c) for c in options)
    if not isinstance(value, str):
        raise bad_type(name, value, accepted)
    if value not in options:
        raise bad_value(name, value, accepted)
    return value


def path(value: Any, name: str) -> str:
    """A non-empty str or os.PathLike naming a file; returns the str."""
    accepted = "a file path (a non-empty str or os.PathLike)"
    try:
        text = os.fspath(value)
    except TypeError:
        raise bad_type(name, value, accepted) from None
    if not isinstance(text, str):
        raise bad_type(name, value, accepted + ", not bytes")
    if not text:
        raise bad_value(name, value, accepted)
    if "\0" in text:
        raise bad_value(name, value, accepted + " without NUL characters")
    return text


def whole_option(low: int = 1, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type=`` reading a whole number in [low, high] from the
    command line; anything else is an ``argparse.ArgumentTypeError`` saying
    what is accepted and what was given (argparse turns it into a usage error)."""
    if high is not None:
        accepted = f"a whole number from {low} to {high}"
    elif low == 1:
        accepted = "a positive whole number"
    else:
        accepted = f"a whole number >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {value}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in its message
    return parse
