"""Outputs never destroy inputs, writes are atomic and safe, write errors are
memviz errors, and no output file is overwritten without --force.

The CLI tests run ``python -m memviz`` in a subprocess. A full disk is
/dev/full (ENOSPC) or a file-size limit set in the child (RLIMIT_FSIZE with
SIGXFSZ ignored: EFBIG), so they need no special file system.
"""

import contextlib
import errno
import os
import pickle
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2
from memviz.capture import cupti as _capture
from memviz import _output_files

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GPU_FLAG = ["--no-gpu"] if _capture.gpu_present()[0] else []


def cli(*args, cwd, env=None, limit=None, timeout=60):
    """`python -m memviz ARGS` in cwd; ``limit``: the child's RLIMIT_FSIZE in bytes."""
    full = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    full["PYTHONDONTWRITEBYTECODE"] = "1"
    full.update(env or {})

    def child():
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "memviz", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=child)


def run(*args, **kw):
    return cli("run", *GPU_FLAG, *args, **kw)


def assert_refused(p, *words):
    """Exit status 2, one line on stderr, no traceback, no report."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not lines[0].startswith("memviz report:")  # no report printed


def no_temp_files(folder):
    left = [n for n in os.listdir(folder) if "tmp" in n]
    assert not left, left


@pytest.fixture
def script(tmp_path):
    """A script that leaves a marker file when it runs."""
    path = tmp_path / "s.py"
    path.write_text("open('ran', 'w').close()\nprint('hello')\n")
    return path


@pytest.fixture
def trace(tmp_path, script):
    p = run("-o", "t.memviz", "s.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (tmp_path / "ran").unlink()
    return tmp_path / "t.memviz"


# ---- 3. an output that is one of the inputs is refused ----------------------------


@pytest.mark.parametrize("option", ["-o", "--output", "--report-file"])
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "dotted"])
def test_run_refuses_to_write_over_its_script(tmp_path, script, option, how):
    before = script.read_bytes()
    name = {"same": "s.py", "dotted": "./sub/../s.py", "symlink": "link.py", "hardlink": "hard.py"}[how]
    (tmp_path / "sub").mkdir()
    if how == "symlink":
        (tmp_path / "link.py").symlink_to("s.py")
    elif how == "hardlink":
        os.link(script, tmp_path / "hard.py")
    p = run(option, name, "s.py", cwd=tmp_path)
    assert_refused(p, repr(name), "the script to run", "Choose another")
    assert script.read_bytes() == before
    assert not (tmp_path / "ran").exists()  # refused before the script ran


def test_run_refuses_the_script_given_through_another_path(tmp_path, script):
    (tmp_path / "link.py").symlink_to("s.py")
    p = run("-o", "s.py", "link.py", cwd=tmp_path)  # the script named by a link, -o by its file
    assert_refused(p, "the script to run")
    assert script.read_text().startswith("open(")


def test_run_refuses_a_report_file_that_is_the_trace(tmp_path, script):
    p = run("-o", "x.memviz", "--report-file", "x.memviz", "s.py", cwd=tmp_path)
    assert_refused(p, "the trace file given with -o", "--report-file")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "x.memviz").exists()


def test_run_refuses_to_write_over_the_module_it_runs(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("print('job')\n")
    (tmp_path / "solo.py").write_text("print('solo')\n")
    for target, module in (("pkg/job.py", "pkg.job"), ("solo.py", "solo"),
                           ("pkg/__init__.py", "pkg.job")):
        before = (tmp_path / target).read_bytes()
        p = run("-o", target, "-m", module, cwd=tmp_path)
        assert_refused(p, "a file of the module to run")
        assert (tmp_path / target).read_bytes() == before
    assert run("-o", "ok.memviz", "-m", "pkg.job", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("fmt", ["text", "json", "html"])
def test_report_refuses_to_write_over_the_trace(trace, fmt):
    before = trace.read_bytes()
    (trace.parent / "t-link.memviz").symlink_to("t.memviz")
    for out in ("t.memviz", "t-link.memviz", str(trace)):
        p = cli("report", "t.memviz", "--format", fmt, "-o", out, cwd=trace.parent)
        assert_refused(p, "the trace being reported", "choose another -o path")
        assert trace.read_bytes() == before
    assert memviz.load(trace).meta  # still a trace


def test_a_dash_for_the_output_is_stdout(trace):
    """-o - writes to stdout, as the default (it made a file named '-')."""
    for args in (("report", "t.memviz", "--format", "json"), ("diff", "t.memviz", "t.memviz")):
        p = cli(*args, "-o", "-", cwd=trace.parent)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() and not (trace.parent / "-").exists()


def test_diff_refuses_to_write_over_either_trace(trace):
    before = trace.read_bytes()
    (trace.parent / "b.memviz").write_bytes(before)
    for out in ("t.memviz", "b.memviz"):
        p = cli("diff", "t.memviz", "b.memviz", "-o", out, cwd=trace.parent)
        assert_refused(p, "trace (", "choose another -o path")
        assert (trace.parent / out).read_bytes() == before


def test_api_exports_refuse_the_trace_they_read(fake, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    before = path.read_bytes()
    loaded = memviz.load(path)
    for write in (loaded.to_html, loaded.to_perfetto, loaded.to_torch_snapshot, t.to_html,
                  t.to_perfetto, t.to_torch_snapshot):
        with pytest.raises(memviz.OutputError, match="the trace file this .* (loaded from|streams to)"):
            write(str(path))
    with pytest.raises(memviz.TraceError, match="the trace file this tracker streams to"):
        t.save(path)  # would replace the streamed history with the smaller saved form
    assert path.read_bytes() == before


# ---- 4. writes go through an exclusive temporary file ---------------------------------


def test_save_does_not_follow_a_symlink_planted_at_the_old_temporary_name(fake, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "t.memviz"
    (tmp_path / f"t.memviz.tmp{os.getpid()}").symlink_to(victim)  # the name save() used to use
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    t.save(target)
    assert victim.read_text() == "precious\n"
    assert memviz.load(target).totals()[0]["current"] == MiB
    assert os.path.islink(tmp_path / f"t.memviz.tmp{os.getpid()}")  # left alone
    assert [n for n in os.listdir(tmp_path) if n.endswith(".memviz-tmp")] == []


def test_temporary_files_are_created_exclusively(tmp_path, monkeypatch):
    """Every temporary name is opened with O_CREAT|O_EXCL (never an existing
    file nor a link), in the target's folder."""
    seen = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        seen.append((os.fspath(path), flags))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    _output_files.write_output(tmp_path / "out.txt", "data", "the test output")
    monkeypatch.undo()
    temp, flags = seen[-1]
    assert os.path.dirname(temp) == str(tmp_path)
    assert flags & os.O_EXCL and flags & os.O_CREAT
    assert (tmp_path / "out.txt").read_text() == "data"
    no_temp_files(tmp_path)


