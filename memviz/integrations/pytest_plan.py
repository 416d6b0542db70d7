"""What the pytest plugin is to do for one test, read from its markers:
``@pytest.mark.memviz(peak=, leaks=, own_code=, filter_fn=)`` and
``@pytest.mark.no_graph_leak``, checked keyword by keyword (a mistake fails
the test with a message saying how to write the marker), and where the
marker stands (``test_x.py:12``), for the messages. The :class:`Plan` also
carries what the checks found and which were left out, and why.

The hooks are in memviz.integrations.pytest_plugin, the checks in
memviz.integrations.pytest_checks. Imports pytest and the floors below
memviz.integrations (docs/architecture.md).
"""

from __future__ import annotations

import linecache
import os
from typing import Any, Callable, Dict, List, Optional

import pytest

from memviz._units import parse_size

__all__ = ["Plan", "marker_plan", "marker_where", "KEYWORDS", "FAILED_FIRST", "SKIPPED_ITSELF"]

#: the keywords of @pytest.mark.memviz
KEYWORDS = ("peak", "leaks", "own_code", "filter_fn", "warmups")


def marker_size(value: Any) -> int:
    """A size in a marker, read as pytest-memray reads limit_memory("24 MB"):
    KB, MB, GB, TB and PB are powers of 1024 there (24 MB = 24 * 1024**2
    bytes), in any letter case ("24 mb", "3 Mb"), as are KiB ... PiB; "B",
    or a bare number, is bytes."""
    import re
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+_]+)\s*([KMGTP]?)B\s*", value, re.IGNORECASE)
        if m:
            unit = m.group(2).upper()
            return parse_size(f"{m.group(1)} {unit + 'iB' if unit else 'B'}")
    return parse_size(value)

#: (reason, what to do) of checks not judged because the test itself failed, or skipped itself
FAILED_FIRST = ("the test failed, so memviz did not judge its memory", "fix the test's own failure first")
SKIPPED_ITSELF = ("the test skipped itself, so memviz did not judge its memory",
                  "nothing, unless the test should not skip here")


class Plan:
    """What the plugin does for one test, and what it found."""

    def __init__(self) -> None:
        self.peak: Optional[int] = None
        self.peak_text = ""
        self.leaks: Optional[int] = None  # bytes tolerated; None: no leak check
        self.leaks_text = ""
        self.own_code = False
        self.warmups = 0  # runs of the test before the measured one (caches warmed)
        self.filter_fn: Optional[Callable[[Any], bool]] = None
        self.graph = False
        self.record = False
        self.where = ""  # "test_x.py:12": the marker's line (or the test's)
        self.test_files: frozenset = frozenset()
        self.tracker = None
        self.call_start_ns = 0
        #: native ids of the Python threads, other than the test's, running when the call began
        self.threads_before: frozenset = frozenset()
        self.seq = None
        self.recorder = None
        self.saved_mark = 0
        self.function = None
        self.failures: List[str] = []
        self.checks_run: List[str] = []
        self.checks_skipped: List[Dict[str, str]] = []
        self.gpu_skipped = False
        self.not_judged = FAILED_FIRST  # why the checks were not judged, when the call did not pass
        self.result: Dict[str, Any] = {}

    @property
    def gpu(self) -> bool:
        return self.peak is not None or self.leaks is not None

    def gpu_checks(self) -> List[str]:
        """The GPU checks asked for, as written in the marker."""
        out = []
        if self.peak is not None:
            out.append(f"peak={self.peak_text}")
        if self.leaks is not None:
            out.append(f"leaks={self.leaks_text}")
        return out

    def marker_text(self) -> str:
        """The marker as written, and its line: ``@pytest.mark.memviz(peak='1 GiB') at t.py:3``."""
        parts = self.gpu_checks()
        if self.leaks is not None and self.filter_fn is not None:
            parts.append("filter_fn=...")
        elif self.leaks is not None and self.own_code:
            parts.append("own_code=True")
        return f"@pytest.mark.memviz({', '.join(parts)}) at {self.where}"

    def skip(self, checks: List[str], reason: str, what_to_do: str) -> None:
        """Leave ``checks`` out (the test itself still runs), saying why."""
        for check in checks:
            self.checks_skipped.append({"check": check, "where": self.where,
                                        "reason": reason, "what_to_do": what_to_do})

    def skip_gpu(self, reason: str, what_to_do: str) -> None:
        if not self.gpu_skipped:
            self.gpu_skipped = True
            self.skip(self.gpu_checks(), reason, what_to_do)


