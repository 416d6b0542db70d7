"""Packaging: the distribution's name, what the sdist and wheel hold, and the
sample trace shipped for a first run without a GPU.

The package index's ``memviz`` is another project, so memviz is distributed
as ``memviz-gpu`` (``import memviz`` stays). ``memviz run examples/basic.py``
without a GPU follows its own report with the report of memviz/data's sample
trace, labelled with where and when it was recorded.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import memviz
from memviz.capture import cupti as _capture
from memviz.cli import sample as _cli_sample
from memviz._errors import TraceError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "memviz" / "data"
DIST = "memviz-gpu"
HAS_GPU = _capture.gpu_present()[0]
#: what the installed package reads at run time, besides its .py files
RUNTIME_FILES = ("memviz/report/assets/report.js", "memviz/report/assets/report.css",
                 "memviz/data/sample.memviz", "memviz/data/sample.json")


def project_name():
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^name = "([^"]+)"', text, re.M).group(1)


def run_memviz(cwd, *args, env=None):
    full = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "memviz", "run", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120)


# ---- the name ---------------------------------------------------------------------


def test_the_distribution_has_a_name_of_its_own():
    assert project_name() == DIST
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {DIST}" in readme
    # ... and says that the bare name installs someone else's project.
    assert re.search(r"`pip install memviz`[^.]*another project", " ".join(readme.split()))


def test_every_install_hint_names_the_distribution():
    """A hint saying `pip install memviz` (any options) would install the other project."""
    hint = re.compile(r"pip install(?: -{1,2}[\w-]+)* memviz(?![\w-])")
    wrong = []
    for path in sorted((ROOT / "memviz").rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if hint.search(line):
                wrong.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


# ---- the sample -------------------------------------------------------------------


def sample_meta():
    return json.loads((DATA / "sample.json").read_text())


def top_lines(trace, script):
    """(line number, size) of the script's lines at the peak of cuda:0, largest first."""
    stats = [s for s in trace.peak_snapshot(0).statistics("lineno") if s.key.filename == script]
    return [(s.key.lineno, s.size) for s in stats]


def check_sample(trace_file, meta):
    assert trace_file.stat().st_size < 1 << 20
    assert {"machine", "date", "script"} <= set(meta) and all(
        isinstance(meta[k], str) and meta[k] for k in ("machine", "date", "script"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", meta["date"])
    trace = memviz.load(trace_file)
    assert trace.gpu_enabled and not trace.truncated
    # The recorded lines are the script's, as the script read when it was
    # recorded (sample.json keeps its text).
    source = meta["script_source"].splitlines()
    lines = top_lines(trace, meta["script"])
    assert len(lines) >= 3, lines
    if meta["script"] == "examples/basic.py":  # the demo (record_sample.py's default)
        calls = sorted(re.search(r"torch\.(\w+)\(", source[n - 1]).group(1) for n, _ in lines[:3])
        assert calls == ["empty", "ones", "zeros"]
    else:  # the shipped sample: a training run, its forward's lines on top, steps, a leak found
        assert all(source[n - 1].strip() and not source[n - 1].strip().startswith("#") for n, _ in lines)
        assert len(trace.steps) >= 10
        assert [f.kind for f in memviz.diagnose(trace)] == ["growth"]
    # Every byte once at the peak: the lines add up to the peak (on the allocator
    # route PyTorch's blocks lie inside its segments; neither is counted twice).
    peak = trace.peak_snapshot(0)
    assert peak.total_bytes() == trace.totals()[0]["peak"]
    assert sum(s.size for s in peak.statistics("lineno")) == trace.totals()[0]["peak"]
    return trace


def test_the_shipped_sample_is_small_and_described():
    check_sample(DATA / "sample.memviz", sample_meta())


def test_record_sample_writes_both_files(fake_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "record_sample.py"),
                        "--fake-cupti", "--out-dir", str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "sample.json").read_text())
    assert meta["script"] == "examples/basic.py" and "placeholder" in meta["machine"]
    assert meta["script_source"] == (ROOT / "examples" / "basic.py").read_text()
    trace = check_sample(tmp_path / "sample.memviz", meta)
    sizes = dict(top_lines(trace, "examples/basic.py"))
    assert sorted(sizes.values()) == [128 << 20, 256 << 20, 512 << 20]
    assert sorted(os.listdir(tmp_path)) == ["sample.json", "sample.memviz"]  # no temporaries left


