"""The capture session (memviz/capture/session.py): one per process; its
event interface tells subscribers start, step, failure, freeze and stop in
order; a tracker's options are checked once and frozen; nesting and fork()
still behave; precise mode is read in one place."""

import dataclasses
import gc
import subprocess
import sys
import textwrap
import weakref

import pytest

import memviz
from conftest import ROOT
from memviz import tracker as _tracker
from memviz.analysis import rules
from memviz.capture import events as E, session as S
from memviz.capture.options import CaptureOptions


class Recorder(E.CaptureEvents):
    """A subscriber that notes what it hears, into a list shared with others."""

    def __init__(self, name, heard):
        self.name, self.heard = name, heard

    def on_start(self, tracker):
        self.heard.append((self.name, "start"))

    def on_step(self, tracker, record):
        self.heard.append((self.name, "step", record.index))

    def on_failure(self, tracker, trigger):
        self.heard.append((self.name, "failure", trigger.kind))
        return None

    def on_freeze(self, tracker):
        self.heard.append((self.name, "freeze"))

    def on_stop(self, tracker):
        self.heard.append((self.name, "stop"))


@pytest.fixture
def subscribed(monkeypatch):
    """Trackers started in the test get two Recorders, a then b, subscribed
    as they start (where the trace writer and the flight recorder are)."""
    heard = []
    original = _tracker.Tracker._attach

    def attach(self, session):
        original(self, session)
        session.subscribe(self, Recorder("a", heard))
        session.subscribe(self, Recorder("b", heard))

    monkeypatch.setattr(_tracker.Tracker, "_attach", attach)
    return heard


def test_there_is_one_session_per_process():
    session = S.current()
    assert S.current() is session and _tracker._session is session
    with pytest.raises(RuntimeError, match="one capture session per process"):
        S.CaptureSession()
    assert S.current() is session


def test_a_stopped_tracker_is_not_kept_by_the_session():
    t = memviz.track(gpu=False, torch=False)
    with t:
        gone = weakref.ref(t)
        assert S.current().running() == [t]
    del t
    gc.collect()
    assert gone() is None
    with memviz.track(gpu=False, torch=False):  # the next outermost tracker: nothing to freeze
        pass


def test_the_events_reach_subscribers_in_order(subscribed):
    session = S.current()
    with memviz.track(gpu=False, torch=False) as t:
        assert [type(s).__name__ for s in t.subscribers] == ["Recorder", "Recorder"]
        t.step()
        assert session.failure(t, E.Trigger(E.EXCEPTION, "a test")) is None
    assert subscribed == [("a", "start"), ("b", "start"), ("a", "step", 0), ("b", "step", 0),
                          ("a", "failure", E.EXCEPTION), ("b", "failure", E.EXCEPTION),
                          ("b", "stop"), ("a", "stop")]
    del subscribed[:]
    with memviz.track(gpu=False, torch=False):  # the store is reused: t's figures are frozen first
        pass
    assert subscribed[:2] == [("a", "freeze"), ("b", "freeze")]
    assert subscribed[2:] == [("a", "start"), ("b", "start"), ("b", "stop"), ("a", "stop")]


def test_a_nested_tracker_freezes_as_it_stops(subscribed):
    with memviz.track(gpu=False, torch=False):
        with memviz.track(gpu=False, torch=False):
            del subscribed[:]
        assert subscribed == [("b", "stop"), ("a", "stop"), ("a", "freeze"), ("b", "freeze")]


def test_an_exception_leaving_track_is_a_failure_event(subscribed):
    with pytest.raises(ZeroDivisionError):
        with memviz.track(gpu=False, torch=False):
            1 / 0
    assert ("a", "failure", E.EXCEPTION) in subscribed
    assert subscribed.index(("a", "failure", E.EXCEPTION)) < subscribed.index(("a", "stop"))


