"""Traces at the reader's limits: nothing memviz writes is refused by its
reader, the reader's memory follows the file's size, lost events are
counted, said and never shown as leaks, and a SIGKILL loses events but never
the names of those written.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path

import pytest

import memviz
import memviz._core as _core
from conftest import HANG, child_env, complete
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.trace import format as F

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def chunk_sizes(path):
    """(kind, compressed, inflated bytes) of each compressed chunk of a file."""
    data = Path(path).read_bytes()
    pos, out = F.HEADER.size, []
    while pos < len(data):
        ctype, length = F.CHUNK_HEAD.unpack_from(data, pos)
        payload = data[pos + F.CHUNK_HEAD.size:pos + F.CHUNK_HEAD.size + length]
        if ctype & F.COMPRESSED:
            out.append((ctype & F.KIND_MASK, length, len(zlib.decompress(payload))))
        pos += F.CHUNK_HEAD.size + length + F.CRC.size
    return out


# ---- 4. nothing memviz writes is refused by its reader ------------------------------------


def _alloc_in(fake, code_filename, depth):
    """An allocation made ``depth`` frames deep in code whose file name is
    ``code_filename``."""
    ns = {"fake": fake, "CB": CBID_cuMemAlloc_v2}
    exec(compile("def f(n):\n    return fake.alloc(CB, 4096) if n == 0 else f(n - 1)\n",
                 code_filename, "exec"), ns)
    return ns["f"](depth)


EXTREMES = {
    # a label of one pattern repeated: its LABELS chunk deflates about 1000x
    "repetitive label": dict(labels=["ab" * 5000]),
    "many repetitive labels": dict(labels=[("%05d" % i) + "x" * 20000 for i in range(40)]),
    "a label of 2 MB of noise": dict(labels=["".join(random.Random(1).choices("abcdef", k=2 * MiB))]),
    "repetitive file names": dict(files=["/" + "d/" * 5000 + f"f{i}.py" for i in range(30)]),
    "deep stacks": dict(depth=_core.MAX_DEPTH + 50, files=["/deep/" + "x" * 3000 + ".py"]),
    "many threads": dict(threads=300),
    "one alloc/free pair, over and over": dict(pairs=300_000),
    "empty steps": dict(steps=20_000),
}


def _record_extremes(fake, path, case, **track):
    with memviz.track(trace=path, torch=False, **track) as t:
        for label in case.get("labels", []):
            with memviz.label(label):
                fake.alloc(CBID_cuMemAlloc_v2, 4096)
        for name in case.get("files", []):
            _alloc_in(fake, name, case.get("depth", 3))
        if case.get("threads"):
            def work(i):
                memviz.label("thread label " + "t" * 5000)
                fake.alloc(CBID_cuMemAlloc_v2, 8192 + i)
            ts = [threading.Thread(target=work, args=(i,), name="worker-" + "w" * 4000 + str(i))
                  for i in range(case["threads"])]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
        if case.get("pairs"):
            fake.alloc_free_loop(case["pairs"], MiB)
        for _ in range(case.get("steps", 0)):
            t.step()
        for _ in range(2000):  # what comes after: recover=True used to keep 1 of these
            fake.alloc(CBID_cuMemAlloc_v2, 4096)
        live = {(a.address, a.label) for a in t.snapshot().allocations}
    return t, live


def _check_extreme(case_name, path, flight_dir=None):
    """Record EXTREMES[case_name] (or the flight recorder's case), load it
    back and check it whole: run in a child, since the labels and threads it
    leaves in the process would be written into every later trace."""
    from fake_cupti import FakeCupti

    fake = FakeCupti()
    if flight_dir is None:
        _t, live = _record_extremes(fake, path, EXTREMES[case_name])
    else:
        with memviz.track(flight_recorder="32 MiB", flight_dir=flight_dir, torch=False) as t:
            with memviz.label("ab" * 5000):
                fake.alloc(CBID_cuMemAlloc_v2, 4096)
            for _ in range(30):
                fake.alloc_free_loop(10_000, MiB)
                _core.trace_writer_flush()  # a flight ring is small: no event lost
            for _ in range(1000):
                fake.alloc(CBID_cuMemAlloc_v2, 4096)
            live = {(a.address, a.label) for a in t.snapshot().allocations}
            path = t.dump()
    loaded = complete(path)
    assert {(a.address, a.label) for a in loaded.snapshot().allocations} == live
    for kind, compressed, inflated in chunk_sizes(path):
        assert inflated <= F.max_inflated(kind, compressed), (F.CHUNK_NAMES[kind], compressed, inflated)
    for a in loaded.snapshot().allocations:
        if a.traceback is not None and len(a.traceback):
            assert a.traceback[0].filename  # every stack named
    threads = EXTREMES.get(case_name, {}).get("threads")
    if threads:
        names = {a.thread.name for a in loaded.snapshot().allocations if a.thread}
        assert sum(1 for n in names if n and n.startswith("worker-www")) == threads
    print("WHOLE")


def _in_child(fake_path, tmp_path, call, **env):
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'integration')!r}); import test_trace_limits as T; {call}"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=HANG * 2, env=child_env(fake_path, **env))
    assert p.returncode == 0 and "WHOLE" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("writer_kind", ["native", "python"])
@pytest.mark.parametrize("case", list(EXTREMES))
def test_extreme_but_legal_traces_load_back_whole(fake_path, tmp_path, case, writer_kind):
    """Huge and repetitive labels, file names, deep stacks, many threads,
    the most regular events: written through the real writers, read back
    whole, every chunk within the reader's cap (a 10,000-character label
    used to make a LABELS chunk the reader called crafted)."""
    if writer_kind == "native" and not _core.zlib_available():
        pytest.skip("the native writer needs zlib")
    _in_child(fake_path, tmp_path, f"T._check_extreme({case!r}, {str(tmp_path / 'x.memviz')!r})",
              **({"MEMVIZ_TRACE_WRITER": "python"} if writer_kind == "python" else {}))


def test_an_extreme_flight_dump_loads_back_whole(fake_path, tmp_path):
    """The flight recorder's dump goes through the same framing (its base
    and its kept chunks): the most regular events and a repetitive label."""
    _in_child(fake_path, tmp_path, f"T._check_extreme('flight', None, {str(tmp_path)!r})")


# ---- 5. the reader's memory follows the file's size -----------------------------------------


def _crafted(kind, payload):
    """A chunk compressed as far as deflate goes, past what memviz writes."""
    packed = zlib.compress(payload, 9)
    head = F.CHUNK_HEAD.pack(kind | F.COMPRESSED, len(packed))
    return head + packed + F.CRC.pack(zlib.crc32(packed, zlib.crc32(head)))


_META = {"format": "memviz-trace", "format_version": 2, "mode": "stream", "memviz_version": "0",
         "python_version": "3", "platform": "linux", "pid": 1, "start_wall_time": 0.0,
         "start_monotonic_ns": 10 ** 12}


def crafted_trace(what, size, spread):
    """About ``size`` bytes of a trace that declares as much as its chunks
    can hold: every event a new live allocation (``spread`` sizes: the fewer,
    the further it inflates), or tables of tiny entries."""
    rnd = random.Random(1)
    out = [F.header(), F.chunk(F.META, F.json_bytes(_META))]
    if what == "frames":
        out.append(F.chunk(F.STRINGS, b'["a","b","c","d"]'))
    total, next_addr, table = 0, 1 << 40, None
    pack, alloc = F.EVENT.pack, F.OP_ALLOC
    while total < size:
        if what == "events":
            n = 200_000
            recs = [F.pack_event(op=F.OP_TIME, address=10 ** 12)]
            recs += [pack(1, alloc, 0, 0, 0, 0, 0, 0, next_addr + 512 * i, 512 + rnd.randrange(spread), 0, 0)
                     for i in range(n)]
            next_addr += 512 * n
            c = _crafted(F.EVENTS, F.events_payload(b"".join(recs)))
        elif table is None and what == "strings":  # one chunk, over and over: the same ratio
            c = table = _crafted(F.STRINGS, ("[" + ",".join(
                '"%s"' % "".join(rnd.choices("ab" + "c" * (spread > 2), k=2)) for _ in range(400_000)) + "]").encode())
        elif table is None:
            c = table = _crafted(F.FRAMES, ("[" + ",".join(
                "[%d,%d,%d]" % (rnd.randrange(spread), rnd.randrange(spread), 0) for _ in range(400_000)) + "]").encode())
        else:
            c = table
        out.append(c)
        total += len(c)
    return b"".join(out)


_MEASURE = """
import resource, sys, warnings
import memviz
warnings.simplefilter("ignore")


