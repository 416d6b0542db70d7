"""The flight recorder (memviz/trace/flight.py, src/trace_writer.c's memory
sink): bounded memory, dumps that are whole traces, and every trigger."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import memviz
import memviz.trace.flight as flight
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.capture.events import OOM, Trigger
from memviz.trace import format as F

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", F.TraceWarning)  # a dump is a complete trace
        return memviz.load(path)


def live_set(snap):
    return sorted((a.address, a.size, a.seq) for a in snap.allocations)


def test_a_dump_is_a_complete_trace_with_the_live_set_and_its_lines(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with memviz.track(flight_recorder="32 MiB", flight_dir=str(tmp_path), torch=False) as t:
        kept = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)  # marker: kept
        for i in range(2000):
            fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 4096 + i))
        path = t.dump()
        truth = live_set(t.snapshot())
    assert os.path.dirname(path) == str(tmp_path)
    name = os.path.basename(path)
    assert name.startswith("memviz-flight-") and f"-pid{os.getpid()}-rank3" in name
    trace = load(path)
    assert live_set(trace.snapshot()) == truth
    assert trace.peak_bytes() == 5 * MiB + 4096 + 1999
    fr = trace.end["flight_recorder"]
    assert fr["reason"] == "tracker.dump()" and fr["events_folded"] == 0
    assert fr["events_kept"] == 4001
    assert t.flight_recorder.dumps == [path]
    assert trace.meta["mode"] == "flight" and trace.meta["ranks"]["rank"] == 3
    text = subprocess.run([sys.executable, "-m", "memviz", "report", path], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert "Flight-recorder dump (tracker.dump())" in text and "covers the whole recording" in text


@pytest.fixture
def small_chunks():
    """Room for 256 KiB of chunks, whatever the budget (the C core's test
    sizes, _core._flight_test_sizes; put back after the test)."""
    memviz._core._flight_test_sizes(0, 256 * 1024)
    yield
    memviz._core._flight_test_sizes(0, 0)


def test_the_budget_is_split_in_c_between_the_ring_the_take_buffer_and_the_chunks():
    """_core.flight_split: a fifth of the budget is the capture ring (16,384
    to 1,048,576 events of the ring's record), the writer's take buffer is a
    chunk of 65,536 of them, and the chunks and their base get the rest."""
    raw = memviz._core.RAW_EVENT_SIZE
    assert flight.MIN_BUDGET == memviz._core.FLIGHT_MIN_BUDGET == 16 << 20
    for budget, ring in ((16 << 20, (16 << 20) // 5 // raw), (1 << 40, 1 << 20)):
        got = memviz._core.flight_split(budget)
        fixed = ring * raw + 65536 * raw
        assert got == (ring, budget - fixed, fixed)
    with pytest.raises(ValueError, match=f"at least {flight.MIN_BUDGET} bytes, not {flight.MIN_BUDGET - 1}"):
        memviz._core.flight_split(flight.MIN_BUDGET - 1)
    memviz._core._flight_test_sizes(1024, 4096)
    try:
        assert memviz._core.flight_split(1 << 30) == (1024, 4096, 1024 * raw + 65536 * raw)
    finally:
        memviz._core._flight_test_sizes(0, 0)
    assert memviz._core.flight_split(1 << 28)[0] == (1 << 28) // 5 // raw


def test_old_events_fold_into_the_live_set_and_memory_stays_in_the_budget(fake, tmp_path, small_chunks):
    """With room for a few chunks only, the oldest are folded away: the dump
    still has every allocation live at its start (dated when made, with its
    line), the window starts late, and live sets agree with the tracker's at
    the end and at a time inside the window."""
    rng = random.Random(7)
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        early = fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
        early_seq = next(a.seq for a in t.snapshot().allocations if a.address == early)
        doomed = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)  # made early, freed inside the window
        live = []
        for round_ in range(12):
            for _ in range(20000):  # random sizes: chunks that compress poorly
                live.append(fake.alloc(CBID_cuMemAlloc_v2, rng.randrange(1, 1 << 20)))
                if len(live) > 50:
                    fake.free(CBID_cuMemFree_v2, live.pop(rng.randrange(len(live))))
            # drained here, not left to the writer thread: 40,000 events a round fit the ring,
            # but on a loaded machine the thread may come too late, and a lost free is a
            # different live set (tests/integration/test_flight_signals.py covers lost events)
            memviz._core.trace_writer_flush()
        memviz._core.trace_writer_flush()
        stats = t.flight_recorder.stats()
        mid_ns = time.monotonic_ns()
        mid = live_set(t.snapshot())
        fake.free(CBID_cuMemFree_v2, doomed)
        for _ in range(5000):
            live.append(fake.alloc(CBID_cuMemAlloc_v2, rng.randrange(1, 1 << 20)))
            fake.free(CBID_cuMemFree_v2, live.pop(0))
        path = t.dump()
        truth = live_set(t.snapshot())
        current = t.current_bytes()
    assert stats["folded_events"] > 100_000, stats
    assert stats["kept_bytes"] <= 256 * 1024 + 2 * MiB  # the budget, and the newest chunk always kept
    trace = load(path)
    fr = trace.end["flight_recorder"]
    assert fr["events_folded"] > 100_000 and fr["allocations_before_window"] >= 2
    assert fr["window_start_ns"] > t.started_ns
    assert live_set(trace.snapshot()) == truth
    assert trace.current_bytes() == current
    assert live_set(trace.snapshot(at_ns=mid_ns)) == mid  # doomed: live then, freed in the window
    first = next(a for a in trace.snapshot().allocations if a.address == early)
    assert first.seq == early_seq and first.size == 3 * MiB
    assert first.traceback and first.traceback.user_frame.filename.endswith("test_flight.py")
    text = " ".join(subprocess.run([sys.executable, "-m", "memviz", "report", path], capture_output=True,
                                   text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.split())
    assert f"The {fr['events_folded']:,} events before them" in text


def test_memory_stays_within_the_budget(fake, tmp_path):
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc_free_loop(2_000_000)
        memviz._core.trace_writer_flush()
        s = t.flight_recorder.stats()
    # A C loop makes events far faster than any program (10 million a second):
    # what the ring had no room for is counted, never kept beyond the budget.
    assert s["events"] + s["dropped_events"] >= 4_000_000 and s["memory"] <= 16 * MiB, s


def test_an_exception_leaving_track_writes_a_dump(fake, tmp_path, capsys):
    with pytest.raises(KeyError):
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            raise KeyError("boom")
    [path] = t.flight_recorder.dumps
    assert load(path).end["flight_recorder"]["reason"] == "KeyError left memviz.track()"
    assert f"written to {path}" in capsys.readouterr().err


def test_sigusr1_writes_a_dump_and_keeps_the_programs_own_handler(fake, tmp_path):
    seen = []

    def mine(signum, frame):
        seen.append(signum)
    old = signal.signal(signal.SIGUSR1, mine)
    try:
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 60
            while not t.flight_recorder.dumps and time.monotonic() < deadline:
                time.sleep(0.01)  # the recorder's thread writes it, not the handler
            [path] = t.flight_recorder.dumps
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is mine  # given back when tracking stopped
        assert load(path).end["flight_recorder"]["reason"] == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_sigusr1_handler_the_program_installs_while_recording_stays_after_stop(fake, tmp_path):
    """stop() put back the handler from before the tracker (SIG_DFL) over one
    the program installed meanwhile (a framework's "save a checkpoint"
    handler): the program's next SIGUSR1 killed it. memviz's handler is put
    back only while it is still SIGUSR1's."""
    seen = []

    def mine(signum, frame):
        seen.append(signum)
    old = signal.getsignal(signal.SIGUSR1)
    try:
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False):
            signal.signal(signal.SIGUSR1, mine)
        assert signal.getsignal(signal.SIGUSR1) is mine
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
        # and, not replaced, memviz's own is taken out as before
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False):
            assert signal.getsignal(signal.SIGUSR1) is not mine
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_failed_driver_call_writes_a_dump_naming_the_line(fake, tmp_path):
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=2)  # marker: refused
        deadline = time.monotonic() + 5
        while not t.flight_recorder.dumps and time.monotonic() < deadline:
            time.sleep(0.05)
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=2)  # a second one soon after: no new dump
        time.sleep(0.6)
    [path] = t.flight_recorder.dumps
    trace = load(path)
    assert trace.end["flight_recorder"]["reason"] == "a driver allocation call failed"
    [failure] = trace.failures
    assert failure.size == 80 << 30 and failure.traceback.user_frame.filename.endswith("test_flight.py")


