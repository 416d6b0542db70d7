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


_SYSTEM = ("libc.so", "[vdso]", "ld-linux", "libpthread", "libm.so", "unknown")


def _memviz_c_files() -> set:
    """The basenames of memviz's C sources (py-spy names a native frame by its file)."""
    import glob
    import os
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    return {os.path.basename(p) for p in glob.glob(os.path.join(src, "*.[ch]"))}


def _own_function(frames, own_files):
    """The memviz function a sample's time is spent in, or None: from the
    innermost frame out, past the C library's frames (a lock, the clock)."""
    for fr in reversed(frames):
        m = re.search(r"\(([^()]*)\)$", fr)
        where = m.group(1) if m else ""
        if where.startswith("0x") or any(s in where or s in fr for s in _SYSTEM):
            continue
        if where in own_files or "memviz/_core" in where:
            return fr
        return None
    return None


def _named(frame: str, name: str) -> bool:
    """The frame is of function `name`, also as a nested function's qualified
    name (Python 3.11+: "main.<locals>.step (file.py)")."""
    head = frame.split(" (", 1)[0].split("(", 1)[0]
    return head == name or head.endswith("." + name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--focus", action="append", default=[])
    ap.add_argument("--within", action="append", default=[],
                    help="only samples whose stack holds a frame of this function (e.g. a step "
                         "function, or the autograd engine's thread_main); may be given again")
    a = ap.parse_args()
    own_files = _memviz_c_files()
    own = collections.Counter()  # memviz's own C work, by the innermost memviz function
    own_by_thread = collections.Counter()
    within_total = 0
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
            if a.within and not any(_named(f, w) for f in frames for w in a.within):
                continue
            within_total += n
            who = _own_function(frames, own_files)
            if who:
                own[who] += n
                own_by_thread[frames[0]] += n
            total += n
            if frames[0].startswith(("thread (", "process ")):
                threads[frames[0]] += n
            self_c[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n

    def pct(c):
        return f"{100.0 * c / total:5.1f}%" if total else "  -  "

    print(f"samples: {total}" + (f" (those inside {' or '.join(a.within)})" if a.within else ""))
    if own_files:
        o = sum(own.values())
        print(f"\nmemviz's own C work (the innermost frame outside libc that is memviz's): "
              f"{pct(o)} ({o} samples)")
        for fr, c in own.most_common(a.top):
            print(f"  {pct(c)}  {c:8d}  {fr[:160]}")
        for t, c in own_by_thread.most_common():
            print(f"  memviz's own in {t}: {c} of its {threads[t]} samples ({100.0 * c / max(threads[t], 1):.2f}%)")
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
