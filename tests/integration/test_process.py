"""Whole-process behaviour through the test double: exit, load errors, CUPTI
versions, machines without a GPU, and code objects that die early.

Each case runs in a fresh interpreter, because libcupti is loaded once per
process and these cases change what is loaded or how the process ends.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, sys, warnings
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from fake_cupti import FakeCupti
import memviz
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run(body, fake_path=None, env=None, expect_rc=0, timeout=120):
    code = PRELUDE.format(root=str(ROOT), tests=str(ROOT / "tests")) + textwrap.dedent(body)
    e = dict(os.environ)
    e.pop("MEMVIZ_CUPTI_LIBRARY", None)
    if fake_path:
        e["MEMVIZ_CUPTI_LIBRARY"] = fake_path
    e.update(env or {})
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=e)
    assert p.returncode == expect_rc, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return (res[-1] if res else None), p


def test_interpreter_exit_while_tracking_and_threads_still_allocating(fake_path):
    _, p = run(f"""
        import threading
        f = FakeCupti({fake_path!r})
        t = memviz.start()
        f.alloc({CBID_cuMemAlloc_v2}, 1 << 20)
        stop = threading.Event()
        def spin():
            while not stop.is_set():
                f.free(245, f.alloc({CBID_cuMemAlloc_v2}, 4096))
        threading.Thread(target=spin, daemon=True).start()
        # a native thread allocating while the interpreter goes down
        threading.Thread(target=lambda: f.alloc_many_in_native_threads(2, 200000, 4096), daemon=True).start()
        print("bye", flush=True)
        # no stop(): atexit must unsubscribe cleanly
    """, fake_path)
    assert "bye" in p.stdout
    assert "Traceback" not in p.stderr and "Fatal" not in p.stderr


def test_explicit_library_that_does_not_load(tmp_path):
    missing = tmp_path / "libcupti.so.13"
    r, _ = run("""
        try:
            memviz.track().start()
        except memviz.CaptureUnavailable as e:
            out(msg=str(e), tried=e.tried, available=memviz.available(),
                info=memviz.capture_info()["reason"])
    """, env={"MEMVIZ_CUPTI_LIBRARY": str(missing)})
    assert "MEMVIZ_CUPTI_LIBRARY" in r["msg"] and "What to do" in r["msg"]
    assert any(str(missing) in x for x in r["tried"])
    assert r["available"] is False and "could not be loaded" in r["info"]


def test_no_gpu_warns_once_and_still_tracks(monkeypatch):
    r, p = run("""
        from memviz.capture import cupti as _capture
        _capture.gpu_present = lambda: (False, "no NVIDIA driver or GPU found (test)")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with memviz.track() as t1:
                pass
            with memviz.track() as t2:
                pass
            with memviz.track(gpu=False):
                pass
        out(n=len([x for x in w if issubclass(x.category, memviz.CaptureWarning)]),
            msg=str(w[0].message), reason=t2.gpu_off_reason, enabled=t2.gpu_enabled,
            available=memviz.available(), snap=len(t1.snapshot()))
    """)
    assert r["n"] == 1 and "GPU capture is off" in r["msg"] and "gpu=False" in r["msg"]
    assert r["reason"] == "no NVIDIA driver or GPU found (test)" and r["enabled"] is False
    assert r["available"] is False and r["snap"] == 0


@pytest.mark.parametrize("version, source", [(26, False), (130001, True)], ids=["cupti-12.8", "cupti-13"])
def test_activity_record_layout_follows_the_cupti_version(fake_path, version, source):
    r, _ = run(f"""
        f = FakeCupti({fake_path!r}); f.set_version({version})
        with memviz.track() as t:
            f.emit_memory2(1, 6, 0x70000000, 4096, 0, 1, "g", "/lib/libcublas.so.13")
        a, = t.snapshot().allocations
        out(kind=a.kind, size=a.size, label=a.label, version=memviz.capture_info()["version"],
            major=memviz.capture_info()["cuda_major"])
    """, fake_path)
    assert (r["kind"], r["size"], r["version"]) == ("static", 4096, version)
    assert r["major"] == (13 if source else 12)
    assert r["label"] == ("CUDA module globals (libcublas.so.13)" if source else "CUDA module globals")


def test_older_cupti_conflict_code_is_a_conflict_too(fake_path):
    r, _ = run(f"""
        f = FakeCupti({fake_path!r}); f.set_subscribe_error(12)
        try:
            memviz.track(cupti=True).start()
        except memviz.CaptureConflict as e:
            out(msg=str(e))
    """, fake_path)
    assert r and "subscriber" in r["msg"].lower()


def test_code_object_that_dies_before_the_snapshot(fake):
    """An exec'd function allocates and is deleted before anything reads the
    stack: its frame must still resolve (and nothing may read freed memory)."""
    src = "def dyn(fake):\n    x = 1\n    return fake.alloc(%d, 1 << 20)\n" % CBID_cuMemAlloc_v2
    with memviz.track() as t:
        ns = {}
        exec(compile(src, "<generated>", "exec"), ns)
        ns["dyn"](fake)
        del ns
        gc.collect()
    a, = t.snapshot().allocations
    assert (a.traceback[-2].filename, a.traceback[-2].lineno, a.traceback[-2].name) == ("<generated>", 3, "dyn")


def test_call_of_a_code_object_that_dies_before_the_snapshot(fake):
    """A notebook cell's code object is gone by the time the next cell looks
    at the tracker: the call its frame was making keeps its name (3.11 keeps
    the code object alive; 3.12+ names the call as the code object dies)."""
    import linecache

    name = "<cell 1>"
    src = "x = 1\nfake._c.fake_alloc(%d, 1 << 20, 0, 0)\n" % CBID_cuMemAlloc_v2
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    try:
        with memviz.track() as t:
            exec(compile(src, name, "exec"), {"fake": fake})
            gc.collect()
        if sys.version_info >= (3, 12):
            del linecache.cache[name]  # named as the code object died: the source is not needed now
        a, = t.snapshot().allocations
    finally:
        linecache.cache.pop(name, None)
    assert (a.traceback[-1].filename, a.traceback[-1].lineno) == (name, 2)
    assert a.op == ("fake._c.fake_alloc" if sys.version_info >= (3, 11) else None)


# ---- fork()ed children ------------------------------------------------------------------------


def _in_child(fn):
    """Run fn() in a fork()ed child; returns what it returned (JSON) or raises
    with the child's error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            res = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001
            import traceback
            res = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        os.write(w, json.dumps(res, default=repr).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    res = json.loads(data)
    assert "error" not in res, res.get("tb")
    return res["ok"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_of_a_capturing_parent_tracks_without_gpu_and_says_why(fake):
    import warnings

    def child():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with memviz.track() as t:  # CUPTI is the parent's: not called here
                with memviz.label("in the child"):
                    fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
                rec = t.step()
        from memviz.report.text import text_report
        report = text_report(t)
        info = memviz.capture_info()
        return {"gpu": t.gpu_enabled, "why": t.gpu_off_reason, "totals": t.totals(),
                "steps": len(t.steps), "devices": list(rec.devices),
                "warnings": [str(w.message) for w in caught if issubclass(w.category, memviz.CaptureWarning)],
                "available": memviz.available(), "info_reason": info["reason"],
                "info_available": info["available"], "active": memviz._core.active(),
                "report": report}

    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
        got = _in_child(child)
        assert fake.is_subscribed()  # the parent's subscription is untouched
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
    assert t.current_bytes() == 2 << 20 and not fake.is_subscribed()
    assert got["gpu"] is False and got["totals"] == {} and got["steps"] == 1 and not got["active"]
    why = got["why"]
    assert "fork()" in why and str(os.getpid()) in why and "spawn" in why
    assert "CUPTI for memviz" not in why
    assert len(got["warnings"]) == 1 and why in got["warnings"][0]
    assert got["available"] is False and got["info_available"] is False and got["info_reason"] == why
    assert "fork()" in " ".join(got["report"].split())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_after_the_parent_stopped_still_keeps_off_cupti(fake):
    with memviz.track():
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)

    def child():
        with memviz.track() as t:
            fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
        return {"gpu": t.gpu_enabled, "why": t.gpu_off_reason, "subscribed": fake.is_subscribed()}

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memviz.CaptureWarning)
        got = _in_child(child)
    assert got == {"gpu": False, "why": got["why"], "subscribed": False} and "fork()" in got["why"]


