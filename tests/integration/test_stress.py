"""A quick stress suite (seconds, for CI): trackers started, nested, read and
stopped while threads allocate; fork() while a trace streams; interpreter
exit while threads allocate; SIGINT and SIGTERM during `memviz run -o`.

Each test asserts exact counts or the store's own consistency (allocations
minus frees equal the live count, the live and peak sets add up to the
totals, a trace replays to the totals it recorded), not only that nothing
crashed. The longer forms are in benchmarks/. Allocations go through the
libcupti test double.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

ROOT = Path(__file__).resolve().parents[2]
SIZE = 4096
MiB = 1 << 20


def assert_consistent(t, size=SIZE):
    """A stopped tracker whose device-0 allocations are all `size` bytes."""
    tot = t.totals().get(0)
    if tot is None:
        assert len(t.snapshot()) == 0
        return 0
    assert tot["allocs"] - tot["frees"] == tot["live_count"], tot
    assert tot["current"] == tot["live_count"] * size and tot["alloc_bytes"] == tot["allocs"] * size, tot
    snap = t.snapshot()
    assert len(snap) == tot["live_count"] and snap.total_bytes() == tot["current"]
    peak = t.peak_snapshot(0)
    assert len(peak) == tot["peak_count"] and peak.total_bytes() == tot["peak"] >= tot["current"]
    points = [v for _, dev, v in t.timeline() if dev == 0]
    assert max(points) == tot["peak"]  # a new peak always makes a point
    return tot["allocs"]


class Allocators:
    """Python threads allocating SIZE bytes through the double, keeping every
    8th allocation (the last 256 of them), until stop() (at least `least`
    each); counts exactly what they did."""

    def __init__(self, fake, n, least=2000):
        self.fake, self.least = fake, least
        self.allocs = [0] * n
        self.frees = [0] * n
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i):
        k = 0
        kept = []
        while k < self.least or not self._stop.is_set():
            a = self.fake.alloc(CBID_cuMemAlloc_v2, SIZE)
            self.allocs[i] += 1
            if k % 8:
                self.fake.free(CBID_cuMemFree_v2, a)
                self.frees[i] += 1
            else:
                kept.append(a)
                if len(kept) > 256:  # bounded, so each snapshot stays cheap
                    self.fake.free(CBID_cuMemFree_v2, kept.pop(0))
                    self.frees[i] += 1
            k += 1

    def __enter__(self):
        for th in self.threads:
            th.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        for th in self.threads:
            th.join()


def test_nested_trackers_start_stop_and_read_while_threads_allocate(fake):
    """An outer tracker counts every allocation exactly while, in two other
    threads, nested trackers start, read and stop over and over."""
    cycles = [0, 0]
    errors = []
    done = threading.Event()

    def churn(slot):
        try:
            while not done.is_set():
                with memviz.track(torch=False) as t:
                    t.snapshot()
                    t.peak_snapshot()
                    t.step()
                assert_consistent(t)
                cycles[slot] += 1
                # A real pause: without it the two readers convoy on the GIL (each
                # cycle releases and at once retakes it), and one can starve the
                # other for seconds (seen as [54693, 1] cycles, on the old code too).
                time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    with memviz.track(torch=False) as outer:
        with Allocators(fake, 4) as work:
            readers = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
            for r in readers:
                r.start()
            assert fake.alloc_many_in_native_threads(2, 5000, SIZE) == 0
            deadline = time.monotonic() + 10
            while min(cycles) < 50 and not errors and time.monotonic() < deadline:
                outer.snapshot()
                time.sleep(0.005)
            done.set()
            for r in readers:
                r.join()
    assert not errors, errors[0]
    assert min(cycles) >= 50, cycles
    made, freed = sum(work.allocs), sum(work.frees)
    tot = outer.totals()[0]
    assert (tot["allocs"], tot["frees"]) == (made + 10000, freed + 10000)
    assert tot["current"] == (made - freed) * SIZE and len(outer.snapshot()) == made - freed
    assert assert_consistent(outer) == made + 10000
    assert not fake.is_subscribed() and memviz.active_tracker() is None


def test_top_level_start_stop_races_allocating_threads(fake):
    """Subscribing and unsubscribing while driver calls arrive: every
    tracker's figures add up, and nothing is left subscribed."""
    with Allocators(fake, 3):
        for _ in range(200):
            t = memviz.track(torch=False).start()
            t.snapshot()
            t.stop()
            assert_consistent(t)
    assert not fake.is_subscribed()
    with memviz.track(torch=False) as t:  # and the store is sound afterwards
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert t.totals()[0]["allocs"] == 1 and t.current_bytes() == MiB