def test_dump_without_a_recorder_says_what_to_do(fake):
    with memviz.track(torch=False) as t:
        with pytest.raises(memviz.NotTracking, match="flight_recorder="):
            t.dump()


def test_dump_after_stop_or_in_a_forked_child_says_why_not(fake, tmp_path):
    """A tracker with a recorder that no longer records says so (stopped, or
    the parent's in a fork()ed child), never "start it with a recorder"; the
    recorder stopped by another thread between the tracker's check and its
    own says the same, as NotTracking (it raised TraceError)."""
    t = memviz.track(torch=False, flight_recorder="16 MiB", flight_dir=str(tmp_path)).start()
    rec = t.flight_recorder
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            t.dump(str(tmp_path / "child.memviz"))
            msg = "no error"
        except memviz.NotTracking as e:
            msg = str(e)
        except BaseException as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    child = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        child += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert "fork()ed child" in child.decode() and "parent" in child.decode(), child
    t.stop()
    with pytest.raises(memviz.NotTracking, match="has stopped") as e:
        t.dump()
    assert "flight_recorder=" not in str(e.value)
    with pytest.raises(memviz.NotTracking, match="has stopped"):
        rec.dump()  # the race: the tracker said running, the recorder had stopped
    assert not (tmp_path / "child.memviz").exists()


