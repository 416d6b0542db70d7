"""SIGUSR1 against the flight recorder: it never dumps inside its handler
(no deadlock, no nesting), its dumps coalesce and are rate-limited, a failed
dump is said once and never raises, the dump's report does not contradict
itself, and stale temporary files of killed dumps are removed (never a live
one's).

What could hang runs in a child process under a generous timeout, which
only detects the hang; nothing here measures time.
"""

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import memviz
import memviz.trace.flight as flight
from conftest import HANG, child_env, complete
from fake_cupti import CBID_cuMemAlloc_v2
from memviz import _output_files
from memviz.report.summary import flight_sentences

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def wait_for(cond, what):
    deadline = time.monotonic() + HANG
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {HANG} s")
        time.sleep(0.01)


def run_child(tmp_path, code, fake_path, *args):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    try:
        return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=child_env(fake_path),
                              capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung: {e.stderr!r}")


# ---- 1. SIGUSR1 during a dump: no deadlock ----------------------------------------------


def test_sigusr1_during_a_dump_does_not_deadlock_on_a_librarys_lock(fake_path, tmp_path):
    """The dump holds a non-reentrant lock, as pynvml's nvmlInit does, when
    SIGUSR1 comes: the handler must not dump (it would wait for that lock
    forever, in the thread that holds it)."""
    p = run_child(tmp_path, """
        import os, signal, sys, threading, time
        import memviz, memviz.trace.flight as flight
        held = threading.Lock()  # as pynvml's library lock: not reentrant
        real, sent = flight._outside, []
        def outside():
            with held:
                if not sent:
                    sent.append(1)
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(0.2)  # the main thread's handler runs here
                return real()
        flight._outside = outside
        with memviz.track(flight_recorder="16 MiB", flight_dir=sys.argv[1], gpu=False, torch=False) as t:
            t.dump()
            deadline = time.monotonic() + 60
            while len(t.flight_recorder.dumps) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        print([memviz.load(p).end["flight_recorder"]["reason"] for p in t.flight_recorder.dumps])
    """, fake_path, str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['tracker.dump()', 'SIGUSR1']", p.stdout + p.stderr


# ---- 2. a storm of SIGUSR1 ---------------------------------------------------------------


def test_a_sigusr1_storm_with_stderr_blocked_neither_hangs_nor_raises(fake_path, tmp_path):
    """SIGUSR1 every millisecond from another process while the program
    allocates and recurses, its stderr a pipe nobody reads (writes block once
    64 KiB are in it): the program ends normally, with one dump or two."""
    (tmp_path / "dumps").mkdir()
    script = tmp_path / "storm.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import memviz
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
        fake = FakeCupti()
        folder, stop = sys.argv[1], sys.argv[2]
        def deep(n):
            return 0 if n == 0 else 1 + deep(n - 1)
        n = 0
        with memviz.track(flight_recorder="16 MiB", flight_dir=folder, torch=False) as t:
            print("ready", flush=True)
            while not os.path.exists(stop):
                fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 4096 + n % 512))
                deep(sys.getrecursionlimit() - 100)  # the program's own deep line
                n += 1
        print("done", n, len(t.flight_recorder.dumps), flush=True)
    """))
    stop = tmp_path / "stop"
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "dumps"), str(stop)], cwd=tmp_path,
                         env=child_env(fake_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        for _ in range(3000):
            if p.poll() is not None:
                break
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.001)
        stop.touch()
        try:
            p.wait(timeout=HANG)  # stderr still unread: a child that floods it blocks here
        except subprocess.TimeoutExpired:
            pytest.fail("the program hung under the SIGUSR1 storm")
        out, err = p.stdout.read().decode(), p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == 0, err[-3000:]
    done = out.split()
    assert done[:1] == ["done"] and int(done[1]) > 0, out + err[-3000:]
    dumps = int(done[2])
    assert 1 <= dumps <= 2, err[-3000:]  # coalesced, then rate-limited
    assert len(os.listdir(tmp_path / "dumps")) == dumps  # no temporary file left
    assert "Traceback" not in err and "could not write" not in err, err[-3000:]
    assert err.count("written to") == dumps and err.count("at most one dump a minute") <= 1, err


def test_signals_during_a_dump_ask_for_one_more_dump(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(flight, "_SIGNAL_DUMP_GAP_S", 0.0, raising=False)  # coalescing alone
    real, calls = flight._outside, []

    def outside():
        calls.append(1)
        if len(calls) == 1:
            for _ in range(5):  # five signals while the first dump is written
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.02)
        return real()
    monkeypatch.setattr(flight, "_outside", outside)
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: len(t.flight_recorder.dumps) >= 2, "the second dump")
        time.sleep(0.5)  # room for a third, which must not come
        dumps = list(t.flight_recorder.dumps)
    assert [complete(p).end["flight_recorder"]["reason"] for p in dumps] == ["SIGUSR1"] * 2


def test_sigusr1_dumps_are_rate_limited(fake, tmp_path, capsys):
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: t.flight_recorder.dumps, "the first dump")
        for _ in range(4):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)
        dumps = list(t.flight_recorder.dumps)
    assert len(dumps) == 1 and os.listdir(tmp_path) == [os.path.basename(dumps[0])]
    err = capsys.readouterr().err
    assert err.count("at most one dump a minute") == 1, err


def test_a_dump_that_cannot_be_written_is_said_once_and_never_raises(fake, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "dumps"
    folder.mkdir()
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(folder), torch=False) as t:
        folder.rmdir()  # every dump fails from now on
        for _ in range(5):
            assert t.flight_recorder.dump_quietly("test") is None
        err = capsys.readouterr().err
        assert err.count("could not write its dump") == 1, err

        class Broken:
            def write(self, text):
                raise BrokenPipeError(32, "Broken pipe")

            flush = write
        with monkeypatch.context() as m:
            m.setattr(flight, "_WARN_GAP_S", 0.0)
            m.setattr(sys, "stderr", Broken())
            assert t.flight_recorder.dump_quietly("test") is None  # stderr gone: no exception either
    assert t.flight_recorder.dumps == []


# ---- 9. the dump's report does not contradict itself ------------------------------------


class _Dump:
    def __init__(self, **fr):
        self.end = {"flight_recorder": dict({"reason": "SIGUSR1", "budget": 16 * MiB, "events_kept": 10,
                                             "events_folded": 0, "events_dropped": 0}, **fr)}


def test_a_dump_with_lost_events_does_not_say_it_covers_everything(fake, tmp_path, request):
    # the smallest ring (1,024 events) against 4,000,000 events, drained at most every 2 ms: the
    # loop would have to run below 0.5 M events/s for none to be lost (the 16 MiB budget's own
    # 52,000-event ring was drained in time on CI's machine)
    memviz._core._flight_test_sizes(1024, 0)
    request.addfinalizer(lambda: memviz._core._flight_test_sizes(0, 0))
    text = " ".join(flight_sentences(_Dump(events_dropped=5170885)))
    assert "whole recording" not in text and "5,170,885 events were lost" in text, text
    assert "covers the whole recording" in " ".join(flight_sentences(_Dump()))
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc_free_loop(2_000_000)  # faster than the ring drains: events lost
        memviz._core.trace_writer_flush()
        path = t.dump()
    trace = complete(path)
    assert trace.end["flight_recorder"]["events_dropped"] > 0
    from memviz.report.text import text_report
    text = " ".join(text_report(trace).split())
    assert "whole recording" not in text and "events were lost because the capture ring was full" in text


# ---- 14. temporary files of killed dumps ------------------------------------------------


def _age(path, seconds=3600):
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_stale_temporary_files_are_removed_and_live_ones_kept(tmp_path):
    stale, fresh, held, other = (tmp_path / n for n in (".a.memviz.1a2b.memviz-tmp", ".b.memviz.3c4d.memviz-tmp",
                                                        ".c.memviz.5e6f.memviz-tmp", "a.memviz-tmp"))
    for p in (stale, fresh, held, other):
        p.write_bytes(b"MVZ")
    (tmp_path / ".link.memviz-tmp").symlink_to(stale)
    (tmp_path / ".dir.memviz-tmp").mkdir()
    for p in (stale, held, other, tmp_path / ".dir.memviz-tmp"):
        _age(p)
    fd = os.open(held, os.O_WRONLY)  # a live writer holds its lock
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert _output_files.remove_stale_temps(str(tmp_path)) == [str(stale)]
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([".b.memviz.3c4d.memviz-tmp", ".c.memviz.5e6f.memviz-tmp",
                                                   "a.memviz-tmp", ".link.memviz-tmp", ".dir.memviz-tmp"])
    assert _output_files.remove_stale_temps(str(tmp_path / "nowhere")) == []


def test_a_dump_killed_midway_leaves_a_file_the_next_recorder_removes(fake_path, fake, tmp_path):
    """SIGKILL in the middle of a dump leaves its hidden temporary file:
    kept while its process lives (however old it looks), removed by the next
    recorder once the process is dead."""
    (tmp_path / "dumps").mkdir()
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import memviz, memviz._core as core
        def stuck(*a):
            print("dumping", flush=True)
            time.sleep(600)  # killed here, the temporary file half written
        core.trace_writer_frozen_write = stuck  # the events, after the header went in
        with memviz.track(flight_recorder="16 MiB", flight_dir=sys.argv[1], gpu=False, torch=False) as t:
            t.dump()
    """))
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "dumps")], cwd=tmp_path,
                         env=child_env(fake_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"dumping\n", p.stderr.read()
        [tmp] = os.listdir(tmp_path / "dumps")
        assert tmp.startswith(".memviz-flight-") and tmp.endswith(".memviz-tmp")
        _age(tmp_path / "dumps" / tmp)
        with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path / "dumps"), torch=False) as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            first = t.dump()
        assert tmp in os.listdir(tmp_path / "dumps")  # its writer lives: kept
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()
    _age(tmp_path / "dumps" / tmp)
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path / "dumps"), torch=False):
        pass
    assert os.listdir(tmp_path / "dumps") == [os.path.basename(first)]
