"""memviz.diagnose() rules on synthetic step series (no GPU, no capture needed).

Each rule must fire on its pattern, with its evidence, and a healthy loop with
a warm-up must fire none — also with noise.
"""

import json
import random
from types import SimpleNamespace

import pytest

import memviz
from memviz.analysis.findings import Finding, FindingLine
from memviz.analysis.diagnose import diagnose
from memviz.model.steps import DeviceStep, GrowthLine, StepRecord

MiB = 1 << 20
GiB = 1 << 30


def steps(n, *, current=None, peak=None, allocated=None, reserved=None, apeak=None, seg=None,
          info=None, durations=None, lines=None, device=0):
    """StepRecords from per-step functions of the step index (None: absent)."""
    out, ts = [], 1_000_000_000
    for i in range(n):
        dur = durations(i) if durations else 100_000_000
        ts += dur
        cur = current(i) if current else None
        prev = current(i - 1) if current and i else 0
        allocs, frees, abytes = seg(i) if seg else (0, 0, 0)
        d = DeviceStep(current=cur, peak=peak(i) if peak else cur,
                       growth=None if cur is None else cur - prev, live_count=10,
                       segment_allocs=allocs, segment_frees=frees, segment_alloc_bytes=abytes,
                       allocated=allocated(i) if allocated else None,
                       reserved=reserved(i) if reserved else None,
                       allocated_peak=apeak(i) if apeak else None)
        out.append(StepRecord(i, ts, dur, {device: d}, lines(i) if lines else [],
                              info(i) if info else {}, None))
    return out


def run(records, **kw):
    return diagnose(SimpleNamespace(steps=records), **kw)


def warm(i, steady):
    """A warm-up: the first 3 steps climb to the steady level."""
    return steady * (i + 1) // 3 if i < 2 else steady


def noisy(seed=0, spread=0.01):
    rnd = random.Random(seed)
    return lambda base: int(base * (1 + rnd.uniform(-spread, spread)))


# ---- healthy loops fire nothing ---------------------------------------------------


def test_healthy_loop_with_warmup_fires_nothing():
    n = lambda v, r=random.Random(1): int(v * (1 + r.uniform(-0.01, 0.01)))  # noqa: E731
    recs = steps(40, current=lambda i: warm(i, 2 * GiB),
                 peak=lambda i: warm(i, 2 * GiB) + n(512 * MiB),
                 allocated=lambda i: n(warm(i, 1500 * MiB)),
                 reserved=lambda i: warm(i, 2 * GiB), apeak=lambda i: 1800 * MiB,
                 seg=lambda i: (5, 0, 2 * GiB) if i < 3 else (0, 0, 0),
                 info=lambda i: {"batch_shape": (32, 512)},
                 durations=lambda i: n(100_000_000))
    assert run(recs) == []


def test_noise_alone_never_fires():
    for seed in range(20):
        r = random.Random(seed)
        cur = [int(GiB * (1 + r.uniform(-0.03, 0.03))) for _ in range(30)]
        alloc = [int(700 * MiB * (1 + r.uniform(-0.05, 0.05))) for _ in range(30)]
        recs = steps(30, current=cur.__getitem__, allocated=alloc.__getitem__,
                     reserved=lambda i: GiB, peak=lambda i: cur[i] + 100 * MiB,
                     info=lambda i, r=r: {"tokens": r.randint(900, 1100)})
        assert run(recs) == [], seed


def test_too_few_steps_fire_nothing():
    recs = steps(6, allocated=lambda i: (i + 1) * 100 * MiB, current=lambda i: (i + 1) * 100 * MiB,
                 reserved=lambda i: (i + 1) * 100 * MiB)
    assert run(recs) == []


# ---- growth ---------------------------------------------------------------------------


def grow_lines(i):
    return [GrowthLine("train.py:42", "step", 16 * MiB, 1, (i + 1) * 16 * MiB, i + 1),
            GrowthLine("train.py:50", "step", 1 * MiB, 1, 1 * MiB, 1)]


