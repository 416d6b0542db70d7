"""``memviz diff A B``: two runs of one script, side by side.

``python -m memviz diff A.memviz B.memviz [--json] [--top N] [--key lineno]
[--devices 0:1] [-o OUT]`` compares two traces of the same script run two
ways (with and without AMP, activation checkpointing, gradient accumulation,
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``...). For each device it
shows A, B, B - A and B / A of the peak, PyTorch's reserved against allocated,
the fragmentation figures at the peak, the bytes per category and the lines
whose bytes at the peak differ most (what each figure is, and the JSON
document ``--json`` writes: memviz.cli.diff_compare; the text:
memviz.cli.diff_render).

This module is the command (its options, reading the traces, where the
output goes); it hands :func:`compare`, :func:`render` and :func:`diff_text`
on, as the Python face of ``memviz diff``. Imports memviz.cli.common,
diff_compare, diff_render and the floors below memviz.cli (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Tuple

from memviz._errors import MemvizError
from memviz.cli.common import (EXIT_USAGE, add_force, add_format, dumps, load_trace, parse, positive, refuse_output,
                               with_progress, write_text)
from memviz.cli.diff_compare import compare
from memviz.cli.diff_render import diff_text, render
from memviz.model.statistics import KEY_TYPES

__all__ = ["main", "diff_main", "diff_parser", "compare", "render", "diff_text"]


def _device_pairs(text: str) -> List[Tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        a, sep, b = part.strip().partition(":")
        try:
            pair = (int(a), int(b if sep else a))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected DEVICE_OF_A:DEVICE_OF_B (e.g. 0:1, or 0:0,1:1), got {text!r}") from None
        if min(pair) < 0:
            raise argparse.ArgumentTypeError(f"device numbers are 0 or more, got {text!r}")
        pairs.append(pair)
    return pairs


def diff_parser(prog: str = "memviz diff") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Compare two .memviz traces of one script run two ways (with and "
                               "without AMP, activation checkpointing, expandable segments, ...): "
                               "per device, the peak, PyTorch's reserved against allocated, the "
                               "fragmentation figures, the bytes per category and the lines at the "
                               "peak, side by side with B - A and B / A.",
        epilog="Example: memviz diff plain.memviz checkpointed.memviz --top 20", allow_abbrev=False)
    parser.add_argument("a", help="trace A (e.g. the run without the remedy)")
    parser.add_argument("b", help="trace B (e.g. the run with it)")
    add_format(parser)
    parser.add_argument("--top", type=positive, default=10, metavar="N",
                        help="lines listed per device (default 10)")
    parser.add_argument("--key", choices=KEY_TYPES, default="lineno",
                        help="group the lines by (default lineno: the user's line)")
    parser.add_argument("--devices", type=_device_pairs, metavar="A:B",
                        help="compare device A of the first trace with device B of the second "
                             "(e.g. 0:1; several: 0:0,1:1); default: the same numbers")
    parser.add_argument("--recover", action="store_true",
                        help="read corrupted files up to the damaged part")
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout (- is stdout)")
    add_force(parser)
    return parser


@with_progress  # on stderr, when it is a terminal and the work takes a while
def main(argv: Optional[List[str]] = None, prog: str = "memviz diff") -> int:
    """Entry point of ``memviz diff``; returns the exit status (2: an error,
    said on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(diff_parser(prog), argv)
    if isinstance(opts, int):
        return opts
    inputs = (("the older trace (A)", opts.a), ("the newer trace (B)", opts.b))
    refused = refuse_output(opts.output, inputs, "the diff", prog, opts.force)  # -o must not name a trace it compares
    if refused is not None:
        return refused
    names = (os.path.basename(opts.a), os.path.basename(opts.b))
    if names[0] == names[1]:
        names = (opts.a, opts.b)
    try:
        a, b = load_trace(opts.a, opts.recover, prog), load_trace(opts.b, opts.recover, prog)
        doc = compare(a, b, names=(f"A ({names[0]})", f"B ({names[1]})"), top=opts.top, key=opts.key,
                      devices=opts.devices)
    except MemvizError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = dumps(doc) if opts.format == "json" else render(doc, names)
    return write_text(text, opts.output, prog, "the diff", inputs)


diff_main = main