def test_options_are_checked(tmp_path):
    for kw, match in [({"flight_recorder": "1 MiB"}, "at least 16 MiB"),
                      ({"flight_recorder": "lots"}, "memory budget"),
                      ({"flight_recorder": "64 MiB", "trace": str(tmp_path / "x")}, "not both"),
                      ({"flight_dir": str(tmp_path)}, "give flight_recorder")]:
        with pytest.raises(memviz.InvalidArgument, match=match):
            memviz.track(**kw)
    (tmp_path / "a_file").write_text("kept")
    with pytest.raises(memviz.TraceError, match="not a folder"):
        memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path / "a_file"), torch=False, gpu=False).start()
    assert memviz.active_tracker() is None


def test_a_missing_flight_dir_is_made_with_its_parents(fake, tmp_path):
    folder = tmp_path / "dumps" / "today"
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(folder), torch=False) as t:
        assert folder.is_dir()
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        path = t.dump()
    assert os.path.dirname(path) == str(folder) and len(load(path).snapshot()) == 1


def test_a_flight_dir_that_is_not_a_folder_is_refused_saying_what_to_do(tmp_path):
    (tmp_path / "a_file").write_text("kept")
    os.symlink(tmp_path / "gone", tmp_path / "broken_link")
    for name in ("a_file", "broken_link"):
        with pytest.raises(memviz.TraceError) as e:
            memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path / name), torch=False, gpu=False).start()
        msg = str(e.value)
        assert name in msg and "exists and is not a folder" in msg, msg
        assert "What to do: give flight_dir= (or --flight-dir) a folder" in msg, msg
        assert memviz.active_tracker() is None
    assert (tmp_path / "a_file").read_text() == "kept" and not (tmp_path / "gone").exists()
    with pytest.raises(memviz.TraceError) as e:  # under a file: it cannot be made
        memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path / "a_file" / "sub"), torch=False,
                     gpu=False).start()
    assert "could not be made: Not a directory" in str(e.value) and "What to do: " in str(e.value)
    assert memviz.active_tracker() is None


