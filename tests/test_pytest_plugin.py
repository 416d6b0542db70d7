"""The memviz pytest plugin, run on generated test files with pytester.

GPU checks (peak=, leaks=) run through the libcupti test double: the outer
``fake`` fixture points MEMVIZ_CUPTI_LIBRARY at it, and the inner tests fire
"driver" allocations with FakeCupti, exactly as CUDA would.
"""

import importlib.metadata
import json

import pytest

from memviz import _capture

try:  # import torch here, once: pytester's in-process runs drop modules first
    import torch  # noqa: F401  imported inside them, and torch cannot be imported twice
except ImportError:
    torch = None

pytest_plugins = ["pytester"]


def _installed() -> bool:
    try:
        eps = importlib.metadata.entry_points(group="pytest11")
    except TypeError:  # pragma: no cover - Python 3.9 API
        eps = importlib.metadata.entry_points().get("pytest11", [])
    return any(ep.value == "memviz.pytest_plugin" for ep in eps)


#: the plugin is active through its entry point once memviz is installed;
#: from a source checkout load it by name (both at once would register it twice)
PLUGIN = [] if _installed() else ["-p", "memviz.pytest_plugin"]
#: other installed plugins only slow the inner runs down
QUIET = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark"]

GPU = """
import os, pytest
from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
fake = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"])
MiB = 1 << 20
"""


def run(pytester, source, *args, name="test_inner"):
    pytester.makepyfile(**{name: source})
    return pytester.runpytest(*PLUGIN, *QUIET, *args)


def lineno(source, marker):
    for i, text in enumerate(source.strip("\n").splitlines(), 1):  # makepyfile strips blank lines
        if marker in text:
            return i
    raise AssertionError(marker)


# ---- markers are registered, and no work is done without them ----------------------


def test_markers_are_registered_for_strict_markers(pytester):
    src = """
import pytest
@pytest.mark.no_graph_leak
def test_a():
    pass
@pytest.mark.memviz(peak="1 GiB")
def test_b():
    pass
"""
    pytester.makepyfile(test_m=src)
    r = pytester.runpytest(*PLUGIN, *QUIET, "--strict-markers", "--collect-only", "-q")
    assert r.ret == 0, r.stdout.str()
    r = pytester.runpytest(*PLUGIN, *QUIET, "--markers")
    r.stdout.fnmatch_lines(["*@pytest.mark.memviz(peak=None, leaks=False)*",
                            "*@pytest.mark.no_graph_leak*"])


def test_no_per_test_hooks_without_markers(pytester):
    src = """
def test_plain(request):
    assert request.config.pluginmanager.has_plugin("memviz.pytest_plugin") or \\
        request.config.pluginmanager.has_plugin("memviz")
    assert not request.config.pluginmanager.has_plugin("memviz-runner")
"""
    r = run(pytester, src)
    r.assert_outcomes(passed=1)


# ---- peak= ----------------------------------------------------------------------------

PEAK = GPU + """
@pytest.mark.memviz(peak="100 MiB")
def test_small():
    a = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)
    fake.free(CBID_cuMemFree_v2, a)

@pytest.mark.memviz(peak="10 MiB")
def test_big():
    a = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)  # BIG
    fake.free(CBID_cuMemFree_v2, a)
"""


def test_peak_passes_under_the_budget_and_fails_over_it(pytester, fake):
    r = run(pytester, PEAK)
    r.assert_outcomes(passed=1, failed=1)
    out = r.stdout.str()
    assert "memviz: GPU peak 64 MiB on cuda:0 exceeds the budget of 10 MiB" in out
    assert "@pytest.mark.memviz(peak='10 MiB')" in out
    assert f"test_inner.py:{lineno(PEAK, '# BIG')}: size=64 MiB" in out
    assert "What to do" in out


