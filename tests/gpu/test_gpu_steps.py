"""Step records, diagnoses and the pytest plugin on real CUDA (pytest -m gpu).

Skipped, with the reason, without a GPU. Every scenario runs in a fresh
Python process: allocator settings (expandable segments) must be chosen before
CUDA starts, and only one CUPTI subscriber may exist per process.

* the three example loops produce exactly their finding, a healthy loop none;
* ``@pytest.mark.memviz(peak=...)`` / ``(leaks=True)`` pass and fail on real
  torch allocations (pytester, in a subprocess).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MiB = 1 << 20
GiB = 1 << 30


from test_gpu_capture import _REASON  # noqa: E402  (one definition of "no CUDA here")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _env(extra=None):
    e = dict(os.environ)
    e.pop("MEMVIZ_CUPTI_LIBRARY", None)
    e.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(extra or {})
    return e


def _result(p):
    results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and results, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return results[-1]


def example(name, *args, env=None, timeout=300):
    """Run examples/<name> --json in a fresh process; its RESULT dict."""
    p = subprocess.run([sys.executable, str(EXAMPLES / name), "--json", *args], capture_output=True,
                       text=True, timeout=timeout, env=_env(env), cwd=str(ROOT))
    return _result(p)


def script(body, env=None, timeout=300):
    code = textwrap.dedent("""
        import json, sys
        import memviz, torch
        def out(**kw):
            print("RESULT " + json.dumps(kw, default=str), flush=True)
    """) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env=_env(env), cwd=str(ROOT))
    return _result(p)


def _line_of(path, marker):
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if marker in text:
            return i
    raise AssertionError(marker)


# ---- the example loops ------------------------------------------------------------------


def test_leaking_loop_is_growth_naming_the_holder_and_the_line():
    r = example("leaking_loop.py")
    assert r["where"] == "cuda" and r["kinds"] == ["growth"], r
    f = r["findings"][0]
    n = f["numbers"]
    assert n["series"] == "allocated", f
    assert 4 * MiB <= n["bytes_per_step"] <= 16 * MiB, f  # two 4 MiB activations a step
    assert n["holder"] == "list `history` in module __main__", f
    keep = _line_of(EXAMPLES / "leaking_loop.py", "history.append(val_loss)  # the bug: keeps the tensor and its graph")
    assert n["kept_at"] == f"{EXAMPLES / 'leaking_loop.py'}:{keep}", f
    assert n.get("graph_bytes", 0) >= 30 * 4 * MiB, f  # recorded by the integration (autograd=True)
    assert "loss.item()" in f["fix"]


def test_leaking_loop_fixed_is_healthy():
    r = example("leaking_loop.py", "--fixed")
    assert r["where"] == "cuda" and r["kinds"] == [], r


def test_fragmenting_loop_is_fragmentation():
    r = example("fragmenting_loop.py")
    assert r["kinds"] == ["fragmentation"], r
    n = r["findings"][0]["numbers"]
    # Either form of the rule: reserved kept growing, or (as on the H200,
    # where the pool reaches its size during warm-up) it stays far above the
    # most ever allocated at once.
    assert n["reserved_end"] - n["reserved_start"] >= GiB or n.get("never_used", 0) >= 512 * MiB, n
    assert abs(n["allocated_end"] - n["allocated_start"]) <= 64 * MiB, n
    assert n["reserved_unused"] >= 512 * MiB and "largest_free_block" in n, n
    assert "expandable_segments:True" in r["findings"][0]["fix"]


def test_expandable_segments_take_the_fragmentation_away():
    """The rule of thumb the finding recommends, checked on the same loop."""
    r = example("fragmenting_loop.py", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert r["conf"] == "expandable_segments:True"
    assert "fragmentation" not in r["kinds"], r
    default = example("fragmenting_loop.py")
    assert r["reserved"][-1] < default["reserved"][-1] / 2, (r["reserved"], default["reserved"])


def test_spiking_loop_is_a_spike_on_the_long_input():
    r = example("spiking_loop.py")
    assert r["kinds"] == ["spike"], r
    n = r["findings"][0]["numbers"]
    assert n["step"] == 12 and n["input"] == "batch_shape" and n["input_value"] == [8, 2048, 512], n
    assert n["input_vs_median"] == 8.0 and n["step_needed"] >= 256 * MiB, n
    assert n["line_at_peak"].startswith(str(EXAMPLES / "spiking_loop.py")), n


def test_healthy_training_loop_has_no_findings_and_records_torch_numbers():
    r = script("""
        torch.manual_seed(0)
        with memviz.track() as t:
            model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                        torch.nn.Linear(4096, 1024)).cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            history = []
            for step in range(40):
                x = torch.randn(64, 128, 1024, device="cuda")
                loss = model(x).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                history.append(loss.item())
                t.step(batch_shape=x.shape)
        d = t.steps[-1].devices[torch.cuda.current_device()]
        out(kinds=[f.kind for f in memviz.diagnose(t)], findings=[str(f) for f in memviz.diagnose(t)],
            allocated=d.allocated, reserved=d.reserved, current=d.current,
            torch_allocated=torch.cuda.memory_allocated(), torch_reserved=torch.cuda.memory_reserved())
    """)
    assert r["kinds"] == [], r
    assert r["allocated"] == r["torch_allocated"] and r["reserved"] == r["torch_reserved"], r
    assert r["current"] >= r["reserved"], r  # memviz sees every segment (tracked from the start)


def test_empty_cache_every_step_is_cache_churn():
    r = script("""
        with memviz.track() as t:
            model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.ReLU(),
                                        torch.nn.Linear(8192, 2048)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for step in range(30):
                x = torch.randn(512, 2048, device="cuda")
                loss = model(x).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                del x, loss
                if step >= 10:
                    torch.cuda.empty_cache()  # the habit that costs speed
                t.step()
        out(kinds=[f.kind for f in memviz.diagnose(t)], findings=[f.to_dict() for f in memviz.diagnose(t)])
    """)
    assert r["kinds"] == ["cache_churn"], r
    n = r["findings"][0]["numbers"]
    assert n["churn_steps"] >= 0.6 * n["steps"] and n["reallocated_bytes_per_step"] >= 16 * MiB, n
    assert "slowdown" in n, n  # steps 3-10 do not churn: the cost is measured against them


def test_watch_records_torch_numbers_per_optimizer_step():
    r = script("""
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with memviz.track() as t, memviz.watch(opt):
            for _ in range(5):
                model(torch.randn(32, 1024, device="cuda")).sum().backward()
                opt.step()
        out(n=len(t.steps), allocated=[s.allocated for s in t.steps])
    """)
    assert r["n"] == 5 and all(a and a > 0 for a in r["allocated"]), r


# ---- the pytest plugin on real allocations ------------------------------------------------

PLUGIN_TESTS = """
import pytest, torch
kept = []

