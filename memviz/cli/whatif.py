"""``memviz whatif TRACE``: the recorded PyTorch requests replayed under
other allocator settings, to rank remedies without re-running
(memviz.analysis.whatif does the work; this module is the command).

``python -m memviz whatif run.memviz --alloc-conf expandable_segments:True
--alloc-conf max_split_size_mb:128 [--device-memory 24GiB | 0.9]
[--format text|json] [-o OUT]``

Imports memviz.cli.common and the floors below memviz.cli (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from memviz._errors import MemvizError
from memviz.analysis.whatif import rows_json, rows_text, whatif
from memviz.cli.common import (EXIT_USAGE, add_force, add_format, dumps, load_trace, parse, refuse_output, with_progress,
                               write_text)

__all__ = ["main"]


def whatif_parser(prog: str = "memviz whatif") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Replay a trace's PyTorch requests, in order and on their streams, through a model "
                    "of PyTorch's caching allocator under other settings: the reserved peak, what was "
                    "allocated then, unused bytes and the largest free block at the peak, cudaMalloc "
                    "calls and retries, and where the run would run out of memory on a given card. "
                    "The first row replays the recorded settings (it checks the model).",
        epilog=f"Example: {prog} run.memviz --alloc-conf expandable_segments:True "
               "--alloc-conf max_split_size_mb:128 --device-memory 24GiB",
        allow_abbrev=False)
    parser.add_argument("trace", help="a .memviz trace (memviz run -o, or track(trace=...))")
    parser.add_argument("--alloc-conf", action="append", default=[], metavar="CONF",
                        help="a setting in PYTORCH_CUDA_ALLOC_CONF's syntax, e.g. "
                             "'expandable_segments:True,max_split_size_mb:128'; give it several times "
                             "for several rows")
    parser.add_argument("--device-memory", metavar="SIZE|FRACTION",
                        help="a card of this size (e.g. 24GiB), or this fraction of the recorded card "
                             "(e.g. 0.9, as torch.cuda.set_per_process_memory_fraction)")
    add_format(parser)
    parser.add_argument("--recover", action="store_true", help="read a damaged trace up to the damage")
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout (- is stdout)")
    add_force(parser)
    return parser


@with_progress
def main(argv: Optional[List[str]] = None, prog: str = "memviz whatif") -> int:
    """Entry point of ``memviz whatif``; returns the exit status (2: an
    error, said on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(whatif_parser(prog), argv)
    if isinstance(opts, int):
        return opts
    inputs = (("the trace", opts.trace),)
    refused = refuse_output(opts.output, inputs, "the what-if table", prog, opts.force)
    if refused is not None:
        return refused
    try:
        trace = load_trace(opts.trace, opts.recover, prog)
        rows = whatif(trace, opts.alloc_conf, opts.device_memory)
    except MemvizError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = dumps(rows_json(rows)) if opts.format == "json" else rows_text(rows)
    return write_text(text, opts.output, prog, "the what-if table", inputs)