def test_peak_counts_fixture_setup(pytester, fake):
    src = GPU + """
@pytest.fixture
def weights():
    a = fake.alloc(CBID_cuMemAlloc_v2, 40 * MiB)  # WEIGHTS
    yield a
    fake.free(CBID_cuMemFree_v2, a)

@pytest.mark.memviz(peak="50 MiB")
def test_uses_weights(weights):
    b = fake.alloc(CBID_cuMemAlloc_v2, 20 * MiB)
    fake.free(CBID_cuMemFree_v2, b)
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    assert "GPU peak 60 MiB" in r.stdout.str()
    assert f"test_inner.py:{lineno(src, '# WEIGHTS')}: size=40 MiB" in r.stdout.str()


# ---- leaks= ----------------------------------------------------------------------------

LEAKS = GPU + """
kept = []

@pytest.mark.memviz(leaks=True)
def test_leaks():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))  # LEAK
    b = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
    fake.free(CBID_cuMemFree_v2, b)

@pytest.mark.memviz(leaks=True)
def test_clean():
    b = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
    fake.free(CBID_cuMemFree_v2, b)

@pytest.mark.memviz(leaks="4 MiB")
def test_tolerated():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))
"""


def test_leaks_fail_with_the_line_and_pass_when_freed(pytester, fake):
    r = run(pytester, LEAKS)
    r.assert_outcomes(passed=2, failed=1)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_leaks" in out
    assert "memviz: the test left 3 MiB of GPU memory it allocated alive after it returned" in out
    assert f"test_inner.py:{lineno(LEAKS, '# LEAK')}: size=3 MiB, count=1" in out


def test_memory_a_fixture_holds_until_teardown_is_not_a_leak(pytester, fake):
    src = GPU + """
@pytest.fixture
def buffer():
    a = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
    yield a
    fake.free(CBID_cuMemFree_v2, a)

@pytest.mark.memviz(leaks=True, peak="1 GiB")
def test_uses_buffer(buffer):
    assert buffer
"""
    run(pytester, src).assert_outcomes(passed=1)


def test_a_failing_test_reports_only_its_own_failure(pytester, fake):
    src = GPU + """
kept = []
@pytest.mark.memviz(leaks=True, peak="1 MiB")
def test_fails():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 30 * MiB))
    assert 1 == 2, "own failure"
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    assert "own failure" in r.stdout.str() and "memviz:" not in r.stdout.str()


# ---- skipped, with the reason, where GPU capture is unavailable ------------------------


def test_gpu_checks_skip_with_the_reason_without_capture(pytester, monkeypatch):
    if _capture.gpu_present()[0]:
        pytest.skip("this machine has a GPU: the skip path is for machines without one")
    monkeypatch.delenv(_capture.ENV_LIBRARY, raising=False)
    src = """
import pytest
@pytest.mark.memviz(peak="1 GiB")
def test_peak():
    pass
@pytest.mark.memviz(leaks=True)
def test_leaks():
    pass
@pytest.mark.no_graph_leak
def test_graph_runs_on_cpu():
    pass
"""
    r = run(pytester, src, "-rs")
    import importlib.util

    has_torch = importlib.util.find_spec("torch") is not None  # no_graph_leak skips without it
    r.assert_outcomes(skipped=2 if has_torch else 3, passed=1 if has_torch else 0)
    out = r.stdout.str()
    assert "this test's GPU memory check (peak='1 GiB') needs GPU capture, which is unavailable here" in out
    assert "(leaks=True)" in out and "no NVIDIA driver or GPU found" in out


# ---- marker mistakes say what to do ---------------------------------------------------


@pytest.mark.parametrize("mark, expected", [
    ("memviz()", "checks nothing; use @pytest.mark.memviz(peak='2 GiB')"),
    ("memviz(peak='lots')", "@pytest.mark.memviz(peak='lots'): cannot parse size 'lots'"),
    ("memviz(budget=1)", "takes the keywords peak= and leaks= only, got budget="),
    ("memviz(leaks='some')", "takes True or a size to tolerate"),
])
def test_marker_mistakes(pytester, fake, mark, expected):
    src = f"""
import pytest
@pytest.mark.{mark}
def test_x():
    pass
"""
    r = run(pytester, src)
    r.assert_outcomes(errors=1)
    assert expected in r.stdout.str()


# ---- no_graph_leak (CPU tensors) --------------------------------------------------------