@pytest.mark.memviz(peak="1 GiB")
def test_small():
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x

@pytest.mark.memviz(peak="100 MiB")
def test_big():
    x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # BIG
    del x

@pytest.mark.memviz(leaks=True)
def test_leaks():
    kept.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))  # LEAK

@pytest.mark.memviz(leaks=True)
def test_clean():
    x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    y = x * 2
    del x, y

@pytest.mark.no_graph_leak
def test_cuda_graph_kept():
    w = torch.ones(1024, 1024, device="cuda", requires_grad=True)
    kept.append((w @ w).relu().sum())  # GRAPH
"""

pytest_plugins = ["pytester"]


def _plugin_args():
    """Load the plugin by name unless memviz is installed (then its entry point does)."""
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="pytest11")
    return [] if any(ep.value == "memviz.integrations.pytest_plugin" for ep in eps) else ["-p", "memviz.integrations.pytest_plugin"]


def test_peak_and_leak_markers_on_real_torch_allocations(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.delenv("MEMVIZ_CUPTI_LIBRARY", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    pytester.makeconftest("import torch\ntorch.ones(1, device='cuda')  # CUDA starts outside the tests\n")
    pytester.makepyfile(test_gpu_inner=PLUGIN_TESTS)
    r = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", timeout=300)
    out = r.stdout.str()
    r.assert_outcomes(passed=2, failed=3)
    lines = PLUGIN_TESTS.strip("\n").splitlines()
    big = next(i for i, t in enumerate(lines, 1) if "# BIG" in t)
    leak = next(i for i, t in enumerate(lines, 1) if "# LEAK" in t)
    graph = next(i for i, t in enumerate(lines, 1) if "# GRAPH" in t)
    assert "memviz: GPU peak 512 MiB on cuda:0 exceeds the budget of 100 MiB" in out, out
    assert f"test_gpu_inner.py:{big}: size=512 MiB" in out, out
    assert "memviz: the test left 64 MiB of GPU memory it allocated alive" in out, out
    assert f"test_gpu_inner.py:{leak}: size=64 MiB" in out, out
    assert "held by list `kept` in module test_gpu_inner" in out and f"test_gpu_inner.py:{graph}" in out, out
    for name in ("test_small", "test_clean"):
        assert f"FAILED test_gpu_inner.py::{name}" not in out, out
