"""Leftovers of the hardening issue (14): non-UTF-8 file names in `memviz diff`
and the pytest plugin's summary, NaN in the JSON report, write errors of the
step files during t.step(), and step files that are the trace (or each other).

A full disk is /dev/full (ENOSPC) or a file-size limit (RLIMIT_FSIZE with
SIGXFSZ ignored: EFBIG), as in test_hardening_outputs.py.
"""

import contextlib
import errno
import json
import os
import resource
import signal

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2
from memviz.cli.diff import diff_main, diff_text
from memviz.cli.report import main as report_main
from test_pytest_plugin import GPU, run  # (imports torch once, before pytester's inner runs)

pytest_plugins = ["pytester"]

MiB = 1 << 20
#: a file name with the byte 0xff, as Python sees it (the surrogate \udcff)
ODD = os.fsdecode(b"/tmp/d\xffir/model.py")


def strict_json(text):
    """json.loads that refuses NaN and Infinity (which JSON does not have)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def odd_trace(fake, path, sizes, info=None):
    """A saved trace whose allocations come from a file named ODD, one step each."""
    ns = {}
    exec(compile("def grow(fake, cbid, size):\n    return fake.alloc(cbid, size)\n", ODD, "exec"), ns)
    with memviz.track(torch=False) as t:
        for size in sizes:
            ns["grow"](fake, CBID_cuMemAlloc_v2, size)
            t.step(**(info or {}))
    t.save(str(path))
    return path


# ---- 1. memviz diff with a file name that is not UTF-8 ----------------------------------


def test_diff_of_traces_with_a_file_name_that_is_not_utf8(fake, tmp_path, capsys):
    a = odd_trace(fake, tmp_path / "a.memviz", [MiB])
    b = odd_trace(fake, tmp_path / "b.memviz", [MiB, 2 * MiB])
    out = tmp_path / "d.txt"
    assert diff_main([str(a), str(b), "-o", str(out)]) == 0, capsys.readouterr().err
    text = out.read_bytes().decode("utf-8")
    assert "/tmp/d\\xffir/model.py:2" in text and "+2 MiB" in text
    diff_text(memviz.load(str(a)), memviz.load(str(b))).encode("utf-8")  # stdout too
    out = tmp_path / "d.json"
    assert diff_main([str(a), str(b), "--format", "json", "-o", str(out)]) == 0
    doc = strict_json(out.read_bytes().decode("utf-8"))
    assert doc["devices"][0]["lines"][0]["file"] == ODD  # JSON keeps the name exactly


# ---- 2. NaN and infinities in the JSON report --------------------------------------------


def test_json_report_writes_nan_and_infinity_as_null(fake, tmp_path, capsys):
    trace = odd_trace(fake, tmp_path / "t.memviz", [MiB],
                      info={"loss": float("nan"), "scale": float("inf"), "lr": 0.5})
    out = tmp_path / "r.json"
    assert report_main([str(trace), "--format", "json", "-o", str(out)]) == 0
    doc = strict_json(out.read_text(encoding="utf-8"))
    assert doc["steps"][0]["info"] == {"loss": None, "scale": None, "lr": 0.5}
    assert doc["devices"][0]["top_lines_at_peak"][0]["file"] == ODD  # still lossless


def test_step_files_write_nan_as_null_and_perfetto_stays_json(fake, tmp_path):
    jl, cs, pf = tmp_path / "s.jsonl", tmp_path / "s.csv", tmp_path / "p.json"
    with memviz.track(torch=False) as t:
        t.on_step(jsonl=jl, csv=cs)
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        t.step(loss=float("nan"), scale=float("-inf"), lr=0.5)
    assert strict_json(jl.read_text().splitlines()[0])["info"] == {"loss": None, "scale": None,
                                                                  "lr": 0.5}
    import csv
    with open(cs, newline="", encoding="utf-8") as f:
        row = list(csv.DictReader(f))[0]
    assert strict_json(row["info"]) == {"loss": None, "scale": None, "lr": 0.5}
    t.to_perfetto(str(pf))
    doc = strict_json(pf.read_text(encoding="utf-8"))
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert steps and steps[0]["args"]["lr"] == 0.5  # (the loss is there as the text "nan")



# ---- 3. the pytest plugin's summary with a file name that is not UTF-8 -------------------


def test_pytest_summary_escapes_file_names_that_are_not_utf8(fake):
    from memviz.integrations import pytest_plugin

    lines = []
    rep = type("TR", (), {"write_sep": lambda self, *a, **k: None,
                          "write_line": lambda self, text, **k: lines.append(text)})()
    plugin = pytest_plugin._Runner.__new__(pytest_plugin._Runner)
    plugin.every_test = True
    plugin.capture = lambda: (True, "")
    plugin.config = type("C", (), {"getoption": lambda self, name, default=None: None})()
    plugin.results = [{"nodeid": "t.py::test_\udcff", "peak_bytes": MiB, "leaked_bytes": 0,
                       "top_lines": [{"line": f"{ODD}:2"}]}]
    plugin.pytest_terminal_summary(rep)
    text = "\n".join(lines)
    text.encode("utf-8")
    assert "/tmp/d\\xffir/model.py:2" in text and "t.py::test_\\xff" in text


def test_pytest_failure_report_escapes_file_names_that_are_not_utf8(pytester, fake):
    src = GPU + f"""
ns = {{}}
exec(compile("def grow(fake, cbid, size):\\n    return fake.alloc(cbid, size)\\n", {ODD!r}, "exec"), ns)
kept = []

@pytest.mark.memviz(leaks=True)
def test_leaks():
    kept.append(ns["grow"](fake, CBID_cuMemAlloc_v2, 2 * MiB))
"""
    r = run(pytester, src, "--memviz", "--junitxml=j.xml")
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "Still alive, by line:\n    /tmp/d\\xffir/model.py:2" in out, out
    (pytester.path / "j.xml").read_text(encoding="utf-8").encode("utf-8")


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
