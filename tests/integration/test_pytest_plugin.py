"""The memviz pytest plugin, run on generated test files with pytester.

GPU checks (peak=, leaks=) run through the libcupti test double: the outer
``fake`` fixture points MEMVIZ_CUPTI_LIBRARY at it, and the inner tests fire
"driver" allocations with FakeCupti, exactly as CUDA would.
"""

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

from memviz.capture import cupti as _capture

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
    return any(ep.value == "memviz.integrations.pytest_plugin" for ep in eps)


#: the plugin is active through its entry point once memviz is installed;
#: from a source checkout load it by name (both at once would register it twice)
PLUGIN = [] if _installed() else ["-p", "memviz.integrations.pytest_plugin"]
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


def marker_line(source, test):
    """The line of the marker just above ``def test``."""
    return lineno(source, f"def {test}(") - 1


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
    r.stdout.fnmatch_lines(["*@pytest.mark.memviz(peak=None, leaks=False, own_code=False, filter_fn=None, warmups=0)*",
                            "*@pytest.mark.no_graph_leak*"])


def test_no_per_test_hooks_without_markers(pytester):
    src = """
def test_plain(request):
    assert request.config.pluginmanager.has_plugin("memviz.integrations.pytest_plugin") or \\
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
    assert f"@pytest.mark.memviz(peak='10 MiB') at test_inner.py:{marker_line(PEAK, 'test_big')}" in out
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


XFAIL = GPU + """
kept = []

@pytest.mark.xfail(reason="known leak")
@pytest.mark.memviz(leaks=True)
def test_known_leak():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))

@pytest.mark.xfail(reason="known leak", strict=True)
@pytest.mark.memviz(leaks=True)
def test_known_leak_strict():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))

@pytest.mark.xfail(reason="fixed", strict=True)
@pytest.mark.memviz(leaks=True)
def test_strict_but_clean():
    b = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
    fake.free(CBID_cuMemFree_v2, b)

@pytest.mark.xfail(raises=KeyError)
@pytest.mark.memviz(leaks=True)
def test_expects_another_error():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))
"""


def test_a_check_failing_in_an_xfail_test_is_an_xfail(pytester, fake):
    """A known leak marked xfail: XFAIL, as a test that raised (memviz made
    it FAILED); strict xfail that memviz passes stays an XPASS(strict)
    failure; xfail(raises=...) expects another failure: memviz's fails it."""
    r = run(pytester, XFAIL)
    r.assert_outcomes(xfailed=2, failed=2)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_strict_but_clean" in out
    assert "FAILED test_inner.py::test_expects_another_error" in out
    r = run(pytester, XFAIL, "--runxfail")
    r.assert_outcomes(failed=3, passed=1)


BACKGROUND = GPU + """
import threading
kept, ask, done = [], threading.Event(), threading.Event()

def worker():  # a prefetcher: its buffer lives on after the test that saw it made
    while True:
        ask.wait(); ask.clear()
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, MiB))  # WORKER
        done.set()

def test_starts_a_worker():
    threading.Thread(target=worker, daemon=True).start()

def _worker_allocates():
    done.clear(); ask.set(); assert done.wait(10)

@pytest.mark.memviz(leaks=True)
def test_clean():
    _worker_allocates()

@pytest.mark.memviz(leaks=True)
def test_leaky():
    _worker_allocates()
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB))  # LEAK

@pytest.mark.memviz(leaks=True)
def test_own_thread_leaks():
    t = threading.Thread(target=lambda: kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)))  # MINE
    t.start(); t.join()
"""


def test_memory_a_thread_running_before_the_test_allocates_is_not_its_leak(pytester, fake):
    """A background thread an earlier test started (a prefetcher) allocated
    during a test and kept it a while: the test, which freed everything it
    made, failed with the thread's line. What threads already running when
    the call began allocate is not counted, and is listed apart; a thread
    the test starts itself is the test's."""
    r = run(pytester, BACKGROUND)
    r.assert_outcomes(passed=2, failed=2)
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_leaky" in out and "FAILED test_inner.py::test_own_thread_leaks" in out
    assert "memviz: the test left 2 MiB of GPU memory" in out
    assert "Not counted (made by threads already running when the test began" in out
    assert f"test_inner.py:{lineno(BACKGROUND, '# WORKER')}: size=1 MiB, count=1" in out
    assert "memviz: the test left 3 MiB of GPU memory" in out
    assert f"test_inner.py:{lineno(BACKGROUND, '# MINE')}: size=3 MiB, count=1" in out


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