def marker_where(item, marker: str = "memviz") -> str:
    """``file:line`` of the test's ``marker`` (memviz's, by default), else of
    the test itself (relative to pytest's rootdir, as pytest names tests)."""
    rel, line0 = item.location[0], item.location[1]
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is None or line0 is None:
        return f"{rel}:{(line0 or 0) + 1}" if line0 is not None else rel
    first = code.co_firstlineno  # the first decorator's line (Python 3.8+)
    for n in range(first, first + 50):
        text = linecache.getline(code.co_filename, n).strip()
        if f"mark.{marker}" in text:
            return f"{rel}:{n}"
        if not text or text.startswith(("def ", "async def ")):
            break
    return f"{rel}:{line0 + 1}"


def _test_files(item) -> frozenset:
    """Real paths of the test's own code: its file (and where its function is defined)."""
    files = set()
    for name in (str(getattr(item, "path", "") or ""),
                 getattr(getattr(getattr(item, "function", None), "__code__", None), "co_filename", "")):
        if name and not name.startswith("<"):
            files.add(os.path.realpath(name))
    return frozenset(files)


def marker_plan(item, own_code_default: bool = False) -> Plan:
    plan = Plan()
    m = item.get_closest_marker("memviz")
    if m is not None:
        plan.where = marker_where(item)
        at = f" (marker at {plan.where})"

        def mistake(text: str) -> None:
            pytest.fail(text, pytrace=False)

        usage = ("use @pytest.mark.memviz(peak='2 GiB') and/or @pytest.mark.memviz(leaks=True) "
                 "(with own_code=True or filter_fn=... to choose which leaks count)")
        unknown = sorted(set(m.kwargs) - set(KEYWORDS))
        if m.args or unknown:
            mistake(f"@pytest.mark.memviz takes the keywords peak=, leaks=, own_code=, filter_fn= and warmups= "
                    f"only, got {', '.join([repr(a) for a in m.args] + [k + '=' for k in unknown])}{at}; "
                    f"{usage}.")
        if m.kwargs.get("peak") is not None:
            try:
                plan.peak = marker_size(m.kwargs["peak"])
            except (TypeError, ValueError) as e:
                mistake(f"@pytest.mark.memviz(peak={m.kwargs['peak']!r}): {e}{at}. Write the budget as "
                        f"a size such as peak='2 GiB' or a number of bytes.")
            plan.peak_text = repr(m.kwargs["peak"])
        leaks = m.kwargs.get("leaks", False)
        if leaks is True:
            plan.leaks, plan.leaks_text = 0, "True"
        elif leaks not in (False, None):
            try:
                plan.leaks = marker_size(leaks)
            except (TypeError, ValueError) as e:
                mistake(f"@pytest.mark.memviz(leaks={leaks!r}) takes True or a size to tolerate "
                        f"(e.g. '1 MiB'): {e}{at}.")
            plan.leaks_text = repr(leaks)
        own_code = m.kwargs.get("own_code", None)
        filter_fn = m.kwargs.get("filter_fn", None)
        if own_code is not None and not isinstance(own_code, bool):
            mistake(f"@pytest.mark.memviz: own_code= takes True or False, got {own_code!r}{at}; "
                    f"own_code=True counts only leaks made by the test file's own lines.")
        if filter_fn is not None and not callable(filter_fn):
            mistake(f"@pytest.mark.memviz: filter_fn= takes a function of a memviz Allocation returning "
                    f"True to count it as a leak, got {filter_fn!r}{at}; e.g. "
                    f"filter_fn=lambda a: a.size >= 1 << 20.")
        if (own_code is not None or filter_fn is not None) and plan.leaks is None:
            mistake(f"@pytest.mark.memviz: own_code= and filter_fn= choose which leaks count; add "
                    f"leaks=True{at}, or drop them.")
        if own_code is not None and filter_fn is not None:
            mistake(f"@pytest.mark.memviz: filter_fn= decides alone which leaks count, so own_code= has "
                    f"no effect beside it{at}; drop own_code=, and test "
                    f"a.user_frame.filename in filter_fn if you need the file.")
        warmups = m.kwargs.get("warmups", 0)
        if isinstance(warmups, bool) or not isinstance(warmups, int) or warmups < 0:
            mistake(f"@pytest.mark.memviz: warmups= takes a whole number of runs (0 or more), got "
                    f"{warmups!r}{at}; warmups=N runs the test N times before the measured run, so "
                    f"caches it fills once are not counted as leaks (pytest-memray's warmups).")
        plan.warmups = warmups
        plan.own_code = own_code if own_code is not None else own_code_default
        plan.filter_fn = filter_fn
        if plan.peak is None and plan.leaks is None:
            mistake(f"@pytest.mark.memviz without peak= or leaks= checks nothing{at}; {usage}.")
        plan.test_files = _test_files(item)
    plan.graph = item.get_closest_marker("no_graph_leak") is not None
    if plan.graph and not plan.where:
        plan.where = marker_where(item, "no_graph_leak")
    return plan
