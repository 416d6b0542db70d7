"""What the verbs of the command line share: the usage exit status, reading
a trace for a command, refusing an output path that names one of the
command's inputs, printing or writing the command's text, JSON, the names of
devices and the whole-number options.

Imports only the floors below memviz.cli (docs/architecture.md); each verb
(run.py, sample.py, report.py, diff.py ...) imports this module, never another verb.
"""

from __future__ import annotations

import argparse
import os
import functools
import inspect
import json
import sys
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import memviz._progress as _progress
from memviz._args import whole_option
from memviz._errors import InvalidArgument, OutputError
from memviz._output_files import refuse_inputs, write_output
from memviz._units import json_finite
from memviz.report.summary import device_name
from memviz.trace.format import TraceWarning

__all__ = ["EXIT_USAGE", "positive", "parse", "say", "load_trace", "refuse_output", "dumps",
           "write_text", "device_name", "with_progress"]

#: the exit status of a mistake in the command line (and of an output that
#: could not be written)
EXIT_USAGE = 2

#: argparse ``type=`` of --top and the like: a whole number >= 1
positive = whole_option(1)


def parse(parser: argparse.ArgumentParser, argv: List[str]) -> Union[argparse.Namespace, int]:
    """The parsed options, or the exit status when argparse ended the command
    (--help: 0, a usage error it printed: 2)."""
    try:
        opts = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if hasattr(opts, "json_flag"):  # add_format's pair
        if opts.json_flag and opts.format not in (None, "json"):
            print(f"{parser.prog}: --json and --format {opts.format} ask for two formats. What to do: "
                  "give one of them.", file=sys.stderr)
            return EXIT_USAGE
        opts.format = "json" if opts.json_flag else (opts.format or "text")
    return opts


def add_format(parser: argparse.ArgumentParser) -> None:
    """``--format text|json`` and ``--json`` (the same as --format json);
    :func:`parse` refuses the two saying different things."""
    parser.add_argument("--json", action="store_true", dest="json_flag",
                        help="write JSON (the same as --format json)")
    parser.add_argument("--format", choices=("text", "json"), default=None,
                        help="text (the default) or json")


def say(line: str) -> None:
    """One line on stderr, if stderr still takes it (the process's own where a
    script set sys.stderr to None)."""
    try:
        print(line, file=sys.stderr if sys.stderr is not None else sys.__stderr__, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def with_progress(main: Callable[..., int]) -> Callable[..., int]:
    """A verb's ``main(argv, prog)`` that shows progress on stderr while it
    runs, when stderr is a terminal and the work takes over a second
    (memviz._progress: reading a big trace, the report's second pass)."""
    default = inspect.signature(main).parameters["prog"].default

    @functools.wraps(main)
    def run(argv: Optional[List[str]] = None, prog: str = default) -> int:
        with _progress.shown(prog):
            return main(argv, prog)
    return run


def load_trace(path: str, recover: bool, prog: str):
    """The loaded trace; a warning about a cut-off file goes to stderr as one line."""
    from memviz.loaded import load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        trace = load(path, recover=recover)
    for w in caught:
        print(f"{prog}: warning: {w.message}", file=sys.stderr)
    return trace


def add_force(parser: argparse.ArgumentParser) -> None:
    """-f/--force: an output file that exists is overwritten (without it, refused)."""
    parser.add_argument("-f", "--force", action="store_true",
                        help="overwrite an output file that exists (without it memviz refuses, "
                             "so that no earlier result is lost by mistake)")


def exists_message(path: str, what: str, option: str = "-o") -> str:
    """Why an existing output is refused, and what to do (--force)."""
    return (f"{what} would go to {path!r}, which exists: memviz does not overwrite a file unless "
            f"told to. Pass --force (-f) to overwrite it, or choose another {option} path.")


def refuse_output(out: Optional[str], inputs: Sequence[Tuple[str, str]], what: str,
                  prog: str, force: bool = False) -> Optional[int]:
    """Before anything is read: EXIT_USAGE (said on stderr) when -o ``out``
    names one of ``inputs`` ((name, path) pairs), or names a file that exists
    and ``force`` is not given; else None."""
    if out is None or out == "-":  # stdout
        return None
    try:
        refuse_inputs(out, inputs, what, hint="choose another -o path")
    except OutputError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not force and os.path.isfile(out):  # a file's content (a device or a FIFO is no file to keep)
        print(f"{prog}: {exists_message(out, what)}", file=sys.stderr)
        return EXIT_USAGE
    return None


def dumps(doc: Any) -> str:
    """Valid JSON (a NaN step value is null), one document and a newline."""
    return json.dumps(json_finite(doc), indent=1, default=str, allow_nan=False) + "\n"


def write_text(text: str, out: Optional[str], prog: str, what: str = "the report",
               inputs: Tuple[Tuple[str, str], ...] = ()) -> int:
    """Print ``text``, or write it to ``out`` (never over one of ``inputs``:
    (name, path) pairs; through a temporary file renamed over ``out``).
    Returns the exit status. ``-o -`` is stdout, as the default."""
    if out is None or out == "-":
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as e:  # a closed pipe, a full disk behind a redirection
            print(f"{prog}: cannot write {what} to stdout: {e.strerror or e}. What to do: "
                  "check where stdout goes, or write to a file with -o PATH.", file=sys.stderr)
            return EXIT_USAGE
        return 0
    try:
        write_output(out, text, what, inputs=inputs)
    except (OutputError, InvalidArgument) as e:  # InvalidArgument: -o ''
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{prog}: wrote {out}", file=sys.stderr)
    return 0