# ---- without GPU capture the test still runs; only memviz's GPU checks are skipped ----------

NO_GPU = """
import pytest
kept = []

@pytest.mark.memviz(peak="1 GiB")
def test_peak():
    assert sum(range(4)) == 6

@pytest.mark.memviz(leaks=True)
def test_leaks():
    kept.append(bytearray(10))

@pytest.mark.memviz(peak="1 GiB", leaks=True)
def test_body_fails():
    assert 1 == 2, "the test's own assertion"  # OWN

@pytest.mark.no_graph_leak
def test_graph_runs_on_cpu():
    pass
"""


@pytest.fixture
def no_capture(monkeypatch):
    """GPU capture unavailable: no GPU on this machine and no test double."""
    if _capture.gpu_present()[0]:
        pytest.skip("this machine has a GPU: the no-capture path is for machines without one")
    monkeypatch.delenv(_capture.ENV_LIBRARY, raising=False)


def test_without_capture_marked_tests_run_and_fail_on_their_own_assertions(pytester, no_capture):
    src = NO_GPU
    r = run(pytester, src)
    r.assert_outcomes(passed=3, failed=1)  # no_graph_leak's test runs with or without torch
    out = r.stdout.str()
    assert "FAILED test_inner.py::test_body_fails" in out
    assert "the test's own assertion" in out
    assert f"test_inner.py:{lineno(src, '# OWN')}: AssertionError" in out


def test_without_capture_the_skipped_checks_are_in_the_summary_and_report(pytester, no_capture, tmp_path):
    src = NO_GPU
    report = tmp_path / "mem.json"
    r = run(pytester, src, f"--memviz-report={report}")
    out = r.stdout.str()
    assert "SKIPPED" not in out and " skipped" not in out.splitlines()[-1]
    assert "memviz: checks not run (the tests themselves ran)" in out
    reason = "GPU capture is unavailable here: no NVIDIA driver or GPU found"
    r.stdout.fnmatch_lines([
        f"test_inner.py::test_peak: peak='1 GiB' (marker at test_inner.py:{marker_line(src, 'test_peak')})",
        f"test_inner.py::test_leaks: leaks=True (marker at test_inner.py:{marker_line(src, 'test_leaks')})",
        f"  why: {reason}*",
        "  what to do: run them on a machine with an NVIDIA GPU and CUPTI*",
    ])
    data = json.loads(report.read_text())
    assert data["capture_available"] is False
    rows = {t["nodeid"]: t for t in data["tests"]}
    peak = rows["test_inner.py::test_peak"]
    assert peak["failed_checks"] == 0 and peak["checks_run"] == []
    assert [c["check"] for c in peak["checks_skipped"]] == ["peak='1 GiB'"]
    assert peak["checks_skipped"][0]["reason"].startswith(reason)
    assert "MEMVIZ_CUPTI_LIBRARY" in peak["checks_skipped"][0]["what_to_do"]
    assert [c["check"] for c in rows["test_inner.py::test_leaks"]["checks_skipped"]] == ["leaks=True"]
    both = rows["test_inner.py::test_body_fails"]["checks_skipped"]
    assert [c["check"] for c in both] == ["peak='1 GiB'", "leaks=True"]
    assert all(c["reason"].startswith(reason) for c in both)
    graph = rows["test_inner.py::test_graph_runs_on_cpu"]
    if torch is not None:  # without torch: test_no_graph_leak_without_torch_runs_the_test
        assert graph["checks_run"] == ["no_graph_leak"] and graph["checks_skipped"] == []


def test_no_graph_leak_without_torch_runs_the_test_and_lists_the_check(pytester, monkeypatch, tmp_path):
    """Without PyTorch no graph can be made: the test body still runs (a
    failing one fails) and the check is listed as not run, with what to do."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, here and in the inner run
    src = """
import pytest

@pytest.mark.no_graph_leak
def test_graph_runs_on_cpu():
    pass

@pytest.mark.no_graph_leak
def test_graph_body_fails():
    assert 1 == 2, "the test's own assertion"