def test_record_sample_refuses_a_missing_folder(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "record_sample.py"),
                        "--fake-cupti", "--out-dir", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "does not exist" in p.stderr
    assert not (tmp_path / "nope").exists()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the demo records its own run")
def test_the_demo_without_a_gpu_shows_the_sample_after_its_own_report(tmp_path):
    meta = sample_meta()
    p = run_memviz(tmp_path, str(ROOT / "examples" / "basic.py"))
    assert p.returncode == 0, p.stderr
    err = p.stderr
    assert err.count("memviz report") == 1, err  # the run's own report, once
    off, own, sample = (err.index(s) for s in ("GPU capture is off", "memviz report: ", "SAMPLE"))
    assert off < own < sample
    heading = " ".join(err[sample - 200:].split())
    for word in ("not this machine's data", f"recorded on {meta['machine']} on {meta['date']} "
                 f"running {meta['script']}"):
        assert word in heading, heading
    tail = err[sample:]
    assert f"SAMPLE (recorded on {meta['date']}, not on this machine): {meta['script']}" in tail
    # Its lines, with their source as recorded (tmp_path has no examples/basic.py).
    source = meta["script_source"].splitlines()
    for n, _ in top_lines(memviz.load(DATA / "sample.memviz"), meta["script"])[:3]:
        assert re.search(rf"{re.escape(meta['script'])}:{n} +{re.escape(source[n - 1].strip()[:12])}", tail), n
    assert all(len(line) <= 99 for line in err[own:].splitlines())


def test_the_sample_is_only_for_scripts_that_ask_and_not_with_no_gpu(tmp_path):
    (tmp_path / "plain.py").write_text("x = 1\n")
    (tmp_path / "asks.py").write_text("MEMVIZ_SAMPLE_WITHOUT_GPU = True\n")
    (tmp_path / "fails.py").write_text("MEMVIZ_SAMPLE_WITHOUT_GPU = True\nraise SystemExit(3)\n")
    p = run_memviz(tmp_path, "plain.py")
    assert p.returncode == 0 and "SAMPLE" not in p.stderr
    p = run_memviz(tmp_path, "--no-gpu", "asks.py")
    assert p.returncode == 0 and "SAMPLE" not in p.stderr
    if not HAS_GPU:
        p = run_memviz(tmp_path, "asks.py")
        assert p.returncode == 0 and "SAMPLE" in p.stderr
    p = run_memviz(tmp_path, "fails.py")  # a script that did not return: no globals to read
    assert p.returncode == 3 and "SAMPLE" not in p.stderr


@pytest.mark.parametrize("damage", ["no json", "bad json", "not an object", "no machine",
                                    "no trace", "bad trace"])
def test_a_broken_sample_says_what_to_do(tmp_path, monkeypatch, capsys, damage):
    shutil.copy(DATA / "sample.memviz", tmp_path)
    meta = sample_meta()
    text = json.dumps(meta)
    if damage == "no json":
        text = None
    elif damage == "bad json":
        text = text[:-3]
    elif damage == "not an object":
        text = json.dumps([meta])
    elif damage == "no machine":
        text = json.dumps({**meta, "machine": ""})
    elif damage == "no trace":
        (tmp_path / "sample.memviz").unlink()
    elif damage == "bad trace":
        (tmp_path / "sample.memviz").write_bytes(b"not a trace at all")
    if text is not None:
        (tmp_path / "sample.json").write_text(text)
    monkeypatch.setattr(_cli_sample, "_sample_folder", lambda: tmp_path)
    with pytest.raises(TraceError) as e:
        _cli_sample.sample_report()
    assert "sample" in str(e.value) and "pip install --force-reinstall memviz-gpu" in str(e.value)
    _cli_sample.show_sample(10)  # never raises: one line saying why
    err = capsys.readouterr().err
    assert err.startswith("memviz: no sample report to show: ") and err.count("\n") == 1