def test_nothing_reaches_the_store_after_stop_returns(fake):
    """stop() waits for every recording that saw capture on: with threads
    allocating flat out, the store's counts do not move once it returns
    (recordings in flight are counted per thread, made visible to stop by
    one membarrier, where the kernel has it: src/capture.c)."""
    from memviz import _core

    with Allocators(fake, 3, least=200):
        for _ in range(150):
            t = memviz.track(torch=False).start()
            time.sleep(0.0002)
            t.stop()
            a = _core.stats()
            time.sleep(0.001)
            b = _core.stats()
            assert (a["calls"], a["live"]) == (b["calls"], b["live"])


# ---- in fresh interpreters -------------------------------------------------------------


PRELUDE = """
import json, os, sys, threading, time, warnings
sys.path[:0] = [{root!r}, {tests!r}]
from fake_cupti import FakeCupti
import memviz
f = FakeCupti({fake!r})
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def script(tmp_path, fake_path, body, name="prog.py"):
    path = tmp_path / name
    path.write_text(PRELUDE.format(root=str(ROOT), tests=str(ROOT / "tests"), fake=fake_path)
                    + textwrap.dedent(body))
    return path


def env_for(fake_path):
    e = dict(os.environ, MEMVIZ_CUPTI_LIBRARY=fake_path)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    return e


def result(stdout):
    rows = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert rows, stdout
    return rows[-1]


def assert_trace_replays_to_its_totals(loaded):
    tot = loaded.totals()[0]
    snap = loaded.snapshot()
    assert snap.total_bytes() == tot["current"] and len(snap) == tot["live_count"], tot
    assert loaded.peak_snapshot(0).total_bytes() == tot["peak"], tot
    return tot


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_streaming_a_trace(fake_path, tmp_path):
    """40 children forked while a thread allocates and the writer streams;
    half of them exit through the interpreter (atexit, finalization), half
    with os._exit. None touches the parent's trace, which replays exactly."""
    trace = tmp_path / "run.memviz"
    prog = script(tmp_path, fake_path, f"""
        t = memviz.track(trace={str(trace)!r}, torch=False).start()
        stop = threading.Event()
        made = [0, 0]
        def spin():  # at most 256 live: each child's first tracker copies the parent's store
            ring = []
            while not stop.is_set():
                ring.append(f.alloc({CBID_cuMemAlloc_v2}, {SIZE}))
                made[0] += 1
                if len(ring) > 256:
                    f.free({CBID_cuMemFree_v2}, ring.pop(0))
                    made[1] += 1
                if made[0] % 16 == 0:  # paced: the trace's ring must not overflow on a busy machine
                    time.sleep(0.001)
        th = threading.Thread(target=spin)
        th.start()
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
        codes = []
        for i in range(40):
            pid = os.fork()
            if pid == 0:
                warnings.simplefilter("ignore")
                with memviz.track(torch=False) as c:  # GPU capture off: the parent's CUPTI
                    with memviz.label("child"):
                        f.alloc({CBID_cuMemAlloc_v2}, {SIZE})
                code = 0 if (not c.gpu_enabled and c.totals() == {{}} and "fork()" in c.gpu_off_reason) else 3
                if i % 2:
                    os._exit(code)
                sys.exit(code)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
            time.sleep(0.01)
        stop.set()
        th.join()
        t.stop()
        tot = t.totals()[0]
        out(codes=codes, made=made, allocs=tot["allocs"], frees=tot["frees"], current=tot["current"])
    """)
    p = subprocess.run([sys.executable, str(prog)], env=env_for(fake_path), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    r = result(p.stdout)
    assert r["codes"] == [0] * 40, (r["codes"], p.stderr[-3000:])
    made, freed = r["made"]
    assert (r["allocs"], r["frees"], r["current"]) == (made, freed, (made - freed) * SIZE)
    loaded = memviz.load(trace)
    assert not loaded.truncated and loaded.error is None
    assert loaded.end["dropped_events"] == 0
    tot = assert_trace_replays_to_its_totals(loaded)
    assert (tot["allocs"], tot["frees"]) == (made, freed)
    assert "child" not in {a.label for a in loaded.snapshot()}


def test_interpreter_exit_while_threads_allocate_leaves_a_complete_trace(fake_path, tmp_path):
    """No stop(): atexit stops the tracker while Python and native threads
    still allocate; the trace is complete and replays to its totals."""
    trace = tmp_path / "exit.memviz"
    prog = script(tmp_path, fake_path, f"""
        t = memviz.track(trace={str(trace)!r}, torch=False).start()
        for i in range(50):
            f.lib.fake_alloc({CBID_cuMemAlloc_v2}, 1 << 20, 0, 0)  # EARLY: this line, not the double's
        def spin():  # paced (~10k a second), so the trace's ring cannot overflow on a busy machine
            k = 0
            while True:
                f.free({CBID_cuMemFree_v2}, f.alloc({CBID_cuMemAlloc_v2}, {SIZE}))
                k += 1
                if k % 10 == 0:
                    time.sleep(0.001)
        def native():  # native threads with no Python frames, started over and over
            while True:
                f.alloc_many_in_native_threads(2, 200, {SIZE})
                time.sleep(0.01)
        for _ in range(4):
            threading.Thread(target=spin, daemon=True).start()
        threading.Thread(target=native, daemon=True).start()
        time.sleep(0.6)
        print("bye", flush=True)
    """)
    p = subprocess.run([sys.executable, str(prog)], env=env_for(fake_path), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "bye" in p.stdout, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Fatal" not in p.stderr, p.stderr[-3000:]
    loaded = memviz.load(trace)
    assert not loaded.truncated and loaded.end is not None and loaded.end["dropped_events"] == 0
    tot = assert_trace_replays_to_its_totals(loaded)
    assert tot["allocs"] - tot["frees"] == tot["live_count"] and tot["allocs"] > 10000
    early = [s for s in loaded.snapshot().statistics("lineno") if s.size == 50 * MiB]
    assert early and early[0].count == 50 and early[0].key.filename == str(prog)


VICTIM = """
    for i in range(100):
        f.lib.fake_alloc({alloc}, 1 << 20, 0, 0)  # EARLY: this line, not the double's
    print("ready", flush=True)
    n = 0
    while True:
        a = f.alloc({alloc}, {size})
        n += 1
        if n % 2:
            f.free({free}, a)
        time.sleep(0.0005)
"""


def memviz_run_then(sig, fake_path, tmp_path, wait):
    trace = tmp_path / "run.memviz"
    prog = script(tmp_path, fake_path, VICTIM.format(alloc=CBID_cuMemAlloc_v2, free=CBID_cuMemFree_v2,
                                                     size=SIZE))
    p = subprocess.Popen([sys.executable, "-m", "memviz", "run", "-o", str(trace), str(prog)],
                         cwd=tmp_path, env=env_for(fake_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(wait)
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    return p.returncode, err, trace


def assert_early_allocations(loaded, path):
    early = [s for s in loaded.snapshot().statistics("lineno") if s.size == 100 * MiB]
    assert early and early[0].count == 100 and early[0].key.filename == str(path)


def test_sigint_during_memviz_run_reports_and_completes_the_trace(fake_path, tmp_path):
    rc, err, trace = memviz_run_then(signal.SIGINT, fake_path, tmp_path, 0.3)
    assert rc == 130 and err.count("memviz report:") == 1, err[-3000:]
    loaded = memviz.load(trace)
    assert not loaded.truncated and loaded.end is not None and loaded.end["dropped_events"] == 0
    tot = assert_trace_replays_to_its_totals(loaded)
    assert tot["allocs"] - tot["frees"] == tot["live_count"] >= 100
    assert_early_allocations(loaded, tmp_path / "prog.py")


def test_sigterm_during_memviz_run_leaves_a_loadable_partial_trace(fake_path, tmp_path):
    """SIGTERM has no handler: the process dies without a report, and the
    trace holds everything up to the last flush (every 0.5 s)."""
    rc, err, trace = memviz_run_then(signal.SIGTERM, fake_path, tmp_path, 1.2)
    assert rc == -signal.SIGTERM and "memviz report:" not in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TraceWarning: incomplete
        loaded = memviz.load(trace)
    assert loaded.truncated and loaded.end is None
    tot = loaded.totals()[0]  # replayed from the events
    snap = loaded.snapshot()
    assert snap.total_bytes() == tot["current"] and len(snap) == tot["allocs"] - tot["frees"]
    assert tot["allocs"] > 100  # later allocations reached the file too
    assert_early_allocations(loaded, tmp_path / "prog.py")
