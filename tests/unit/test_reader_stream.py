"""The bounded reader: each EVENTS chunk streams through the C replayer
(``_core.Replayer``) and is let go, and what needs the whole history reads
the file again. Checked against the reader it replaced, which kept every
event as columns and replayed them at once (``_core.replay``, itself held
to the plain rules in tests/unit/test_capture.py): ``Oracle`` below is that
reader's logic, over columns decoded here from the very chunks the reader
accepted.

Random traces (allocations, frees, retirements, unmatched frees, failures,
TIME and GAP records, PyTorch's blocks inside segments, several devices,
both record layouts, sizes up to 64 bits), the fuzzer's seed traces and
their loadable mutants: the live set, each device's peak and peak set, the
failures, the totals replayed from the events, the timeline, the events
with their seq, snapshots at any time, and the category series of the
HTML report and Perfetto export must agree. Plus: a 2,000,000-event trace
loads in bounded memory (the old reader failed that), and a file changed
after it was loaded is a TraceError, not wrong answers.
"""

import itertools
import os
import random
import subprocess
import sys
import warnings
import zlib
from array import array
from types import SimpleNamespace

import pytest

import memviz
from memviz import _core
from memviz.loaded import LoadedTrace
from memviz.trace import format as F

from conftest import ROOT

BLOCK, DEVICE, PHYSICAL = 5, 0, 4


# ---- traces -----------------------------------------------------------------------


def meta(start=1_000_000):
    return {"format": "memviz-trace", "format_version": 1, "mode": "stream",
            "start_monotonic_ns": start, "tracker": {}, "capture": {}}


def trace_bytes(records, *, chunk_sizes=None, rnd=None, start=1_000_000, end=False):
    """A trace of packed event records, cut into EVENTS chunks (random sizes
    and layouts with ``rnd``)."""
    out = [F.header(), F.chunk(F.META, F.json_bytes(meta(start))),
           F.chunk(F.LABELS, F.json_bytes({"1": "one", "2": "\x01Node\x1fx.py:3"}))]
    i = 0
    while i < len(records):
        n = rnd.randint(1, 400) if rnd else (chunk_sizes or len(records))
        rows = b"".join(records[i:i + n])
        layout = rnd.choice([F.LAYOUT_ROWS, F.LAYOUT_PLANES]) if rnd else F.LAYOUT_PLANES
        out.append(F.chunk(F.EVENTS, F.events_payload(rows, layout),
                           compress=rnd.choice([None, 1, 6]) if rnd else 6))
        i += n
    if end:
        out.append(F.chunk(F.END, F.json_bytes({"stopped_monotonic_ns": 10 ** 12})))
    return b"".join(out)


def random_records(rnd, n, *, big_sizes=False):
    """Events like a run's, and odd ones: retirements, unmatched frees,
    kinds sharing a key space, blocks inside segments (right after them, as
    the allocator route records them), TIME records backwards too, GAPs."""
    recs = []
    live = []
    segs = []
    addrs = [0x7000_0000 + k * 0x1000 for k in range(24)]
    for _ in range(n):
        r = rnd.random()
        dev = rnd.choice([0, 0, 0, 1, -1, 7])
        thread = rnd.randrange(3)
        delta = rnd.choice([0, 1, 5, 1000, 0xFFFFFFFF])
        size = (rnd.randrange(1, 1 << 62) if big_sizes and rnd.random() < 0.2
                else rnd.randrange(1, 64) << 16)
        label = rnd.choice([0, 0, 1, 2, 9])
        stack = rnd.choice([0, 1, 2, 77])
        if r < 0.04:
            recs.append(F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0,
                                     rnd.choice([1, 5_000_000, 2_000_000_000]), 0, 0, 0))
        elif r < 0.06:
            recs.append(F.EVENT.pack(delta, F.OP_GAP, 0, 0, 0, 0, 0, 0, rnd.randrange(1, 99), 0, 0, 0))
        elif r < 0.09:
            recs.append(F.EVENT.pack(delta, F.OP_FAILED, DEVICE, dev, 0, stack, thread, label,
                                     rnd.choice([2, (1 << 64) - 5]), size, 0, 0))
        elif r < 0.16:  # a segment, then a block of its thread inside it
            a = rnd.choice(addrs) + (1 << 36)
            seg = 64 << 20
            recs.append(F.EVENT.pack(delta, F.OP_ALLOC, DEVICE, dev, 0, stack, thread, label, a, seg, 0, 0))
            segs.append((a, seg, dev))
            if rnd.random() < 0.8:
                for _ in range(rnd.randrange(4)):  # another thread's events between them
                    recs.append(F.EVENT.pack(0, F.OP_ALLOC, DEVICE, dev, 0, 0, thread + 1, 0,
                                             rnd.choice(addrs), 4096, 0, 0))
                b = a + rnd.randrange(0, seg, 4096)
                recs.append(F.EVENT.pack(0, F.OP_ALLOC, BLOCK, dev, 0, stack, thread, label, b, 1 << 20, 0, 0))
                live.append((b, 1 << 20, BLOCK, dev))
            live.append((a, seg, DEVICE, dev))
        elif r < 0.55 or not live:
            kind = rnd.choice([DEVICE, DEVICE, DEVICE, 1, 2, 3, 4, BLOCK])
            a = rnd.choice(addrs)
            if kind == BLOCK and segs and rnd.random() < 0.7:
                s_addr, s_size, dev = rnd.choice(segs)
                a = s_addr + rnd.randrange(0, s_size, 4096)
            recs.append(F.EVENT.pack(delta, F.OP_ALLOC, kind, dev, rnd.choice([0, 0x80]), stack,
                                     thread, label, a, size, 0, 0))
            live.append((a, size, kind, dev))
        else:
            a, size, kind, dev = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.1:  # a free of another kind of its key space, or of nothing known
                kind = rnd.choice([DEVICE, 2, BLOCK])
            if rnd.random() < 0.05:
                a += 8
            recs.append(F.EVENT.pack(delta, F.OP_FREE, kind, dev, 0, 0, thread, label, a, size, 0, 0))
    return recs