GRAPH = """
import pytest, torch
history = []
model = torch.nn.Linear(16, 16)

def test_keeps_plain_tensors():
    history.append(torch.zeros(1))  # no graph: not the line to name

@pytest.mark.no_graph_leak
def test_keeps_graph():
    for _ in range(3):
        loss = model(torch.randn(8, 16)).relu().sum()  # FORWARD
        history.append(loss)  # KEEP

@pytest.mark.no_graph_leak
def test_keeps_numbers():
    numbers = []
    for _ in range(3):
        loss = model(torch.randn(8, 16)).relu().sum()
        numbers.append(loss.item())

@pytest.mark.no_graph_leak
def test_backward_then_drop():
    loss = model(torch.randn(8, 16)).relu().sum()
    loss.backward()
"""


def test_no_graph_leak_names_the_holder_and_the_line(pytester):
    pytest.importorskip("torch", reason="no_graph_leak needs torch")
    r = run(pytester, GRAPH)
    r.assert_outcomes(passed=3, failed=1)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_keeps_graph" in out
    assert "an autograd graph created in this test is still reachable after it returned" in out
    assert "held by list `history` in module test_inner" in out
    assert f"kept at {pytester.path / 'test_inner.py'}:{lineno(GRAPH, '# KEEP')}" in out
    assert f"test_inner.py:{lineno(GRAPH, '# FORWARD')}: " in out  # the line that saved tensors
    assert "loss.item()" in out


def test_graph_leak_in_a_fixture_object(pytester):
    pytest.importorskip("torch", reason="no_graph_leak needs torch")
    src = """
import pytest, torch

class Logger:
    def __init__(self):
        self.values = []
    def log(self, v):
        self.values.append(v)  # KEEP

LOG = Logger()

@pytest.mark.no_graph_leak
def test_logs_tensor():
    w = torch.ones(4, requires_grad=True)
    LOG.log((w * 2).sum())
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "held by list `values` of a Logger object" in out
    assert f"test_inner.py:{lineno(src, '# KEEP')}" in out


# ---- the memviz_tracker fixture, --memviz and --memviz-report ----------------------------


def test_memviz_tracker_fixture(pytester, fake):
    src = GPU + """
import memviz

def test_own_tracker(memviz_tracker):
    assert memviz_tracker.running and memviz.active_tracker() is memviz_tracker
    fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    assert memviz_tracker.current_bytes() == 2 * MiB

@pytest.mark.memviz(peak="1 GiB")
def test_markers_tracker(memviz_tracker):
    a = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    fake.free(CBID_cuMemFree_v2, a)
    assert memviz_tracker.peak_bytes() == 2 * MiB
"""
    run(pytester, src).assert_outcomes(passed=2)


def test_memviz_option_prints_a_table_and_writes_a_report(pytester, fake, tmp_path):
    src = GPU + """
kept = []
def test_big():
    a = fake.alloc(CBID_cuMemAlloc_v2, 96 * MiB)  # BIG
    fake.free(CBID_cuMemFree_v2, a)
def test_leaky():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB))
def test_nothing():
    pass
"""
    report = tmp_path / "mem.json"
    r = run(pytester, src, "--memviz", f"--memviz-report={report}")
    r.assert_outcomes(passed=3)
    out = r.stdout.str()
    assert "memviz: GPU memory per test" in out
    r.stdout.fnmatch_lines(["*96 MiB*0 B*test_inner.py::test_big*test_inner.py:*",
                            "*2 MiB*2 MiB*test_inner.py::test_leaky*"])
    data = json.loads(report.read_text())
    assert data["capture_available"] is True
    rows = {t["nodeid"]: t for t in data["tests"]}
    assert rows["test_inner.py::test_big"]["peak_bytes"] == 96 * MiB
    assert rows["test_inner.py::test_big"]["top_lines"][0]["line"].endswith(f"test_inner.py:{lineno(src, '# BIG')}")
    assert rows["test_inner.py::test_leaky"]["leaked_bytes"] == 2 * MiB
    assert rows["test_inner.py::test_nothing"]["peak_bytes"] == 0


MiB = 1 << 20