@contextlib.contextmanager
def file_size_limit(n):
    """Files of this process cannot grow past n bytes (EFBIG), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("which", ["to_perfetto", "to_torch_snapshot", "to_html", "save"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(fake, tmp_path, which):
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    target = tmp_path / "out.bin"
    target.write_bytes(b"the previous version\n")
    write = getattr(t, which)
    err = memviz.TraceError if which == "save" else memviz.OutputError
    with file_size_limit(100):  # a little gets written, then the "disk" is full
        with pytest.raises(err, match="File too large.*What to do: .*ulimit -f"):
            write(str(target))
    assert target.read_bytes() == b"the previous version\n"
    no_temp_files(tmp_path)
    write(str(target))  # and then it works
    assert target.read_bytes() != b"the previous version\n"


def test_mode_symlinks_and_pipes(fake, tmp_path):
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    # an existing file keeps its permission bits; a new one gets what open() gives
    kept = tmp_path / "kept.html"
    kept.write_text("old")
    os.chmod(kept, 0o640)
    t.to_html(kept)
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o640 and "<html" in kept.read_text()
    t.to_html(tmp_path / "new.html")
    (tmp_path / "plain.txt").write_text("")
    assert os.stat(tmp_path / "new.html").st_mode == os.stat(tmp_path / "plain.txt").st_mode
    # a symlink at the path is followed: its target gets the new file
    (tmp_path / "real").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "real" / "t.json")
    t.to_perfetto(tmp_path / "link.json")
    assert os.path.islink(tmp_path / "link.json")
    assert (tmp_path / "real" / "t.json").read_text().startswith("{")
    # a pipe is written into, not replaced
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    t.to_perfetto(fifo)
    reader.join(10)
    assert got and got[0].startswith(b"{") and stat.S_ISFIFO(os.stat(fifo).st_mode)
    no_temp_files(tmp_path)


def test_read_only_file_and_folder_errors(fake, tmp_path, monkeypatch):
    with memviz.track(torch=False) as t:
        pass
    with pytest.raises(memviz.OutputError, match="is a folder.*give a file name") as e:
        t.to_html(tmp_path)
    assert e.value.errno == errno.EISDIR and isinstance(e.value, OSError)
    with pytest.raises(memviz.OutputError, match="folder .* does not exist.*create it"):
        t.to_perfetto(tmp_path / "missing" / "t.json")
    ro = tmp_path / "ro.html"
    ro.write_text("keep")
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith("ro.html"))  # as non-root
    with pytest.raises(memviz.OutputError, match="read-only.*make it writable"):
        t.to_html(ro)
    monkeypatch.undo()
    assert ro.read_text() == "keep"

    def denied(path, flags, mode=0o777):
        raise PermissionError(errno.EACCES, "Permission denied", path)
    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(memviz.OutputError, match="Permission denied.*folder you may write to"):
        t.to_html(tmp_path / "x.html")


def test_output_error_is_picklable_and_an_oserror():
    e = memviz.OutputError("the HTML report", "/x/r.html", "No space left on device",
                           errno=errno.ENOSPC)
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.errno == errno.ENOSPC and back.path == "/x/r.html"
    assert isinstance(back, OSError) and isinstance(back, memviz.MemvizError)
    assert str(e).startswith("memviz cannot write the HTML report to '/x/r.html': No space")


# ---- 10. write errors in the CLI: a message, a non-zero exit, no traceback -------------


def test_run_with_a_trace_on_a_full_disk(tmp_path, script):
    p = run("-o", "/dev/full", "s.py", cwd=tmp_path)
    assert_refused(p, "/dev/full", "No space left on device", "What to do")
    assert not (tmp_path / "ran").exists()  # refused before the script ran
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_run_with_a_report_file_on_a_full_disk_keeps_the_report(tmp_path, script):
    p = run("--report-file", "/dev/full", "s.py", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr
    assert "memviz report: s.py" in p.stderr  # the report still printed
    last = p.stderr.strip().splitlines()[-1]
    assert "cannot write the report to '/dev/full': No space left on device" in last
    assert "What to do" in last and p.stdout == "hello\n"
    assert (tmp_path / "ran").exists()


def test_run_keeps_the_scripts_own_failure_status(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nsys.exit(3)\n")
    p = run("--report-file", "/dev/full", "fail.py", cwd=tmp_path)
    assert p.returncode == 3 and "No space left on device" in p.stderr


def test_run_report_file_errors_before_the_script_runs(tmp_path, script):
    (tmp_path / "d").mkdir()
    assert_refused(run("--report-file", "d", "s.py", cwd=tmp_path), "is a directory")
    assert_refused(run("-o", "d", "s.py", cwd=tmp_path), "is a directory")
    assert_refused(run("-o", "no/t.memviz", "s.py", cwd=tmp_path), "does not exist")
    assert not (tmp_path / "ran").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_run_refuses_unwritable_outputs_before_the_script_runs(tmp_path, script):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    ro = tmp_path / "ro.txt"
    ro.write_text("keep")
    os.chmod(ro, 0o400)
    try:
        assert_refused(run("--report-file", "locked/r.txt", "s.py", cwd=tmp_path), "permission")
        assert_refused(run("-o", "locked/t.memviz", "s.py", cwd=tmp_path), "permission")
        assert_refused(run("--report-file", "ro.txt", "s.py", cwd=tmp_path), "read-only")
    finally:
        os.chmod(locked, 0o700)
    assert not (tmp_path / "ran").exists() and ro.read_text() == "keep"


def test_run_checks_permissions_before_the_script_runs(tmp_path, monkeypatch):
    """The same checks in-process, with os.access answering as for a user
    without the right (root passes every access check)."""
    from memviz.cli.run import UsageError, _check_report_file

    (tmp_path / "locked").mkdir()
    (tmp_path / "ro.txt").write_text("keep")
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith(("locked", "ro.txt")))
    denied = "permission denied in the folder"
    for path, option, words in ((tmp_path / "locked" / "r.txt", "--report-file", denied),
                                (tmp_path / "locked" / "t.memviz", "-o", denied),
                                (tmp_path / "ro.txt", "--report-file", "read-only")):
        with pytest.raises(UsageError, match=words) as e:
            _check_report_file(str(path), option=option)
        assert f"another {option}" in str(e.value)
    _check_report_file(str(tmp_path / "fine.txt"))


def test_run_trace_cut_short_by_a_full_disk(fake_path, tmp_path):
    """The disk fills while the script runs: the script finishes, the report
    prints, the trace says how far it goes, the exit status is not 0."""
    (tmp_path / "big.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
        lib = FakeCupti({fake_path!r}).lib
        for i in range(20000):
            a = lib.fake_alloc(CBID_cuMemAlloc_v2, (i % 97 + 1) << 20, 0, 0)
            if i % 3:
                lib.fake_free(CBID_cuMemFree_v2, a, 0, 0)
        print("script done")
    """))
    p = cli("run", "-o", "big.memviz", "big.py", cwd=tmp_path, limit=16384,
            env={_capture.ENV_LIBRARY: fake_path})
    assert p.returncode == 2, p.stderr
    assert p.stdout == "script done\n"
    assert "Traceback" not in p.stderr and "TraceWarning" not in p.stderr
    assert "memviz report: big.py" in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "the trace big.memviz is incomplete" in last and "File too large" in last
    assert "What to do" in last and "writing stopped after" in last
    q = cli("report", "big.memviz", cwd=tmp_path)
    assert q.returncode == 0 and "incomplete trace" in q.stdout