def test_the_sample_report_reads_the_recorded_source_and_puts_linecache_back():
    import linecache

    meta = sample_meta()
    before = linecache.cache.get(meta["script"])
    text = _cli_sample.sample_report()
    assert linecache.cache.get(meta["script"]) == before
    assert "memviz report" not in text  # not to be taken for this run's report
    n = top_lines(memviz.load(DATA / "sample.memviz"), meta["script"])[0][0]
    assert meta["script_source"].splitlines()[n - 1].strip()[:20] in text


# ---- sdist and wheel --------------------------------------------------------------


def _unmet_build_needs():
    """Why `python -m build --no-isolation` cannot run in this environment, or None."""
    try:
        from build import ProjectBuilder  # noqa: F401 - a real `build`, not a build/ folder
        from packaging.requirements import Requirement
    except ImportError:
        return "needs the `build` package (pip install build) to make the sdist and wheel"
    from importlib.metadata import PackageNotFoundError, version

    block = re.search(r"^requires = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    unmet, wanted = [], []
    for text in re.findall(r'"([^"]+)"', block.group(1)):
        req = Requirement(text)
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                unmet.append(f"{text} (have {version(req.name)})")
                wanted.append(f"'{text}'")
        except PackageNotFoundError:
            unmet.append(f"{text} (not installed)")
            wanted.append(f"'{text}'")
    if unmet:
        return (f"building without isolation needs {', '.join(unmet)}: "
                f"pip install {' '.join(wanted)}")
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist file names, wheel file names) of `python -m build` on a copy of the tree."""
    why = _unmet_build_needs()
    if why is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    # A copy: no build outputs or stale *.egg-info of the tree get in.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "_build"))
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "out"),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "warn" in line.lower()
              and "byte-compiling is disabled" not in line]  # PYTHONDONTWRITEBYTECODE
    assert not warned, warned
    sdist, = (tmp / "out").glob("*.tar.gz")
    wheel, = (tmp / "out").glob("*.whl")
    with tarfile.open(sdist) as t:
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
        metadata = z.read(next(n for n in in_wheel if n.endswith(".dist-info/METADATA"))).decode()
    return sdist.name, in_sdist, wheel.name, in_wheel, metadata


def test_the_sdist_and_wheel_hold_what_memviz_reads_at_run_time(built):
    sdist, in_sdist, wheel, in_wheel, metadata = built
    assert sdist.startswith("memviz_gpu-") and wheel.startswith("memviz_gpu-")
    assert "Name: memviz-gpu" in metadata
    for name in RUNTIME_FILES:
        assert name in in_sdist and name in in_wheel, name
    assert any(re.fullmatch(r"memviz/_core\..*\.so", n) for n in in_wheel), sorted(in_wheel)
    # The sdist builds the extension and runs the demo and the tests.
    for name in ("setup.py", "src/module.c", "src/cupti_abi.h", "examples/basic.py",
                 "tests/fake_cupti/fake_cupti.c", "tests/conftest.py"):
        assert name in in_sdist, name
    assert not [n for n in in_sdist | in_wheel if "/_build/" in n or n.endswith((".so", ".pyc"))
                and not n.startswith("memviz/_core.")]
    assert not [n for n in in_wheel if n.startswith(("tests/", "examples/", "benchmarks/"))]


def test_the_training_sample_says_what_it_needs_without_a_gpu():
    """examples/train_sample.py (the run the shipped sample is of) says in
    one sentence that it needs a CUDA GPU, and why there is none, and exits 0."""
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "train_sample.py")], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, p.stderr
    out = p.stdout.strip()
    assert out.startswith("train_sample.py: this example needs a CUDA GPU, and ") and out.endswith("."), out
