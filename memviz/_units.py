"""Byte-size formatting and parsing.

``format_size`` renders byte counts in binary units (B, KiB, MiB, GiB, TiB)
the way memviz reports them; ``parse_size`` accepts what a person would type
in a config file or on a command line ("2 GiB", "512MB", "1024").
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

from memviz._errors import InvalidArgument, InvalidArgumentType

__all__ = ["format_size", "parse_size", "escape_surrogates", "json_finite"]

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# Lower-cased unit spelling -> multiplier. Binary (IEC) and decimal (SI)
# units are both accepted; single letters ("M", "G") are not, because it is
# not clear whether the writer meant MB or MiB.
_PARSE_UNITS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

_SIZE_RE = re.compile(r"^\s*(-?\s*(?:[0-9]+(?:_[0-9]+)*(?:\.[0-9]*)?|\.[0-9]+))\s*([A-Za-z]*)\s*$")


def _trim(number: str) -> str:
    """Drop trailing zeros of a fixed-point string: '1.50' -> '1.5', '2.00' -> '2'."""
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def format_size(n: float, sign: bool = False) -> str:
    """Format a byte count in binary units.

    Picks the largest unit in which the value is at least 1 and shows at most
    three significant digits, dropping trailing zeros::

        format_size(512)          -> '512 B'
        format_size(1536)         -> '1.5 KiB'
        format_size(256 << 20)    -> '256 MiB'
        format_size(1 << 30)      -> '1 GiB'
        format_size(-3 << 29, sign=True) -> '-1.5 GiB'

    With ``sign=True`` a '+' is added to positive values and zero (for diffs).
    Fractional byte counts (averages) are accepted and shown rounded.
    """
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        raise InvalidArgumentType(f"format_size() expects a number of bytes, got {n!r:.60} "
                                  f"({type(n).__name__})")
    negative = n < 0
    value = -n if negative else n
    unit_index = 0
    while value >= 1024 and unit_index < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit_index += 1
    while True:
        if unit_index == 0:
            text = f"{value:.0f}" if isinstance(value, float) else str(value)
        elif value >= 100:
            text = f"{value:.0f}"
        elif value >= 10:
            text = _trim(f"{value:.1f}")
        else:
            text = _trim(f"{value:.2f}")
        # Rounding may reach 1024 (1023.7 MiB -> "1024"): move up a unit.
        if float(text) >= 1024 and unit_index < len(_BINARY_UNITS) - 1:
            value /= 1024
            unit_index += 1
            continue
        break
    if negative and text.strip("0.") != "":
        prefix = "-"
    elif sign:
        prefix = "+"
    else:
        prefix = ""
    return f"{prefix}{text} {_BINARY_UNITS[unit_index]}"


def parse_size(value: "int | float | str") -> int:
    """Parse a byte size into an int number of bytes.

    Accepts:

    * non-negative ints (``1024``) and integral floats (``2e9``);
    * strings with an optional unit, case-insensitive, space optional:
      binary ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB`` (powers of 1024)
      and decimal ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` (powers of 1000);
      the number may have a fraction (``"1.5 GiB"``), rounded to whole bytes.

    Raises ``ValueError`` for negative sizes, malformed strings and unknown
    units (the message lists the accepted forms), and ``TypeError`` for values
    that are neither numbers nor strings.
    """
    if isinstance(value, bool):
        raise InvalidArgumentType("parse_size() expects a size such as 1024 or '2 GiB', got a bool")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise InvalidArgument(f"size must be a finite number of bytes, got {value}")
        if value < 0:
            raise InvalidArgument(f"size must not be negative, got {value}")
        if not value.is_integer():
            raise InvalidArgument(
                f"size {value} is not a whole number of bytes; pass an int or a "
                f"string with a unit such as '1.5 GiB'"
            )
        return int(value)
    if not isinstance(value, str):
        raise InvalidArgumentType(
            f"parse_size() expects an int or a string such as '2 GiB', got {type(value).__name__}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise InvalidArgument(
            f"cannot parse size {value!r}: write a non-negative number with an optional "
            f"unit, e.g. '1024', '512 MiB', '2GiB', '1.5 GB' "
            f"(units: B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB, PB)"
        )
    number_text, unit_text = match.groups()
    if number_text.startswith("-"):
        raise InvalidArgument(f"size must not be negative, got {value!r}")
    multiplier = _PARSE_UNITS.get(unit_text.lower())
    if multiplier is None:
        raise InvalidArgument(
            f"unknown size unit {unit_text!r} in {value!r}: use B, KiB, MiB, GiB, TiB, PiB "
            f"(powers of 1024) or KB, MB, GB, TB, PB (powers of 1000)"
        )
    try:
        number = Decimal(number_text.replace("_", ""))
    except InvalidOperation:  # pragma: no cover - the regex already rules this out
        raise InvalidArgument(f"cannot parse the number in size {value!r}") from None
    return int((number * multiplier).to_integral_value(rounding=ROUND_HALF_UP))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_one(m: "re.Match[str]") -> str:
    c = ord(m.group())
    return f"\\x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"\\u{c:04x}"


def _escape_one_json(m: "re.Match[str]") -> str:
    return "\\" + _escape_one(m)  # inside a JSON string the backslash is escaped too


def escape_surrogates(text: str, in_json: bool = False) -> str:
    """``text`` with lone surrogates written as escapes, so it encodes as UTF-8.

    A file name that is not valid UTF-8 reaches Python with each bad byte as
    a surrogate (``os.fsdecode(b"d\\xff")`` is ``"d\\udcff"``); it is shown
    as ``d\\xff``, the byte's escape. Other lone surrogates become ``\\udXXX``.
    ``in_json``: ``text`` is JSON written with ``ensure_ascii=False`` (where
    surrogates can only be inside strings); the escape's backslash is doubled
    so that the JSON decodes to the escaped name."""
    if text.isascii():
        return text
    return _SURROGATE.sub(_escape_one_json if in_json else _escape_one, text)


#: what must not reach a terminal or a page raw from trace data: C0 controls
#: (ESC starts the sequences that clear a screen, set colours or write the
#: clipboard, OSC 52; BEL ends them), DEL, C1 controls (U+009B is a one-byte
#: CSI), and the bidirectional controls that reorder what is shown (U+202E
#: right-to-left override, the isolates, the marks)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape_control(m: "re.Match[str]") -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def escape_controls(text: str, keep: str = "\n") -> str:
    """``text`` safe to print or show: lone surrogates escaped (see
    :func:`escape_surrogates`), and control characters and bidirectional
    controls written as their escapes (``\\x1b``, ``\\u202e``) but those in
    ``keep`` (newlines, by default; a page may keep tabs too). For what a
    trace or a program names (file, function, label and thread names) on
    its way to a terminal, a notebook or an HTML page."""
    text = escape_surrogates(text)
    if not _CONTROL.search(text):
        return text
    if not keep:
        return _CONTROL.sub(_escape_control, text)
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else _escape_control(m), text)


def json_finite(value: Any) -> Any:
    """``value`` (dicts, lists, tuples, leaves) with NaN and infinities as
    None: floats JSON does not have (``json.dumps`` would write ``NaN``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_finite(v) for v in value]
    return value
