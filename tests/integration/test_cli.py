"""The command line (python -m memviz run) and the text report, without a GPU.

The CLI tests run ``python -m memviz run`` in a subprocess on small scripts
written to tmp_path. They are about the command line, not GPU capture: on a
machine with an NVIDIA GPU they pass --no-gpu so that they behave the same
everywhere (tests/gpu covers the real capture). One test drives the report
through the libcupti test double.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memviz
from memviz.capture import cupti as _capture, device as _device
from memviz.__main__ import main
from memviz.report.text import GPU_OFF_SENTENCE, NO_GPU_SENTENCE, WIDTH, text_report

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = _capture.gpu_present()[0]
GPU_FLAG = ["--no-gpu"] if HAS_GPU else []
MiB = 1 << 20


def flat(text):
    """Whitespace-normalised text, for sentences the report wraps."""
    return " ".join(text.split())


def run_cli(tmp_path, *args, env=None, gpu_flag=True, timeout=60):
    """Run `python -m memviz run ARGS` in tmp_path; returns the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "memviz", "run", *(GPU_FLAG if gpu_flag else []), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def assert_one_report(stderr):
    assert stderr.count("memviz report") == 1, stderr
    report = stderr[stderr.index("memviz report"):]
    too_wide = [line for line in report.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide
    return report


# ---- how the script ends ----------------------------------------------------


def test_normal_exit_prints_one_report(tmp_path):
    script(tmp_path, "ok.py", """\
        print("hello from the script")
    """)
    p = run_cli(tmp_path, "ok.py")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "hello from the script\n"
    report = assert_one_report(p.stderr)
    assert report.startswith("memviz report: ok.py")
    for section in ("Devices", "Memory outside the tracked allocations", "memviz itself:"):
        assert section in report


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_without_gpu_the_report_says_what_needs_one(tmp_path):
    script(tmp_path, "ok.py", "x = 1\n")
    p = run_cli(tmp_path, "ok.py", gpu_flag=False)
    assert p.returncode == 0, p.stderr
    report = assert_one_report(p.stderr)
    assert "GPU capture off: no NVIDIA driver or GPU found" in report
    assert NO_GPU_SENTENCE in flat(report)
    assert "GPU capture needs an NVIDIA GPU with its driver and CUPTI" in flat(report)
    assert "no GPU allocation was recorded" in report
    # ... and a one-line note before the script runs, without a Python warning.
    first = p.stderr.splitlines()[0]
    assert first.startswith("memviz: GPU capture is off:")
    assert "CaptureWarning" not in p.stderr


def test_no_gpu_flag(tmp_path):
    script(tmp_path, "ok.py", "x = 1\n")
    p = run_cli(tmp_path, "--no-gpu", "ok.py", gpu_flag=False)
    assert p.returncode == 0, p.stderr
    report = assert_one_report(p.stderr)
    assert "GPU capture off: gpu=False was passed" in report
    assert GPU_OFF_SENTENCE in flat(report)
    assert "memviz: GPU capture is off" not in p.stderr  # asked for: no start-up note


def test_exception_prints_traceback_then_report(tmp_path):
    script(tmp_path, "boom.py", """\
        def inner():
            raise ValueError("boom")

        inner()
    """)
    p = run_cli(tmp_path, "boom.py")
    assert p.returncode == 1
    assert_one_report(p.stderr)
    tb = p.stderr.index("Traceback (most recent call last):")
    assert tb < p.stderr.index("ValueError: boom") < p.stderr.index("memviz report")
    # Like `python boom.py`: the traceback starts at the script, not in memviz or runpy.
    traceback_text = p.stderr[tb:p.stderr.index("memviz report")]
    assert "memviz/cli/" not in traceback_text and "runpy" not in traceback_text
    assert 'boom.py", line 4, in <module>' in traceback_text
    assert 'boom.py", line 2, in inner' in traceback_text


def test_syntax_error_is_printed_like_python(tmp_path):
    script(tmp_path, "bad.py", "def (:\n")
    p = run_cli(tmp_path, "bad.py")
    assert p.returncode == 1
    assert "SyntaxError" in p.stderr
    assert "Traceback" not in p.stderr  # Python shows none for a script's syntax error
    assert_one_report(p.stderr)


def test_sys_exit_code_is_kept(tmp_path):
    script(tmp_path, "ex.py", "import sys\nsys.exit(3)\n")
    p = run_cli(tmp_path, "ex.py")
    assert p.returncode == 3
    assert_one_report(p.stderr)
    assert "Traceback" not in p.stderr


def test_sys_exit_with_message(tmp_path):
    script(tmp_path, "ex.py", "import sys\nsys.exit('giving up')\n")
    p = run_cli(tmp_path, "ex.py")
    assert p.returncode == 1
    assert p.stderr.index("giving up") < p.stderr.index("memviz report")
    assert_one_report(p.stderr)


def test_keyboard_interrupt_exits_130_with_report(tmp_path):
    script(tmp_path, "ki.py", "raise KeyboardInterrupt\n")
    p = run_cli(tmp_path, "ki.py")
    assert p.returncode == 130
    assert "KeyboardInterrupt" in p.stderr
    assert_one_report(p.stderr)


def test_real_ctrl_c(tmp_path):
    script(tmp_path, "sleepy.py", """\
        import time
        print("ready", flush=True)
        time.sleep(30)
    """)
    full_env = dict(os.environ, PYTHONPATH=str(ROOT))
    full_env.pop(_capture.ENV_LIBRARY, None)
    # SIGINT's default in the child even where this run inherited it ignored (a
    # suite started in the background by a shell without job control): Python
    # keeps an ignored SIGINT ignored, and the Ctrl-C below would never land.
    proc = subprocess.Popen([sys.executable, "-m", "memviz", "run", *GPU_FLAG, "sleepy.py"],
                            cwd=tmp_path, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "KeyboardInterrupt" in err
    assert_one_report(err)


def test_waits_for_non_daemon_threads_before_reporting(tmp_path):
    script(tmp_path, "th.py", """\
        import sys, threading, time

        def work():
            time.sleep(0.3)
            print("thread done", file=sys.stderr, flush=True)

        threading.Thread(target=work).start()
    """)
    p = run_cli(tmp_path, "th.py")
    assert p.returncode == 0, p.stderr
    assert p.stderr.index("thread done") < p.stderr.index("memviz report")


@pytest.mark.parametrize("pool", ["ThreadPoolExecutor", "ProcessPoolExecutor"])
def test_an_executor_left_open_ends_as_under_python(tmp_path, pool):
    """Python runs threading's shutdown calls (an executor's: stop your
    workers) before it joins the threads; memviz run joined them only, and
    hung for ever."""
    script(tmp_path, "pool.py", f"""\
        from concurrent.futures import {pool}
        ex = {pool}(2)
        print("task ran", ex.submit(abs, -7).result(), flush=True)
    """)
    p = run_cli(tmp_path, "pool.py", timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "task ran 7\n"
    assert_one_report(p.stderr)


def test_a_pool_left_open_prints_nothing_at_exit(tmp_path):
    """The script's objects go once the report is written, while the
    interpreter is whole: kept to its end, multiprocessing's ThreadPool
    printed "Exception ignored in ... Pool.__del__" (python prints nothing)."""
    script(tmp_path, "tp.py", """\
        from multiprocessing.pool import ThreadPool
        pool = ThreadPool(2)
        print(pool.apply(abs, (-3,)))
    """)
    p = run_cli(tmp_path, "tp.py")
    assert p.returncode == 0, p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert_one_report(p.stderr)


def test_outputs_stay_where_they_were_given_when_the_script_changes_folder(tmp_path):
    """--report-file, -o and --flight-dir are taken in the folder memviz run
    started in: a script's os.chdir() wrote the report over a file of the new
    folder, checked by nobody, and lost the flight recorder's dump."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "rep.txt").write_text("PRECIOUS")
    script(tmp_path, "cd.py", """\
        import os
        os.chdir("other")
        raise RuntimeError("after the chdir")
    """)
    p = run_cli(tmp_path, "--report-file", "rep.txt", "--flight-recorder", "16MiB",
                "--flight-dir", "fdir", "cd.py")
    assert p.returncode == 1, p.stderr
    assert (tmp_path / "other" / "rep.txt").read_text() == "PRECIOUS"
    assert (tmp_path / "rep.txt").read_text().startswith("memviz report: cd.py")
    dumps = list((tmp_path / "fdir").glob("*.memviz"))
    assert len(dumps) == 1, (p.stderr, list(tmp_path.rglob("*")))
    assert memviz.load(str(dumps[0])) is not None
    p = run_cli(tmp_path, "-o", "run.memviz", "-f", "cd.py")
    assert (tmp_path / "run.memviz").exists() and not (tmp_path / "other" / "run.memviz").exists()
    note = [line for line in p.stderr.splitlines() if "trace written to" in line]
    assert note and "?)" not in note[0], p.stderr


def test_a_forked_child_of_the_script_prints_no_report(tmp_path):
    """Only the parent reports: a child the script forked, returning through
    the script's end, printed a report of its own and wrote it over the
    parent's --report-file."""
    script(tmp_path, "fk.py", """\
        import os, sys, time
        if os.fork() == 0:
            time.sleep(0.5)
            sys.exit(0)
        os.wait()
    """)
    p = run_cli(tmp_path, "--report-file", "r.txt", "fk.py")
    assert p.returncode == 0, p.stderr
    assert_one_report(p.stderr)
    assert "(still running)" not in (tmp_path / "r.txt").read_text()


def test_a_script_that_sets_stderr_to_none_still_gets_its_report(tmp_path):
    script(tmp_path, "ns.py", "import sys\nsys.stderr = None\n")
    p = run_cli(tmp_path, "--report-file", "ns.txt", "ns.py")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ns.txt").read_text().startswith("memviz report: ns.py")
    assert "internal error" not in p.stdout + p.stderr
    assert_one_report(p.stderr)


# ---- what the script sees ------------------------------------------------------


def test_script_sees_its_arguments_like_python(tmp_path):
    (tmp_path / "sub").mkdir()
    script(tmp_path / "sub", "show.py", """\
        import json, sys
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0],
                          "file": __file__, "main": sys.modules["__main__"].__file__}))
    """)
    p = run_cli(tmp_path, "--top", "3", "sub/show.py", "a", "--top", "5", "-m", "x", "--", "z")
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert seen["argv"][1:] == ["a", "--top", "5", "-m", "x", "--", "z"]
    assert os.path.basename(seen["argv"][0]) == "show.py"
    assert seen["name"] == "__main__"
    assert seen["path0"] == os.path.realpath(tmp_path / "sub")
    assert seen["file"] == seen["main"] == str(tmp_path / "sub" / "show.py")
    assert "memviz report: sub/show.py a --top 5 -m x -- z" in p.stderr


def test_module_form(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    script(pkg, "tool.py", """\
        import json, sys
        print(json.dumps({"argv": sys.argv, "name": __name__}))
    """)
    p = run_cli(tmp_path, "-m", "mypkg.tool", "x", "--no-gpu")
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert seen == {"argv": [str(pkg / "tool.py"), "x", "--no-gpu"], "name": "__main__"}
    assert "memviz report: -m mypkg.tool x --no-gpu" in p.stderr
    assert_one_report(p.stderr)


def test_module_exception_is_a_traceback_not_a_usage_error(tmp_path):
    script(tmp_path, "broken.py", "import no_such_module_here\n")
    p = run_cli(tmp_path, "-m", "broken")
    assert p.returncode == 1
    assert "ModuleNotFoundError" in p.stderr and 'broken.py", line 1' in p.stderr
    assert_one_report(p.stderr)


# ---- mistakes: one line, exit status 2 ---------------------------------------------


def assert_usage_error(p, *words):
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0]
    assert "memviz report" not in p.stderr


def test_missing_script(tmp_path):
    assert_usage_error(run_cli(tmp_path, "nope.py", "arg"), "nope.py", "no such file")


def test_not_a_python_file(tmp_path):
    (tmp_path / "data.txt").write_text("x = 1\n")
    assert_usage_error(run_cli(tmp_path, "data.txt"), "not a .py file", "-m")


def test_directory(tmp_path):
    (tmp_path / "d").mkdir()
    assert_usage_error(run_cli(tmp_path, "d"), "is a directory")


def test_missing_module(tmp_path):
    assert_usage_error(run_cli(tmp_path, "-m", "no_such_module_xyz"), "no_such_module_xyz")


def test_nothing_to_run(tmp_path):
    assert_usage_error(run_cli(tmp_path), "give a script")


def test_report_file_in_missing_folder(tmp_path):
    script(tmp_path, "ok.py", "x = 1\n")
    assert_usage_error(run_cli(tmp_path, "--report-file", "no/such/r.txt", "ok.py"), "--report-file")


def test_bad_option_values(tmp_path):
    script(tmp_path, "ok.py", "x = 1\n")
    for args in (["--depth", "0", "ok.py"], ["--top", "x", "ok.py"], ["--dep", "3", "ok.py"]):
        p = run_cli(tmp_path, *args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (args, p.stderr)


def test_report_file(tmp_path):
    script(tmp_path, "ok.py", "x = 1\n")
    p = run_cli(tmp_path, "--report-file", "r.txt", "ok.py")
    assert p.returncode == 0, p.stderr
    written = (tmp_path / "r.txt").read_text()
    assert written.startswith("memviz report: ok.py")
    assert written in p.stderr


def test_main_without_a_command(capsys):
    assert main([]) == 2
    assert "run" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not reached: main returns argparse's status
        raise SystemExit(main(["--version"]))
    assert "memviz" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    assert "--report-file" in capsys.readouterr().out


def test_basic_example_runs_everywhere(tmp_path):
    p = run_cli(ROOT, "examples/basic.py")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("basic.py: ")
    assert_one_report(p.stderr)


# ---- GPU capture through the libcupti test double ----------------------------------


def test_cli_report_names_the_cupti_library(tmp_path, fake_path):
    script(tmp_path, "alloc.py", f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        lib = FakeCupti({fake_path!r}).lib
        weights = lib.fake_alloc(CBID_cuMemAlloc_v2, 256 << 20, 0, 0)
        lib.fake_alloc(CBID_cuMemAlloc_v2, 1 << 40, 0, 2)
    """)
    p = run_cli(tmp_path, "alloc.py", env={_capture.ENV_LIBRARY: fake_path}, gpu_flag=False)
    assert p.returncode == 0, p.stderr
    report = assert_one_report(p.stderr)
    assert f"capture: CUPTI {fake_path}" in flat(report)
    assert "cuda:0" in report and "256 MiB" in report
    assert "Top lines at the peak of cuda:0 (256 MiB):" in report
    top = report.splitlines()[report.splitlines().index("Top lines at the peak of cuda:0 (256 MiB):") + 1]
    assert "alloc.py:5" in top and "weights = lib.fake_alloc" in top
    assert "Failed allocations (1):" in report and "CUDA error 2: out of memory" in report


@pytest.mark.skipif(sys.version_info < (3, 11), reason="call names need column positions (3.11+)")
@pytest.mark.parametrize("ending", ["", "raise RuntimeError('boom')"], ids=["returns", "raises"])
def test_cli_report_names_calls_through_the_scripts_module_aliases(tmp_path, fake_path, ending):
    """The script ran in a temporary __main__ that is gone by report time:
    its alias G still names the call's module, whether it returns or raises."""
    script(tmp_path, "gpu_ops.py", f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from fake_cupti import FakeCupti
        alloc = FakeCupti({fake_path!r}).lib.fake_alloc
    """)
    script(tmp_path, "names.py", f"""\
        import gpu_ops as G
        from fake_cupti import CBID_cuMemAlloc_v2
        weights = G.alloc(CBID_cuMemAlloc_v2, 256 << 20, 0, 0)
        {ending}
    """)
    p = run_cli(tmp_path, "names.py", env={_capture.ENV_LIBRARY: fake_path}, gpu_flag=False)
    assert p.returncode == (1 if ending else 0), p.stderr
    lines = assert_one_report(p.stderr).splitlines()
    at = lines.index("By call at the peak of cuda:0 (what the innermost Python frame was calling):")
    assert "256 MiB" in lines[at + 1] and lines[at + 1].endswith(" gpu_ops.alloc"), lines[at:at + 3]


def _cli_bytes(cwd, *args, env=None, module="run"):
    """`python -m memviz MODULE ARGS` with bytes out (a file name may be any bytes)."""
    full_env = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "memviz", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, timeout=120)


def _strict_text(data: bytes) -> str:
    """The bytes as UTF-8, failing on anything else (and on encoded lone surrogates)."""
    text = data.decode("utf-8")
    text.encode("utf-8")
    return text


def _no_surrogates(obj):
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, str):
            o.encode("utf-8")
        elif isinstance(o, dict):
            todo += list(o) + list(o.values())
        elif isinstance(o, (list, tuple)):
            todo += list(o)


def test_a_script_in_a_folder_whose_name_is_not_utf8(tmp_path, fake_path):
    """Hardening issue, item 9: every output of a run whose file names hold
    the byte 0xff (the surrogate '\\udcff' in Python) is valid UTF-8 and
    shows the name escaped (\\xff); the trace keeps the name exactly."""
    folder = tmp_path / os.fsdecode(b"d\xffir")
    folder.mkdir()
    s = script(folder, "s.py", f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import memviz
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        lib = FakeCupti({fake_path!r}).lib
        t = memviz.active_tracker()
        for i in range(8):
            w = lib.fake_alloc(CBID_cuMemAlloc_v2, (i + 1) << 20, 0, 0)
            t.step()
    """)
    env = {_capture.ENV_LIBRARY: fake_path}
    trace, report = folder / "t.memviz", folder / "r.txt"
    p = _cli_bytes(tmp_path, "--report-file", str(report), "-o", str(trace), str(s), env=env)
    err = _strict_text(p.stderr)
    assert p.returncode == 0 and "internal error" not in err, err
    written = _strict_text(report.read_bytes())
    assert "d\\xffir" in written and "s.py:8" in written and written in err
    loaded = memviz.load(str(trace))  # the trace keeps the real name
    assert loaded.peak_snapshot().allocations[0].traceback[-1].filename == str(s)
    for fmt in ("text", "json", "html"):
        out = folder / f"r.{fmt}"
        p = _cli_bytes(tmp_path, str(trace), "--format", fmt, "-o", str(out), module="report")
        assert p.returncode == 0, p.stderr.decode("utf-8", "replace")
        _strict_text(p.stderr)
        text = _strict_text(out.read_bytes())
        if fmt == "json":
            doc = json.loads(text)
            assert doc["devices"][0]["top_lines_at_peak"][0]["file"] == str(s)  # lossless
        elif fmt == "html":
            m = re.search(r'<script type="application/json" class="memviz-data">(.*?)</script>',
                          text, re.S)
            data = json.loads(m.group(1))
            _no_surrogates(data)
            assert any("d\\xffir" in n[1] for n in data["names"])
            assert "memviz report: t.memviz" in text
        else:
            assert "d\\xffir" in text and "s.py:8" in text
    p = _cli_bytes(tmp_path, str(trace), module="report")  # to stdout
    assert p.returncode == 0 and "d\\xffir" in _strict_text(p.stdout)
    loaded.to_perfetto(str(folder / "p.json"))
    doc = json.loads(_strict_text((folder / "p.json").read_bytes()))
    _no_surrogates(doc)
    assert any("d\\xffir" in str(e.get("args", {}).get("line", "")) for e in doc["traceEvents"])
    loaded.to_torch_snapshot(str(folder / "s.pickle"))
    import pickle
    snap = pickle.loads((folder / "s.pickle").read_bytes())
    assert snap["segments"][0]["frames"][0]["filename"] == str(s)  # a pickle keeps any str


# ---- text_report in process ----------------------------------------------------------


def test_text_report_without_gpu():
    with memviz.track(gpu=False) as t:
        pass
    report = text_report(t, outside={})
    assert report.startswith("memviz report\n")
    assert GPU_OFF_SENTENCE in flat(report)
    assert "no GPU allocation was recorded" in report
    assert all(len(line) <= WIDTH for line in report.splitlines())
    with pytest.raises(ValueError):
        text_report(t, top=0)


def test_text_report_with_allocations(fake):
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemAllocHost_v2, CBID_cuMemFree_v2

    with memviz.track() as t:
        keep = fake.alloc(CBID_cuMemAlloc_v2, 256 * MiB)  # KEEP
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)  # TEMP
        fake.free(CBID_cuMemFree_v2, tmp)
        fake.alloc(CBID_cuMemAllocHost_v2, 4096)
    assert keep
    report = text_report(t, top=1, outside={0: (300 * MiB, _device.SOURCE_NVML)},
                         command="python train.py")
    assert report.startswith("memviz report: python train.py\n")
    lines = report.splitlines()
    row = next(line for line in lines if line.startswith("  cuda:0 "))
    assert row.split()[1:7] == ["256", "MiB", "320", "MiB", "2", "1"]
    assert any(line.startswith("  pinned host") for line in lines)
    at_peak = lines[lines.index("Top lines at the peak of cuda:0 (320 MiB):") + 1]
    assert "256 MiB" in at_peak and "1 alloc " in at_peak and "keep = fake.alloc(" in at_peak
    assert "1 more line(s) holding 64 MiB" in report  # top=1
    outside = next(line for line in lines if "MiB outside" in line)
    assert "44 MiB outside" in outside and "memviz saw 256 MiB" in outside
    assert all(len(line) <= WIDTH for line in lines)
    # a process number below what memviz saw shows 0, not a negative size
    low = text_report(t, outside={0: (MiB, _device.SOURCE_CUMEMGETINFO)})
    assert "0 B outside" in low and "-" not in low.split("0 B outside")[0].splitlines()[-1]
    assert "device in use 1 MiB" in low


# ---- memory according to the driver ------------------------------------------------


def test_process_device_memory_never_raises():
    result = _device.process_device_memory()
    assert isinstance(result, dict)
    if not HAS_GPU:
        assert result == {}
    for dev, (size, source) in result.items():
        assert isinstance(dev, int) and size >= 0 and source


def test_process_device_memory_does_not_load_libcuda():
    _device.process_device_memory()
    with open("/proc/self/maps") as f:
        maps = f.read()
    if "libcuda.so" not in maps:  # not loaded before: must not be loaded now either
        with pytest.raises(OSError):
            _device._Cuda()


class _StandInNvml:
    """NVIDIA's bindings (pynvml) as far as _device uses them: one device
    whose process list holds this process, another process, and one whose
    figure is not available; ``v3`` False is a driver without the _v3 call."""

    class NVMLError(Exception):
        pass

    def __init__(self, procs, v3=True, init_fails=False):
        self.procs, self.v3, self.init_fails, self.calls = procs, v3, init_fails, []
        if not v3:
            self.nvmlDeviceGetComputeRunningProcesses_v3 = self._missing

    def _missing(self, handle):
        self.calls.append("v3")
        raise self.NVMLError("Function Not Found")

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("NVML Shared Library Not Found")
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        self.calls.append("v3")
        return self.procs

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle):
        self.calls.append("v2")
        return self.procs


def _proc(pid, used):
    return type("P", (), {"pid": pid, "usedGpuMemory": used})()


@pytest.mark.parametrize("v3", [True, False])
def test_nvml_figures_come_from_nvidias_bindings(monkeypatch, v3):
    nvml = _StandInNvml([_proc(111, 5 * MiB), _proc(os.getpid(), 300 * MiB), _proc(222, None)], v3=v3)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert _device._from_nvml(None) == {0: (300 * MiB, _device.SOURCE_NVML)}
    assert nvml.calls == (["init", "v3", "shutdown"] if v3 else ["init", "v3", "v2", "shutdown"])
    # this process not listed, or its figure not available: no NVML answer for the device
    monkeypatch.setitem(sys.modules, "pynvml", _StandInNvml([_proc(111, 5 * MiB), _proc(os.getpid(), None)]))
    assert _device._from_nvml(None) == {}


def test_without_nvidias_bindings_or_a_driver_nvml_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert _device._from_nvml(None) == {}
    monkeypatch.setitem(sys.modules, "pynvml", _StandInNvml([], init_fails=True))
    assert _device._from_nvml(None) == {}


def test_every_command_reads_its_whole_number_options_alike(capsys):
    """run, report and diff take --top (and run --depth) through one argparse
    type: the same usage error, naming what is accepted and what was given."""
    from memviz import _core

    for argv, said in ((["run", "--top", "0", "ok.py"], "expected a positive whole number, got 0"),
                       (["report", "t.memviz", "--top", "x"], "expected a positive whole number, got 'x'"),
                       (["diff", "a.memviz", "b.memviz", "--top", "-1"],
                        "expected a positive whole number, got -1"),
                       (["run", "--depth", str(_core.MAX_DEPTH + 1), "ok.py"],
                        f"expected a whole number from 1 to {_core.MAX_DEPTH}, got {_core.MAX_DEPTH + 1}")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "usage:" in err, (argv, err)


# ---- the README's usage lines ------------------------------------------------------


def _usage_options(text):
    """{option: metavar or None} of the ``[--opt META]`` groups of a usage text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\[(-{1,2}[\w-]+)(?: ([A-Za-z_.]+))?[]|]", text)}


def _readme_run_usage():
    """The ``python -m memviz run`` lines of the README's "From the command line" block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From the command line", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert block.lstrip().startswith("python -m memviz run"), block
    return block


def test_the_readme_usage_names_every_option_of_memviz_run():
    """The parser's usage is argparse's, generated from its options; the
    README's usage block names each of them with the same metavar."""
    from memviz.cli import run as cli_run

    parser = cli_run.build_parser("python -m memviz run")
    assert parser.usage is None  # no hand-written usage line to drift
    generated = _usage_options(parser.format_usage())
    generated.pop("-h")
    ours = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert len(generated) == len(ours) >= 10  # one group per option in argparse's line
    assert generated.pop("-m") == "module"  # the README's second line: -m package.module
    readme = _readme_run_usage()
    named = _usage_options(readme)
    assert named == generated, (named, generated)
    assert "script.py [args ...]" in readme and "-m package.module [args ...]" in readme
    # and whatever the README names elsewhere in the block is an option of the parser
    known = {o for a in parser._actions for o in a.option_strings}
    assert set(re.findall(r"(?<![\w-])(-{1,2}[a-z][\w-]*)", readme)) <= known


def test_the_usage_line_of_help_comes_from_the_parser(capsys):
    assert main(["run", "--help"]) == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert re.match(r"usage: (python -m )?memviz run \[-h\] \[--precise\] \[--autograd\]", usage), usage
    assert "[--flight-recorder SIZE] [--flight-dir DIR]" in usage and "[-o TRACE]" in usage
    assert usage.endswith(("[-m module] [script.py] [args ...]", "[-m module | script.py] [args ...]"))
