"""The memviz command line: ``python -m memviz COMMAND ...`` or ``memviz COMMAND ...``.

Commands:

    run     run a Python script (or -m module) with every CUDA allocation
            tracked, and print a memory report to stderr when it ends
            (-o run.memviz also streams a trace file)
    report  print the report of a .memviz trace file (text, json or html);
            of several, the ranks of one torchrun run, their merged report
    diff    compare two .memviz traces of one script run two ways: peaks,
            reserved against allocated, fragmentation, categories, lines
    whatif  replay a trace's PyTorch requests under other allocator settings
            and on other cards: predicted peaks, retries, out-of-memory points
    export  write traces as Parquet tables (--parquet OUT/ run.rank*.memviz)

``python -m memviz run --help`` shows the options of a command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["main", "COMMANDS"]

#: command -> ("module" with main(argv, prog) -> int, or "module:function", one-line help)
COMMANDS: Dict[str, Tuple[str, str]] = {
    "run": ("memviz.cli.run",
            "run a Python script (or -m module) under memviz and print a memory report"),
    "report": ("memviz.cli.report",
               "print the report of a .memviz trace file (text, json or html), or of a "
               "run's ranks merged"),
    "diff": ("memviz.cli.diff",
             "compare two .memviz traces of one script run two ways, side by side"),
    "whatif": ("memviz.cli.whatif",
               "replay a .memviz trace's PyTorch requests under other allocator settings "
               "(expandable segments, max_split_size_mb, a smaller card)"),
    "export": ("memviz.cli.export",
               "write .memviz traces as Parquet tables (events, stacks, steps, peaks, findings) "
               "for DuckDB, Polars or Spark"),
}


def _prog() -> str:
    """How the user invoked us, for usage lines: 'python -m memviz' or 'memviz'."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m memviz" if argv0 in ("__main__.py", "-m", "") else "memviz"


def _parser(prog: str) -> argparse.ArgumentParser:
    from memviz._package import __version__

    parser = argparse.ArgumentParser(
        prog=prog,
        description="memviz: which line of your Python code is holding this GPU memory?",
        epilog=f"Example: {prog} run examples/basic.py.  "
               f"'{prog} COMMAND --help' shows a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"memviz {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the memviz command line with ``argv`` (default ``sys.argv[1:]``).

    Returns the exit status: the script's for ``run``, 2 for usage errors.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog()
    if argv and argv[0] in COMMANDS:
        module_name, _, function = COMMANDS[argv[0]][0].partition(":")
        entry = getattr(importlib.import_module(module_name), function or "main")
        return entry(argv[1:], prog=f"{prog} {argv[0]}")
    parser = _parser(prog)
    try:
        parser.parse_args(argv)  # --help, --version, or an unknown command
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    parser.print_usage(sys.stderr)
    print(f"{prog}: give a command, e.g. `{prog} run script.py`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