def test_forked_child_of_a_parent_that_never_loaded_cupti_can_capture(fake_path):
    """A parent that never loaded CUPTI (and never initialised CUDA): its
    child is like a new process and captures; a child of a parent that
    initialised CUDA (as PyTorch reports it) keeps GPU capture off."""
    r, p = run(f"""
        import warnings
        def child(bad_fork):
            if bad_fork:
                try:
                    import torch
                except ImportError:  # the CI's other Pythons have no torch
                    print("CHILD " + json.dumps({{"skip": True}}), flush=True)
                    return
                torch.cuda._is_in_bad_fork = lambda: True
            f = FakeCupti({fake_path!r})
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with memviz.track() as t:
                    f.alloc({CBID_cuMemAlloc_v2}, 1 << 20)
            ok = {{"gpu": t.gpu_enabled, "bytes": t.current_bytes(), "why": t.gpu_off_reason,
                   "warned": len(caught)}}
            print("CHILD " + json.dumps(ok), flush=True)
        for bad in (False, True):
            pid = os.fork()
            if pid == 0:
                try:
                    child(bad)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        out(done=True)
    """, fake_path)
    kids = [json.loads(x[6:]) for x in p.stdout.splitlines() if x.startswith("CHILD ")]
    assert len(kids) == 2, p.stderr
    assert kids[0] == {"gpu": True, "bytes": 1 << 20, "why": None, "warned": 0}
    if kids[1].get("skip"):
        return  # no torch in this Python: its bad-fork answer cannot be asked
    assert kids[1]["gpu"] is False and kids[1]["bytes"] == 0 and kids[1]["warned"] == 1
    assert "initialised CUDA" in kids[1]["why"] and "spawn" in kids[1]["why"]


