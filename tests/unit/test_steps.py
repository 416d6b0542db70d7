"""Step records (t.step()), their sinks, and memviz.watch(optimizer).

Allocations are fired through the libcupti test double, so the records come
from the real capture path (C store marks, totals and line resolution).
"""

import csv
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import memviz
from conftest import here
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.analysis import sinks as _sinks
from memviz.analysis import steps as _steps
from memviz.model.steps import StepRecord

MiB = 1 << 20
THIS = os.path.abspath(__file__)


def add_sinks(t, **sinks):
    """tracker.on_step(...) once the Tracker delegates it; memviz.analysis.steps.on_step otherwise."""
    if hasattr(t, "on_step"):
        return t.on_step(**sinks)
    return _steps.on_step(t, **sinks)


def track():
    return memviz.track(torch=False)


# ---- the record ------------------------------------------------------------------------


def test_step_records_current_peak_growth_segments_and_lines(fake):
    keep = []
    with track() as t:
        keep.append(fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)); grow = here()  # noqa: E702
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)
        fake.free(CBID_cuMemFree_v2, tmp)
        r0 = t.step(batch_shape=(8, 128))
        keep.append(fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)); grow2 = here()  # noqa: E702
        r1 = t.step(batch_shape=(8, 256), tokens=2048)
        r2 = t.step()
    assert t.steps == [r0, r1, r2] and [r.index for r in t.steps] == [0, 1, 2]
    d0, d1, d2 = (r.devices[0] for r in (r0, r1, r2))
    assert (d0.current, d0.peak, d0.growth, d0.live_count) == (4 * MiB, 20 * MiB, 4 * MiB, 1)
    assert (d0.segment_allocs, d0.segment_frees, d0.segment_alloc_bytes) == (2, 1, 20 * MiB)
    assert (d1.current, d1.peak, d1.growth) == (8 * MiB, 8 * MiB, 4 * MiB)
    assert (d1.segment_allocs, d1.segment_frees) == (1, 0)
    assert (d2.current, d2.peak, d2.growth, d2.segment_allocs) == (8 * MiB, 8 * MiB, 0, 0)
    assert [(g.location, g.bytes, g.count) for g in r0.lines] == [(f"{THIS}:{grow}", 4 * MiB, 1)]
    assert [(g.location, g.bytes) for g in r1.lines] == [(f"{THIS}:{grow2}", 4 * MiB)]
    assert r2.lines == []
    assert r0.info == {"batch_shape": (8, 128)} and r1.info == {"batch_shape": (8, 256), "tokens": 2048}
    assert r0.duration_ns > 0 and r1.timestamp_ns - r0.timestamp_ns == r1.duration_ns
    assert (r1.current, r1.peak, r1.growth) == (8 * MiB, 8 * MiB, 4 * MiB)
    assert r1.allocated is None and r1.reserved is None  # no PyTorch CUDA here
    assert "memviz step 1" in str(r1) and f"grew: {THIS}:{grow2} (+4 MiB)" in str(r1)


def test_lines_are_ranked_and_capped(fake):
    with track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 6 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 7 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        rec = t.step()
    assert len(rec.lines) == _steps.TOP_LINES
    sizes = [g.bytes for g in rec.lines]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 8 * MiB


def test_info_is_kept_json_friendly():
    class Shaped:
        shape = (4, 5)

    assert _steps._norm_info(Shaped()) == (4, 5)
    assert _steps._norm_info([1, 2]) == (1, 2)
    assert _steps._norm_info(SimpleNamespace(text="x" * 500)).endswith("...")
    assert _steps._norm_info(object()).startswith("<object")


def test_torch_size_and_tensors_become_shapes(fake):
    torch = pytest.importorskip("torch", reason="checks torch.Size handling")
    x = torch.zeros(3, 7)
    with track() as t:
        r = t.step(batch_shape=x.shape, batch=x, lr=torch.tensor(0.5).item())
    assert r.info == {"batch_shape": (3, 7), "batch": (3, 7), "lr": 0.5}


def test_zero_d_tensors_and_arrays_become_their_numbers(fake):
    """t.step(loss=loss, tokens=n) with 0-d tensors: the numbers, not ()
    (the value was lost, and a tokens= tensor never reached the spike rule)."""
    torch = pytest.importorskip("torch", reason="0-d tensors")
    with track() as t:
        r = t.step(loss=torch.tensor(2.5), tokens=torch.tensor(512), ok=torch.tensor(True),
                   one=torch.zeros(1))
    assert r.info == {"loss": 2.5, "tokens": 512, "ok": True, "one": (1,)}
    assert type(r.info["tokens"]) is int
    np = pytest.importorskip("numpy", reason="0-d arrays")
    assert _steps._norm_info(np.array(7)) == 7 and _steps._norm_info(np.float32(0.5)) == 0.5
    assert json.dumps(r.to_dict())


