"""Step files (t.on_step's jsonl and csv sinks, memviz.watch, the framework
callbacks): a write error during t.step() is a memviz error and the records
are kept, and step files that are the trace (or each other) are refused.

A full disk is /dev/full (ENOSPC) or a file-size limit (RLIMIT_FSIZE with
SIGXFSZ ignored: EFBIG), as in test_output_safety.py.
"""

import contextlib
import errno
import os
import resource
import signal

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2

MiB = 1 << 20


# ---- 4. a write error in a step file during t.step() -------------------------------------


@contextlib.contextmanager
def file_size_limit(n):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def test_a_full_disk_under_the_jsonl_step_file(fake, tmp_path):
    with memviz.track(torch=False) as t:
        t.on_step(jsonl="/dev/full")
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        with pytest.raises(memviz.OutputError, match="the jsonl step file.*/dev/full.*"
                                                     "No space left.*What to do") as e:
            t.step()
        assert e.value.errno == errno.ENOSPC and "t.steps" in str(e.value)
        t.step()  # the broken file is left alone; steps still record
    assert [r.index for r in t.steps] == [0, 1]


def test_a_file_size_limit_under_the_csv_step_file(fake, tmp_path):
    seen = []
    path = tmp_path / "s.csv"
    with memviz.track(torch=False) as t:
        t.on_step(csv=path, callback=seen.append)
        with file_size_limit(os.path.getsize(path) + 10):
            with pytest.raises(memviz.OutputError, match="the csv step file") as e:
                t.step(batch=(8, 128))
        assert e.value.errno == errno.EFBIG
    assert len(t.steps) == 1 and seen == t.steps  # the record is kept, other sinks got it


def test_a_full_disk_when_the_csv_header_is_written(fake):
    with memviz.track(torch=False) as t:
        with pytest.raises(memviz.OutputError, match="the csv step file.*/dev/full") as e:
            t.on_step(csv="/dev/full")
        assert e.value.errno == errno.ENOSPC


def test_watch_keeps_its_records_when_a_step_file_fails(fake, tmp_path):
    hooks = []

    class Optimizer:
        def register_step_post_hook(self, fn):
            hooks.append(fn)
            return type("H", (), {"remove": lambda self: hooks.clear()})()

    got = []
    with memviz.track(torch=False) as t:
        t.on_step(callback=got.append)
        with memviz.watch(Optimizer(), jsonl="/dev/full") as h:
            with pytest.raises(memviz.OutputError, match="jsonl step file"):
                hooks[0](None, (), {})
            hooks[0](None, (), {})
    assert h.records == t.steps == got and len(got) == 2


# ---- 5. step files that are the trace, or each other -------------------------------------


def test_step_files_that_are_the_trace_or_each_other_are_refused(fake, tmp_path):
    trace = tmp_path / "t.memviz"
    with memviz.track(torch=False, trace=str(trace)) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        before = trace.read_bytes()
        link = tmp_path / "link.jsonl"
        link.symlink_to(trace)
        for kw in ({"jsonl": trace}, {"csv": str(link)}):
            with pytest.raises(memviz.OutputError, match="trace file"):
                t.on_step(**kw)
        assert trace.read_bytes() == before
        steps = tmp_path / "s.txt"
        steps.write_text("old")
        with pytest.raises(memviz.OutputError, match="jsonl step file"):
            t.on_step(jsonl=steps, csv=steps)
        with pytest.raises(memviz.OutputError, match="jsonl step file"):
            t.on_step(jsonl=tmp_path / "new.txt", csv=tmp_path / "." / "new.txt")
        assert steps.read_text() == "old" and not (tmp_path / "new.txt").exists()
        t.step()
    assert memviz.load(str(trace)).steps[0].index == 0  # the trace is intact


def test_a_step_file_already_written_is_refused_for_another_sink(fake, tmp_path):
    hooks = []
    opt = type("O", (), {"register_step_post_hook": lambda self, fn: hooks.append(fn)})()
    path = tmp_path / "s.jsonl"
    with memviz.track(torch=False, trace=str(tmp_path / "t.memviz")) as t:
        handle = t.on_step(jsonl=path)
        t.step()
        with pytest.raises(memviz.OutputError, match="the csv step file.*jsonl step file"):
            t.on_step(csv=path)
        with pytest.raises(memviz.OutputError, match="trace file"):
            memviz.watch(opt, csv=tmp_path / "t.memviz")  # the running tracker's trace
        with pytest.raises(memviz.InvalidArgumentType, match="jsonl=.*3 \\(int\\)"):
            t.on_step(jsonl=3)  # not taken for file descriptor 3
        t.step()
        handle.remove()
        t.on_step(csv=path)  # closed: free to be written again
    assert not hooks


def test_framework_callbacks_check_and_survive_their_step_files(fake, tmp_path):
    from memviz.integrations.callbacks import StepCallbackCore

    with pytest.raises(memviz.OutputError, match="the csv step file.*jsonl step file"):
        StepCallbackCore(jsonl=tmp_path / "s", csv=tmp_path / "s")
    assert not (tmp_path / "s").exists()
    got = []
    with memviz.track(torch=False) as t:
        t.on_step(jsonl="/dev/full")
        core = StepCallbackCore(callback=got.append)
        core.begin()
        with pytest.raises(memviz.OutputError, match="jsonl step file"):
            core.step()
    assert got == t.steps and len(got) == 1