def test_a_conflict_with_memviz_itself_says_so(fake_path):
    r, _ = run(f"""
        f = FakeCupti({fake_path!r}); f.set_conflict("CUPTI for memviz")
        try:
            memviz.track(cupti=True).start()
        except memviz.CaptureConflict as e:
            out(msg=str(e))
    """, fake_path)
    assert "memviz itself" in r["msg"] and "fork" in r["msg"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_reads_the_parents_nested_tracker_after_starting_its_own(fake):
    def child():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", memviz.CaptureWarning)
            with memviz.track():  # clears the child's copy of the store
                pass
        return {"inner": inner.current_bytes(), "outer": outer.current_bytes(),
                "inner_live": len(inner.snapshot()), "running": inner.running}

    with memviz.track() as outer:
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
        with memviz.track() as inner:
            fake.alloc(CBID_cuMemAlloc_v2, 2 << 20)
            got = _in_child(child)
    assert got == {"inner": 2 << 20, "outer": 3 << 20, "inner_live": 1, "running": False}


_SAME_TRACE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    import memviz
    try:
        with memviz.track(gpu=False, torch=False, trace=sys.argv[1]) as t:
            print("ready", flush=True)
            t0 = time.time()
            while time.time() - t0 < float(sys.argv[2]):
                t.step(); time.sleep(0.002)
    except memviz.TraceError as e:
        print("refused", e, flush=True)
        sys.exit(3)
""")


def test_a_second_process_given_the_same_trace_path_is_refused(tmp_path):
    """Two processes given one trace= path both wrote it: the second
    truncated the file under the first one's writes, both exited 0 with no
    warning, and neither file loaded (its checksums did not match). The file
    is now locked while a process writes it, and emptied only once locked."""
    path = str(tmp_path / "run.memviz")
    root = str(Path(__file__).resolve().parents[2])
    first = subprocess.Popen([sys.executable, "-c", _SAME_TRACE, path, "2", root],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "ready"
        second = subprocess.run([sys.executable, "-c", _SAME_TRACE, path, "0", root],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 3 and "another process is writing this trace file" in second.stdout
    finally:
        assert first.wait(60) == 0
    trace = memviz.load(path)
    assert len(trace.steps) >= 50


def test_a_forked_child_living_on_does_not_keep_the_trace_locked(tmp_path):
    """A child forked while the parent traced (a DataLoader worker) holds a
    copy of the trace file's descriptor, and with it the lock; it closes
    that copy (never unlocking: the lock is the parent's too), so the parent
    can trace to the same path again while the child lives on."""
    path = str(tmp_path / "run.memviz")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    with memviz.track(gpu=False, torch=False, trace=path) as t:
        pid = os.fork()
        if pid == 0:  # the child: says it runs, waits until told, leaves without cleanup
            os.close(w)
            os.write(ready_w, b"r")  # fork() returned here: the after-fork hooks ran
            os.read(r, 1)
            os._exit(0)
        t.step()
    # The child closes its copy in its after-fork hook, on its own schedule: on a
    # loaded 2-core CI machine the parent got here first (the lock still held)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"r"
    os.close(ready_r)
    try:
        with memviz.track(gpu=False, torch=False, trace=path) as t:
            t.step()
            t.step()
    finally:
        os.close(r)
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert len(memviz.load(path).steps) == 2


# ---- signal handlers, exit and fork against a stop under way ---------------------------------


def test_a_stop_inside_a_stop_returns_and_the_trace_ends_whole(fake_path, tmp_path):
    """A signal handler (or a finaliser) calling t.stop() while that tracker
    stops, on the same thread: the inner stop returns, the one under way
    finishes (it waited on the writer's lock its outer frame held, for ever)."""
    path = str(tmp_path / "t.memviz")
    res, _ = run(f"""
        from memviz.trace import writer as W
        f = FakeCupti({fake_path!r})
        original = W.TraceWriter._finish
        def finish(self, tracker):
            tracker.stop()  # as a handler would, in the middle of the stop
            return original(self, tracker)
        W.TraceWriter._finish = finish
        with memviz.track(trace={path!r}) as t:
            f.alloc({CBID_cuMemAlloc_v2}, 1 << 20)
        t2 = memviz.load({path!r})
        out(running=t.running, truncated=t2.truncated)
    """, fake_path, timeout=30)
    assert res == {"running": False, "truncated": False}


def test_a_sigterm_handler_calling_sys_exit_during_the_stop_leaves_a_whole_trace(fake_path, tmp_path):
    """SIGTERM with the usual graceful handler (sys.exit) while the trace
    writes its END record: held until the file is closed whole (the END was
    cut off without a word)."""
    path = str(tmp_path / "t.memviz")
    _, p = run(f"""
        import signal
        from memviz.trace import writer as W
        f = FakeCupti({fake_path!r})
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
        original = W.TraceWriter._finish
        def finish(self, tracker):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecode boundaries: the handler would run here
                pass
            return original(self, tracker)
        W.TraceWriter._finish = finish
        with memviz.track(trace={path!r}) as t:
            f.alloc({CBID_cuMemAlloc_v2}, 1 << 20)
        print("not reached: sys.exit(3) ends the program after the stop", flush=True)
    """, fake_path, expect_rc=3, timeout=30)
    assert "not reached" not in p.stdout
    loaded = memviz.load(path)
    assert not loaded.truncated


def test_a_ctrl_c_while_trackers_stop_at_exit_stops_them_all(fake_path, tmp_path):
    """Trackers left running at exit: a Ctrl-C during the exit hook's first
    stop is held until every tracker stopped (it escaped the hook, leaving
    the outer tracker's trace without its END record), then dropped."""
    path = str(tmp_path / "t.memviz")
    _, p = run(f"""
        import signal
        f = FakeCupti({fake_path!r})
        outer = memviz.track(trace={path!r}).start()
        inner = memviz.track().start()
        f.alloc({CBID_cuMemAlloc_v2}, 1 << 20)
        stop = memviz.Tracker.stop
        sent = []
        def stop_with_ctrl_c(self):
            if not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)
            return stop(self)
        memviz.Tracker.stop = stop_with_ctrl_c
        print("exiting", flush=True)
    """, fake_path, timeout=30)
    assert "exiting" in p.stdout
    assert "KeyboardInterrupt" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert not memviz.load(path).truncated


def test_a_child_forked_while_another_thread_held_the_session_lock_can_track():
    """A thread of the parent's inside the session (a step, a stop) at the
    fork: the child's first tracker waited on the lock that thread held."""
    import threading
    from memviz.capture import session as S

    held, release = threading.Event(), threading.Event()

    def hold():
        with S.current().lock:
            held.set()
            release.wait(30)

    th = threading.Thread(target=hold)
    th.start()
    assert held.wait(10)
    try:
        def child():
            import signal
            signal.alarm(10)  # a hang ends the child, not the suite
            with memviz.track(gpu=False, torch=False) as t:
                pass
            return t.running
        res = _in_child(child)
    finally:
        release.set()
        th.join()
    assert res is False