def test_to_dict_round_trip_is_json(fake):
    with track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        r = t.step(batch_shape=(2, 3))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["devices"]["0"]["current"] == MiB and d["info"] == {"batch_shape": [2, 3]}
    assert StepRecord.from_dict(d) == r


def test_pytorch_numbers_come_from_one_stats_call_per_device(fake, monkeypatch):
    calls = []

    def stats(dev):
        calls.append(dev)
        return {"allocated_bytes": {"all": {"current": 100 + dev, "peak": 300}},
                "reserved_bytes": {"all": {"current": 200 + dev}}}

    cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2, current_device=lambda: 0)
    fake_torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_memoryStats=stats,
                                                               _autograd=SimpleNamespace(_get_sequence_nr=lambda: 42)))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        r = t.step()
    d = r.devices[0]
    assert (d.allocated, d.reserved, d.allocated_peak, d.current) == (100, 200, 300, MiB)
    assert calls == [0] and r.autograd_seq == 41


def test_step_needs_a_running_tracker(fake):
    t = track()
    with pytest.raises(memviz.NotTracking, match="needs a running tracker"):
        t.step()
    with t:
        pass
    with pytest.raises(memviz.NotTracking, match=r"memviz.track\(\) as t"):
        t.step()


def test_step_without_gpu_capture_still_records_time_and_info():
    with memviz.track(gpu=False) as t:
        r = t.step(tokens=5)
    assert r.devices == {} and r.info == {"tokens": 5} and r.current is None


# ---- sinks -------------------------------------------------------------------------------


def test_callback_log_and_print_sinks(fake, caplog, capsys):
    got = []
    with track() as t:
        add_sinks(t, callback=got.append, log=True, print_every=2)
        with caplog.at_level(logging.INFO, logger="memviz"):
            for _ in range(4):
                fake.alloc(CBID_cuMemAlloc_v2, MiB)
                t.step()
    assert [r.index for r in got] == [0, 1, 2, 3]
    logged = [r for r in caplog.records if r.name == "memviz"]
    assert len(logged) == 4 and logged[0].getMessage().startswith("memviz step 0 (")
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in printed] == ["memviz step 1", "memviz step 3"]
    assert "cuda:0 current 4 MiB (+1 MiB)" in printed[-1]