def test_report_and_diff_write_errors(trace):
    folder = trace.parent
    for args in (["report", "t.memviz", "--format", "html", "-o", "/dev/full"],
                 ["report", "t.memviz", "-o", "."],
                 ["report", "t.memviz", "-o", "no/such/r.txt"],
                 ["diff", "t.memviz", "t.memviz", "-o", "/dev/full"]):
        p = cli(*args, cwd=folder)
        assert_refused(p, "cannot write", "What to do")
    for args in (["report", "t.memviz", "-o", ""], ["diff", "t.memviz", "t.memviz", "-o", ""]):
        assert_refused(cli(*args, cwd=folder), "takes a file path", "got '' (str)")
    for option in ("-o", "--report-file"):
        assert_refused(run(option, "", "s.py", cwd=folder), "not a file name", option)
    # stdout on a full disk
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "memviz", "report", "t.memviz"], cwd=folder,
                           stdout=full, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "cannot write the report to stdout: No space left on device" in p.stderr


def test_report_on_a_full_disk_keeps_the_previous_file(trace):
    out = trace.parent / "out.html"
    out.write_text("the previous report\n")
    p = cli("report", "t.memviz", "--format", "html", "-o", "out.html", "--force", cwd=trace.parent,
            limit=4096)
    assert_refused(p, "cannot write the HTML report to 'out.html': File too large",
                   "ulimit -f")
    assert out.read_text() == "the previous report\n"
    no_temp_files(trace.parent)