def rss():
    return int([l for l in open("/proc/self/status") if l.startswith(sys.argv[2])][0].split()[1]) * 1024
before = rss("VmRSS:")
try:
    memviz.load(sys.argv[1])
    print("LOADED", rss("VmHWM:") - before)
except memviz.TraceError as e:
    print("REFUSED", rss("VmHWM:") - before, e)
"""


def _load_growth(path):
    p = subprocess.run([sys.executable, "-c", _MEASURE.replace("sys.argv[2]", "which").replace(
        "def rss():", "def rss(which):"), str(path)], capture_output=True, text=True, timeout=HANG,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    word, growth = p.stdout.split()[:2]
    return word, int(growth), p.stdout


@pytest.mark.parametrize("what,spread", [("events", 64), ("strings", 3), ("frames", 3)])
def test_the_readers_memory_is_bounded_by_the_files_size(tmp_path, what, spread):
    """A crafted file declaring as much as its chunks can hold (every event
    a new live allocation; tables of tiny entries), each chunk as far under
    the reader's cap as deflate allows: loading it takes at most
    READER_MEMORY_FACTOR times the file's size."""
    from memviz.trace.parse import READER_MEMORY_FACTOR

    path = tmp_path / "big.memviz"
    path.write_bytes(crafted_trace(what, 1 << 20, spread))
    word, growth, out = _load_growth(path)
    assert word == "LOADED", out
    assert growth <= READER_MEMORY_FACTOR * path.stat().st_size, (growth / path.stat().st_size, out)