def test_jsonl_and_csv_sinks(fake, tmp_path):
    jl, cs = tmp_path / "steps.jsonl", tmp_path / "steps.csv"
    with track() as t:
        add_sinks(t, jsonl=jl, csv=cs)
        for i in range(3):
            fake.alloc(CBID_cuMemAlloc_v2, MiB); line = here()  # noqa: E702
            t.step(batch_shape=(4, i + 1))
    rows = [json.loads(x) for x in jl.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[2]["devices"]["0"]["current"] == 3 * MiB and rows[2]["info"] == {"batch_shape": [4, 3]}
    assert StepRecord.from_dict(rows[1]) == t.steps[1]
    with open(cs, newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == _sinks.CSV_COLUMNS
    assert [(r["step"], r["device"], r["current"], r["growth"]) for r in table] == [
        ("0", "0", str(MiB), str(MiB)), ("1", "0", str(2 * MiB), str(MiB)), ("2", "0", str(3 * MiB), str(MiB))]
    assert table[0]["top_line"] == f"{THIS}:{line}" and json.loads(table[2]["info"]) == {"batch_shape": [4, 3]}


def test_step_sinks_with_a_file_name_that_is_not_utf8(fake, tmp_path, capsys):
    # Code from a folder named with byte 0xff: the CSV and the printed summary
    # show the name escaped (d\\xff), the JSON lines keep it exactly.
    name = os.fsdecode(b"/tmp/d\xffir/model.py")
    ns = {}
    exec(compile("def grow(fake, cbid, size):\n    return fake.alloc(cbid, size)\n", name, "exec"), ns)
    jl, cs = tmp_path / "steps.jsonl", tmp_path / "steps.csv"
    with track() as t:
        add_sinks(t, jsonl=jl, csv=cs, print_every=1)
        for _ in range(2):
            ns["grow"](fake, CBID_cuMemAlloc_v2, MiB)
            t.step()
    assert t.steps[-1].lines[0].location == f"{name}:2"
    with open(cs, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert table[-1]["top_line"] == "/tmp/d\\xffir/model.py:2"
    assert "grew: /tmp/d\\xffir/model.py:2 (+1 MiB)" in capsys.readouterr().out
    assert StepRecord.from_dict(json.loads(jl.read_bytes().splitlines()[-1])) == t.steps[-1]


def test_file_sinks_close_when_the_tracker_stops(fake, tmp_path):
    with track() as t:
        h = add_sinks(t, jsonl=tmp_path / "a.jsonl")
        t.step()
    assert all(s.f.closed for s in h.sinks)


def test_removed_sinks_receive_nothing(fake):
    got = []
    with track() as t:
        h = add_sinks(t, callback=got.append)
        t.step()
        h.remove()
        t.step()
    assert len(got) == 1


def test_tensorboard_sink_uses_add_scalar(fake):
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    w = Writer()
    with track() as t:
        add_sinks(t, tensorboard=w)
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
        t.step()
    tags = {tag: (v, s) for tag, v, s in w.scalars}
    assert tags["memviz/cuda:0/current_MiB"] == (2.0, 0) and "memviz/step_time_ms" in tags


@pytest.mark.parametrize("kwargs, err, text", [
    ({"callback": 3}, TypeError, "callback= must be a function"),
    ({"tensorboard": object()}, TypeError, "needs a SummaryWriter"),
    ({"print_every": 0}, ValueError, "print_every= must be a whole number"),
    ({"log": "loud"}, TypeError, "log= takes True"),
    ({"jsonl": "/nonexistent-dir/x.jsonl"}, OSError, "pass a path in a writable directory"),
])
def test_sink_mistakes_say_what_to_do(kwargs, err, text):
    with pytest.raises(err, match=text):
        _sinks.make_sinks(**kwargs)


# ---- memviz.watch(optimizer) ---------------------------------------------------------------


def _tiny_training(torch):
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_watch_records_a_step_per_optimizer_step(fake):
    torch = pytest.importorskip("torch", reason="watch() wraps a torch optimizer")
    model, opt = _tiny_training(torch)
    got, kept = [], []
    with track() as t:
        h = memviz.watch(opt, info=lambda: {"batch_shape": x.shape}, callback=got.append)
        for i in range(3):
            x = torch.randn(i + 1, 4)
            kept.append(fake.alloc(CBID_cuMemAlloc_v2, MiB)); line = here()  # noqa: E702
            model(x).sum().backward()
            opt.step()
        h.remove()
        opt.step()  # not recorded any more
    assert [r.index for r in t.steps] == [0, 1, 2] and h.records == t.steps == got
    assert [r.info["batch_shape"] for r in t.steps] == [(1, 4), (2, 4), (3, 4)]
    assert t.steps[2].devices[0].current == 3 * MiB
    assert t.steps[2].lines[0].location == f"{THIS}:{line}"


def test_watch_uses_the_given_tracker_and_warns_once_without_one(fake):
    torch = pytest.importorskip("torch", reason="watch() wraps a torch optimizer")
    model, opt = _tiny_training(torch)
    with memviz.watch(opt):
        with pytest.warns(RuntimeWarning, match="no memviz tracker is running"):
            opt.step()
        opt.step()  # warned once only (pytest.warns would not see a second one here)
    t = track()
    with memviz.watch(opt, tracker=t):
        with t:
            opt.step()
    assert len(t.steps) == 1


def test_watching_an_optimizer_again_replaces_the_earlier_watch(fake, tmp_path):
    """A notebook cell with memviz.watch(opt) run twice: each step recorded
    once (twice before, with the step findings' rates halved), said in a
    warning; a watch for another tracker is a watch of its own."""
    torch = pytest.importorskip("torch", reason="watch() wraps a torch optimizer")
    model, opt = _tiny_training(torch)
    other = track()
    with track() as t:
        first = memviz.watch(opt, tracker=t, jsonl=str(tmp_path / "s.jsonl"))
        with pytest.warns(RuntimeWarning, match="already watched"):
            second = memviz.watch(opt, tracker=t, jsonl=str(tmp_path / "s.jsonl"))
        mine = memviz.watch(opt, tracker=other)  # another tracker: no warning, both stay
        with other:
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
        second.remove(), mine.remove()
    assert [r.index for r in t.steps] == [0, 1, 2] and len(other.steps) == 3
    assert first.records == [] and len(second.records) == 3
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 3


def test_watch_needs_an_optimizer():
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        memviz.watch(object())
    with pytest.raises(TypeError, match=r"info=\.\.\.\) takes a dict"):
        memviz.watch(SimpleNamespace(register_step_post_hook=lambda fn: None), info=5)


# ---- Lightning and transformers callbacks (with stand-in framework modules) -----------------


def _stub_frameworks(monkeypatch):
    """Minimal `lightning.pytorch.callbacks.Callback` and `transformers.TrainerCallback`."""
    import types

    mods = {}
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks", "transformers"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["lightning.pytorch.callbacks"].Callback = type("Callback", (), {})
    mods["transformers"].TrainerCallback = type("TrainerCallback", (), {})
    for name in ("memviz.integrations.lightning", "memviz.integrations.huggingface"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_lightning_callback_records_each_batch_and_diagnoses(fake, monkeypatch, caplog):
    _stub_frameworks(monkeypatch)
    from memviz.integrations.lightning import MemvizCallback

    cb = MemvizCallback()
    trainer = SimpleNamespace(global_step=0)
    kept = []
    with caplog.at_level(logging.WARNING, logger="memviz"):
        cb.on_train_start(trainer, None)
        t = cb.tracker
        assert t is memviz.active_tracker() and t.running
        for i in range(20):
            kept.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))  # a steady leak
            trainer.global_step = i + 1
            cb.on_train_batch_end(trainer, None, None, (SimpleNamespace(shape=(4, 16)), None), i)
        cb.on_train_end(trainer, None)
    assert not t.running and len(t.steps) == 20
    assert t.steps[3].info == {"batch_shape": (4, 16), "batch_idx": 3, "global_step": 4}
    assert [f.kind for f in cb.findings] == ["growth"]
    assert any("rises 8 MiB per step" in r.getMessage() for r in caplog.records)


def test_huggingface_callback_uses_the_running_tracker(fake, monkeypatch):
    _stub_frameworks(monkeypatch)
    from memviz.integrations.huggingface import MemvizCallback

    got = []
    cb = MemvizCallback(callback=got.append, diagnose=False)
    with track() as t:
        cb.on_train_begin(None, None, None)
        for i in range(3):
            cb.on_step_end(None, SimpleNamespace(global_step=i + 1), None, model=None)
        cb.on_train_end(None, None, None)
        assert t.running  # not ours to stop
    assert [r.info["global_step"] for r in t.steps] == [1, 2, 3] and len(got) == 3


def test_integrations_say_what_to_install(monkeypatch):
    frameworks = ("lightning", "pytorch_lightning", "transformers")
    for name in list(sys.modules):  # where installed, an earlier test may have imported them:
        if name.split(".")[0] in frameworks:  # their submodules (lightning.pytorch.callbacks) too
            monkeypatch.setitem(sys.modules, name, None)
    for name in frameworks:
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    for name in ("memviz.integrations.lightning", "memviz.integrations.huggingface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match="pip install lightning"):
        import memviz.integrations.lightning  # noqa: F401
    with pytest.raises(ImportError, match="pip install transformers"):
        import memviz.integrations.huggingface  # noqa: F401


def test_batch_shape_of_common_batches():
    from memviz.integrations.callbacks import batch_shape

    x = SimpleNamespace(shape=(2, 3))
    assert batch_shape(x) == batch_shape([x, 1]) == batch_shape({"input_ids": x, "y": 1}) == (2, 3)
    assert batch_shape({"a": 1, "b": x}) == (2, 3) and batch_shape(5) is None


@pytest.mark.parametrize("name", ["spiking_loop.py", "fragmenting_loop.py"])
def test_gpu_examples_say_so_in_one_sentence_without_cuda(name):
    import subprocess

    torch = pytest.importorskip("torch", reason="the examples need torch to get as far as the GPU check")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu runs the examples")
    path = os.path.join(os.path.dirname(THIS), "..", "..", "examples", name)
    p = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})  # e.g. torch without numpy
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.count("\n") == 1 and p.stdout.startswith(f"{name}: this example needs a CUDA GPU")


def test_print_every_keeps_a_tqdm_bar_whole(monkeypatch, capsys):
    """print_every= goes through tqdm.write while a tqdm bar is open (a bare
    print would break the bar), else to stdout."""
    import types

    from memviz.analysis.sinks import console_write

    written = []
    bar = type("tqdm", (), {"_instances": set(), "write": staticmethod(written.append)})
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=bar))
    console_write("no bar open")
    assert capsys.readouterr().out == "no bar open\n" and written == []
    bar._instances.add(object())
    console_write("step 3: 1 MiB")
    assert written == ["step 3: 1 MiB"] and capsys.readouterr().out == ""