"""
    report = tmp_path / "mem.json"
    r = run(pytester, src, f"--memviz-report={report}")
    r.assert_outcomes(passed=1, failed=1)
    assert "the test's own assertion" in r.stdout.str()
    r.stdout.fnmatch_lines([
        "*memviz: checks not run (the tests themselves ran)*",
        f"test_inner.py::test_graph_runs_on_cpu: no_graph_leak (marker at "
        f"test_inner.py:{marker_line(src, 'test_graph_runs_on_cpu')})",
        "  why: PyTorch is not installed*",
        "  what to do: pip install torch*",
    ])
    rows = {t["nodeid"]: t for t in json.loads(report.read_text())["tests"]}
    ran = rows["test_inner.py::test_graph_runs_on_cpu"]
    assert ran["checks_run"] == [] and [c["check"] for c in ran["checks_skipped"]] == ["no_graph_leak"]


def test_a_capture_conflict_skips_only_the_gpu_checks(pytester, fake):
    src = GPU + """
fake.set_conflict("nsys")

@pytest.mark.memviz(leaks=True)
def test_passes():
    assert True

@pytest.mark.memviz(peak="1 MiB")
def test_fails():
    assert 1 == 2, "own failure"
"""
    r = run(pytester, src)
    r.assert_outcomes(passed=1, failed=1)
    out = r.stdout.str()
    assert "own failure" in out
    r.stdout.fnmatch_lines([
        "*memviz: checks not run*",
        "test_inner.py::test_passes: leaks=True (marker at test_inner.py:*)",
        "test_inner.py::test_fails: peak='1 MiB' (marker at test_inner.py:*)",
        "  why: memviz cannot capture GPU allocations: CUPTI is already in use in this process by nsys*",
        "  what to do: stop the other profiler before the test*",
    ])


def test_checks_of_a_failing_test_are_listed_as_not_judged(pytester, fake, tmp_path):
    src = GPU + """
@pytest.mark.memviz(peak="1 GiB")
def test_fails():
    assert 1 == 2

@pytest.mark.memviz(leaks=True)
def test_skips_itself():
    pytest.skip("not today")
"""
    report = tmp_path / "mem.json"
    r = run(pytester, src, f"--memviz-report={report}")
    r.assert_outcomes(failed=1, skipped=1)
    assert "memviz: checks not run" not in r.stdout.str()  # their own outcome is what to read
    row, skipped = json.loads(report.read_text())["tests"]
    assert skipped["checks_skipped"][0]["reason"] == \
        "the test skipped itself, so memviz did not judge its memory"
    assert row["checks_run"] == [] and row["failed_checks"] == 0
    assert row["checks_skipped"] == [{"check": "peak='1 GiB'",
                                      "where": f"test_inner.py:{marker_line(src, 'test_fails')}",
                                      "reason": "the test failed, so memviz did not judge its memory",
                                      "what_to_do": "fix the test's own failure first"}]


# ---- which leaks count: the test's own code, or filter_fn ---------------------------------

CACHELIB = """
import os
from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
fake = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"])
_cache = []

def warm(size):
    _cache.append(fake.alloc(CBID_cuMemAlloc_v2, size))  # CACHE
"""

FILTERED = GPU + """
import cachelib
kept = []

@pytest.mark.memviz(leaks=True, own_code=True)
def test_own_leak():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))  # OWN

@pytest.mark.memviz(leaks=True, own_code=True)
def test_library_cache():
    cachelib.warm(5 * MiB)

@pytest.mark.memviz(leaks=True)
def test_library_cache_counted():
    cachelib.warm(5 * MiB)

@pytest.mark.memviz(leaks=True, filter_fn=lambda a: a.size >= 4 * MiB)
def test_filter_ignores_small():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB))

