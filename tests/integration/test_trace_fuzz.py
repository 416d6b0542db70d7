"""Fuzz the trace reader for a bounded time (see tests/fuzz_trace.py).

``MEMVIZ_FUZZ_SECONDS`` (default 20) is the budget. The dependency-free
mutation fuzzer always runs; when atheris is installed, half of the budget
goes to a coverage-guided atheris run in a subprocess. Any exception other
than memviz.TraceError fails the test (after loading, the whole pipeline
runs: reports, diagnose, exports); the failing input is kept in the test's
tmp_path (its name is printed).

Then crafted fields, one per test: each wrong type or value of a decoded
field raises TraceError naming the chunk and the field.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fuzz_trace
import memviz
import memviz.loaded
from memviz.trace import format as F

ROOT = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("MEMVIZ_FUZZ_SECONDS", "20"))
HAS_ATHERIS = importlib.util.find_spec("atheris") is not None


def test_seed_traces_load():
    for data in fuzz_trace.seeds():
        t = fuzz_trace.check(data)
        assert t is not None and not t.truncated


def test_crc_repair_reaches_the_chunk_parsers():
    data = fuzz_trace.seeds()[1]  # uncompressed chunks
    assert fuzz_trace.fix_crcs(data) == data
    head, chunks, tail = fuzz_trace.split(data)
    assert len(chunks) >= 9 and tail == b""


def test_mutation_fuzzer(tmp_path):
    budget = SECONDS / 2 if HAS_ATHERIS else SECONDS
    runs = fuzz_trace.fuzz(budget, rng_seed=int(os.environ.get("MEMVIZ_FUZZ_SEED", "0")),
                           save_dir=str(tmp_path))
    assert runs > 0


def test_atheris_harness(tmp_path):
    if not HAS_ATHERIS:
        pytest.skip("atheris is not installed (pip install atheris); the mutation fuzzer ran")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fuzz_trace.py"),
         f"-max_total_time={max(1, int(SECONDS / 2))}", "-timeout=30",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, env=env, timeout=SECONDS * 3 + 120)
    assert p.returncode == 0, p.stderr[-4000:]


# ---- crafted fields (hardening issue, item 8) -----------------------------------


def _with(kind, change):
    """The uncompressed seed trace with the JSON payload of its chunk of
    ``kind`` replaced by ``change(payload)`` (and a valid CRC)."""
    head, chunks, tail = fuzz_trace.split(fuzz_trace.seed(False))
    out = []
    for ctype, payload in chunks:
        if ctype & F.KIND_MASK == kind:
            payload = json.dumps(change(json.loads(payload))).encode("utf-8", "surrogatepass")
        out.append((ctype & ~F.COMPRESSED, payload))
    return fuzz_trace.join(head, out, tail)


def _end(**fields):
    return lambda end: dict(end, **fields)


def _stats(**fields):
    return lambda end: dict(end, stats=dict(end["stats"], **fields))


def _step(n, **fields):
    def change(steps):
        steps[n] = dict(steps[n], **fields)
        return steps
    return change


def _device(n, **fields):
    def change(steps):
        steps[n]["devices"]["0"] = dict(steps[n]["devices"]["0"], **fields)
        return steps
    return change


def _meta(key, value, inside=None):
    def change(meta):
        meta = dict(meta)
        if inside:
            meta[inside] = dict(meta[inside], **{key: value})
        else:
            meta[key] = value
        return meta
    return change


CRAFTED = [
    # the three
    (F.END, _stats(calls=5), r"END chunk is invalid: the end record: its field 'stats': its field "
                             r"'calls' is a JSON number, not an object"),
    (F.STEPS, _step(3, timestamp_ns=1e999), r"STEPS chunk is invalid: step entry 3: its field "
                                            r"'timestamp_ns' inf is not a whole number"),
    (F.STEPS, _step(3, timestamp_ns=float("nan")), r"step entry 3: its field 'timestamp_ns' nan"),
    (F.STEPS, lambda steps: steps + [5], r"step entry 13 is a JSON number, not an object"),
    (F.STEPS, lambda steps: [["x"]] + steps, r"step entry 0 is a JSON array, not an object"),
    # the rest of the step record
    (F.STEPS, _step(2, index="2"), r"step entry 2: its field 'index' '2' is not a whole number"),
    (F.STEPS, _step(2, index=-1), r"its field 'index' -1 is not a whole number between 0"),
    (F.STEPS, _step(2, duration_ns=1.5), r"its field 'duration_ns' 1.5"),
    (F.STEPS, _step(2, devices=[1]), r"its field 'devices' is a JSON array, not an object"),
    (F.STEPS, _step(2, devices={"x": {}}), r"step entry 2: a device 'x' is not a number"),
    (F.STEPS, _step(2, devices={"0": 7}), r"its field 'devices'\['0'\] is a JSON number"),
    (F.STEPS, _device(2, current=-(1 << 20)), r"'devices'\['0'\]: its field 'current' -1048576"),
    (F.STEPS, _device(2, peak=1 << 64), r"its field 'peak' 18446744073709551616"),
    (F.STEPS, _device(2, reserved=float("inf")), r"its field 'reserved' inf"),
    (F.STEPS, _device(2, segment_frees=None), r"its field 'segment_frees' None"),
    (F.STEPS, _step(2, lines={"a": 1}), r"its field 'lines' is a JSON object, not an array"),
    (F.STEPS, _step(2, lines=[{"location": 5}]), r"its field 'lines'\[0\]: its field 'location' "
                                                 r"is a JSON number, not a string"),
    (F.STEPS, _step(2, lines=[{"location": "a.py:1"}]), r"'lines'\[0\] has no field 'name'"),
    (F.STEPS, _step(2, info=[1]), r"its field 'info' is a JSON array, not an object"),
    (F.STEPS, _step(2, info={"x": {"y": 1}}), r"its field 'info'\['x'\] is a JSON object, not a "
                                              r"number, string or shape"),
    (F.STEPS, _step(2, info={"shape": [1, "2"]}), r"'info'\['shape'\] \(a shape\) holds '2'"),
    (F.STEPS, _step(2, autograd_seq="7"), r"its field 'autograd_seq' '7' is not a whole number"),
    # END
    (F.END, _stats(live="3"), r"its field 'stats': its field 'live' '3' is not a whole number"),
    (F.END, _stats(calls={"alloc": -1}), r"its field 'calls'\['alloc'\] -1"),
    (F.END, _stats(frames_abi=311), r"its field 'frames_abi' is a JSON number, not a string"),
    (F.END, _end(stats=[1]), r"its field 'stats' is a JSON array, not an object"),
    (F.END, _end(stopped_monotonic_ns=-5), r"its field 'stopped_monotonic_ns' -5"),
    (F.END, _end(stopped_wall_time=float("nan")), r"'stopped_wall_time' nan is not a finite number"),
    (F.END, _end(events=None), r"its field 'events' None"),
    (F.END, _end(totals={"0": {"current": -1}}), r"total 'current' of device '0' -1"),
    (F.END, _end(totals={"0": {"peak": 2.5}}), r"total 'peak' of device '0' 2.5"),
    (F.END, _end(extra=float("inf")), r"its field 'extra' inf is not a finite number"),
    # META
    (F.META, _meta("depth", "32", "tracker"), r"META chunk is invalid: its metadata: its field "
                                              r"'tracker': its field 'depth' '32'"),
    (F.META, _meta("depth", 100_000, "tracker"), r"its field 'depth' 100000 is not a whole number "
                                                 r"between 0 and 256"),
    (F.META, _meta("gpu_enabled", 1, "tracker"), r"'gpu_enabled' is a JSON number, not a boolean"),
    (F.META, _meta("gpu_off_reason", [], "tracker"), r"'gpu_off_reason' is a JSON array"),
    (F.META, _meta("reason", 5, "capture"), r"its field 'capture': its field 'reason' is a JSON "
                                            r"number, not a string"),
    (F.META, _meta("library", {"a": 1}, "capture"), r"its field 'library' is a JSON object"),
    (F.META, _meta("tried", [1], "capture"), r"its field 'tried'\[0\] is a JSON number"),
    (F.META, _meta("store", {"calls": 5}, "capture"), r"'store': its field 'calls' is a JSON number"),
    (F.META, _meta("command", 5), r"its metadata: its field 'command' is a JSON number"),
    (F.META, _meta("argv", ["a", None]), r"its field 'argv'\[1\] is a JSON null, not a string"),
    (F.META, _meta("start_monotonic_ns", -1), r"its field 'start_monotonic_ns' -1"),
    (F.META, _meta("start_wall_time", float("inf")), r"'start_wall_time' inf is not a finite"),
    (F.META, _meta("memviz_version", [[[[[[1]]]]]]), r"its field 'memviz_version' is a JSON array"),
    (F.META, _meta("future", [[[[[1]]]]]), r"its field 'future'.* is nested deeper than 4 levels"),
    (F.META, _meta("tracker", 5), r"its field 'tracker' is a JSON number, not an object"),
]


@pytest.mark.parametrize("kind,change,message", CRAFTED,
                         ids=[f"{F.CHUNK_NAMES[k]}-{i}" for i, (k, _c, _m) in enumerate(CRAFTED)])
def test_a_crafted_field_is_a_trace_error_naming_the_chunk_and_field(kind, change, message):
    data = _with(kind, change)
    with pytest.raises(memviz.TraceError, match=message) as e:
        memviz.loaded.LoadedTrace.from_bytes(data, "crafted.memviz")
    assert "crafted.memviz" in str(e.value) and " at byte " in str(e.value)
    if kind == F.META:  # nothing comes before the header
        return
    with warnings.catch_warnings():  # recover=True keeps what came before it
        warnings.simplefilter("ignore")
        t = memviz.loaded.LoadedTrace.from_bytes(data, "crafted.memviz", recover=True)
    assert t.truncated and f"the {F.CHUNK_NAMES[kind]} chunk is invalid" in t.error
    assert fuzz_trace.check(data[:-1] + b"\x01") is not None  # and the rest works


def test_the_seed_runs_the_whole_pipeline():
    # The seed's step records carry a NaN loss, a shape and a record the
    # program appended itself; all of it loads and every output is valid.
    t = fuzz_trace.check(fuzz_trace.seed(False))
    assert t is not None and [f.kind for f in memviz.diagnose(t)] == ["growth"]
    assert math.isnan(t.steps[7].info["loss"]) and t.steps[4].info["batch_shape"] == (4, 900)
    assert t.steps[-1] == {"x": [1]}


def test_a_valid_trace_with_odd_but_allowed_values_runs_the_whole_pipeline():
    deep = [1]
    for _ in range(600):
        deep = [deep]

    def change(steps):
        steps[4]["info"].update(loss=float("inf"), big=1 << 200, huge_shape=[1 << 62] * 40,
                                name="\udcff\ud800</script>")
        steps[5]["devices"]["0"]["growth"] = -(1 << 40)
        steps[6]["lines"] = [dict(steps[6]["lines"][0], location="\udcffx.py:1"),
                             dict(steps[6]["lines"][0], location="\udcffx.py:1", name="g")]
        return steps + [{"repr": "<Step>"}, {"timestamp_ns": float("nan"), "loss": 1e999},
                        {"config": {"a": {"b": {"c": {"d": [1]}}}}, "deep": deep}]
    t = fuzz_trace.check(_with(F.STEPS, change))
    assert t is not None and t.steps[4].info["big"] == 1 << 200
    # a record the program appended itself is kept; what is nested deeper
    # than 4 levels is kept as its JSON text
    assert t.steps[-1]["config"] == {"a": {"b": {"c": '{"d": [1]}'}}}
    assert json.loads(t.steps[-1]["deep"][0][0][0]) == deep[0][0][0]