def test_print_every_with_a_real_tqdm_bar(capsys):
    tqdm = pytest.importorskip("tqdm", reason="needs tqdm (pip install tqdm)")
    from memviz.analysis.sinks import console_write

    with tqdm.tqdm(total=3, file=sys.stderr) as bar:
        console_write("a step line")
        bar.update(1)
    assert "a step line" in capsys.readouterr().out


def test_the_no_gpu_example_names_its_own_lines_and_the_leak(tmp_path):
    """examples/try_without_gpu.py, as the README tells a newcomer without a
    GPU to run it: the loop's lines, the steps, and the growth at the leak."""
    import subprocess

    from conftest import ROOT
    script = ROOT / "examples" / "try_without_gpu.py"
    leak = next(i for i, ln in enumerate(script.read_text().splitlines(), 1) if "history.append(loss)" in ln) - 1
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert f"try_without_gpu.py:{leak}" in p.stdout  # the loss line, kept in `history`
    assert "[growth]" in p.stdout and "Steps: 8 recorded" in p.stdout


def test_a_growth_finding_on_blocks_leaves_out_lines_that_only_made_segments():
    """On the allocator route a step line carries its blocks' growth: the
    finding about PyTorch's allocated memory sums those, and a line that only
    made segments (the backward's, without Python frames) is not listed; a
    trace of an older memviz, without block figures, is read as before."""
    from memviz.analysis.diagnose import _grown_lines
    from memviz.model.steps import GrowthLine, StepRecord

    def steps(with_blocks):
        out = []
        for i in range(6):
            seg = GrowthLine("<no Python frames>:?", "", 8 << 20, 1, (i + 1) * (8 << 20), i + 1,
                             *((0, 0) if with_blocks else (None, None)))
            mine = GrowthLine("train.py:12", "step", 5 << 20, 2, (i + 1) * (5 << 20), 2 * (i + 1),
                              *((4 << 20, (i + 1) * (4 << 20)) if with_blocks else (None, None)))
            out.append(StepRecord(i, i * 1000, 1000, {}, [seg, mine]))
        return out

    assert [(f.location, f.bytes) for f in _grown_lines(steps(True), blocks=True)] == [("train.py:12", 24 << 20)]
    older = [(f.location, f.bytes) for f in _grown_lines(steps(False), blocks=True)]
    assert older == [("<no Python frames>:?", 48 << 20), ("train.py:12", 30 << 20)]
    again = StepRecord.from_dict(steps(True)[0].to_dict())
    assert again.lines[1].block_bytes == 4 << 20 and again.lines[1].block_live_bytes == 4 << 20