@pytest.mark.memviz(leaks=True, filter_fn=lambda a: a.user_frame.filename.endswith("cachelib.py"))
def test_filter_counts_library():
    cachelib.warm(2 * MiB)
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB))
"""


def test_leak_filters(pytester, fake, tmp_path):
    pytester.makepyfile(cachelib=CACHELIB)
    report = tmp_path / "mem.json"
    r = run(pytester, FILTERED, f"--memviz-report={report}", "-rA")
    out = r.stdout.str()
    outcomes = {ln.split()[1]: ln.split()[0] for ln in out.splitlines()
                if ln.startswith(("PASSED ", "FAILED "))}
    assert outcomes == {"test_inner.py::test_own_leak": "FAILED",
                        "test_inner.py::test_library_cache": "PASSED",
                        "test_inner.py::test_library_cache_counted": "FAILED",
                        "test_inner.py::test_filter_ignores_small": "PASSED",
                        "test_inner.py::test_filter_counts_library": "FAILED"}, out
    cache_line = f"cachelib.py:{lineno(CACHELIB, '# CACHE')}"
    assert f"test_inner.py:{lineno(FILTERED, '# OWN')}: size=3 MiB, count=1" in out
    assert "the test left 3 MiB of GPU memory it allocated alive" in out
    assert "the test left 5 MiB of GPU memory it allocated alive" in out  # without own_code=True
    assert f"{cache_line}: size=5 MiB, count=1" in out
    assert "the test left 2 MiB of GPU memory it allocated alive" in out  # filter_fn chose cachelib's
    assert "filter_fn" in out
    rows = {t["nodeid"].split("::")[1]: t for t in json.loads(report.read_text())["tests"]}
    lib = rows["test_library_cache"]
    assert lib["leaked_bytes"] == 0 and lib["leak_filter"] == "own_code"
    assert lib["not_counted_bytes"] == 5 * MiB
    assert lib["not_counted_lines"][0]["line"].endswith(cache_line)
    assert lib["checks_run"] == ["leaks=True"] and lib["failed_checks"] == 0
    assert rows["test_library_cache_counted"]["leak_filter"] == "all"
    assert rows["test_filter_ignores_small"]["leak_filter"] == "filter_fn"
    assert rows["test_filter_ignores_small"]["not_counted_bytes"] == 1 * MiB
    assert rows["test_filter_counts_library"]["leaked_bytes"] == 2 * MiB


def test_a_failed_own_code_check_names_what_it_did_not_count(pytester, fake):
    """The message for a failed own-code check mentions what it did not count, and how to count it."""
    pytester.makepyfile(cachelib=CACHELIB)
    src = GPU + """
import cachelib
kept = []

@pytest.mark.memviz(leaks=True, own_code=True)
def test_both():
    cachelib.warm(5 * MiB)
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))  # OWN
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "the test left 3 MiB of GPU memory it allocated alive" in out
    assert f"test_inner.py:{lineno(src, '# OWN')}: size=3 MiB, count=1" in out
    assert "Not counted (made outside test_inner.py): 5 MiB in 1 allocation(s)" in out
    assert f"cachelib.py:{lineno(CACHELIB, '# CACHE')}: size=5 MiB" in out
    assert "own_code=False" in out


def test_the_ini_setting_makes_own_code_the_default(pytester, fake):
    pytester.makepyfile(cachelib=CACHELIB)
    pytester.makeini("[pytest]\nmemviz_own_code = true\n")
    src = GPU + """
import cachelib
kept = []

@pytest.mark.memviz(leaks=True)
def test_library_cache():
    cachelib.warm(5 * MiB)

@pytest.mark.memviz(leaks=True, own_code=False)
def test_library_cache_counted():
    cachelib.warm(5 * MiB)

@pytest.mark.memviz(leaks=True)
def test_own_leak():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB))
"""
    r = run(pytester, src, "-rA")
    r.assert_outcomes(passed=1, failed=2)
    r.stdout.fnmatch_lines(["PASSED test_inner.py::test_library_cache",
                            "FAILED test_inner.py::test_library_cache_counted*",
                            "FAILED test_inner.py::test_own_leak*"])


@pytest.mark.parametrize("body, expected", [
    ("lambda a: None", "filter_fn returned None for the allocation made at "),
    ("lambda a: 1 / 0", "filter_fn raised ZeroDivisionError: division by zero for the allocation made at "),
])
def test_a_broken_filter_fn_fails_the_test_and_says_why(pytester, fake, body, expected):
    src = GPU + f"""
kept = []
@pytest.mark.memviz(leaks=True, filter_fn={body})
def test_x():
    kept.append(fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB))  # ALLOC
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert expected in out
    where = f"marker at test_inner.py:{marker_line(src, 'test_x')}"
    assert f"test_inner.py:{lineno(src, '# ALLOC')} (1 MiB; {where})" in out
    assert "return True to count it as a leak, False to ignore it" in out


# ---- marker mistakes say what to do ---------------------------------------------------


@pytest.mark.parametrize("mark, expected", [
    ("memviz()", "checks nothing (marker at test_inner.py:2); use @pytest.mark.memviz(peak='2 GiB')"),
    ("memviz(peak='lots')", "@pytest.mark.memviz(peak='lots'): cannot parse size 'lots'"),
    ("memviz(budget=1)", "takes the keywords peak=, leaks=, own_code=, filter_fn= and warmups= only, got budget="),
    ("memviz(leaks='some')", "takes True or a size to tolerate"),
    ("memviz(peak='1 GiB', own_code=True)",
     "own_code= and filter_fn= choose which leaks count; add leaks=True"),
    ("memviz(leaks=True, filter_fn=3)", "filter_fn= takes a function of a memviz Allocation returning True"),
    ("memviz(leaks=True, own_code='no')", "own_code= takes True or False, got 'no'"),
    ("memviz(leaks=True, own_code=True, filter_fn=lambda a: True)", "filter_fn= decides alone"),
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
    assert "(marker at test_inner.py:2)" in r.stdout.str()  # the line responsible


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


# ---- conventions from pytest-memray ------------------------------------------------------


def test_marker_sizes_read_as_pytest_memray_reads_them(pytester, fake):
    """'3 MB' is 3 * 1024**2 bytes, as pytest-memray's limit_memory('3 MB');
    a bare number is bytes."""
    src = GPU + """
