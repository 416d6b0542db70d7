"""Ctrl-C while tracking stops: stop() survives KeyboardInterrupt at any
point (nothing is left running, the next tracker works), a Ctrl-C while the
trace closes waits for its end, and `memviz run` survives a second Ctrl-C
while it stops.

What could hang runs in a child process under a generous timeout, which
only detects the hang; nothing here measures time.
"""

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import memviz
import memviz.trace.flight as flight
import memviz.trace.writer as writer
from conftest import HANG, child_env, complete
from fake_cupti import CBID_cuMemAlloc_v2
from memviz.trace import format as F

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


# ---- 3. KeyboardInterrupt inside stop() -------------------------------------------------


class _JoinInterrupted:
    """A thread whose join() is cut short by Ctrl-C (after the thread ended)."""

    def __init__(self, thread):
        self.thread = thread

    def join(self, timeout=None):
        self.thread.join(timeout)
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.thread, name)


def _holds_open(path):
    path = os.path.realpath(path)
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.path.realpath(f"/proc/self/fd/{fd}") == path:
                return True
        except OSError:
            pass
    return False


def _next_trackers_work(fake, tmp_path):
    """A new trace and a new flight recorder start and write whole files."""
    path = str(tmp_path / "after.memviz")
    with memviz.track(trace=path, torch=False):
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert complete(path).event_count >= 1
    with memviz.track(flight_recorder="16 MiB", flight_dir=str(tmp_path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        assert complete(t.dump()).event_count >= 1


@pytest.mark.parametrize("where", ["trace: joining its thread", "trace: before the END",
                                   "flight: joining its thread", "flight: giving SIGUSR1 back",
                                   "tracker: before the plugins"])
def test_keyboard_interrupt_inside_stop_leaves_nothing_running(fake, tmp_path, monkeypatch, where):
    kind = where.split(":")[0]
    path = str(tmp_path / "run.memviz")
    opts = {"trace": path} if kind == "trace" else {"flight_recorder": "16 MiB", "flight_dir": str(tmp_path)}
    sigusr1 = signal.getsignal(signal.SIGUSR1)
    t = memviz.track(torch=False, **opts).start()
    fake.alloc(CBID_cuMemAlloc_v2, MiB)
    plugin = t.subscribers[-1]
    with monkeypatch.context() as m:
        if "joining" in where:
            m.setattr(plugin, "_thread", _JoinInterrupted(plugin._thread))
        elif where == "trace: before the END":
            m.setattr(writer, "_outside", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
        elif where == "flight: giving SIGUSR1 back":
            real, raised = plugin._restore_signal, []

            def restore():
                if not raised:
                    raised.append(1)
                    raise KeyboardInterrupt
                real()
            m.setattr(plugin, "_restore_signal", restore)
        else:
            m.setattr(memviz.capture.threads, "note_running_threads",
                      lambda: (_ for _ in ()).throw(KeyboardInterrupt))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", F.TraceWarning)  # a file cut short says so
            with pytest.raises(KeyboardInterrupt):
                t.stop()
    assert not t.running and memviz.active_tracker() is None
    assert not memviz._core.trace_writer_stats()["running"]
    assert signal.getsignal(signal.SIGUSR1) == sigusr1
    if kind == "trace":
        assert not _holds_open(path)
        if where == "trace: joining its thread":
            assert complete(path).event_count >= 1  # the END was still written
    _next_trackers_work(fake, tmp_path)


# ---- KeyboardInterrupt while a trace or flight recorder starts ----------------------------


@pytest.mark.parametrize("how", ["raised", "signal", "signal, then an error"])
@pytest.mark.parametrize("where", ["trace: its native writer started", "trace: its thread started",
                                   "flight: its native writer started", "flight: SIGUSR1 taken"])
def test_keyboard_interrupt_inside_start_leaves_nothing_running(fake, tmp_path, monkeypatch, where, how):
    """A Ctrl-C landing while track(trace=...) or a flight recorder starts
    left the native writer running (the subscriber's cleanup caught only
    OSError, and the session's rollback stops only subscribers that had
    started): every later trace and flight recorder of the process was
    refused ("Device or resource busy", "another tracker's trace or flight
    recorder is running"). Found by a stress run with
    _thread.interrupt_main() at random moments (7 runs in 7). `raised`: the
    KeyboardInterrupt comes out of the call; `signal`: a real SIGINT there,
    held until the subscriber is on the started list, then raised;
    `signal, then an error`: the SIGINT is held while the start fails, and
    comes out of the rollback's stop, which still finishes."""
    import threading

    kind, point = where.split(": ")
    path = str(tmp_path / "run.memviz")
    opts = {"trace": path} if kind == "trace" else {"flight_recorder": "16 MiB", "flight_dir": str(tmp_path)}
    sigusr1 = signal.getsignal(signal.SIGUSR1)
    target = {"its native writer started": (memviz._core, "trace_writer_start"),
              "its thread started": (threading.Thread, "start"),
              "SIGUSR1 taken": (flight.FlightRecorder, "_install_signal")}[point]
    real = getattr(*target)

    def then_interrupt(*args, **kwargs):
        out = real(*args, **kwargs)
        if how != "raised":
            os.kill(os.getpid(), signal.SIGINT)
        if how != "signal":
            raise KeyboardInterrupt if how == "raised" else RuntimeError("a failed start")
        return out

    with monkeypatch.context() as m:
        m.setattr(*target, then_interrupt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", F.TraceWarning)
            with pytest.raises(KeyboardInterrupt):
                memviz.track(torch=False, **opts).start()
    assert memviz.active_tracker() is None
    assert not memviz._core.trace_writer_stats()["running"]
    assert signal.getsignal(signal.SIGUSR1) == sigusr1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not _holds_open(path)
    _next_trackers_work(fake, tmp_path)


def test_a_ctrl_c_while_the_trace_closes_waits_for_the_end(fake, tmp_path, monkeypatch):
    """A real SIGINT in the middle of writing the END: held until the file is
    whole and closed, then raised."""
    path = str(tmp_path / "run.memviz")
    real = writer._outside

    def outside():
        os.kill(os.getpid(), signal.SIGINT)
        return real()
    t = memviz.track(trace=path, torch=False).start()
    fake.alloc(CBID_cuMemAlloc_v2, MiB)
    monkeypatch.setattr(writer, "_outside", outside)
    with pytest.raises(KeyboardInterrupt):
        t.stop()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not _holds_open(path) and not memviz._core.trace_writer_stats()["running"]
    trace = complete(path)
    assert trace.end is not None and trace.snapshot().allocations[0].size == MiB


def test_memviz_run_survives_a_second_ctrl_c_while_it_stops(fake_path, tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import os, signal
        import memviz.trace.writer as w
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        held = FakeCupti().alloc(CBID_cuMemAlloc_v2, 1 << 20)
        real = w._outside
        def outside():
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while memviz closes the trace
            return real()
        w._outside = outside
        raise KeyboardInterrupt  # the first
    """))
    try:
        p = subprocess.run([sys.executable, "-m", "memviz", "run", "-o", "run.memviz", "train.py"], cwd=tmp_path,
                           env=child_env(fake_path), capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"memviz run hung: {e.stderr!r}")
    assert p.returncode == 130, p.stderr
    assert "writer.py" not in p.stderr and p.stderr.count("Traceback") == 1, p.stderr
    assert "trace written to" in p.stderr
    assert complete(str(tmp_path / "run.memviz")).snapshot().allocations[0].size == MiB