def load_bytes(data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        return LoadedTrace.from_bytes(data, "<test>", **kw)


# ---- the reader it replaced ---------------------------------------------------------


class Oracle:
    """The old reader's logic: every event as columns, replayed at once."""

    def __init__(self, data, trace):
        cols = {k: [] for k in ("delta", "op", "kind", "dev", "flags", "stack", "thread", "label",
                                "addr", "size", "slack", "stream")}
        for off, length, count in trace._event_chunks:  # the chunks the reader accepted
            raw = data[off:off + length]
            payload = raw[F.CHUNK_HEAD.size:-F.CRC.size]
            if raw[0] & F.COMPRESSED:
                payload = zlib.decompress(payload)
            n, layout = F.EVENTS_HEAD.unpack_from(payload)
            assert n == count
            body = payload[F.EVENTS_HEAD.size:]
            w = F.EVENT.size
            rows = bytearray(body) if layout == F.LAYOUT_ROWS else bytearray(n * w)
            if layout == F.LAYOUT_PLANES:
                for k in range(w):
                    rows[k::w] = body[k * n:(k + 1) * n]
            for rec in F.EVENT.iter_unpack(rows):
                for k, v in zip(cols, rec):
                    cols[k].append(v)
        self.c = cols
        op, addr = cols["op"], cols["addr"]
        self.n = len(op)
        base, ts = trace._start_ns(), []
        for i in range(self.n):
            base = addr[i] if op[i] == F.OP_TIME else base + cols["delta"][i]
            ts.append(base)
        self.ts = ts
        self.r = _core.replay(bytes(op), array("Q", addr), array("Q", cols["size"]),
                              bytes(cols["kind"]), array("b", cols["dev"]))

    def row(self, j):
        c = self.c
        return (c["addr"][j], c["size"][j], c["dev"][j], c["kind"][j], 0, c["thread"][j],
                c["label"][j], self.ts[j], c["stack"][j], self.ts[j],
                (c["size"][j] - c["slack"][j]) & ((1 << 64) - 1), c["flags"][j])

    def live(self):
        return [self.row(j) for j in self.r["live"]]

    def peak_idx(self, d):
        c, r = self.c, self.r
        p = r["peak_i"].get(d, -1)
        if p < 0:
            return []
        alloc_idx, end = r["alloc_idx"], r["end"]
        cut = sum(1 for j in alloc_idx if j <= p)
        idx = [j for j in alloc_idx[:cut] if c["dev"][j] == d and (end[j] == 0 or end[j] > p)]
        if c["kind"][p] != BLOCK:
            lo, hi = c["addr"][p], c["addr"][p] + c["size"][p]
            for j in alloc_idx[cut:cut + 64]:
                if c["kind"][j] == BLOCK and c["thread"][j] == c["thread"][p] and lo <= c["addr"][j] < hi:
                    idx.append(j)
                    break
        return idx

    def peak(self, d=None):
        devs = [d] if d is not None else sorted(self.r["peak_i"])
        return [self.row(j) for j in sorted(itertools.chain(*(self.peak_idx(x) for x in devs)))]

    def failures(self):
        return [self.row(j) for j in self.r["fail_idx"]]

    def totals(self):
        c, r, out = self.c, self.r, {}
        for d in r["peak"]:
            on = [i for i in range(self.n) if c["dev"][i] == d]
            allocs = [i for i in on if c["op"][i] == F.OP_ALLOC]
            out[d] = {"current": r["cur"][d], "peak": r["peak"][d],
                      "peak_timestamp_ns": self.ts[r["peak_i"][d]] if r["peak_i"][d] >= 0 else 0,
                      "allocs": len(allocs),
                      "frees": sum(1 for i in on if c["op"][i] == F.OP_FREE),
                      "failed": sum(1 for i in on if c["op"][i] == F.OP_FAILED),
                      "alloc_bytes": sum(c["size"][i] for i in allocs),
                      "live_count": sum(1 for j in r["live"] if c["dev"][j] == d),
                      "peak_count": len(self.peak_idx(d)), "window_peak": r["peak"][d]}
        return out

    def series(self):
        """{device: [(index, level)]} after every change of a device's totals
        (the exact timeline): the store's rules, so a block (inside a segment
        the totals hold) is no change, an ALLOC at a live address ends it
        first, and a FREE of nothing live is no change."""
        c, out = self.c, {}
        level, live = {}, {}
        for i in range(self.n):
            o = c["op"][i]
            if o not in (F.OP_ALLOC, F.OP_FREE):
                continue
            kind = c["kind"][i]  # the live table's key spaces (src/livetab.c)
            key = (c["addr"][i], 1 if kind == PHYSICAL else 2 if kind == BLOCK else 0)
            ended = live.pop(key, None)
            if ended is not None and ended[1] != BLOCK:
                d, size = ended[0], ended[2]
                level[d] = level.get(d, 0) - size
                out.setdefault(d, []).append((i, level[d]))
            if o == F.OP_ALLOC:
                d = c["dev"][i]
                live[key] = (d, c["kind"][i], c["size"][i])
                if c["kind"][i] != BLOCK:
                    level[d] = level.get(d, 0) + c["size"][i]
                    out.setdefault(d, []).append((i, level[d]))
        return out

    def timeline(self):
        per = self.series()
        total = sum(len(v) for v in per.values())
        points = []
        for d in sorted(per):
            pts = per[d]
            m = len(pts)
            budget = max(16, 16384 * m // max(total, 1))
            if m > budget:
                step = -(-m // (budget // 2))
                pts = [max(pts[lo:lo + step], key=lambda p: p[1]) for lo in range(0, m, step)]
            points += [(i, d, v) for i, v in pts]
        points.sort()
        return [(self.ts[i], d, v) for i, d, v in points]

    def at(self, at_ns):
        end, ts = self.r["end"], self.ts
        return [self.row(j) for j in self.r["alloc_idx"]
                if ts[j] <= at_ns and (end[j] == 0 or ts[end[j]] > at_ns)]

    def events(self):
        c, r = self.c, self.r
        end = r["end"]
        freed = {end[j]: j for j in r["alloc_idx"] if end[j] and c["op"][end[j]] == F.OP_FREE}
        out = []
        for i in range(self.n):
            o = c["op"][i]
            if o not in (F.OP_ALLOC, F.OP_FREE, F.OP_FAILED):
                continue
            j = freed.get(i, i)
            row = self.row(j)  # with the stream of the event itself (a replay's live rows have none)
            out.append((o, self.ts[i], None if o == F.OP_FREE and i == j else self.ts[j],
                        row[:4] + (c["stream"][i],) + row[5:]))
        return out

    def blocks(self):
        c, per = self.c, {}
        for j in self.r["alloc_idx"]:
            if c["kind"][j] == BLOCK:
                per.setdefault(c["dev"][j], set()).add(c["addr"][j])
        return {d: sorted(v) for d, v in per.items()}


def new_at(trace, at_ns):
    rp = None
    for rp, payload, count, layout in trace._again("test"):
        rp.feed_at(payload, F.EVENTS_HEAD.size, count, layout, at_ns)
    return rp.at() if rp is not None else []


def new_events(trace):
    out = []
    for rp, payload, count, layout in trace._again("test"):
        for b in rp.feed_events(payload, F.EVENTS_HEAD.size, count, layout):
            out.append((b[0], b[1], b[2], (b[3], b[4], b[5], b[6], b[13], b[7], b[8], b[9], b[10], b[9], b[11], b[12])))
    return out


def assert_agree(data, trace, rnd, *, exact_timeline=True):
    if getattr(trace, "_reconciled", None) is not None:
        return  # set right at its end from its LIVE chunk, which the oracle does not model
        # (tests/integration/test_trace_limits.py checks that against the tracker's live set)
    o = Oracle(data, trace)
    rp = trace._rp
    assert trace.event_count == o.n
    assert rp.live() == o.live()
    assert rp.peak() == o.peak()
    for d in o.r["peak"]:
        assert rp.peak(d) == o.peak(d), d
    assert rp.failures() == o.failures()
    assert trace._derived_totals() == o.totals()
    assert trace._block_addresses() == o.blocks()
    assert trace.dropped_events == sum(o.c["addr"][i] for i in range(o.n) if o.c["op"][i] == F.OP_GAP)
    if trace.end is None and trace.started_ns is not None:
        assert trace.stopped_ns == (max(o.ts[-1], trace.started_ns) if o.n else trace.started_ns)
    if trace._timeline is not None:  # a saved trace's own TIMELINE chunk
        assert trace.timeline() == trace._timeline
    elif exact_timeline:
        assert trace.timeline() == o.timeline()
    else:  # downsampled differently: each device's highest point is kept, every point is real
        exact = o.series()
        real = {(o.ts[i], d, v) for d, pts in exact.items() for i, v in pts}
        got = trace.timeline()
        assert set(got) <= real
        for d, pts in exact.items():
            assert max(v for t, dd, v in got if dd == d) == max(v for _i, v in pts)
    assert new_events(trace) == o.events()
    stamps = sorted(set(o.ts)) or [0]
    for at in {0, stamps[0], stamps[-1], rnd.choice(stamps), rnd.choice(stamps) + 1}:
        assert new_at(trace, at) == o.at(at), at
    # and the public reads are built from them
    assert trace.snapshot().allocations == trace._snapshot(o.live(), None).allocations
    assert trace.peak_snapshot().allocations == trace._snapshot(o.peak(), None).allocations
    assert [e.seq for e in trace.events()] == [e[2] for e in o.events()]


# ---- streaming against the whole-column replay ---------------------------------------


def test_streaming_replay_agrees_with_the_whole_column_replay_on_random_traces():
    rnd = random.Random(2026)
    for trial in range(150):
        recs = random_records(rnd, rnd.randrange(0, 700), big_sizes=trial % 5 == 0)
        data = trace_bytes(recs, rnd=rnd, end=rnd.random() < 0.3)
        trace = load_bytes(data)
        assert_agree(data, trace, rnd)


def test_streaming_replay_agrees_on_the_fuzz_seeds_and_their_loadable_mutants():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fuzz_trace

    rnd = random.Random(7)
    inputs = list(fuzz_trace.seeds())
    for base in list(inputs):
        for _ in range(80):
            inputs.append(fuzz_trace.fix_crcs(fuzz_trace.mutate(rnd, base)))
    checked = 0
    for data in inputs:
        for recover in (False, True):
            try:
                trace = load_bytes(data, recover=recover)
            except memviz.TraceError:
                continue
            assert_agree(data, trace, rnd)
            checked += 1
    assert checked > 50, checked


def test_a_timeline_of_many_changes_keeps_each_devices_highest_point():
    """Past 16,384 changes the replay keeps the highest of each bucket of
    consecutive changes: not the old reader's points, but its peaks."""
    rnd = random.Random(3)
    recs = []
    for k in range(30_000):
        dev = k % 3 - 1
        recs.append(F.EVENT.pack(7, F.OP_ALLOC, DEVICE, dev, 0, 0, 0, 0, 0x1000 + k * 4096,
                                 rnd.randrange(1, 1 << 30), 0, 0))
        if k % 4:
            recs.append(F.EVENT.pack(3, F.OP_FREE, DEVICE, dev, 0, 0, 0, 0, 0x1000 + k * 4096, 0, 0, 0))
    data = trace_bytes(recs, chunk_sizes=5000)
    trace = load_bytes(data)
    assert len(trace.timeline()) <= 16384
    assert_agree(data, trace, rnd, exact_timeline=False)


# ---- the category series: over the file, and over the events() repacked ------------------


class EventsOnly:
    """A recording with events() but no pass over its file: its events are
    packed into records and summed by the same C pass (memviz/trace/categories.py)."""

    def __init__(self, trace):
        self.trace = trace

    def events(self):
        return self.trace.events()


def category_inputs(trace):
    end, peak = trace.snapshot(), trace.peak_snapshot()
    allocs = list(end.allocations)
    seen = {(a.device, a.address, a.timestamp_ns) for a in allocs}
    return allocs, [a for a in peak.allocations if (a.device, a.address, a.timestamp_ns) not in seen]


def test_category_series_summed_in_c_are_the_python_rules():
    from memviz.report._categories import category_series

    rnd = random.Random(11)
    nonempty = 0
    for trial in range(120):
        recs = random_records(rnd, rnd.randrange(1, 600), big_sizes=trial % 7 == 0)
        trace = load_bytes(trace_bytes(recs, rnd=rnd))
        allocs, peak_only = category_inputs(trace)
        if trial % 3 == 0:  # categories of other names too, on whatever is live
            allocs = [a._replace(category=rnd.choice([None, "parameter", "activation"]))
                      for a in allocs]
        end_ns = trace.stopped_ns or 0
        fast = category_series(trace, allocs, peak_only, {}, end_ns)
        slow = category_series(EventsOnly(trace), allocs, peak_only, {}, end_ns)
        assert fast == slow, trial
        assert list(fast[0]) == list(slow[0]) and all(
            list(fast[0][d]) == list(slow[0][d]) for d in slow[0])  # the same order
        nonempty += bool(fast[0].get(0, {}).get("unused_pool"))
        # bounded: at most that many points a series (plus the end), each one real, peaks kept
        bounded, _ = category_series(trace, allocs, peak_only, {}, end_ns, points=16)
        for d, cats in slow[0].items():
            for cat, (ts, vs) in cats.items():
                bts, bvs = bounded[d][cat]
                assert len(bts) <= 17 and set(zip(bts, bvs)) <= set(zip(ts, vs))
                assert max(bvs) == max(vs)
    assert nonempty > 10, nonempty


def test_category_series_of_events_out_of_time_order_are_summed_in_time_order():
    """A saved trace's events go back in time (its peak set, frees at a
    made-up time, then the rest of its live set): summed in time order, as
    the rules sort them."""
    from memviz.report._categories import category_series

    rnd = random.Random(5)
    recs = random_records(rnd, 500)
    rows = []
    for r in recs:  # every record after a TIME record of a random time
        rows.append(F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, rnd.randrange(1, 10 ** 6), 0, 0, 0))
        rows.append(r)
    trace = load_bytes(trace_bytes(rows, rnd=rnd))
    allocs, peak_only = category_inputs(trace)
    fast = category_series(trace, allocs, peak_only, {}, 10 ** 7)
    slow = category_series(EventsOnly(trace), allocs, peak_only, {}, 10 ** 7)
    assert fast == slow and fast[0]


# ---- memory, and a file that changes ----------------------------------------------------


def big_trace(path, events=2_000_000, per_chunk=100_000):
    """A trace of ``events`` events (alloc/free pairs of a few sizes at
    reused addresses), written chunk by chunk."""
    template = []
    for k in range(500):
        a, size = 0x7F00_0000_0000 + (k % 50) * (1 << 24), ((k % 7) + 1) << 20
        template.append(F.EVENT.pack(1000 + k, F.OP_ALLOC, DEVICE, 0, 0, 1 + k % 5, 0, 0, a, size, 0, 0))
        template.append(F.EVENT.pack(500, F.OP_FREE, DEVICE, 0, 0, 1 + k % 5, 0, 0, a, size, 0, 0))
    body = b"".join(template)
    reps = per_chunk // len(template)
    with open(path, "wb") as f:
        f.write(F.header() + F.chunk(F.META, F.json_bytes(meta())))
        for c in range(events // (reps * len(template))):
            rows = F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 10 ** 9 * (c + 1), 0, 0, 0) + body * reps
            f.write(F.chunk(F.EVENTS, F.events_payload(rows), compress=1))


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under benchmarks/sanitize.sh the sanitizer's shadow memory is RSS too")
def test_a_two_million_event_trace_loads_in_bounded_memory(tmp_path):
    """The old reader kept every event as columns (31 bytes an event) and a
    Python list of timestamps (about 40 more): a 2,000,000-event trace took
    it past 500 MB of RSS (benchmarks/RESULTS.md). Now only one chunk's
    events are in memory at a time (two while the next is inflated: 100,000
    events, 3.2 MB each here) and the replay's state: the live set, the
    peak sets, a timeline of at most 16,384 points a device. The
    interpreter with memviz's reading modules takes about 35 MB, so 120 MB
    leaves room for allocator slack and stays far below what the columns
    alone took (143 MB of timestamps and columns, before the planes)."""
    path = tmp_path / "big.memviz"
    big_trace(str(path))
    code = ("import sys, warnings, memviz\n"
            "warnings.simplefilter('ignore')\n"
            "t = memviz.load(sys.argv[1])\n"
            "assert t.event_count == 2_000_020, t.event_count\n"
            "t.peak_snapshot(); t.snapshot(); t.totals(); t.timeline(); t.failures\n"
            "n = sum(1 for _ in t.snapshot(at_ns=5 * 10 ** 9))\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
            "print('RSS_MB', int(hwm.split()[1]) // 1024)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout + p.stderr
    rss = int(p.stdout.split("RSS_MB ")[1].split()[0])
    assert rss < 120, p.stdout


def test_a_file_changed_after_it_was_loaded_is_a_trace_error(tmp_path):
    """The history is read again from the file; a file changed since is
    refused, not read as something else."""
    rnd = random.Random(1)
    path = tmp_path / "run.memviz"
    data = trace_bytes(random_records(rnd, 300), chunk_sizes=50)
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        trace = memviz.load(path)
    want = [(e.op, e.timestamp_ns, e.seq) for e in trace.events()]
    assert want and [(e.op, e.timestamp_ns, e.seq) for e in trace.events()] == want
    off, length, _n = trace._event_chunks[-1]
    with open(path, "r+b") as f:  # one byte of the last EVENTS chunk's payload
        f.seek(off + 7)
        byte = f.read(1)
        f.seek(off + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(memviz.TraceError, match="changed after it was loaded") as e:
        list(trace.events())
    assert "load the trace again" in str(e.value)
    with pytest.raises(memviz.TraceError, match="changed after it was loaded"):
        trace.snapshot(at_ns=1)
    os.truncate(path, off)  # cut short: the same
    with pytest.raises(memviz.TraceError, match="changed after it was loaded"):
        list(trace.events())
    # what the first pass gave stays as it was
    assert trace.snapshot() is not None and trace.totals()


def test_a_loaded_trace_keeps_its_file_open_and_closes_it_when_it_goes(tmp_path):
    rnd = random.Random(2)
    path = tmp_path / "run.memviz"
    path.write_bytes(trace_bytes(random_records(rnd, 200), chunk_sizes=40))

    def fds():
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        trace = memviz.load(path)
    assert fds() == before + 1
    path.unlink()  # still readable: the reader holds the file
    assert sum(1 for _ in trace.events()) > 0
    del trace
    assert fds() == before


def test_the_replayer_refuses_buffers_that_do_not_hold_the_records():
    rp = _core.Replayer(0, True)
    with pytest.raises(ValueError, match="do not fit"):
        rp.feed(bytes(40), 5, 2, F.LAYOUT_ROWS)
    with pytest.raises(ValueError, match="do not fit"):
        rp.feed(bytes(64), 0, 2, 3)
    with pytest.raises(RuntimeError, match="start_categories"):
        rp.feed_categories(bytes(F.EVENT.size), 0, 1, 0)
    with pytest.raises(ValueError, match="categories"):
        _core.Replayer(0, False).start_categories(_core.REPLAY_CATEGORIES_MAX + 1, [], 0)
    rp.feed(F.EVENT.pack(0, F.OP_ALLOC, 0, 0, 0, 0, 0, 0, 4096, 10, 0, 0), 0, 1, F.LAYOUT_ROWS)
    assert rp.events == 1 and rp.live()[0][:2] == (4096, 10)
    with pytest.raises(RuntimeError, match="before any event"):
        rp.start_categories(2, [], 0)
    plain = _core.Replayer(0, False)
    with pytest.raises(RuntimeError, match="summary"):
        plain.peak()


def test_the_graveyard_keeps_only_what_the_peak_sets_can_need():
    """A device peak early (one segment) and a tensor peak that keeps moving
    (each block a byte bigger than the last, the last one freed): every free
    adds a grave for the tensor peak, which its next move makes useless. They
    were kept while freed after the (early) device peak, so the graveyard
    grew with the trace and was compacted on nearly every free (a 7 M-event
    trace loaded in 90 s); now it stays within what the peak sets can need."""
    recs = [F.EVENT.pack(0, F.OP_ALLOC, DEVICE, 0, 0, 0, 0, 0, 0x7000_0000, 1 << 30, 0, 0)]
    n, prev = 20_000, None
    for i in range(n):
        addr = 0x7000_0000 + (i % 2) * (1 << 20)
        recs.append(F.EVENT.pack(1, F.OP_ALLOC, BLOCK, 0, 0, 0, 0, 0, addr, 4096 + i, 0, 0))
        if prev is not None:
            recs.append(F.EVENT.pack(1, F.OP_FREE, BLOCK, 0, 0, 0, 0, 0, prev[0], prev[1], 0, 0))
        prev = (addr, 4096 + i)
    rp = _core.Replayer(0, True)
    payload = F.events_payload(b"".join(recs), F.LAYOUT_ROWS)
    rp.feed(payload, F.EVENTS_HEAD.size, len(recs), F.LAYOUT_ROWS)
    held, bound = rp.graves()
    assert held <= 2 * bound + 1024, (held, bound)
    # and the tensor peak's set is still right: the last two blocks
    trace = load_bytes(trace_bytes(recs))
    tp = trace.peak_snapshot(peak="tensor")
    assert sorted(a.size for a in tp.allocations if a.kind == "block") == [4096 + n - 2, 4096 + n - 1]


# ---- the category rules, as the Python version summed them --------------------------------


def duck_events(rnd, n):
    """Events as a duck-typed recording's events() may give them: kinds by
    name (one no trace has), threads as any value, categories of their own,
    times going back, several devices."""
    kinds = ["device", "device", "block", "block", "physical", "host", "managed", "weird"]
    cats = [None, None, None, "parameter", "activation", "optimizer"]
    live, segs, out, ts = [], [], [], 1000
    for _ in range(n):
        ts += rnd.choice([0, 1, 7, 1000, -3])
        dev = rnd.choice([0, 0, 1, -1])
        thread = rnd.choice(["main", "main", ("w", 1)])
        r = rnd.random()
        if r < 0.15:  # a segment, then a block of its thread inside it
            a = 0x7000_0000 + rnd.randrange(16) * (1 << 28)
            out.append(SimpleNamespace(op="alloc", timestamp_ns=ts, device=dev, address=a, size=64 << 20,
                                       kind="device", thread=thread, category=rnd.choice(cats)))
            segs.append((a, dev))
            live.append(out[-1])
            b = SimpleNamespace(op="alloc", timestamp_ns=ts, device=dev, address=a + rnd.randrange(0, 64 << 20, 4096),
                                size=1 << 20, kind="block", thread=thread, category=rnd.choice(cats))
            out.append(b)
            live.append(b)
        elif r < 0.6 or not live:
            kind = rnd.choice(kinds)
            a = 0x7000_0000 + rnd.randrange(24) * 0x1000
            if kind == "block" and segs:
                s, dev = rnd.choice(segs)
                a = s + rnd.randrange(0, 64 << 20, 4096)
            out.append(SimpleNamespace(op="alloc", timestamp_ns=ts, device=dev, address=a,
                                       size=rnd.randrange(1, 64) << 16, kind=kind, thread=thread,
                                       category=rnd.choice(cats)))
            live.append(out[-1])
        elif r < 0.65:
            out.append(SimpleNamespace(op="failed", timestamp_ns=ts, device=dev, address=2, size=5,
                                       kind="device", thread=thread, category=None))
        else:
            e = live.pop(rnd.randrange(len(live)))
            out.append(SimpleNamespace(op="free", timestamp_ns=ts, device=e.device, address=e.address,
                                       size=e.size, kind=e.kind, thread=thread, category=e.category))
    return out


class DuckEvents:
    def __init__(self, evs):
        self.evs = evs

    def events(self):
        return iter(self.evs)


def category_rule_cases():
    """(name, MemorySeries) of the recordings whose series the Python rules
    summed before the C pass became their one owner (their digests are in
    CATEGORY_DIGESTS): the shipped sample, the random traces of the tests
    above, events out of time order, and duck-typed events."""
    from memviz.report._categories import memory_series

    def series(obj, trace, allocs, peak, end_ns):
        return memory_series(obj, allocs, peak, {}, end_ns)

    sample = memviz.load(os.path.join(ROOT, "memviz", "data", "sample.memviz"))
    allocs, peak_only = category_inputs(sample)
    peak_ts = {d: t["peak_timestamp_ns"] for d, t in sample.totals().items()}
    yield "sample", memory_series(EventsOnly(sample), allocs, peak_only, peak_ts, sample.stopped_ns)
    rnd = random.Random(11)
    for trial in range(120):
        recs = random_records(rnd, rnd.randrange(1, 600), big_sizes=trial % 7 == 0)
        trace = load_bytes(trace_bytes(recs, rnd=rnd))
        allocs, peak_only = category_inputs(trace)
        if trial % 3 == 0:
            allocs = [a._replace(category=rnd.choice([None, "parameter", "activation"])) for a in allocs]
        yield f"random {trial}", series(EventsOnly(trace), trace, allocs, peak_only, trace.stopped_ns or 0)
    rnd = random.Random(5)
    rows = []
    for r in random_records(rnd, 500):
        rows.append(F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, rnd.randrange(1, 10 ** 6), 0, 0, 0))
        rows.append(r)
    trace = load_bytes(trace_bytes(rows, rnd=rnd))
    allocs, peak_only = category_inputs(trace)
    yield "out of order", series(EventsOnly(trace), trace, allocs, peak_only, 10 ** 7)
    rnd = random.Random(3)
    for trial in range(20):
        evs = duck_events(rnd, rnd.randrange(1, 400))
        yield f"duck {trial}", memory_series(DuckEvents(evs), [], [], {}, 10 ** 9)


def _digest(m):
    import hashlib
    return hashlib.sha256(repr(m).encode()).hexdigest()[:16]


#: sha256 (first 16 hex digits) of repr(memory_series(...)) of each case, as the
#: Python rules (memviz/report/_categories.py before the C pass owned them) gave them
CATEGORY_DIGESTS = {
    'sample': '503c561047dfd101', 'random 0': 'e407273c83a9c0a3', 'random 1': '29f5b3595f5c362a',
    'random 2': '1f7d09b8814cc91a', 'random 3': 'f39082968a16f5a7', 'random 4': 'c49ef4079e82739b',
    'random 5': '567a246905eb2cd9', 'random 6': '2b571026673662b6', 'random 7': '4506bdcc1509f7f8',
    'random 8': '5c65ecb0109459cb', 'random 9': 'dcd3ba3ea854d7d4', 'random 10': 'a0ed43e78aee504f',
    'random 11': '02e6445ef23dfdc7', 'random 12': '21802a897b0ef113', 'random 13': 'c62b1c77b0d0b8a6',
    'random 14': 'fe5f2b38a9dd5669', 'random 15': '361cdc7531192c3a', 'random 16': '147f3cf178608063',
    'random 17': 'bc607733a45d1d45', 'random 18': '7e0babb72ddfada6', 'random 19': 'c9880c07be6a25a8',
    'random 20': '4c4c4219435d7150', 'random 21': '3784851f753329bc', 'random 22': '0b844649986b0fe5',
    'random 23': '245b22c2bbd8f45a', 'random 24': '89fd43a41300966a', 'random 25': '17636e88f3a17c60',
    'random 26': '373fc35a2ca0d563', 'random 27': 'af3f4d3cf1e06a59', 'random 28': 'f93719b91eea9e6e',
    'random 29': 'e41c4de70c4e51dd', 'random 30': 'f3c5da404bc77312', 'random 31': 'b78a015063635678',
    'random 32': '5f7ba0712d6ab6ef', 'random 33': '726641056bb78745', 'random 34': '81a1e2a2e588cb9f',
    'random 35': 'b1df878e91769f9a', 'random 36': '9e6d7cb79d1a1b2d', 'random 37': '750c665d51c8bf43',
    'random 38': '2d0c489c978285a6', 'random 39': '21bff7c9c23ab6df', 'random 40': '4c10f557b586780a',
    'random 41': 'bd1b33a2a4085b85', 'random 42': 'f86ad46fc76fffea', 'random 43': '872ca1319e28fed0',
    'random 44': 'dd95155d222b99f9', 'random 45': 'dd09949a8ca8f408', 'random 46': '078e6d22f3576f02',
    'random 47': '62ea84cffff743e1', 'random 48': 'd8001f76c03c2359', 'random 49': 'ce8a4fecbdb9cae0',
    'random 50': '2f65b99bf055c00c', 'random 51': '52e7826d5a3a7eb2', 'random 52': '8959695e99dd6d8a',
    'random 53': 'c8e0c22595eb5b2f', 'random 54': '55743e41e1d94e40', 'random 55': 'feca63a3336fb7e2',
    'random 56': '922eb5c4399e3efd', 'random 57': '6a8f57a77392e0ee', 'random 58': 'de95520f66126893',
    'random 59': '57893cd7c133376a', 'random 60': '675bb54e652b5f97', 'random 61': 'fbc815e096d63f50',
    'random 62': '1765efd4e6edb59d', 'random 63': 'eb82dc80cf1cebc9', 'random 64': '09bb57385708aed3',
    'random 65': '4b7f7aeadd344ea1', 'random 66': '57ced6aa7ef69f23', 'random 67': '6c3ab243d291a941',
    'random 68': 'fe6171732139bb92', 'random 69': 'fecbd90a94b0004a', 'random 70': '58c17fea488a0d78',
    'random 71': '716b81cd445a82c3', 'random 72': '337a94cad24d13f3', 'random 73': '98a39239902bf299',
    'random 74': 'c35bcbb2b5ab0a99', 'random 75': '3bb89084d9ce2eca', 'random 76': '67e5543db7211303',
    'random 77': '327d6536210a49d8', 'random 78': '05453dd8f44f9213', 'random 79': 'd2d34c5993955e76',
    'random 80': '2bb3c58e0c428f43', 'random 81': '2fbbf2e398f22ddf', 'random 82': 'c74fc58e34de9f9d',
    'random 83': 'ea2672295274c766', 'random 84': '4826f86222130dfa', 'random 85': 'efd39c047c75e745',
    'random 86': '39bbf54a06be40b9', 'random 87': '58d091ec0b170d4b', 'random 88': '5090775c2c1e12ce',
    'random 89': '1f225960754fd8b5', 'random 90': '51227d05bbd31d85', 'random 91': '177cca41ad762747',
    'random 92': '9fb39f3ff8a702e8', 'random 93': '0264f608013907a9', 'random 94': '9d860ca4050fe083',
    'random 95': 'ea1ffd06b2f59723', 'random 96': '5699c53f79f7bebc', 'random 97': 'f475703b127949e5',
    'random 98': '8302f6f40ea98e0d', 'random 99': '05293b00e41711e7', 'random 100': 'b9bca941db9377b0',
    'random 101': '1c750dacf2ffe4f9', 'random 102': 'f67cfbf916cf3d53', 'random 103': '8cc8ab67aaa6c7e2',
    'random 104': 'c886196cadd7766a', 'random 105': '86af028b8ca88e48', 'random 106': 'db8a1f45e38810bc',
    'random 107': 'c89163bed2c4c6ad', 'random 108': 'ce499f6288fec481', 'random 109': 'bd44a2d80249f190',
    'random 110': 'd60b7c489c9727d3', 'random 111': 'a017e9f2d687bd89', 'random 112': 'ae0ea0ca93b07bcf',
    'random 113': 'b793a41643ec740e', 'random 114': 'cfe0373b333d6858', 'random 115': 'e5bf30f98581ce32',
    'random 116': '4b238b42601b743b', 'random 117': '769cf376a0899244', 'random 118': '9e87cf999f8dd6f9',
    'random 119': 'b24e2eb9d270ccd4', 'out of order': '596347b035979929', 'duck 0': 'ab4944003c978796',
    'duck 1': '71b9c7b13024df0e', 'duck 2': '538103082e7a06b7', 'duck 3': '394e85b7882d1847',
    'duck 4': 'e408cfc6c39762eb', 'duck 5': '67f4c6cc2b8292df', 'duck 6': '98196f5ede56bd99',
    'duck 7': '96b053f25dfaac98', 'duck 8': 'ff6ab9f36e9f975b', 'duck 9': 'a7e888b4f8f08ab9',
    'duck 10': 'b297741314ad5c45', 'duck 11': '288363afc601059e', 'duck 12': 'b20ca17a85041d47',
    'duck 13': 'd04647f870234beb', 'duck 14': '9ca38240c7cb7896', 'duck 15': '8f29feedc7d16efb',
    'duck 16': 'fb7d9d97625e464d', 'duck 17': '6b80acb257403b41', 'duck 18': '211bd21757b695ac',
    'duck 19': 'f801d1f3539a50bb',
}


def test_category_series_are_what_the_python_rules_gave():
    """The series the C pass sums (src/replay_categories.c, the rules' one owner),
    through memory_series() as every caller reaches it, are, to the byte and in order,
    what the Python rules returned before they moved to C."""
    got = {name: _digest(m) for name, m in category_rule_cases()}
    assert [n for n in CATEGORY_DIGESTS if got.get(n) != CATEGORY_DIGESTS[n]] == []
    assert len(got) == len(CATEGORY_DIGESTS)


def test_hundreds_of_categories_are_summed_in_c():
    """More categories than a byte holds (each slot's series made when the
    slot first changes): every one summed, on two devices."""
    from memviz.report._categories import EXACT, memory_series

    evs = []
    for k in range(600):
        evs.append(SimpleNamespace(op="alloc", timestamp_ns=10 + k, device=k % 2, address=0x1000 * (k + 1),
                                   size=k + 1, kind="device", thread=0, category=f"c{k}"))
    evs.append(SimpleNamespace(op="free", timestamp_ns=1000, device=0, address=0x1000, size=1, kind="device",
                               thread=0, category="c0"))
    m = memory_series(DuckEvents(evs), [], [], {}, 2000)
    assert m.note == EXACT and len(m.categories[0]) == len(m.categories[1]) == 300
    assert m.categories[0]["c0"] == ([10, 1000, 2000], [1, 0, 0])
    assert m.categories[1]["c599"] == ([609, 2000], [600, 600])
