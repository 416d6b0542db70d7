"""Summarise a py-spy raw (collapsed stacks) profile into a short text report.

    python benchmarks/pyspy_summary.py profile.txt [--top 40] [--focus memviz]

py-spy's raw files of a whole training run are tens of MB; this keeps what a
reader needs: samples per thread, the functions with the most samples on top
of the stack (self), the functions with the most samples anywhere in the
stack (inclusive), and the inclusive figures of frames matching --focus.
Line numbers are dropped so that one function is one row.
"""

import argparse
import collections
import re

_LINE = re.compile(r":\d+\)$")


def frame_key(frame: str) -> str:
    return _LINE.sub(")", frame.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--focus", action="append", default=[])
    a = ap.parse_args()
    total = 0
    threads = collections.Counter()
    self_c = collections.Counter()
    incl = collections.Counter()
    with open(a.path, errors="replace") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            n = int(n)
            frames = [frame_key(x) for x in stack.split(";") if x]
            if not frames:
                continue
            total += n
            if frames[0].startswith(("thread (", "process ")):
                threads[frames[0]] += n
            self_c[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n

    def pct(c):
        return f"{100.0 * c / total:5.1f}%" if total else "  -  "

    print(f"samples: {total}")
    if threads:
        print("\nby thread:")
        for t, c in threads.most_common():
            print(f"  {pct(c)}  {c:8d}  {t}")
    print(f"\nself (top {a.top}):")
    for fr, c in self_c.most_common(a.top):
        print(f"  {pct(c)}  {c:8d}  {fr[:160]}")
    print(f"\ninclusive (top {a.top}):")
    for fr, c in incl.most_common(a.top):
        print(f"  {pct(c)}  {c:8d}  {fr[:160]}")
    for focus in a.focus:
        rows = [(fr, c) for fr, c in incl.items() if focus in fr]
        print(f"\ninclusive, frames matching {focus!r}:")
        for fr, c in sorted(rows, key=lambda r: -r[1])[: a.top]:
            print(f"  {pct(c)}  {c:8d}  {fr[:160]}")


if __name__ == "__main__":
    main()