def test_a_small_file_declaring_millions_of_allocations_is_refused(tmp_path):
    """A 0.3 MB file whose one EVENTS chunk inflates about 310x (under the
    512x the reader allowed) declared 2 million live allocations: `memviz
    report` took minutes and gigabytes. Now nothing past 64x is read."""
    path = tmp_path / "bomb.memviz"
    path.write_bytes(crafted_trace("events", 200_000, 4))
    word, growth, out = _load_growth(path)
    assert word == "REFUSED" and "inflate to more than" in out, out
    assert growth < 64 * MiB, out


# ---- 8. a SIGKILL loses events, never the names of those written ------------------------------


_KILLED = """
import os, sys, time
import memviz
from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
fake = FakeCupti()
ns = {"fake": fake, "CB": CBID_cuMemAlloc_v2}
with memviz.track(trace=sys.argv[1], torch=False):
    n = 0
    while True:
        # a new stack (a new code object) and a new label every time
        exec(compile("def f():\\n    return fake.alloc(CB, 4096)\\n", f"gen_{n}.py", "exec"), ns)
        with memviz.label(f"label {n}"):
            a = ns["f"]()
        if n % 2:
            fake.free(CBID_cuMemFree_v2, a)
        if n == 200:
            print("ready", flush=True)
        n += 1
"""


def _events_in(path) -> int:
    """How many events a trace being written holds so far (0 while it holds none)."""
    if not path.exists():
        return 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return memviz.load(str(path), recover=True).event_count
    except Exception:  # noqa: BLE001 - not even a header yet
        return 0