def test_growth_fires_on_a_steady_rise_and_names_the_line():
    recs = steps(30, current=lambda i: GiB + i * 16 * MiB, allocated=lambda i: 800 * MiB + i * 16 * MiB,
                 reserved=lambda i: GiB + i * 16 * MiB, lines=grow_lines)
    f, = run(recs)
    assert f.kind == "growth"
    assert "rises 16 MiB per step" in f.message and "cuda:0" in f.message
    assert f.numbers["series"] == "allocated" and f.numbers["bytes_per_step"] == 16 * MiB
    assert f.lines[0].location == "train.py:42"
    assert f.lines[0].bytes == (30 - 3) * 16 * MiB  # net growth over the post-warm-up steps
    assert "train.py:42: +432 MiB" in f.lines[0]
    assert f.fix


def test_growth_in_stairs_without_torch_numbers():
    # driver-level only: the caching allocator adds a 20 MiB segment every 4th step
    recs = steps(40, current=lambda i: GiB + (i // 4) * 20 * MiB)
    f, = run(recs)
    assert f.kind == "growth" and f.numbers["series"] == "current"


def test_small_rise_relative_to_the_total_does_not_fire():
    recs = steps(30, current=lambda i: 40 * GiB + i * 4 * MiB, allocated=lambda i: 40 * GiB + i * 4 * MiB,
                 reserved=lambda i: 40 * GiB + i * 4 * MiB)
    assert run(recs) == []  # +108 MiB on 40 GiB is 0.3%


def test_sawtooth_does_not_fire():
    recs = steps(30, allocated=lambda i: GiB + (i % 3) * 200 * MiB, current=lambda i: 2 * GiB,
                 reserved=lambda i: 2 * GiB)
    assert run(recs) == []


def test_growth_outside_pytorch():
    recs = steps(30, current=lambda i: GiB + i * 8 * MiB, allocated=lambda i: 500 * MiB,
                 reserved=lambda i: GiB)
    f, = run(recs)
    assert f.kind == "growth" and f.numbers["series"] == "outside PyTorch"
    assert "PyTorch does not hold" in f.message


# ---- fragmentation ----------------------------------------------------------------


def test_fragmentation_fires_when_reserved_grows_and_allocated_does_not():
    recs = steps(30, current=lambda i: GiB + i * 100 * MiB, reserved=lambda i: GiB + i * 100 * MiB,
                 allocated=lambda i: 600 * MiB, apeak=lambda i: 900 * MiB + i * MiB,
                 info=lambda i: {"batch_shape": (8, 1000 + 10 * i)})
    f, = run(recs)
    assert f.kind == "fragmentation"
    assert f.numbers["reserved_unused"] == GiB + 29 * 100 * MiB - 600 * MiB
    assert "reserved but unused" in f.message
    assert "expandable_segments:True" in f.fix


def test_fragmentation_reports_the_largest_free_block_from_step_info():
    recs = steps(30, reserved=lambda i: GiB + i * 100 * MiB, allocated=lambda i: 600 * MiB,
                 current=lambda i: GiB + i * 100 * MiB, info=lambda i: {"largest_free_block": 64 * MiB})
    f, = run(recs)
    assert f.numbers["largest_free_block"] == 64 * MiB and "largest free block 64 MiB" in f.message


def test_counters_in_step_info_are_not_input_sizes():
    # Lightning's callback passes batch_idx and global_step: counters, not lengths
    recs = steps(30, current=lambda i: GiB + i * 100 * MiB, reserved=lambda i: GiB + i * 100 * MiB,
                 allocated=lambda i: 600 * MiB,
                 info=lambda i: {"batch_idx": i, "global_step": i + 1, "lr": 1e-3 / (i + 1),
                                 "batch_shape": (8, 512)})
    f, = run(recs)
    assert f.kind == "fragmentation"
    from memviz.analysis.findings import _input_keys
    assert _input_keys(recs) == []


def test_fragmentation_fires_when_reserved_stays_far_above_any_real_need():
    # Shaped like examples/fragmenting_loop.py on an H200 (2026-11-29): reserved reached
    # 1010 MiB during warm-up and stayed there while allocated stayed at 129 MiB. (The
    # peak-allocated value below is illustrative; that run did not print it.)
    recs = steps(30, current=lambda i: 1010 * MiB, reserved=lambda i: min(1010, 546 + 232 * i) * MiB,
                 allocated=lambda i: 129 * MiB, apeak=lambda i: 380 * MiB)
    f, = run(recs)
    assert f.kind == "fragmentation" and "served no request" in f.message
    assert f.numbers["never_used"] == (1010 - 380) * MiB
    assert f.numbers["allocated_start"] == f.numbers["allocated_end"] == 129 * MiB
    assert f.numbers["reserved_end"] == 1010 * MiB and "reserved_start" in f.numbers


def test_a_cache_sized_for_the_step_peak_is_not_fragmentation():
    # Healthy: reserved stays high between steps because activations reuse it at the peak.
    recs = steps(30, current=lambda i: 3 * GiB, reserved=lambda i: 3 * GiB,
                 allocated=lambda i: 600 * MiB, apeak=lambda i: 3 * GiB - 100 * MiB)
    assert run(recs) == []


def test_reserved_growing_with_the_real_need_is_not_fragmentation():
    # expandable segments: reserved follows the allocated peak
    recs = steps(30, reserved=lambda i: GiB + i * 40 * MiB, allocated=lambda i: 600 * MiB,
                 apeak=lambda i: 900 * MiB + i * 40 * MiB, current=lambda i: GiB + i * 40 * MiB)
    assert run(recs) == []


def test_failed_allocation_with_enough_unused_cache_is_fragmentation():
    recs = steps(10, reserved=lambda i: 70 * GiB, allocated=lambda i: 40 * GiB, current=lambda i: 70 * GiB)
    fail = SimpleNamespace(size=2 * GiB, device=0, timestamp_ns=recs[-1].timestamp_ns + 5,
                           traceback="train.py:77")
    f, = diagnose(SimpleNamespace(steps=recs, failures=[fail]))
    assert f.kind == "fragmentation"
    assert "failed at train.py:77" in f.message and f.numbers["reserved_unused"] == 30 * GiB
    assert f.lines[0].location == "train.py:77"


def test_failed_allocation_without_unused_cache_is_not_fragmentation():
    recs = steps(10, reserved=lambda i: 70 * GiB, allocated=lambda i: 69 * GiB, current=lambda i: 70 * GiB)
    fail = SimpleNamespace(size=2 * GiB, device=0, timestamp_ns=recs[-1].timestamp_ns + 5, traceback="x:1")
    assert diagnose(SimpleNamespace(steps=recs, failures=[fail])) == []


# ---- spike -------------------------------------------------------------------------------

LONG = {12, 25, 33}


def spike_series():
    """Caching allocator: the first long input adds segments that stay cached."""
    def cur(i):
        return warm(i, GiB) + (3 * GiB if i >= 12 else 0)

    def peak(i):
        return cur(i) if i != 12 else cur(i) + 512 * MiB

    return steps(40, current=cur, peak=peak, allocated=lambda i: 600 * MiB,
                 reserved=cur, info=lambda i: {"batch_shape": (8, 2048 if i in LONG else 256)})


def test_spike_fires_on_long_inputs_and_names_the_input():
    backward = SimpleNamespace(key=memviz.Frame("<thread pt_autograd_0>", 0), size=4 * GiB)
    snap_line = SimpleNamespace(key=memviz.Frame("spiking.py", 40), size=3 * GiB)
    stats = [backward, snap_line]  # the backward thread's allocations are not a line
    obj = SimpleNamespace(steps=spike_series(),
                          peak_snapshot=lambda dev=None: SimpleNamespace(statistics=lambda k: stats))
    f, = diagnose(obj)
    assert f.kind == "spike"
    assert f.numbers["step"] == 12 and f.numbers["input"] == "batch_shape"
    assert f.numbers["input_value"] == [8, 2048] and f.numbers["input_vs_median"] == 8.0
    assert "batch_shape=(8, 2048)" in f.message and "spiking.py:40" in f.message
    assert f.lines[0].location == "spiking.py:40"
    assert "chunk" in f.fix


def test_spike_in_precise_mode_where_every_step_needs_memory():
    # per-tensor driver calls: each step's temporaries are visible, long ones 8x
    recs = steps(40, current=lambda i: GiB, peak=lambda i: GiB + (2 * GiB if i in LONG else 256 * MiB),
                 allocated=lambda i: GiB, reserved=lambda i: GiB,
                 info=lambda i: {"tokens": 16384 if i in LONG else 2048})
    f, = run(recs)
    assert f.kind == "spike" and f.numbers["input"] == "tokens"
    assert f.numbers["spike_steps"] == sorted(LONG)


def test_peaks_unrelated_to_input_length_are_not_spikes():
    recs = steps(40, current=lambda i: GiB, peak=lambda i: GiB + (2 * GiB if i in {7, 19, 30} else 256 * MiB),
                 allocated=lambda i: GiB, reserved=lambda i: GiB,
                 info=lambda i: {"tokens": 16384 if i in LONG else 2048})
    assert run(recs) == []


# ---- cache churn --------------------------------------------------------------------------


def test_cache_churn_fires_with_its_cost():
    churn = lambda i: i % 5 != 0  # noqa: E731 - four steps in five call empty_cache()
    recs = steps(40, current=lambda i: 2 * GiB, allocated=lambda i: GiB, reserved=lambda i: 2 * GiB,
                 seg=lambda i: (6, 6, 1536 * MiB) if churn(i) else (0, 0, 0),
                 durations=lambda i: 135_000_000 if churn(i) else 100_000_000)
    f, = run(recs)
    assert f.kind == "cache_churn"
    assert f.numbers["slowdown"] == 0.35 and "35% longer" in f.message
    assert f.numbers["reallocated_bytes_per_step"] == 1536 * MiB
    assert "empty_cache" in f.fix


def test_cache_churn_without_calm_steps_has_no_cost_claim():
    recs = steps(20, current=lambda i: 2 * GiB, seg=lambda i: (6, 6, GiB))
    f, = run(recs)
    assert f.kind == "cache_churn" and "slowdown" not in f.numbers and "longer" not in f.message


def test_small_churn_does_not_fire():
    recs = steps(20, current=lambda i: 20 * GiB, seg=lambda i: (1, 1, 2 * MiB))
    assert run(recs) == []


def test_precise_mode_is_not_churn():
    recs = steps(20, current=lambda i: 2 * GiB, seg=lambda i: (600, 600, GiB))
    assert diagnose(SimpleNamespace(steps=recs, precise=True)) == []


# ---- outside PyTorch ---------------------------------------------------------------------


def _alloc(size, kind, label, category, line):
    tb = memviz.Traceback((memviz.Frame("lib.py", line, "f"),))
    return memviz.Allocation(0x1000 + line, size, 0, kind, 0, memviz.ThreadInfo(1, 1, "main"), label, 0, tb,
                             category=category)


def test_outside_pytorch_with_breakdown():
    recs = steps(10, current=lambda i: 6 * GiB, allocated=lambda i: 3 * GiB, reserved=lambda i: 4 * GiB)
    snap = memviz.Snapshot([_alloc(4 * GiB, "device", None, "activation", 1),
                            _alloc(1536 * MiB, "device", "cupy pool", "outside_pytorch", 2),
                            _alloc(512 * MiB, "static", None, "outside_pytorch", 3)])
    f, = diagnose(SimpleNamespace(steps=recs, snapshot=lambda: snap))
    assert f.kind == "outside_pytorch"
    assert f.numbers["outside_bytes"] == 2 * GiB and "(33% of the 6 GiB it sees)" in f.message
    assert "labelled 'cupy pool' (1.5 GiB)" in f.message
    assert f.numbers["by_kind"] == {"device": 1536 * MiB, "static": 512 * MiB}
    assert f.numbers["by_category"] == {"outside_pytorch": 2 * GiB}  # PyTorch's own left out
    assert [ln.location for ln in f.lines] == ["lib.py:2", "lib.py:3"]


def test_outside_pytorch_below_thresholds_is_quiet():
    recs = steps(10, current=lambda i: 4 * GiB + 200 * MiB, allocated=lambda i: 3 * GiB,
                 reserved=lambda i: 4 * GiB)
    assert run(recs) == []


# ---- the Finding object -----------------------------------------------------------------


def test_finding_str_and_dict():
    f = Finding("growth", "It grows.", {"rise": 5}, [FindingLine("a.py:3", 2 * MiB, "grew")], "Stop it.")
    assert str(f) == "[growth] It grows.\n    a.py:3: +2 MiB (grew)\n  fix: Stop it."
    d = json.loads(json.dumps(f.to_dict()))
    assert d == {"kind": "growth", "message": "It grows.", "numbers": {"rise": 5},
                 "lines": [{"location": "a.py:3", "bytes": 2 * MiB, "note": "grew"}], "fix": "Stop it."}
    assert "a.py:3" in f.lines[0]


def test_diagnose_accepts_step_dicts_from_a_loaded_trace():
    recs = steps(30, current=lambda i: GiB + i * 16 * MiB, allocated=lambda i: 800 * MiB + i * 16 * MiB,
                 reserved=lambda i: GiB + i * 16 * MiB, lines=grow_lines)
    dicts = json.loads(json.dumps([r.to_dict() for r in recs]))
    f, = run(dicts)
    assert f.kind == "growth" and f.lines[0].location == "train.py:42"


def test_diagnose_reads_a_saved_and_loaded_trace(fake, tmp_path):
    from conftest import here
    from fake_cupti import CBID_cuMemAlloc_v2

    with memviz.track(torch=False) as t:
        for _ in range(20):
            fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB); line = here()  # noqa: E702
            t.step()
    t.save(tmp_path / "run.memviz")
    loaded = memviz.load(tmp_path / "run.memviz")
    live, = diagnose(t)
    f, = diagnose(loaded)
    assert f.to_dict() == live.to_dict()
    assert f.kind == "growth" and f.lines[0].location.endswith(f"test_diagnose.py:{line}")


def _two_on_one_line(fake, alloc_id):
    from fake_cupti import CBID_cuMemAlloc_v2
    (lambda: fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB))(); fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)  # noqa: E702 TWO


