"""Fuzzing the .memviz trace reader.

Two drivers share :func:`check` (load the bytes, then run the whole
pipeline: every reading API, the text, JSON and HTML reports, diagnose(),
the notebook views, the Perfetto and torch exports; anything but
:class:`memviz.TraceError` is a bug, and so is output that is not valid
UTF-8 or JSON):

* an atheris (libFuzzer) harness, coverage-guided::

      pip install atheris
      python tests/fuzz_trace.py [-max_total_time=60] [CORPUS_DIR ...]

  Each input is tried as is and with its chunk CRCs repaired
  (:func:`fix_crcs`), so mutations reach the chunk parsers instead of
  stopping at the checksum. The seed traces are added to the first corpus
  directory when it is empty.

* :func:`fuzz`, a seeded random mutation fuzzer with no dependency (what
  tests/integration/test_trace_fuzz.py runs in CI; benchmarks/fuzz_traces.py runs a
  million inputs): bit flips, byte and block overwrites, truncations, chunk
  length lies, huge counts, chunk duplication/removal/reordering, and
  structure-aware mutations of decompressed payloads re-framed with a
  valid CRC: event records, and the decoded JSON fields (mostly of the
  META, STEPS and END chunks) given other types, NaN and infinities, 64-bit
  edges and beyond, negative sizes, other nesting (wrapped, unwrapped, 2,000
  levels deep), odd strings. Half of the inputs get their CRCs repaired.

Seeds are built in memory with the writer's own encoders, so no GPU and no
capture is needed.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import sys
import time
import warnings
import zlib
from contextlib import redirect_stderr
from typing import Callable, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from memviz import TraceError  # noqa: E402
from memviz.trace import format as F  # noqa: E402

Chunk = Tuple[int, bytes]  # (type byte, payload as stored)


# ---- seeds ------------------------------------------------------------------------


def _events(rnd: random.Random, n: int) -> bytes:
    """A plausible event stream: allocs, frees, failures, TIME and GAP records."""
    out = [F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 1_000_000, 0, 0, 0)]
    live: List[Tuple[int, int, int]] = []
    for i in range(n):
        r = rnd.random()
        if live and r < 0.4:
            addr, size, dev = live.pop(rnd.randrange(len(live)))
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_FREE, 0, dev, 0, 1, 0, 0, addr, size, 0, 0))
        elif r < 0.45:
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_FAILED, 0, 0, 0, 2, 1, 1, 2,
                                    1 << 40, 0, 0))
        elif r < 0.47:
            out.append(F.EVENT.pack(0, F.OP_GAP, 0, 0, 0, 0, 0, 0, rnd.randrange(100), 0, 0, 0))
        elif r < 0.49:
            out.append(F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 2_000_000 + i * 10_000, 0, 0, 0))
        elif r < 0.6 and live:
            # PyTorch's: a block inside a live device allocation (a segment to the what-if
            # pass), or a granule of an expandable segment (a physical handle of 2 or 20 MiB)
            base, bsize, dev = rnd.choice(live)
            if rnd.random() < 0.7 and dev >= 0:
                addr, size, kind = base + rnd.randrange(0, max(bsize, 1), 512), rnd.randrange(1, 1 << 26), 5
            else:
                addr, size, kind = 0x3000_0000 + i, rnd.choice((2 << 20, 20 << 20, 6 << 20)), 4
            live.append((addr, size, max(dev, 0)))
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_ALLOC, kind, max(dev, 0), rnd.choice((0, 1, 4)),
                                    rnd.choice((0, 1, 2)), rnd.choice((0, 1)), rnd.choice((0, 1, 2)),
                                    addr, size, rnd.randrange(0, 512), rnd.choice((0, 7))))
        else:
            addr, size, dev = 0x7F00_0000_0000 + i * 512, rnd.randrange(1, 1 << 30), rnd.choice(
                (0, 0, 1, -1))
            kind = 1 if dev < 0 else rnd.choice((0, 0, 3))
            live.append((addr, size, dev))
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_ALLOC, kind, dev, 0,
                                    rnd.choice((0, 1, 2)), rnd.choice((0, 1)),
                                    rnd.choice((0, 1, 2)), addr, size, 0, 0))
    return b"".join(out)


def _steps(rnd: random.Random, n: int) -> List[dict]:
    """Step records as StepRecord.to_dict() writes them: memory that grows
    every step (so diagnose() has a finding), a loss that turns NaN, shapes."""
    MiB, out = 1 << 20, []
    for i in range(n):
        cur = (i + 1) * 64 * MiB + rnd.randrange(MiB)
        out.append({
            "index": i, "timestamp_ns": 2_000_000 + i * 100_000, "duration_ns": 100_000,
            "devices": {"0": {"current": cur, "peak": cur + 8 * MiB, "growth": 64 * MiB,
                              "live_count": i + 1, "segment_allocs": 1, "segment_frees": i % 2,
                              "segment_alloc_bytes": 64 * MiB, "allocated": cur - MiB,
                              "reserved": cur + 32 * MiB * (i % 3), "allocated_peak": cur},
                        "-1": {"current": 4096, "peak": 4096, "growth": 0, "live_count": 1,
                               "segment_allocs": 0, "segment_frees": 0,
                               "segment_alloc_bytes": 0}},
            "lines": [{"location": "train.py:10", "name": "<module>", "bytes": 64 * MiB,
                       "count": 1, "live_bytes": (i + 1) * 64 * MiB, "live_count": i + 1}],
            "info": {"loss": float("nan") if i == 7 else 1.0 / (i + 1),
                     "batch_shape": [4, 128 if i % 4 else 900], "note": "x"},
            "autograd_seq": 10 * i})
    return out


def seed(compress: bool = True, n: int = 60, rng_seed: int = 0, saved: bool = False,
         lossy: bool = False) -> bytes:
    """A valid trace of every chunk kind, built with the writer's encoders."""
    rnd = random.Random(rng_seed)
    level = 6 if compress else None

    def c(kind: int, obj) -> bytes:
        payload = obj if isinstance(obj, bytes) else F.json_bytes(obj)
        return F.chunk(kind, payload, compress=level)

    meta = {"format": "memviz-trace", "format_version": 1, "mode": "saved" if saved else "stream",
            "memviz_version": "0.1.0", "python_version": "3.11", "pid": 1,
            "start_wall_time": 1.5e9, "start_monotonic_ns": 1_000_000, "command": "python x.py",
            "tracker": {"gpu_requested": True, "gpu_enabled": True, "gpu_off_reason": None,
                        "activity_enabled": True, "activity_error": None, "depth": 32},
            "capture": {"available": True, "library": "/x/libcupti.so", "version": 130001,
                        "cuda_major": 13, "found_by": "fuzz", "python_frames_abi": "3.11",
                        "tried": ["/y/libcupti.so (path): not found"],
                        "store": {"live": 0, "calls": {"alloc": 0}, "frames_abi": "3.11"}},
            "argv": ["x.py", "--fast"], "platform": "linux"}
    parts = [F.header(), c(F.META, meta),
             c(F.STRINGS, ["train.py", "<module>", "model.py", "forward"]),
             c(F.FRAMES, [[0, 10, 1], [2, 42, 3]]),
             c(F.STACKS, [[1, [0]], [2, [1, 0]]]),
             c(F.THREADS, {"0": [100, 200, "MainThread"], "1": [101, None, "autograd-0"]}),
             c(F.LABELS, {"1": "forward", "2": "\x01MmBackward0\x1ftrain.py:3"}),
             c(F.EVENTS, F.events_payload(_events(rnd, n), rnd.choice((0, 1)))),
             c(F.STEPS, _steps(rnd, 12) + [{"x": [1]}]),
             c(F.EVENTS, F.events_payload(_events(rnd, n // 2), 1))]
    if saved:
        parts.append(c(F.TIMELINE, [[1_000_000, 0, 10], [2_000_000, 0, 5]]))
    if lossy:  # events lost (a GAP), and the live set at the end (LIVE)
        gap = F.pack_event(op=F.OP_TIME, address=5_000_000) + F.pack_event(op=F.OP_GAP, address=7)
        parts.append(c(F.EVENTS, F.events_payload(gap, 0)))
        live = F.pack_event(op=F.OP_TIME, address=1_000_000) + b"".join(
            F.pack_event(ts_delta=10, op=F.OP_ALLOC, stack_id=1 + k % 2, label_id=k % 3,
                         address=0x7F0000000000 + (k << 20), size=1 << 20) for k in range(4))
        parts.append(c(F.LIVE | F.OPTIONAL, F.events_payload(live, rnd.choice((0, 1)))))
    parts.append(c(F.END, {"stopped_monotonic_ns": 9_000_000, "totals": {
        "0": {"current": 5, "peak": 10, "peak_timestamp_ns": 2, "allocs": 3, "frees": 1,
              "failed": 1}}, "failures": 1, "stats": {"live": 3, "calls": {"alloc": 3}},
        "outside": {"0": [1 << 30, "NVML"]}, "events": n, "dropped_events": 0}))
    return b"".join(parts)


def seeds() -> List[bytes]:
    return [seed(True), seed(False), seed(False, 200, 1, saved=True), seed(True, 5, 2),
            seed(True, 0, 3), seed(True, 60, 4, lossy=True)]


# ---- the check ------------------------------------------------------------------


class PipelineError(AssertionError):
    """An output of the pipeline that is not what it must be (invalid UTF-8 or JSON)."""


def _strict_json(text: str) -> None:
    """``text`` must be JSON without NaN/Infinity and valid UTF-8."""
    def no_constant(name):
        raise PipelineError(f"{name} in JSON output")
    text.encode("utf-8")
    json.loads(text, parse_constant=no_constant)


def _no_rule_failed(caught) -> None:
    for w in caught:
        if "Please report this" in str(w.message):
            raise PipelineError(f"a diagnose rule failed: {w.message}")


def check(data: bytes, pipeline: bool = True, reports: bool = True,
          reading: bool = True) -> Optional[object]:
    """Load ``data`` and use everything: the reading API, the text, JSON and
    HTML reports, diagnose(), the notebook views and both exports (with
    ``pipeline``; only the reading API and the text reports without; only
    the reading API without ``reports`` either; only the load, the live set
    and the totals without ``reading``).
    Returns the trace, or None for a TraceError. Any other exception
    propagates (a bug), and so does output that is not valid UTF-8 or JSON
    (:class:`PipelineError`)."""
    import pickle

    from memviz.cli.diff import diff_text
    from memviz.cli.report import json_report
    from memviz.report.text import text_report
    from memviz.loaded import LoadedTrace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t = LoadedTrace.from_bytes(data, "<fuzz>", recover=bool(data[-1:] == b"\x01"))
        except TraceError:
            return None
    t.totals(), t.current_bytes(), t.peak_bytes(), t.capture_info(), t.steps, repr(t)
    if not reading:
        t.snapshot()
        return t
    for f in t.failures:
        str(f)
    snaps = [t.snapshot(), t.peak_snapshot()]
    snaps += [t.peak_snapshot(d) for d in list(t.totals())[:4]]
    tl = t.timeline()
    if tl:
        snaps.append(t.snapshot(at_ns=tl[len(tl) // 2][0]))
    for snap in snaps:
        for key in ("lineno", "traceback", "label", "thread", "autograd_node"):
            [str(s) for s in snap.statistics(key)]
        repr(snap)
    if not reports:
        sum(1 for _e in t.events())
        return t
    text_report(t, outside=t.outside, command=t.command).encode("utf-8")
    json.dumps(json_report(t), default=str)
    diff_text(t, t)
    if not pipeline:
        return t
    from memviz import diagnose
    from memviz.export import perfetto, torch_snapshot
    import memviz.report as html  # render and the notebook views

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        findings = diagnose(t)
        [str(f) for f in findings]
        json.dumps([f.to_dict() for f in findings], default=str)
        page = html.render(t)
    _no_rule_failed(caught)
    start = page.index('class="memviz-data">') + len('class="memviz-data">')
    _strict_json(page[start:page.index("</script>", start)])
    page.encode("utf-8")
    for view in (html.tracker_repr_html(t), html.snapshot_repr_html(snaps[1]),
                 html.findings_repr_html(findings)):
        view.encode("utf-8")
    # the what-if replay (its C pass and models) under settings that reach every rule,
    # on the recorded card and on a small one (out-of-memory points, retries, flushes)
    for args, kw in ((("expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4"), {}),
                     (("expandable_segments:True", "garbage_collection_threshold:0.5"), {"device_memory": "64MiB"})):
        rows = t.whatif(*args, **kw)
        [str(r) for r in rows]
    out = io.StringIO()
    perfetto._dump(t, out)
    _strict_json(out.getvalue())
    pickle.dumps(torch_snapshot.build(t), protocol=4)
    return t


# ---- the mutation fuzzer --------------------------------------------------------


def split(data: bytes) -> Tuple[bytes, List[Chunk], bytes]:
    """(header, chunks, trailing bytes) of a trace, without checking CRCs."""
    pos, chunks = F.HEADER.size, []
    while pos + F.CHUNK_HEAD.size + F.CRC.size <= len(data):
        ctype, length = F.CHUNK_HEAD.unpack_from(data, pos)
        end = pos + F.CHUNK_HEAD.size + length
        if end + F.CRC.size > len(data):
            break
        chunks.append((ctype, data[pos + F.CHUNK_HEAD.size:end]))
        pos = end + F.CRC.size
    return data[:F.HEADER.size], chunks, data[pos:]


def frame(ctype: int, payload: bytes) -> bytes:
    head = F.CHUNK_HEAD.pack(ctype, len(payload))
    return head + payload + F.CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def join(head: bytes, chunks: List[Chunk], tail: bytes = b"") -> bytes:
    return head + b"".join(frame(t, p) for t, p in chunks) + tail


def fix_crcs(data: bytes) -> bytes:
    """The same bytes with every whole chunk's CRC made valid."""
    head, chunks, tail = split(data)
    return join(head, chunks, tail)


def _flip(rnd, data):
    b = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        if b:
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
    return bytes(b)


def _overwrite(rnd, data):
    b = bytearray(data)
    if b:
        i = rnd.randrange(len(b))
        b[i:i + rnd.randint(1, 8)] = bytes(rnd.choice((0, 0xFF, rnd.randrange(256)))
                                           for _ in range(rnd.randint(1, 8)))
    return bytes(b)


def _truncate(rnd, data):
    return data[:rnd.randrange(len(data) + 1)]


def _length_lie(rnd, data):
    head, chunks, tail = split(data)
    out = bytearray(join(head, chunks, tail))
    if chunks:
        pos = F.HEADER.size
        k = rnd.randrange(len(chunks))
        for t, p in chunks[:k]:
            pos += F.CHUNK_HEAD.size + len(p) + F.CRC.size
        lie = rnd.choice((0, 1, len(chunks[k][1]) + rnd.randint(-9, 9), 1 << 31, 0xFFFFFFFF))
        struct.pack_into("<I", out, pos + 1, max(0, min(lie, 0xFFFFFFFF)))
    return bytes(out)


def _payload(ctype: int, payload: bytes) -> Tuple[bytes, bool]:
    if ctype & F.COMPRESSED:
        try:
            return zlib.decompress(payload), True
        except zlib.error:
            return payload, False
    return payload, False


#: values that decoded fields must be checked against: wrong types, NaN and
#: infinities, 64-bit edges and beyond, negative sizes, odd strings
_VALUES = [None, -1, 0, 1, 1 << 31, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63) - 1, -(1 << 70),
           10 ** 30, -(1 << 40), 1.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf"),
           True, False, "", "x" * 3, "9" * 30, "-1", "\udcff", "\ud800", "</script>",
           [], {}, [[]], [1, 2, 3], [None], {"0": [1, 2, "x"]}, {"index": 0, "timestamp_ns": 1}]


def _reshape(rnd, v):
    """A structural change of one value: its type, sign, size or nesting."""
    op = rnd.randrange(12)
    if op == 0:
        return [v]
    if op == 1:
        return {rnd.choice(("0", "x", "-1", "index")): v}
    if op == 2:  # deep nesting
        for _ in range(rnd.choice((5, 60, 300, 2000))):
            v = [v]
        return v
    if op == 3 and isinstance(v, (list, dict)) and v:  # one level less
        return next(iter(v.values())) if isinstance(v, dict) else v[0]
    if op == 4 and isinstance(v, dict):
        return list(v.values())
    if op == 5 and isinstance(v, list):
        return {str(i): x for i, x in enumerate(v)}
    if op == 6 and type(v) in (int, float):
        return rnd.choice((-v, v * (1 << 64), str(v), float(v) * 1e300, int(v) if v == v and
                           abs(v) != float("inf") else 0))
    if op == 7 and isinstance(v, str):
        return rnd.choice((len(v), [v], v * 1000, v + "\udcff", float("nan")))
    if op == 8 and isinstance(v, list):
        return v + [rnd.choice(_VALUES)]
    if op == 9 and isinstance(v, dict):
        new = dict(v)
        new[rnd.choice(("extra", "index", "timestamp_ns", "devices", "calls", "store"))] = \
            rnd.choice(_VALUES)
        return new
    return rnd.choice(_VALUES)


def _mutate_json(rnd, obj, depth=0):
    """A random change somewhere inside a JSON value: a value replaced, or
    reshaped (:func:`_reshape`), or an element dropped or repeated."""
    if depth > 6 or rnd.random() < (0.04, 0.1, 0.25)[min(depth, 2)]:  # mostly fields, not chunks
        return _reshape(rnd, obj) if rnd.random() < 0.6 else rnd.choice(_VALUES)
    if isinstance(obj, list) and obj:
        i = rnd.randrange(len(obj))
        op = rnd.random()
        if op < 0.15:
            return obj[:i] + obj[i + 1:]
        if op < 0.25:
            return obj + [obj[i]] * rnd.randint(1, 3)
        return obj[:i] + [_mutate_json(rnd, obj[i], depth + 1)] + obj[i + 1:]
    if isinstance(obj, dict) and obj:
        k = rnd.choice(list(obj))
        new = dict(obj)
        r = rnd.random()
        if r < 0.15:
            new.pop(k)
        elif r < 0.3:
            new[rnd.choice(("-1", "999999", "x", "128", "65536", " 1", "1_0"))] = new[k]
        else:
            new[k] = _mutate_json(rnd, obj[k], depth + 1)
        return new
    return _reshape(rnd, obj) if rnd.random() < 0.5 else rnd.choice(_VALUES)


#: chunks whose decoded JSON fields the reports, diagnose() and the exports read
_FIELD_KINDS = (F.META, F.STEPS, F.STEPS, F.END, F.THREADS, F.LABELS, F.CALLS, F.TIMELINE,
                F.FRAMES)


def _structured(rnd, data, fields=False):
    """Change one chunk's decoded payload and re-frame it with a valid CRC
    (with ``fields``: a chunk whose JSON fields memviz reads, when there is one)."""
    head, chunks, tail = split(data)
    if not chunks:
        return data
    k = rnd.randrange(len(chunks))
    if fields:
        want = rnd.choice(_FIELD_KINDS)
        some = [i for i, (t, _p) in enumerate(chunks) if t & F.KIND_MASK == want]
        k = rnd.choice(some) if some else k
    ctype, payload = chunks[k]
    raw, was_compressed = _payload(ctype, payload)
    kind = ctype & F.KIND_MASK
    if kind == F.EVENTS and len(raw) >= 5:
        b = bytearray(raw)
        op = rnd.random()
        if op < 0.3:  # huge or wrong count
            struct.pack_into("<I", b, 0, rnd.choice((0, 1, 0xFFFFFFFF, (len(b) - 5) // 32 + 1)))
        elif op < 0.4:
            b[4] = rnd.choice((0, 1, 2, 255))
        else:
            for _ in range(rnd.randint(1, 6)):
                if len(b) > 5:
                    b[rnd.randrange(5, len(b))] = rnd.randrange(256)
        raw = bytes(b)
    else:
        try:
            obj = json.loads(raw)
            for _ in range(rnd.choice((1, 1, 1, 2, 3))):
                obj = _mutate_json(rnd, obj)
            raw = json.dumps(obj).encode("utf-8", "surrogatepass")
        except (ValueError, RecursionError):
            raw = _flip(rnd, raw)
    if was_compressed and rnd.random() < 0.8:
        raw = zlib.compress(raw)
    else:
        ctype &= ~F.COMPRESSED
    chunks[k] = (ctype, raw)
    return join(head, chunks, tail)


def _shuffle_chunks(rnd, data):
    head, chunks, tail = split(data)
    if len(chunks) < 2:
        return data
    op = rnd.random()
    i = rnd.randrange(len(chunks))
    if op < 0.3:
        del chunks[i]
    elif op < 0.6:
        chunks.insert(rnd.randrange(len(chunks)), chunks[i])
    else:
        j = rnd.randrange(len(chunks))
        chunks[i], chunks[j] = chunks[j], chunks[i]
    if rnd.random() < 0.2:
        chunks.insert(rnd.randrange(len(chunks) + 1),
                      (rnd.randrange(256), bytes(rnd.randrange(256) for _ in range(8))))
    return join(head, chunks, tail)


def _bad_compression(rnd, data):
    head, chunks, tail = split(data)
    if chunks:
        k = rnd.randrange(len(chunks))
        t, p = chunks[k]
        chunks[k] = (t | F.COMPRESSED, p if t & F.COMPRESSED and rnd.random() < 0.5
                     else zlib.compress(p)[:-rnd.randint(0, 4)] + b"\0" * rnd.randint(0, 2))
    return join(head, chunks, tail)


def _fields(rnd, data):
    return _structured(rnd, data, fields=True)


MUTATIONS: List[Callable] = [_flip, _overwrite, _truncate, _length_lie, _structured,
                             _structured, _fields, _fields, _fields, _shuffle_chunks,
                             _bad_compression]


def mutate(rnd: random.Random, data: bytes) -> bytes:
    """One to three mutations; half the time the CRCs are repaired after, so
    that flipped and overwritten bytes reach the chunk parsers."""
    for _ in range(rnd.randint(1, 3)):
        data = rnd.choice(MUTATIONS)(rnd, data)
    if rnd.random() < 0.5 and len(data) >= F.HEADER.size:
        data = fix_crcs(data)
    return data


def fuzz(seconds: float, rng_seed: int = 0, save_dir: Optional[str] = None) -> int:
    """Mutate the seeds for ``seconds``; returns how many inputs ran. On a
    bug, writes the input to ``save_dir`` (if given) and re-raises."""
    rnd = random.Random(rng_seed)
    pool = seeds()
    for s in pool:
        assert check(s) is not None, "a seed trace does not load"
    runs, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = mutate(rnd, rnd.choice(pool))
        try:
            t = check(data)
        except Exception:
            if save_dir:
                path = os.path.join(save_dir, f"crash-{rng_seed}-{runs}.memviz")
                with open(path, "wb") as f:
                    f.write(data)
                print(f"fuzz_trace: input that failed written to {path}", file=sys.stderr)
            raise
        runs += 1
        if t is not None and len(pool) < 200 and rnd.random() < 0.05:
            pool.append(data)  # loadable mutants breed further ones
    return runs


# ---- atheris entry point --------------------------------------------------------


def test_one_input(data: bytes) -> None:
    """libFuzzer entry: the input as is, and with its CRCs repaired."""
    with redirect_stderr(io.StringIO()):
        check(data)
        if len(data) >= F.HEADER.size:
            check(fix_crcs(data))


def main() -> None:
    import atheris

    with atheris.instrument_imports():
        import memviz.trace.reader  # noqa: F401
        import memviz.model.snapshot  # noqa: F401  (instrumented too)
    dirs = [a for a in sys.argv[1:] if not a.startswith("-")]
    if dirs and os.path.isdir(dirs[0]) and not os.listdir(dirs[0]):
        for i, s in enumerate(seeds()):
            with open(os.path.join(dirs[0], f"seed-{i}.memviz"), "wb") as f:
                f.write(s)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
