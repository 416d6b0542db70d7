"""The sample trace shipped in memviz/data, shown where GPU capture is off.

``memviz run`` follows the report of a script that sets
``MEMVIZ_SAMPLE_WITHOUT_GPU = True`` in its globals (memviz's demo,
examples/basic.py, does), where GPU capture is off, by the report of
sample.memviz: a run of that demo recorded on a GPU, headed by the machine,
date and script it was recorded on (sample.json) and marked as a recording,
not this machine's data. :func:`load_sample` and :func:`recorded_source`
(memviz/report/summary.py's, named here too) also serve the README's picture
(benchmarks/readme_picture.py). ``memviz report`` on the sample file (or a
copy) says it is a sample too: memviz.load marks it (LoadedTrace.sample).

Imports memviz.cli.common and the floors below memviz.cli (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import warnings
from typing import Any, Dict, Tuple

from memviz._errors import MemvizError
from memviz.cli.common import say
from memviz.report.summary import recorded_source
from memviz.report.text import WIDTH, text_report
from memviz.trace.format import TraceWarning

__all__ = ["SAMPLE_OPT_IN", "load_sample", "recorded_source", "sample_report", "show_sample"]

#: a script's global that asks for the sample report where GPU capture is off
SAMPLE_OPT_IN = "MEMVIZ_SAMPLE_WITHOUT_GPU"
_SAMPLE_FILES = ("sample.memviz", "sample.json")
_REINSTALL = "reinstall memviz (pip install --force-reinstall memviz-gpu)"


def _sample_folder() -> Any:
    """Where the sample's files are: memviz/data, as installed."""
    from importlib import resources

    return resources.files("memviz").joinpath("data")


def load_sample() -> Tuple[Any, Dict[str, str]]:
    """(the loaded sample trace, its description) from memviz/data.

    The description (sample.json) has "machine", "date" and "script" (what
    ran, as its lines are recorded, e.g. "examples/basic.py"), and may have
    "script_source": the script's text when it was recorded. Raises
    :class:`~memviz.TraceError` when a file is missing or unreadable (a broken
    install), saying which and what to do."""
    from importlib import resources

    from memviz._errors import TraceError
    from memviz.loaded import load

    folder = _sample_folder()
    trace_file, meta_file = (folder.joinpath(name) for name in _SAMPLE_FILES)
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("it is not a JSON object")
        if not all(isinstance(meta.get(k), str) and meta[k]
                   for k in ("machine", "date", "script")):
            raise ValueError('it lacks one of "machine", "date" and "script" (non-empty strings)')
        if not isinstance(meta.get("script_source", ""), str):
            raise ValueError('its "script_source" is not a string')
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise TraceError(f"memviz's sample description {meta_file} cannot be read ({e}); "
                         f"{_REINSTALL}.") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # a cut-off sample is still a sample
        with resources.as_file(trace_file) as path:
            if not os.path.isfile(path):
                raise TraceError(f"memviz's sample trace {path} is missing; {_REINSTALL}.")
            try:
                trace = load(os.fspath(path))
            except TraceError as e:
                raise TraceError(f"memviz's sample trace cannot be read: {e}; "
                                 f"{_REINSTALL}.") from None
    trace.sample = meta  # its reports say it is a sample (LoadedTrace.sample)
    return trace, meta


def sample_report(top: int = 10) -> str:
    """The text report of the sample trace shipped in memviz/data, headed by
    the machine, date and script it was recorded on (see :func:`load_sample`)."""
    trace, meta = load_sample()
    machine, date, script = meta["machine"], meta["date"], meta["script"]
    heading = (f"memviz: GPU capture was off, so here is a SAMPLE instead, a recording shipped "
               f"with memviz and not this machine's data: the report of a run recorded on "
               f"{machine} on {date} running {script}.")
    # Headed "SAMPLE (recorded on DATE, not on this machine): SCRIPT", not
    # "memviz report", and read with the script's recorded source (text_report
    # does both for a sample: LoadedTrace.sample).
    report = text_report(trace, top=top, outside=trace.outside)
    return "\n".join(textwrap.wrap(heading, WIDTH, subsequent_indent="  ")) + "\n\n" + report


def show_sample(top: int) -> None:
    """Print the sample report after the run's own (never fails the run)."""
    try:
        text = sample_report(top)
    except MemvizError as e:
        say(f"memviz: no sample report to show: {e}")
        return
    try:
        sys.stderr.write("\n" + text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
