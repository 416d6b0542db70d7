"""Fuzzing the .memviz trace reader.

Two drivers share :func:`check` (load the bytes, then use every reading API
and both reports; anything but :class:`memviz.TraceError` is a bug):

* an atheris (libFuzzer) harness, coverage-guided::

      pip install atheris
      python tests/fuzz_trace.py [-max_total_time=60] [CORPUS_DIR ...]

  Each input is tried as is and with its chunk CRCs repaired
  (:func:`fix_crcs`), so mutations reach the chunk parsers instead of
  stopping at the checksum. The seed traces are added to the first corpus
  directory when it is empty.

* :func:`fuzz`, a seeded random mutation fuzzer with no dependency (what
  tests/test_trace_fuzz.py runs in CI): bit flips, byte and block
  overwrites, truncations, chunk length lies, huge counts, chunk
  duplication/removal/reordering, and structure-aware mutations of
  decompressed payloads (JSON values, event records) re-framed with a valid
  CRC.

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
from memviz import _trace as F  # noqa: E402

Chunk = Tuple[int, bytes]  # (type byte, payload as stored)


# ---- seeds ------------------------------------------------------------------------


def _events(rnd: random.Random, n: int) -> bytes:
    """A plausible event stream: allocs, frees, failures, TIME and GAP records."""
    out = [F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 1_000_000, 0)]
    live: List[Tuple[int, int, int]] = []
    for i in range(n):
        r = rnd.random()
        if live and r < 0.4:
            addr, size, dev = live.pop(rnd.randrange(len(live)))
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_FREE, 0, dev, 0, 1, 0, 0, addr, size))
        elif r < 0.45:
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_FAILED, 0, 0, 0, 2, 1, 1, 2,
                                    1 << 40))
        elif r < 0.47:
            out.append(F.EVENT.pack(0, F.OP_GAP, 0, 0, 0, 0, 0, 0, rnd.randrange(100), 0))
        elif r < 0.49:
            out.append(F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 2_000_000 + i * 10_000, 0))
        else:
            addr, size, dev = 0x7F00_0000_0000 + i * 512, rnd.randrange(1, 1 << 30), rnd.choice(
                (0, 0, 1, -1))
            kind = 1 if dev < 0 else rnd.choice((0, 0, 3))
            live.append((addr, size, dev))
            out.append(F.EVENT.pack(rnd.randrange(5000), F.OP_ALLOC, kind, dev, 0,
                                    rnd.choice((0, 1, 2)), rnd.choice((0, 1)),
                                    rnd.choice((0, 1, 2)), addr, size))
    return b"".join(out)


def seed(compress: bool = True, n: int = 60, rng_seed: int = 0, saved: bool = False) -> bytes:
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
                        "cuda_major": 13, "found_by": "fuzz", "python_frames_abi": "3.11"}}
    parts = [F.header(), c(F.META, meta),
             c(F.STRINGS, ["train.py", "<module>", "model.py", "forward"]),
             c(F.FRAMES, [[0, 10, 1], [2, 42, 3]]),
             c(F.STACKS, [[1, [0]], [2, [1, 0]]]),
             c(F.THREADS, {"0": [100, 200, "MainThread"], "1": [101, None, "autograd-0"]}),
             c(F.LABELS, {"1": "forward", "2": "\x01MmBackward0\x1ftrain.py:3"}),
             c(F.EVENTS, F.events_payload(_events(rnd, n), rnd.choice((0, 1)))),
             c(F.STEPS, [{"index": 0, "timestamp_ns": 2_000_000, "devices": {}}, {"x": [1]}]),
             c(F.EVENTS, F.events_payload(_events(rnd, n // 2), 1))]
    if saved:
        parts.append(c(F.TIMELINE, [[1_000_000, 0, 10], [2_000_000, 0, 5]]))
    parts.append(c(F.END, {"stopped_monotonic_ns": 9_000_000, "totals": {
        "0": {"current": 5, "peak": 10, "peak_timestamp_ns": 2, "allocs": 3, "frees": 1,
              "failed": 1}}, "failures": 1, "stats": {"live": 3, "calls": {"alloc": 3}},
        "outside": {"0": [1 << 30, "NVML"]}, "events": n, "dropped_events": 0}))
    return b"".join(parts)


def seeds() -> List[bytes]:
    return [seed(True), seed(False), seed(False, 200, 1, saved=True), seed(True, 5, 2),
            seed(True, 0, 3)]


# ---- the check ------------------------------------------------------------------


def check(data: bytes) -> Optional[object]:
    """Load ``data`` and use everything; returns the trace, or None for a
    TraceError. Any other exception propagates (a bug)."""
    from memviz._cli_report import diff_text, json_report
    from memviz._report import text_report
    from memviz._trace_load import LoadedTrace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t = LoadedTrace.from_bytes(data, "<fuzz>", recover=bool(data[-1:] == b"\x01"))
        except TraceError:
            return None
    t.totals(), t.current_bytes(), t.peak_bytes(), t.capture_info(), t.steps, repr(t)
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
    text_report(t, outside=t.outside, command=t.command)
    json.dumps(json_report(t), default=str)
    diff_text(t, t)
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


def _mutate_json(rnd, obj, depth=0):
    """A random change somewhere inside a JSON value."""
    choices = [None, -1, 0, 1 << 64, 1 << 31, -(1 << 70), 1.5, "", "x" * 3, [], {}, [[]],
               True, "\udcff", [1, 2, 3], {"0": [1, 2, "x"]}]
    if depth > 4 or rnd.random() < 0.25:
        return rnd.choice(choices)
    if isinstance(obj, list) and obj:
        i = rnd.randrange(len(obj))
        op = rnd.random()
        if op < 0.2:
            return obj[:i] + obj[i + 1:]
        if op < 0.3:
            return obj + [obj[i]] * rnd.randint(1, 3)
        return obj[:i] + [_mutate_json(rnd, obj[i], depth + 1)] + obj[i + 1:]
    if isinstance(obj, dict) and obj:
        k = rnd.choice(list(obj))
        new = dict(obj)
        if rnd.random() < 0.2:
            new.pop(k)
        elif rnd.random() < 0.2:
            new[rnd.choice(("-1", "999999", "x", "128", "65536"))] = new[k]
        else:
            new[k] = _mutate_json(rnd, obj[k], depth + 1)
        return new
    return rnd.choice(choices)


def _structured(rnd, data):
    """Change one chunk's decoded payload and re-frame it with a valid CRC."""
    head, chunks, tail = split(data)
    if not chunks:
        return data
    k = rnd.randrange(len(chunks))
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
            raw = json.dumps(_mutate_json(rnd, obj)).encode("utf-8", "surrogatepass")
        except ValueError:
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


MUTATIONS: List[Callable] = [_flip, _overwrite, _truncate, _length_lie, _structured,
                             _structured, _structured, _shuffle_chunks, _bad_compression]


def mutate(rnd: random.Random, data: bytes) -> bytes:
    for _ in range(rnd.randint(1, 3)):
        data = rnd.choice(MUTATIONS)(rnd, data)
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
        import memviz._trace_load  # noqa: F401
        import memviz._snapshot  # noqa: F401  (instrumented too)
    dirs = [a for a in sys.argv[1:] if not a.startswith("-")]
    if dirs and os.path.isdir(dirs[0]) and not os.listdir(dirs[0]):
        for i, s in enumerate(seeds()):
            with open(os.path.join(dirs[0], f"seed-{i}.memviz"), "wb") as f:
                f.write(s)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