@pytest.mark.parametrize("verb", ["report", "whatif", "diff"])
def test_an_existing_output_is_refused_without_force(tmp_path, verb):
    """As memray's run -o: no output file is overwritten unless --force says so
    (the earlier result is kept, byte for byte)."""
    sample = os.path.join(os.path.dirname(memviz.__file__), "data", "sample.memviz")
    out = tmp_path / "out.txt"
    out.write_text("an earlier result\n")
    args = [verb, sample] + ([sample] if verb == "diff" else []) + ["-o", str(out)]
    p = subprocess.run([sys.executable, "-m", "memviz", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "exists" in p.stderr and "--force" in p.stderr, p.stderr
    assert out.read_text() == "an earlier result\n"
    p = subprocess.run([sys.executable, "-m", "memviz", *args, "--force"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.read_text() != "an earlier result\n"


def test_run_refuses_an_existing_trace_before_the_script_runs(tmp_path, script):
    (tmp_path / "run.memviz").write_bytes(b"kept")
    p = run("-o", "run.memviz", "s.py", cwd=tmp_path)
    assert p.returncode == 2 and "--force" in p.stderr, p.stderr
    assert not (tmp_path / "ran").exists() and (tmp_path / "run.memviz").read_bytes() == b"kept"
    p = run("-o", "run.memviz", "-f", "s.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run.memviz").read_bytes()[:3] != b"kep"