STEP_WHILE_ANOTHER_THREAD_STOPS = """
import sys, os, random, threading, time, traceback
sys.path.insert(0, %r)
sys.setswitchinterval(1e-6)
import memviz
from memviz import NotTracking
d, errors, n = %r, [], 0
def stepper(t, stop):
    while not stop.is_set():
        try:
            t.step(x=1)
        except NotTracking:
            return
        except Exception:
            errors.append(traceback.format_exc())
            return
t0 = time.time()
while time.time() - t0 < 4 and not errors:
    t = memviz.track(gpu=False).start()
    t.on_step(jsonl=os.path.join(d, "s.jsonl"), csv=os.path.join(d, "s.csv"))
    stop = threading.Event()
    th = threading.Thread(target=stepper, args=(t, stop)); th.start()
    time.sleep(random.random() * 0.01)
    try:
        t.stop()
    finally:
        stop.set(); th.join()
    n += 1
print("RESULT", n, len(errors))
print(errors[0] if errors else "")
"""


def test_a_step_while_another_thread_stops_the_tracker_is_kept_or_refused(tmp_path):
    """t.step() on one thread while another stopped the tracker: the step
    files closed between a record's check and its write, and step() raised
    "ValueError: I/O operation on closed file" (the CSV file then missed the
    record too). Each file's check-and-write and its close are now one
    (sinks.py, _File.lock): a step is written, or came after the close and is
    kept in t.steps only, or came after the stop and raises NotTracking."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", STEP_WHILE_ANOTHER_THREAD_STOPS % (root, str(tmp_path))],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.split("RESULT", 1)[1].split(None, 2)
    assert int(out[0]) > 50 and out[1] == "0", p.stdout[-3000:]


def test_a_records_dict_is_asdicts_without_its_copies(fake):
    """StepRecord.to_dict() reads its devices and lines field by field (the
    notebook view reads every step's): the same dicts dataclasses.asdict
    makes."""
    import dataclasses

    kept = []
    with track() as t:
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, MiB))
        rec = t.step(batch_shape=(2, 3))
    d = rec.to_dict()
    assert d["devices"] == {str(k): dataclasses.asdict(v) for k, v in rec.devices.items()}
    assert d["lines"] == [dataclasses.asdict(x) for x in rec.lines] and d["lines"]