def _run(tmp_path, *args, fake_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               MEMVIZ_CUPTI_LIBRARY=fake_path)
    return subprocess.run([sys.executable, "-m", "memviz", "run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_memviz_run_dumps_when_the_script_raises(fake_path, tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        fake = FakeCupti()
        held = fake.alloc(CBID_cuMemAlloc_v2, 96 << 20)  # the line
        raise RuntimeError("out of patience")
    """))
    (tmp_path / "dumps").mkdir()
    p = _run(tmp_path, "--flight-recorder", "32MiB", "--flight-dir", "dumps", "train.py", fake_path=fake_path)
    assert p.returncode == 1, p.stderr
    [name] = os.listdir(tmp_path / "dumps")
    assert "RuntimeError raised by the script" in p.stderr and name in p.stderr
    assert p.stderr.index("flight recorder dump") < p.stderr.index("Traceback")
    trace = load(str(tmp_path / "dumps" / name))
    [a] = trace.snapshot().allocations
    assert a.size == 96 << 20 and any(f.filename.endswith("train.py") and f.lineno == 4 for f in a.traceback)
    made = _run(tmp_path, "--flight-recorder", "32MiB", "--flight-dir", "new/dumps", "train.py", fake_path=fake_path)
    assert made.returncode == 1, made.stderr
    [name] = os.listdir(tmp_path / "new" / "dumps")  # the missing folder was made, with its parent
    assert name in made.stderr and len(load(str(tmp_path / "new" / "dumps" / name)).snapshot()) == 1
    (tmp_path / "a_file").write_text("kept")
    refused = _run(tmp_path, "--flight-recorder", "32MiB", "--flight-dir", "a_file", "train.py",
                   fake_path=fake_path)
    assert refused.returncode == 2 and "out of patience" not in refused.stderr  # the script did not run
    assert "a_file" in refused.stderr and "exists and is not a folder" in refused.stderr
    assert "What to do: give flight_dir= (or --flight-dir) a folder" in refused.stderr
    assert (tmp_path / "a_file").read_text() == "kept"
    bad = _run(tmp_path, "--flight-recorder", "32MiB", "-o", "x.memviz", "train.py", fake_path=fake_path)
    assert bad.returncode == 2 and "not both" in bad.stderr
    tiny = _run(tmp_path, "--flight-recorder", "1KiB", "train.py", fake_path=fake_path)
    assert tiny.returncode == 2 and "at least 16 MiB" in tiny.stderr


def test_failures_before_the_recorder_started_cause_no_dump(fake, tmp_path):
    with memviz.track(torch=False):
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=2)  # the outer tracker's failure
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as inner:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            time.sleep(0.7)
    assert inner.flight_recorder.dumps == [] and os.listdir(tmp_path) == []


def test_a_writer_thread_that_cannot_start_is_a_clear_error(fake, tmp_path, monkeypatch):
    import errno

    def refuse(*a):
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    with monkeypatch.context() as m:
        m.setattr(memviz._core, "trace_writer_start", refuse)
        with pytest.raises(memviz.TraceError, match="could not start its writer thread"):
            memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False).start()
    assert memviz.active_tracker() is None
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        assert len(memviz.load(t.dump()).snapshot()) == 1


def test_an_out_of_memory_dump_is_frozen_at_the_failure_and_written_off_the_failing_thread(
        fake, tmp_path, monkeypatch, small_chunks):
    """on_failure (PyTorch's out-of-memory hook) freezes the dump on the
    failing thread and the recorder's thread writes it. What the program does
    after the freeze is not in it, even when the recorder folds away the very
    chunks the frozen dump holds before it is written (they stay until it
    is), and the failing thread waits at most _FAILURE_WAIT_S for the file."""
    monkeypatch.setattr(flight, "_FAILURE_WAIT_S", 0.0)
    rng = random.Random(3)
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fr = t.flight_recorder
        kept = [fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB + i) for i in range(3)]
        live = []
        for i in range(60000):
            live.append(fake.alloc(CBID_cuMemAlloc_v2, rng.randrange(1, 1 << 20)))
            if len(live) > 40:
                fake.free(CBID_cuMemFree_v2, live.pop(rng.randrange(len(live))))
            if i % 20000 == 19999:
                memviz._core.trace_writer_flush()
        memviz._core.trace_writer_flush()
        truth = live_set(t.snapshot())
        with fr._lock:  # the recorder's thread cannot write the dump until this block ends
            fr.on_failure(t, Trigger(OOM, "a planted out-of-memory error"))  # its time: benchmarks/bench_bounds.py (flight)
            assert fr.dumps == [] and len(fr._jobs) == 1
            target = fr._jobs[0].target
            assert not os.path.exists(target)  # not written yet: the failing thread did not wait
            frozen = fr.stats()
            after = fake.alloc(CBID_cuMemAlloc_v2, 7 * MiB + 1)  # after the failure: not in the dump
            for i in range(90000):  # the recorder folds every chunk the frozen dump holds
                live.append(fake.alloc(CBID_cuMemAlloc_v2, rng.randrange(1, 1 << 20)))
                fake.free(CBID_cuMemFree_v2, live.pop(0))
                if i % 20000 == 19999:  # drained here: on a loaded machine the thread may come late
                    memviz._core.trace_writer_flush()
            memviz._core.trace_writer_flush()
            now = fr.stats()
            assert now["folded_events"] - frozen["folded_events"] >= frozen["kept_events"] > 0, (frozen, now)
        assert fr.wait_for_dumps(timeout=30)
        assert fr.dumps == [target] and fr.error is None
        fake.free(CBID_cuMemFree_v2, after)
        for k in kept:
            fake.free(CBID_cuMemFree_v2, k)
    trace = load(target)
    assert trace.end["flight_recorder"]["reason"] == "a planted out-of-memory error"
    assert live_set(trace.snapshot()) == truth
    assert all(a.size != 7 * MiB + 1 for a in trace.snapshot().allocations)
    assert sorted(a.size for a in trace.snapshot().allocations if a.size >= 3 * MiB) == \
        [3 * MiB, 3 * MiB + 1, 3 * MiB + 2]


def test_the_recorder_stop_writes_a_frozen_dump_still_waiting(fake, tmp_path, monkeypatch):
    """A dump frozen at an out-of-memory error that the recorder's thread has
    not written when tracking stops (the program ends on the error) is
    written before the recorder's memory goes: nothing is lost at exit."""
    monkeypatch.setattr(flight, "_FAILURE_WAIT_S", 0.0)
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fr = t.flight_recorder
        x = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
        with fr._lock:
            fr.on_failure(t, Trigger(OOM, "the last error"))
            [job] = fr._jobs
        fake.free(CBID_cuMemFree_v2, x)
    assert fr.dumps == [job.target] and job.done.is_set()
    assert load(job.target).end["flight_recorder"]["reason"] == "the last error"
