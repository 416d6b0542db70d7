"""The .memviz trace file: streaming, save(), load(), damaged files and the CLI.

Allocations are fired through the libcupti test double (the ``fake``
fixture), so the real capture path fills the C core's event ring that the
trace writer drains.
"""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib
from pathlib import Path

import pytest

import memviz
from fake_cupti import (CBID_cuMemAlloc_v2, CBID_cuMemAllocHost_v2, CBID_cuMemFree_v2,
                        CUDA_ERROR_OUT_OF_MEMORY)
from memviz.trace import format as F
from memviz.loaded import LoadedTrace
from memviz.trace.writer import TraceWriter

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
KEYS = ("lineno", "traceback", "label", "thread", "kind", "device", "filename")


def stats(snap):
    """Everything statistics() says, per key type, as plain data."""
    out = {}
    for key in KEYS:
        out[key] = sorted((str(s.key), s.size, s.count) for s in snap.statistics(key))
    return out


def allocs(snap):
    return sorted((a.address, a.size, a.device, a.kind, a.label, a.timestamp_ns, a.thread.name,
                   tuple(a.traceback)) for a in snap.allocations)


def failures(x):
    return [(f.size, f.device, f.kind, f.result, f.label, f.timestamp_ns, f.thread.name,
             tuple(f.traceback)) for f in x.failures]


def load_quiet(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        return memviz.load(path, **kw)


def from_bytes(data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", F.TraceWarning)
        return LoadedTrace.from_bytes(data, "<test>", **kw)


def assert_same(live, loaded, *, timeline=True):
    assert stats(loaded.snapshot()) == stats(live.snapshot())
    assert allocs(loaded.snapshot()) == allocs(live.snapshot())
    assert stats(loaded.peak_snapshot()) == stats(live.peak_snapshot())
    assert allocs(loaded.peak_snapshot()) == allocs(live.peak_snapshot())
    for dev in live.totals():
        assert allocs(loaded.peak_snapshot(dev)) == allocs(live.peak_snapshot(dev))
    assert loaded.totals() == live.totals()
    assert (loaded.current_bytes(), loaded.peak_bytes()) == (live.current_bytes(), live.peak_bytes())
    assert failures(loaded) == failures(live)
    if timeline:
        assert loaded.timeline() == live.timeline()


def worker_alloc(fake, size):
    return fake.alloc(CBID_cuMemAlloc_v2, size)  # WORKER LINE


def busy_run(fake):
    """Lines, a Python thread, a native thread, labels, frees, a failure, a
    host allocation, a second device and static module memory."""
    keep = fake.alloc(CBID_cuMemAlloc_v2, 256 * MiB)
    with memviz.label("data loading"):
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY)
    fake.free(CBID_cuMemFree_v2, tmp)
    th = threading.Thread(target=worker_alloc, args=(fake, 3 * MiB), name="loader-1")
    th.start()
    th.join()
    fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 5 * MiB, 0, "autograd-0")
    fake.alloc(CBID_cuMemAllocHost_v2, 4096)
    fake.set_device(1)
    big = fake.alloc(CBID_cuMemAlloc_v2, 512 * MiB)
    fake.free(CBID_cuMemFree_v2, big)
    fake.alloc(CBID_cuMemAlloc_v2, 7 * MiB)
    fake.set_device(0)
    fake.emit_memory2(1, 6, 0x7000_0000, 3 * MiB, 0, 0, "globals", "/x/libcublasLt.so.13")
    return keep


# ---- round trips ----------------------------------------------------------------