@pytest.mark.parametrize("writer_kind", ["native", "python"])
def test_after_a_sigkill_every_allocation_in_the_trace_has_its_stack_and_label(fake_path, tmp_path,
                                                                             writer_kind):
    """A program that makes a new stack and a new label with every
    allocation, killed with SIGKILL at random moments: every allocation the
    file holds has its stack and its label named (stacks used to be named
    once a second, events written every 0.5 s: a kill lost the last
    second's stacks)."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    env = child_env(fake_path)
    if writer_kind == "python":
        env["MEMVIZ_TRACE_WRITER"] = "python"
    rnd = random.Random(3)
    for k in range(4):
        path = tmp_path / f"killed{k}.memviz"
        p = subprocess.Popen([sys.executable, str(script), str(path)], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert p.stdout.readline() == b"ready\n", p.stderr.read()
            # killed at a random moment once the writer has written events (on a
            # loaded machine naming thousands of new stacks a second takes a while)
            deadline = time.monotonic() + HANG
            while time.monotonic() < deadline and _events_in(path) <= 200:
                time.sleep(0.1)
            time.sleep(rnd.random() * 1.5)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=HANG)
        with pytest.warns(F.TraceWarning, match="no end-of-trace record"):
            loaded = memviz.load(str(path))
        allocs = [e for e in loaded.events() if e.op == "alloc"]
        assert len(allocs) > 200
        unnamed = [e for e in allocs if not any(f.filename.startswith("gen_") for f in e.traceback or ())]
        # past 65,534 labels (a fast machine makes them in about 2 s) every new one is
        # the table's overflow label, named in the file as such (src/labels.h)
        unlabelled = [e for e in allocs if not ((e.label or "").startswith("label ")
                                                or e.label == _core.label_name(0xFFFF))]
        assert not unnamed and not unlabelled, (k, len(allocs), len(unnamed), len(unlabelled))


# ---- 7. lost events: counted, said once, never shown as leaks -------------------------------------


def test_events_a_trace_lost_are_said_once_and_their_frees_never_show_as_leaks(fake, tmp_path, monkeypatch):
    """A 1,024-event ring and bursts of alloc/free pairs: the trace loses
    events, some of them frees of allocations kept live across the bursts.
    The writer warns once, while tracking, saying how to get a bigger ring;
    the loaded trace's live set at the end is the tracker's (the 9 of the
    issue were allocations whose frees were lost); the text report counts
    the lost events, not "0 dropped", and says which figures they affect."""
    monkeypatch.setenv(F.RING_ENV, "1024")
    path = str(tmp_path / "lossy.memviz")
    rnd = random.Random(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memviz.track(trace=path, torch=False) as t:
            keep = [fake.alloc(CBID_cuMemAlloc_v2, 4096 + i) for i in range(1000)]
            for _ in range(30):
                fake.alloc_free_loop(20_000, MiB)  # fills the ring: what follows is lost
                for _ in range(20):
                    fake.free(CBID_cuMemFree_v2, keep.pop(rnd.randrange(len(keep))))
                keep += [fake.alloc(CBID_cuMemAlloc_v2, 8192) for _ in range(20)]
                time.sleep(0.03)  # the writer drains, the warning may come
            time.sleep(1.0)
            live = {(a.address, a.seq) for a in t.snapshot().allocations}
            during = [w for w in caught if issubclass(w.category, F.TraceWarning)]
    lost = [w for w in caught if issubclass(w.category, F.TraceWarning) and "events were lost" in str(w.message)]
    assert len(lost) == 1 and during, [str(w.message) for w in caught]
    assert F.RING_ENV in str(lost[0].message)
    loaded = complete(path)
    assert loaded.dropped_events > 0
    assert {(a.address, a.seq) for a in loaded.snapshot().allocations} == live
    assert loaded.gap_freed > 0  # frees were lost, and set right
    from memviz.report.text import text_report

    text = text_report(loaded, outside={})
    flat = " ".join(text.split())
    assert f"{loaded.dropped_events:,} events lost by the trace" in flat, text
    assert "Affected: the lines at each peak" in flat and "none of them is a leak" in flat, text