def test_two_functions_on_one_line_are_one_line_of_the_growth(fake):
    # A lambda and its caller allocate on the same line: one line, grown in
    # each of the 17 steps after warm-up (not "in 34 of 17").
    from conftest import line_of

    with memviz.track(torch=False) as t:
        for i in range(20):
            _two_on_one_line(fake, i)
            t.step()
    where = f"{__file__}:{line_of(__file__, 'TWO')}"
    assert [g.location for g in t.steps[-1].lines] == [where]
    assert t.steps[-1].lines[0].bytes == 6 * MiB and t.steps[-1].lines[0].count == 2
    assert t.steps[-1].lines[0].live_bytes == 20 * 6 * MiB
    f, = diagnose(t)
    line = next(ln for ln in f.lines if ln.location == where)
    assert line.note == "grew in 17 of 17 steps" and line.bytes == 17 * 6 * MiB


def test_duplicate_lines_in_a_step_record_count_once():
    # Step records written by an older memviz may list one location twice.
    def dup(i):
        return [GrowthLine("train.py:42", "f", 12 * MiB, 1, (i + 1) * 12 * MiB, i + 1),
                GrowthLine("train.py:42", "<lambda>", 4 * MiB, 1, (i + 1) * 4 * MiB, i + 1)]

    recs = steps(30, current=lambda i: GiB + i * 16 * MiB, allocated=lambda i: 800 * MiB + i * 16 * MiB,
                 reserved=lambda i: GiB + i * 16 * MiB, lines=dup)
    f, = run(recs)
    assert f.lines[0].location == "train.py:42" and f.lines[0].note == "grew in 27 of 27 steps"
    assert f.lines[0].bytes == 27 * 16 * MiB


def test_step_info_beyond_any_float_is_not_an_input_size():
    # A tuple of ids whose product is beyond a float (199! > 1e308), a NaN
    # loss: no rule fails on them (a failing rule warns "Please report this").
    import warnings

    recs = steps(30, current=lambda i: GiB, allocated=lambda i: 800 * MiB, reserved=lambda i: GiB,
                 info=lambda i: {"ids": tuple(range(1, 200 + i)), "loss": float("nan"),
                                 "tokens": float("inf") if i % 2 else 10.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(recs) == []


def test_bad_arguments_say_what_to_do():
    with pytest.raises(TypeError, match="Tracker or a loaded trace"):
        diagnose(object())
    with pytest.raises(ValueError, match="warmup"):
        run([], warmup=-1)


def test_exported_from_memviz():
    assert memviz.diagnose is diagnose and memviz.Finding is Finding