def test_streamed_trace_round_trip(fake, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        busy_run(fake)
    loaded = memviz.load(path)
    assert not loaded.truncated and not loaded.saved and loaded.error is None
    assert_same(t, loaded)
    kinds = {a.kind for a in loaded.snapshot()}
    assert kinds == {"device", "host", "static"}
    threads = {s.key for s in loaded.snapshot().statistics("thread")}
    assert {"MainThread", "autograd-0"} <= threads
    assert "loader-1" in {a.thread.name for a in loaded.snapshot()}
    assert loaded.capture_info()["gpu_enabled"] and loaded.capture_info()["store"]["live"] > 0
    assert loaded.gpu_enabled and loaded.depth == t.depth
    assert loaded.started_ns == t.started_ns and loaded.stopped_ns <= t.stopped_ns
    assert loaded.meta["pid"] == os.getpid() and loaded.meta["mode"] == "stream"


def test_snapshot_at_any_time_replays_the_events(fake, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        a = fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
        mid = t.snapshot()
        time.sleep(0.01)
        at = time.monotonic_ns()
        fake.free(CBID_cuMemFree_v2, a)
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    loaded = memviz.load(path)
    assert allocs(loaded.snapshot(at_ns=at)) == allocs(mid)
    assert loaded.snapshot(at_ns=0).allocations == ()
    assert allocs(loaded.snapshot()) == allocs(t.snapshot())


def test_steps_are_stored(fake, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        t.steps.append({"index": 0, "note": "a plain dict"})
        t.writer = next(p for p in t.subscribers if isinstance(p, TraceWriter))
        t.writer.flush()
        t.steps.append(object())  # unknown: stored by its attributes / repr
    loaded = memviz.load(path)
    assert loaded.steps[0] == {"index": 0, "note": "a plain dict"}
    assert len(loaded.steps) == 2


def test_save_round_trip_after_stop(fake, tmp_path):
    with memviz.track(torch=False) as t:
        busy_run(fake)
    t.save(tmp_path / "saved.memviz")
    loaded = memviz.load(tmp_path / "saved.memviz")
    assert loaded.saved and not loaded.truncated
    assert_same(t, loaded)


def test_save_while_running_and_after_freeze(fake, tmp_path):
    t = memviz.track(torch=False).start()
    try:
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        fake.free(CBID_cuMemFree_v2, tmp)
        t.save(tmp_path / "running.memviz")
        assert_same(t, memviz.load(tmp_path / "running.memviz"))
    finally:
        t.stop()
    with memviz.track(torch=False):  # freezes t's data into Python
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    t.save(tmp_path / "frozen.memviz")
    assert_same(t, memviz.load(tmp_path / "frozen.memviz"))


def test_save_errors_say_what_to_do(fake, tmp_path):
    with pytest.raises(memviz.NotTracking):
        memviz.track(torch=False).save(tmp_path / "never.memviz")
    with memviz.track(torch=False) as t:
        pass
    with pytest.raises(memviz.TraceError, match="What to do") as e:
        t.save(tmp_path / "no" / "such" / "dir.memviz")
    assert e.value.path.endswith("dir.memviz")


def test_unwritable_trace_path_fails_at_start(fake, tmp_path):
    with pytest.raises(memviz.TraceError, match="cannot create the trace file"):
        memviz.track(trace=str(tmp_path / "missing" / "x.memviz"), torch=False).start()
    assert memviz.active_tracker() is None
    with memviz.track(torch=False):  # capture still works afterwards
        fake.alloc(CBID_cuMemAlloc_v2, MiB)


def test_writer_failure_never_reaches_the_program(fake, tmp_path, monkeypatch):
    """The Python writer's failure (the native writer's: test_trace_native.py)."""
    monkeypatch.setenv("MEMVIZ_TRACE_WRITER", "python")
    path = tmp_path / "run.memviz"
    with pytest.warns(F.TraceWarning, match="RuntimeError: disk on fire"):
        with memviz.track(trace=str(path), torch=False) as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            writer = next(p for p in t.subscribers if isinstance(p, TraceWriter))
            writer.flush()

            def boom():
                raise RuntimeError("disk on fire")
            monkeypatch.setattr(memviz._core, "trace_drain", boom)
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            writer.flush()  # fails: recorded, not raised
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
    monkeypatch.undo()
    assert t.current_bytes() == 3 * MiB  # tracking itself went on
    loaded = load_quiet(path)
    assert loaded.truncated and len(loaded.snapshot()) == 1


def test_synthetic_events_and_a_million_event_load_is_fast(tmp_path):
    path = tmp_path / "big.memviz"
    with memviz.track(gpu=False, trace=str(path), torch=False) as t:
        memviz._core._synthetic(0x10_0000_0000, 4096, False, 1000)  # live
        memviz._core._synthetic(0x20_0000_0000, 4096, True, 499_000)  # alloc + free pairs
    assert os.path.getsize(path) / 1_000_000 < 32
    loaded = memviz.load(path)  # its time: benchmarks/bench_bounds.py (load)
    peak = loaded.peak_snapshot()
    assert loaded.event_count >= 999_000
    assert len(peak) == 1001 and len(loaded.snapshot()) == 1000
    assert loaded.totals() == t.totals()


# ---- damaged and foreign files --------------------------------------------------


@pytest.fixture
def good_trace(fake, tmp_path):
    path = tmp_path / "good.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        for k in range(3):
            fake.alloc(CBID_cuMemAlloc_v2, (k + 1) * MiB)
            next(p for p in t.subscribers if isinstance(p, TraceWriter)).flush()
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY)
    return path.read_bytes()


def crafted_chunk(kind, payload):
    """A chunk compressed however far deflate goes (memviz's own writers
    stop at the reader's cap, F.MAX_RATIO): what a crafted file holds."""
    import zlib

    packed = zlib.compress(payload, 9)
    head = F.CHUNK_HEAD.pack(kind | F.COMPRESSED, len(packed))
    return head + packed + F.CRC.pack(zlib.crc32(packed, zlib.crc32(head)))


def chunk_offsets(data):
    pos, out = F.HEADER.size, []
    while pos < len(data):
        out.append(pos)
        pos += F.CHUNK_HEAD.size + struct.unpack_from("<I", data, pos + 1)[0] + F.CRC.size
    assert pos == len(data)
    return out


def test_truncated_at_every_chunk_boundary_and_inside_chunks(good_trace):
    offsets = chunk_offsets(good_trace)
    meta_end = offsets[1]
    counts = []
    for cut in sorted(set(offsets[1:] + [o + d for o in offsets for d in (1, 5, 9)])):
        if not meta_end <= cut < len(good_trace):
            continue
        with pytest.warns(F.TraceWarning, match="incomplete"):
            t = LoadedTrace.from_bytes(good_trace[:cut], "cut.memviz")
        assert t.truncated and t.error
        t.totals(), t.snapshot(), t.peak_snapshot(), t.timeline(), t.failures
        counts.append((cut, len(t.snapshot())))
    assert [c for _, c in counts] == sorted(c for _, c in counts)  # a prefix, growing
    assert counts[-1][1] == 3
    for cut in range(0, meta_end):  # nothing usable before the metadata is complete
        with pytest.raises(memviz.TraceError):
            LoadedTrace.from_bytes(good_trace[:cut], "cut.memviz")


def test_corrupted_crc_names_the_file_and_offset(good_trace, tmp_path):
    offsets = chunk_offsets(good_trace)
    victim = offsets[len(offsets) // 2]
    bad = bytearray(good_trace)
    bad[victim + F.CHUNK_HEAD.size] ^= 0x40
    path = tmp_path / "bad.memviz"
    path.write_bytes(bad)
    with pytest.raises(memviz.TraceError) as e:
        memviz.load(path)
    assert e.value.offset == victim and e.value.path == str(path)
    assert str(path) in str(e.value) and f"byte {victim:,}" in str(e.value)
    assert "corrupted" in str(e.value) and "recover=True" in str(e.value)
    with pytest.warns(F.TraceWarning):
        t = memviz.load(path, recover=True)
    assert t.truncated and "checksum" in t.error


def test_foreign_empty_newer_and_missing_files(tmp_path, good_trace):
    png = tmp_path / "image.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(memviz.TraceError, match="not a memviz trace") as e:
        memviz.load(png)
    assert e.value.offset == 0 and isinstance(e.value, memviz.MemvizError)
    empty = tmp_path / "empty.memviz"
    empty.write_bytes(b"")
    with pytest.raises(memviz.TraceError, match="empty"):
        memviz.load(empty)
    newer = tmp_path / "newer.memviz"
    newer.write_bytes(F.MAGIC + struct.pack("<I", 99) + good_trace[12:])
    with pytest.raises(memviz.TraceError, match="format 99, written by a newer memviz.*upgrade"):
        memviz.load(newer)
    with pytest.raises(memviz.TraceError, match="cannot read"):
        memviz.load(tmp_path / "nope.memviz")


def test_chunk_level_problems(good_trace):
    offsets = chunk_offsets(good_trace)
    # a length that lies past the end of the file reads as a cut-off tail
    lie = bytearray(good_trace)
    struct.pack_into("<I", lie, offsets[-1] + 1, 1 << 30)
    assert from_bytes(bytes(lie)).truncated
    # an unknown chunk kind: an error, unless marked optional
    extra = F.chunk(50, b"future")
    at = offsets[-1]
    with pytest.raises(memviz.TraceError, match="unknown"):
        from_bytes(good_trace[:at] + extra + good_trace[at:])
    skip = F.chunk(50 | F.OPTIONAL, b"future")
    assert not from_bytes(good_trace[:at] + skip + good_trace[at:]).truncated
    # data after the END chunk
    with pytest.raises(memviz.TraceError, match="after the end"):
        from_bytes(good_trace + F.chunk(F.STRINGS, b"[]"))
    # a call-name table whose names are not strings, or whose keys are no stack ids
    for bad, what in ((b'{"1": 5}', "is not a string"), (b'{"x": "f"}', "stack id")):
        with pytest.raises(memviz.TraceError, match=what):
            from_bytes(good_trace[:at] + F.chunk(F.CALLS | F.OPTIONAL, bad) + good_trace[at:])
    # an event count that does not match the payload (valid CRC)
    bogus = F.chunk(F.EVENTS, struct.pack("<IB", 1 << 31, 1) + b"\0" * 64, compress=None)
    with pytest.raises(memviz.TraceError, match="says 2,147,483,648 events"):
        from_bytes(good_trace[:at] + bogus + good_trace[at:])


def test_gap_records_count_dropped_events(good_trace):
    at = chunk_offsets(good_trace)[-1]
    gap = F.EVENT.pack(0, F.OP_TIME, 0, 0, 0, 0, 0, 0, 10**12, 0, 0, 0) + \
        F.EVENT.pack(0, F.OP_GAP, 0, 0, 0, 0, 0, 0, 12345, 0, 0, 0)
    t = from_bytes(good_trace[:at] + F.chunk(F.EVENTS, F.events_payload(gap)) + good_trace[at:])
    assert t.dropped_events == 12345


# ---- a process killed while streaming ------------------------------------------


def test_sigkill_leaves_a_loadable_trace(fake_path, tmp_path):
    path = tmp_path / "killed.memviz"
    prog = tmp_path / "victim.py"
    prog.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
        import memviz
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        lib = FakeCupti({fake_path!r}).lib
        t = memviz.track(trace={str(path)!r}, torch=False).start()
        for i in range(100):
            lib.fake_alloc(CBID_cuMemAlloc_v2, 1 << 20, 0, 0)  # EARLY
        print("ready", flush=True)
        while True:
            lib.fake_alloc(CBID_cuMemAlloc_v2, 4096, 0, 0)
            time.sleep(0.001)
    """))
    env = dict(os.environ, MEMVIZ_CUPTI_LIBRARY=fake_path)
    p = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.6)  # > 1 s: at least two flushes happened
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
    with pytest.warns(F.TraceWarning, match="incomplete"):
        t = memviz.load(path)
    assert t.truncated and t.end is None
    lines = t.snapshot().statistics("lineno")
    early = [s for s in lines if s.size == 100 * MiB]
    assert early and early[0].count == 100 and early[0].key.filename == str(prog)
    assert len(t.snapshot()) > 100  # and some of the later ones
    assert t.totals()[0]["current"] == t.snapshot().total_bytes()


# ---- the command line -----------------------------------------------------------


def cli(*args, cwd, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items() if k != memviz.capture.cupti.ENV_LIBRARY}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "memviz", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_run_with_output_then_report_and_diff(fake_path, tmp_path):
    body = """
        import sys
        sys.path.insert(0, {tests!r})
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        lib = FakeCupti({fake!r}).lib
        weights = lib.fake_alloc(CBID_cuMemAlloc_v2, {size} << 20, 0, 0)
        lib.fake_alloc(CBID_cuMemAlloc_v2, 1 << 40, 0, 2)
    """
    env = {memviz.capture.cupti.ENV_LIBRARY: fake_path}
    for name, size in (("a", 64), ("b", 256)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body.format(
            tests=str(ROOT / "tests"), fake=fake_path, size=size)))
        p = cli("run", "-o", f"{name}.memviz", f"{name}.py", cwd=tmp_path, env=env)
        assert p.returncode == 0, p.stderr
        assert "memviz report" in p.stderr and f"trace written to {name}.memviz" in p.stderr

    p = cli("report", "b.memviz", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Top lines at the peak of cuda:0 (256 MiB)" in p.stdout and "b.py:6" in p.stdout
    assert "Failed allocations (1)" in p.stdout

    p = cli("report", "b.memviz", "--format", "json", "-o", "b.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    dev, = doc["devices"]
    assert doc["memviz_report"] == 1 and not doc["truncated"]
    assert (dev["device"], dev["peak"], dev["failed"]) == (0, 256 * MiB, 1)
    top = dev["top_lines_at_peak"][0]
    assert (os.path.basename(top["file"]), top["line"], top["size"]) == ("b.py", 6, 256 * MiB)
    assert doc["failures"][0]["result"] == 2 and doc["failures"][0]["line"] == 7

    p = cli("report", "b.memviz", "--format", "html", "-o", "b.html", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "b.html").read_text().lstrip().lower().startswith("<!doctype html")

    p = cli("diff", "a.memviz", "b.memviz", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "+192 MiB" in p.stdout and "b.py:6" in p.stdout and "a.py:6" in p.stdout

    p = cli("diff", "a.memviz", "b.memviz", "--format", "json", cwd=tmp_path)
    assert json.loads(p.stdout)["peaks"][0] == {"device": 0, "a": 64 * MiB, "b": 256 * MiB}


def test_cli_errors(tmp_path, good_trace):
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    p = cli("report", "x.png", cwd=tmp_path)
    assert p.returncode == 2 and "not a memviz trace" in p.stderr and "Traceback" not in p.stderr
    p = cli("report", "missing.memviz", cwd=tmp_path)
    assert p.returncode == 2 and "cannot read" in p.stderr
    p = cli("diff", "x.png", cwd=tmp_path)
    assert p.returncode == 2
    (tmp_path / "x.py").write_text("pass\n")
    p = cli("run", "-o", "no/such/dir/t.memviz", "x.py", cwd=tmp_path)
    assert p.returncode == 2 and "does not exist" in p.stderr
    (tmp_path / "cut.memviz").write_bytes(good_trace[:-20])
    p = cli("report", "cut.memviz", cwd=tmp_path)
    assert p.returncode == 0 and "warning" in p.stderr and "incomplete trace" in p.stdout


def test_memviz_frames_recorded_in_another_checkout_are_library_code_when_loaded(fake, tmp_path):
    """A trace recorded by a memviz installed elsewhere (the sample shipped
    with memviz was recorded on a GPU machine): its memviz frames stay hidden
    here, so the user's line is the one reported."""
    elsewhere = "/opt/elsewhere/checkout/memviz/torch/allocator.py"
    ns = {"fake": fake, "CBID": CBID_cuMemAlloc_v2}
    exec(compile("def probe(n):\n    return fake.alloc(CBID, n)\n", elsewhere, "exec"), ns)
    path = str(tmp_path / "t.memviz")
    with memviz.track(trace=path):
        kept = ns["probe"](3 * MiB); line = sys._getframe().f_lineno  # noqa: E702
    loaded = memviz.load(path)
    top = loaded.peak_snapshot(0).statistics("lineno")[0]
    assert (top.key.filename, top.key.lineno) == (__file__, line), top
    fake.free(CBID_cuMemFree_v2, kept)


@pytest.mark.parametrize("special", ["device", "directory", "fifo"])
def test_special_files_are_refused_at_once(tmp_path, special):
    """A device, a directory or a FIFO is not a trace: `memviz report
    /dev/zero` read until memory ran out, and a FIFO without a writer
    blocked forever. Both the API and the CLI refuse them before reading."""
    if special == "device":
        path, what = "/dev/zero", "a character device"
    elif special == "directory":
        path, what = str(tmp_path), "a directory"
    else:
        path, what = str(tmp_path / "pipe"), "a FIFO"
        os.mkfifo(path)
    code = ("import sys, memviz\n"
            "try:\n    memviz.load(sys.argv[1])\n"
            "except memviz.TraceError as e:\n    print('REFUSED', e)\n")
    for argv in ([sys.executable, "-c", code, path],
                 [sys.executable, "-m", "memviz", "report", path]):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        out = p.stdout + p.stderr
        assert f"it is {what}" in out and "What to do:" in out, out
        assert ("REFUSED" in out) if argv[1] == "-c" else (p.returncode == 2), (p.returncode, out)


@pytest.mark.parametrize("bomb", ["steps", "events", "strings"])
def test_chunks_that_inflate_far_beyond_what_memviz_writes_are_refused(good_trace, tmp_path, bomb):
    """Deflate lets a few hundred KB stand for gigabytes (a crafted STEPS chunk
    of 292 KB took the reader past 10 GB). Each chunk may inflate only so far
    over its compressed size (so the file, too, only so far over its size):
    what is past that is refused, quickly, without the memory."""
    meta_end = chunk_offsets(good_trace)[1]
    if bomb == "steps":
        extra = crafted_chunk(F.STEPS, b"[" + b" " * (96 << 20) + b"]")
    elif bomb == "events":
        count = (96 << 20) // F.EVENT.size
        extra = crafted_chunk(F.EVENTS, F.EVENTS_HEAD.pack(count, F.LAYOUT_PLANES) + bytes(count * F.EVENT.size))
    else:
        extra = crafted_chunk(F.STRINGS, b'["' + b"a" * (96 << 20) + b'"]')
    path = tmp_path / "bomb.memviz"
    path.write_bytes(good_trace[:meta_end] + extra)
    code = ("import sys, memviz\n"
            "try:\n    memviz.load(sys.argv[1])\n    print('LOADED')\n"
            "except memviz.TraceError as e:\n    print('REFUSED', e)\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
            "print('RSS_MB', int(hwm.split()[1]) // 1024)\n")

    def peak_mb(trace):
        p = subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        out = p.stdout + p.stderr
        return int(out.split("RSS_MB ")[1].split()[0]), out

    rss, out = peak_mb(path)
    assert "REFUSED" in out and "inflate to more than" in out and "damaged or crafted" in out, out
    # The 96 MiB payload was never built: the peak stays within 48 MiB of a
    # process that loads the good trace (measured here, so that an allocator
    # with its own overhead, such as AddressSanitizer's, moves both alike).
    # Its time: benchmarks/bench_bounds.py, bomb.
    good = tmp_path / "good.memviz"
    good.write_bytes(good_trace)
    base, base_out = peak_mb(good)
    assert "LOADED" in base_out, base_out
    assert rss < base + 48, (rss, base, out)


def test_the_most_compressible_traces_memviz_writes_still_load(fake, tmp_path):
    """memviz's own most regular output loads: one alloc/free pair repeated
    (its events in byte planes would inflate about 150x, past the cap: the
    writer gives them as rows, which compress less) and empty steps."""
    path = str(tmp_path / "regular.memviz")
    with memviz.track(trace=path) as t:
        fake.lib.fake_alloc_free_loop(CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, 200_000, MiB)
        for _ in range(5000):
            t.step()
    loaded = memviz.load(path)
    assert loaded.event_count >= 400_000 and len(loaded.steps) == 5000


# ---- events() ---------------------------------------------------------------------


def test_events_of_a_loaded_trace_share_seq_with_the_tracker(fake, tmp_path):
    """Every alloc, free and failure, in order; ``seq`` names the allocation an
    event concerns with the number the tracker's own Allocation.seq gives it."""
    from memviz.report import read

    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        busy_run(fake)
        live_seqs = {(a.device, a.address): a.seq for a in t.snapshot().allocations}
    loaded = memviz.load(path)
    evs = list(loaded.events())
    ops = [e.op for e in evs]
    totals = loaded.totals()
    assert ops.count("alloc") == sum(v["allocs"] for v in totals.values())
    assert ops.count("free") == sum(v["frees"] for v in totals.values()) == 2
    assert ops.count("failed") == len(loaded.failures) == 1
    assert [e.timestamp_ns for e in evs] == sorted(e.timestamp_ns for e in evs)

    # seq: what the live tracker and the loaded trace call each allocation
    assert {(a.device, a.address): a.seq for a in loaded.snapshot().allocations} == live_seqs
    made = {}
    for e in evs:
        if e.op == "alloc":
            assert e.seq == e.timestamp_ns
            made[(e.device, e.address)] = e
        elif e.op == "free":
            a = made.pop((e.device, e.address))
            assert (e.seq, e.size, e.traceback, e.label) == (a.seq, a.size, a.traceback, a.label)
            assert e.timestamp_ns >= a.timestamp_ns
    assert {k: e.seq for k, e in made.items() if e.kind != "static"} == {
        k: s for k, s in live_seqs.items() if k in made and made[k].kind != "static"}
    tmp = next(e for e in evs if e.op == "free" and e.device == 0)
    assert tmp.size == 64 * MiB and tmp.label == "data loading"
    worker = next(e for e in evs if e.op == "alloc" and e.thread.name == "loader-1")
    assert worker.traceback.user_frame.name == "worker_alloc" and worker.size == 3 * MiB
    failed, = [e for e in evs if e.op == "failed"]
    assert failed.size == 1 << 40 and failed.seq == failed.timestamp_ns

    # the readers of reports and exports get the same history from both
    def norm(obj):
        return [(e.op, e.timestamp_ns, e.device, e.address, e.size, e.kind, e.label)
                for e in read.events(obj)]
    assert norm(loaded) == norm(t) == [(e.op, e.timestamp_ns, e.device, e.address, e.size,
                                        e.kind, e.label) for e in evs]


def test_events_of_a_saved_trace_replay_its_peak_and_live_set(fake, tmp_path):
    """save() keeps no history: its events are each device's peak set, frees
    of what was not live any more (at a made-up time), and the rest of the
    live set; seq still names each allocation as the tracker did."""
    with memviz.track(torch=False) as t:
        busy_run(fake)
    path = tmp_path / "saved.memviz"
    t.save(str(path))
    evs = list(memviz.load(path).events())
    made = {(a.device, a.address, a.seq) for a in t.snapshot().allocations}
    made |= {(a.device, a.address, a.seq) for a in t.peak_snapshot().allocations}
    assert {(e.device, e.address, e.seq) for e in evs if e.op == "alloc"} == made
    live = set()
    for e in evs:
        if e.op == "alloc":
            live.add((e.device, e.address, e.seq))
        elif e.op == "free":
            live.remove((e.device, e.address, e.seq))
    assert live == {(a.device, a.address, a.seq) for a in t.snapshot().allocations}


@pytest.mark.parametrize("how", ["stream", "save"])
def test_frame_settings_travel_with_the_trace(fake, tmp_path, how):
    """memviz.frames.add_library_path() is kept in the trace: read back in a
    process that never made that call, the user line is the wrapper's caller,
    as the recording tracker had it (top lines and findings agree)."""
    import importlib.util
    import inspect

    wrapper = tmp_path / "gpu_wrapper.py"
    wrapper.write_text("def alloc(fake, cbid, n):\n    return fake.alloc(cbid, n)\n")
    spec = importlib.util.spec_from_file_location("gpu_wrapper", wrapper)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    memviz.frames.add_library_path(str(wrapper))
    path = tmp_path / "run.memviz"
    with memviz.track(**({"trace": str(path)} if how == "stream" else {})) as t:
        mod.alloc(fake, CBID_cuMemAlloc_v2, 3 * MiB); line = inspect.currentframe().f_lineno  # noqa: E702
    if how == "save":
        t.save(str(path))
    live = t.snapshot().statistics("lineno")[0].key
    assert (os.path.basename(live.filename), live.lineno) == ("test_trace.py", line)
    memviz.frames.reset()  # a reading process that never hid the wrapper
    memviz.frames.add_library_path(str(ROOT / "tests" / "fake_cupti"))
    back = memviz.load(str(path)).snapshot().statistics("lineno")[0].key
    assert (os.path.basename(back.filename), back.lineno) == ("test_trace.py", line)


def test_the_constants_shared_with_the_c_core_come_from_it():
    """The format's numbers that the C core also writes or checks are read
    from _core, not copied: record ops, the EVENTS chunk's kind, its
    compressed bit and layouts, the inflate slack, the devices a record
    holds, the overflow label's id (the record's largest label), and the
    ring's bounds, which trace_enable enforces."""
    from memviz import _core
    from memviz.trace import writer
    assert (F.OP_ALLOC, F.OP_FREE, F.OP_FAILED, F.OP_TIME, F.OP_GAP) == (
        _core.OP_ALLOC, _core.OP_FREE, _core.OP_FAILED, _core.OP_TIME, _core.OP_GAP) == (1, 2, 3, 4, 5)
    assert (F.EVENTS, F.COMPRESSED, F.LAYOUT_ROWS, F.LAYOUT_PLANES, F.INFLATE_SLACK) == (7, 0x80, 0, 1, 4096)
    assert (F.DEVICE_MIN, F.DEVICE_MAX) == (-128, 127)
    assert writer._LABEL_OVERFLOW == _core.LABEL_OVERFLOW_ID == 0xFFFF
    for bad in (_core.TRACE_RING_MIN - 1, _core.TRACE_RING_MAX + 1):
        with pytest.raises(ValueError, match=f"between {_core.TRACE_RING_MIN} and {_core.TRACE_RING_MAX} events, not {bad}"):
            _core.trace_enable(bad)
    assert (_core.TRACE_RING_MIN, _core.TRACE_RING_MAX) == (1024, 1 << 28)


@pytest.mark.parametrize("how", ["native", "python", "saved"])
def test_each_events_stream_goes_into_the_trace_and_is_read_back(fake, tmp_path, monkeypatch, how):
    """The stream of a stream-ordered allocation (the record's `stream`) is
    written by the native writer, the Python writer and Tracker.save(), and
    a loaded trace's events() give it back, the free's too."""
    from fake_cupti import CBID_cuMemAllocAsync, CBID_cuMemFreeAsync
    if how == "python":
        monkeypatch.setenv("MEMVIZ_TRACE_WRITER", "python")
    path = str(tmp_path / "streams.memviz")
    with memviz.track(trace=None if how == "saved" else path, torch=False) as t:
        x = fake.alloc(CBID_cuMemAllocAsync, 8 * MiB, stream=0x77)
        y = fake.alloc(CBID_cuMemAllocAsync, MiB, stream=0x99)
        fake.free(CBID_cuMemFreeAsync, y, stream=0x99)
    assert [a.stream for a in t.snapshot().allocations] == [0x77]
    if how == "saved":
        t.save(path)
    got = [(e.op, e.address, e.stream) for e in memviz.load(path).events()]
    assert sorted(got) == sorted([("alloc", x, 0x77), ("alloc", y, 0x99), ("free", y, 0x99)]), got


def test_records_are_encoded_by_the_c_core_with_time_records_where_needed():
    """_core.encode_events, the one encoding of records (the ring's, save(),
    the writers' live sets): a TIME record of the start, another before an
    event that goes back in time or more than 32 bits of ns on; fields held
    to the record's widths."""
    from memviz import _core
    big = 1 << 40
    rows = [(F.OP_ALLOC, 1_000, 5, 0, 0x01, 7, 3, 2, 0x10, 4096, 96, 0x77),
            (F.OP_FREE, 1_500, 5, 0, 0, 7, 3, 2, 0x10, 4096, 0, 0x77),
            (F.OP_ALLOC, 900, 0, -1, 0, 0, 70_000, 1 << 20, 0x20, 8, 0, 0),  # back in time, host
            (F.OP_FAILED, 900 + big, 0, 300, 0, 0, 0, 0, 2, 1 << 30, 0, 0)]  # far on, a device held
    data = _core.encode_events(rows, 1_000, F.FLAG_SYNTHETIC)
    recs = [F.EVENT.unpack_from(data, k) for k in range(0, len(data), F.EVENT.size)]
    ev = F.EV
    assert [r[ev["op"]] for r in recs] == [F.OP_TIME, F.OP_ALLOC, F.OP_FREE, F.OP_TIME, F.OP_ALLOC, F.OP_TIME,
                                           F.OP_FAILED]
    assert [r[ev["address"]] for r in recs if r[ev["op"]] == F.OP_TIME] == [1_000, 900, 900 + big]
    assert all(r[ev["flags"]] == F.FLAG_SYNTHETIC for r in recs if r[ev["op"]] == F.OP_TIME)
    assert recs[2][ev["ts_delta"]] == 500 and recs[1][ev["slack"]] == 96 and recs[1][ev["stream"]] == 0x77
    host = recs[4]
    assert (host[ev["device"]], host[ev["thread_idx"]], host[ev["label_id"]]) == (-1, 0xFFFF, 0xFFFF)
    assert recs[6][ev["device"]] == 127 and recs[6][ev["size"]] == 1 << 30
    # decoded by the replay: each event at its own time
    rp = _core.Replayer(0, False, F.EVENT.size)
    got = rp.feed_events(data, 0, len(recs), F.LAYOUT_ROWS)
    assert [(g[0], g[1]) for g in got] == [(F.OP_ALLOC, 1_000), (F.OP_FREE, 1_500), (F.OP_ALLOC, 900),
                                           (F.OP_FAILED, 900 + big)]
    with pytest.raises(TypeError, match="12 ints"):
        _core.encode_events([(1, 2)], 0, 0)


def test_events_chunks_are_framed_by_the_c_core():
    """_core.events_payload and events_chunk, the one framing of EVENTS and
    LIVE chunks: byte planes, compressed where that helps within the
    reader's ratio, else the same records as rows, else as given."""
    from memviz import _core
    rnd = __import__("random").Random(2)
    recs = b"".join(F.pack_event(ts_delta=rnd.randrange(1000), op=F.OP_ALLOC, address=rnd.randrange(1 << 40),
                                 size=rnd.randrange(1 << 30)) for _ in range(300))
    planes = _core.events_payload(recs, F.LAYOUT_PLANES)
    assert planes[5:] == b"".join(recs[k::F.EVENT.size] for k in range(F.EVENT.size))
    assert _core.events_payload(recs, F.LAYOUT_ROWS)[5:] == recs
    assert F.EVENTS_HEAD.unpack_from(planes) == (300, F.LAYOUT_PLANES)

    def parse(c):
        kind, n = F.CHUNK_HEAD.unpack_from(c)
        body = c[5:5 + n]
        assert F.CRC.unpack_from(c, 5 + n)[0] == zlib.crc32(c[:5 + n]) and len(c) == 9 + n
        return kind, zlib.decompress(body) if kind & F.COMPRESSED else body

    kind, body = parse(_core.events_chunk(F.EVENTS, planes, 6))
    assert kind == F.EVENTS | F.COMPRESSED and body == planes
    kind, body = parse(_core.events_chunk(F.LIVE | F.OPTIONAL, planes, 0))
    assert kind == F.LIVE | F.OPTIONAL and body == planes
    # one record 20,000 times: its planes would inflate past the reader's ratio, its rows do not
    same = _core.events_payload(recs[:F.EVENT.size] * 20_000, F.LAYOUT_PLANES)
    if _core.zlib_available():
        kind, body = parse(_core.events_chunk(F.EVENTS, same, 6))
        assert body[4] == F.LAYOUT_ROWS and body[5:] == recs[:F.EVENT.size] * 20_000
        assert len(body) <= F.max_inflated(kind, F.CHUNK_HEAD.unpack_from(_core.events_chunk(F.EVENTS, same, 6))[1])
    with pytest.raises(ValueError, match="whole records"):
        _core.events_payload(recs[:-1], F.LAYOUT_PLANES)