def test_automatic_triggers_never_raise_but_a_dump_request_does():
    class Broken(E.CaptureEvents):
        def on_failure(self, tracker, trigger):
            raise OSError("disk full")

    session = S.current()
    with memviz.track(gpu=False, torch=False) as t:
        session.subscribe(t, Broken())
        for kind in (E.OOM, E.DRIVER, E.EXCEPTION, E.SIGNAL):
            assert session.failure(t, E.Trigger(kind, "a test")) is None
        with pytest.raises(OSError, match="disk full"):
            session.failure(t, E.Trigger(E.REQUEST, "tracker.dump()"))


def test_only_capture_events_subscribe():
    with memviz.track(gpu=False, torch=False) as t:
        with pytest.raises(TypeError, match="CaptureEvents"):
            S.current().subscribe(t, object())
        assert t.subscribers == ()


def test_options_are_checked_once_and_frozen():
    t = memviz.track(gpu=False, torch=False, depth=8)
    assert isinstance(t.options, CaptureOptions) and t.options.depth == 8 and t.options.depth_given
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.options.depth = 4
    with pytest.raises(memviz.InvalidArgumentType, match="no option 'dpeth'"):
        memviz.track(dpeth=8)
    with pytest.raises(memviz.InvalidArgumentType, match="depth"):
        memviz.track(depth=None)  # memviz.track() takes no None depth; Tracker(depth=None) is the default
    assert memviz.Tracker(depth=None).options.depth == 32
    with pytest.raises(memviz.InvalidArgument, match="autograd=True needs"):
        memviz.track(autograd=True, torch=False)
    opts = CaptureOptions.parse(precise=True)
    assert opts.activity is False and opts.autograd_requested  # precise mode's defaults, worked out once


def test_nested_trackers_share_the_capture_and_stop_in_any_order():
    session = S.current()
    outer = memviz.track(gpu=False, torch=False, depth=8).start()
    try:
        with pytest.raises(memviz.AlreadyTracking, match="depth=4"):
            memviz.track(gpu=False, torch=False, depth=4).start()
        inner = memviz.track(gpu=False, torch=False).start()
        assert inner.outer is outer and inner.depth == 8
        assert session.running() == [outer, inner] and memviz.active_tracker() is inner
        assert session.capture is not None and session.capture.depth == 8
        outer.stop()  # the outer keeps what it saw; the inner goes on
        assert not outer.running and inner.running and session.running() == [inner]
        assert session.run_of(outer).frozen is not None
        assert session.capture is not None
    finally:
        for t in (outer, memviz.active_tracker()):
            if t is not None and t.running:
                t.stop()
    assert session.running() == [] and session.capture is None and session.active() is None


def test_precise_is_read_in_one_place(monkeypatch):
    session = S.current()
    t = memviz.track(gpu=False, torch=False)
    with t:
        pass
    monkeypatch.setattr(S, "allocator_backend", lambda: "native")
    assert not session.precise(t) and not rules._precise(t)
    monkeypatch.setattr(S, "allocator_backend", lambda: S.PRECISE_BACKEND)
    assert session.precise(t) and rules._precise(t)  # PyTorch on the driver's pool, whoever chose it
    assert S.conf_backend(S.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,"
                                                                  "backend:cudaMallocAsync"})) == S.PRECISE_BACKEND
    assert S.conf_backend(S.alloc_conf({})) is None


def test_a_forked_child_starts_a_capture_of_its_own():
    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, %r)
        import memviz
        from memviz.capture import session as S
        outer = memviz.track(gpu=False, torch=False).start()
        inner = memviz.track(gpu=False, torch=False).start()
        pid = os.fork()
        if pid == 0:
            ok = (S.current().running() == [] and not outer.running and not inner.running
                  and S.current().capture is None)
            outer.stop()  # the parent's tracker: nothing to stop here
            with memviz.track(gpu=False, torch=False) as t:
                ok = ok and t.outer is None and S.current().running() == [t]
            ok = ok and S.current().run_of(inner).frozen is not None  # frozen before the store was reused
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert inner.running and S.current().running() == [outer, inner]
        inner.stop(); outer.stop()
        print("child", os.waitstatus_to_exitcode(status))
    """) % str(ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child 0"
