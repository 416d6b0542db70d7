"""What if, against real runs on a GPU (pytest -m gpu; issue 30): a workload
recorded once under the defaults, the model's prediction for other
allocator settings, and each setting run for real in a fresh process.
The workloads and the runner are benchmarks/whatif_gpu.py's."""

import importlib.util
import os
import tempfile

import pytest

from test_gpu_capture import _REASON  # noqa: F401  (same skip)
from conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

SETTINGS = ["expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"]


def _bench():
    spec = importlib.util.spec_from_file_location("whatif_gpu", os.path.join(ROOT, "benchmarks", "whatif_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["transformer", "varlen", "varlen_empty", "churn"])
def test_the_recorded_settings_reproduce_the_peak_and_others_come_within_2_percent(name):
    import memviz

    b = _bench()
    path = os.path.join(tempfile.mkdtemp(), f"{name}.memviz")
    rec = b.child(b.WORKLOADS[name], trace=path)
    assert "error" not in rec, rec
    rows = memviz.load(path).whatif(*SETTINGS)
    assert rows[0].recorded and rows[0].reserved_peak == rec["reserved_peak"], (rows[0], rec)
    errors = {}
    for conf, row in zip(SETTINGS, rows[1:]):
        real = b.child(b.WORKLOADS[name], conf=conf)["reserved_peak"]
        errors[conf] = (row.reserved_peak, real, round(100.0 * (row.reserved_peak - real) / real, 2))
    print(name, "predicted, real, error %:", errors)
    assert all(abs(e[2]) <= 2.0 for e in errors.values()), errors


@pytest.mark.parametrize("name", ["transformer", "kvcache"])
def test_an_out_of_memory_verdict_under_a_fraction_names_the_failing_line(name):
    """8% under the default reserved peak: the defaults run out of memory, on
    the line predicted; with expandable segments the run fits, as predicted
    (the issue's measurements)."""
    import memviz

    b = _bench()
    body = b.WORKLOADS[name]
    path = os.path.join(tempfile.mkdtemp(), f"{name}.memviz")
    rec = b.child(body, trace=path)
    frac = round(0.92 * rec["reserved_peak"] / rec["total"], 6)
    pred, pred_exp = memviz.load(path).whatif("expandable_segments:True", device_memory=frac)
    real = b.child(body, fraction=frac)
    real_exp = b.child(body, conf="expandable_segments:True", fraction=frac)
    print(name, "fraction", frac, "predicted", pred.oom and pred.oom.line, "real", real.get("oom"),
          "expandable: predicted", pred_exp.oom and pred_exp.oom.line, pred_exp.reserved_peak,
          "real", real_exp.get("oom"), real_exp.get("reserved_peak"))
    assert pred.oom is not None and real.get("oom") is not None, (pred, real)
    assert pred.oom.line == real["oom"], (pred.oom, real)
    assert (pred_exp.oom and pred_exp.oom.line) == real_exp.get("oom"), (pred_exp, real_exp)


@pytest.mark.parametrize("name", ["transformer", "varlen_empty"])
def test_a_recording_made_with_expandable_segments_replays_to_its_peak_and_predicts_the_defaults(name):
    """Recorded with expandable_segments:True, PyTorch's memory is mapped
    granules: the recorded settings replay to the recorded reserved peak, and
    the defaults come within 2% of a real run of them (the program's
    empty_cache() calls, seen only as granules given back, replayed). The
    transformer's own runs under the defaults vary by 1.7% (RESULTS.md), so
    its defaults are held to that beside the 2%."""
    import memviz

    b = _bench()
    conf = "expandable_segments:True"
    path = os.path.join(tempfile.mkdtemp(), f"{name}.memviz")
    rec = b.child(b.WORKLOADS[name], conf=conf, trace=path)
    assert "error" not in rec, rec
    row, plain = memviz.load(path).whatif("expandable_segments:False")
    real = b.child(b.WORKLOADS[name])["reserved_peak"]
    print(name, "recorded", rec["reserved_peak"], "replayed", row.reserved_peak, row.notes,
          "defaults predicted", plain.reserved_peak, "real", real)
    assert row.setting == conf and row.reserved_peak == rec["reserved_peak"] and not row.notes, row
    assert abs(plain.reserved_peak - real) <= (0.037 if name == "transformer" else 0.02) * real, (plain, real)