@pytest.mark.memviz(peak="3 MB")
def test_mb_is_binary():
    fake.alloc(CBID_cuMemAlloc_v2, 3_100_000)  # over 3,000,000 but under 3 MiB

@pytest.mark.memviz(peak=3_000_000)
def test_bytes_are_bytes():
    fake.alloc(CBID_cuMemAlloc_v2, 3_100_000)
"""
    r = run(pytester, src)
    r.assert_outcomes(passed=1, failed=1)
    assert "test_bytes_are_bytes" in r.stdout.str() and "FAILED" in r.stdout.str()
    from memviz.integrations.pytest_plan import marker_size
    for text in ("24 MB", "24 mb", "24 Mb", "24mB", "24 MiB", "24 mib"):
        assert marker_size(text) == 24 << 20, text
    assert marker_size("1 gb") == 1 << 30 and marker_size("100.0b") == marker_size("100 B") == 100


def test_warmups_leave_a_cache_filled_once_out_of_the_leak_check(pytester, fake):
    src = GPU + """
CACHE = {}

def cached_workspace():
    if "w" not in CACHE:
        CACHE["w"] = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)  # filled on the first run only
    return CACHE["w"]

RUNS = []

@pytest.mark.memviz(leaks=True, warmups=1)
def test_with_warmup():
    RUNS.append(1)
    cached_workspace()

@pytest.mark.memviz(leaks=True)
def test_without_warmup():
    CACHE.clear()
    cached_workspace()

def test_runs_counted():
    assert len(RUNS) == 2  # one warm-up, one measured run
"""
    r = run(pytester, src)
    r.assert_outcomes(passed=2, failed=1)
    assert "test_without_warmup" in r.stdout.str()


def test_most_allocations_limits_the_table(pytester, fake):
    src = GPU + "".join(f"""
def test_t{i}():
    fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, {i + 1} * MiB))
""" for i in range(3))
    r = run(pytester, src, "--memviz", "--most-allocations", "1")
    r.assert_outcomes(passed=3)
    out = r.stdout.str()
    assert "test_t2" in out and "test_t0" not in out.split("memviz: GPU memory per test")[1], out
    assert "2 more tests (--most-allocations 0 lists all" in out


def test_a_refused_nested_trace_names_the_plugin_as_the_outer_trackers_start(pytester, fake):
    """The refusal named pytest's own frame (pluggy/_callers.py) as where the
    outer tracker started; it was the plugin's, for the marker."""
    src = GPU + """
import memviz

@pytest.mark.memviz(leaks=True)
def test_own_trace(tmp_path):
    with memviz.track(torch=False, trace=str(tmp_path / "t.memviz")):
        pass
"""
    r = run(pytester, src)
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "nested in the one started at memviz's pytest plugin, for the test's @pytest.mark.memviz marker" in out
    assert "pluggy" not in out.split("AlreadyTracking", 1)[1].split("\n", 1)[0]



def test_a_ctrl_c_during_warmups_stops_the_tests_tracker(pytester, fake, monkeypatch):
    """A KeyboardInterrupt in a warm-up run ends the session; the plugin's
    tracker for the test was left running until the process exited. (In a
    process of its own: pytester passes an inner Ctrl-C on to this run.)"""
    tests_dir = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest("""
import memviz

def pytest_keyboard_interrupt(excinfo):
    print("TRACKER LEFT RUNNING:", memviz.active_tracker() is not None)
""")
    pytester.makepyfile(test_inner=GPU + """
runs = []

@pytest.mark.memviz(leaks=True, warmups=2)
def test_interrupted():
    runs.append(1)
    if len(runs) == 1:
        raise KeyboardInterrupt
""")
    r = pytester.runpytest_subprocess(*PLUGIN, *QUIET, "-s")
    out = r.stdout.str()
    assert "TRACKER LEFT RUNNING: False" in out, out
