"""memviz.integrations.huggingface with the real transformers Trainer, on the
CPU: a tiny model, a few steps, allocations through the libcupti test double
(the model's forward makes one of 8 MiB a step and keeps it).

What is checked: ``attach(trainer)`` puts the callback before the
``report_to`` integrations (TensorBoard, read back from its event files) and
the callbacks given to ``Trainer(callbacks=...)`` (a CSV writer), so that
every one of them gets memviz's metrics, as ``state.log_history`` does;
nothing of the Trainer is replaced; ``Trainer(callbacks=[MemvizCallback()])``
says why report_to does not get them; a training that raises. The call
order of transformers' events, and the same behaviour against stand-ins,
are in tests/integration/test_integrations.py.

Skipped, saying what to install, without transformers (and accelerate,
which its Trainer needs, and torch); the TensorBoard part also needs
tensorboard.
"""

import csv
import importlib
import importlib.util
import logging
import sys

import pytest

_MISSING = [m for m in ("torch", "transformers", "accelerate") if importlib.util.find_spec(m) is None]
if _MISSING:  # before importing any of them
    pytest.skip(f"the real Hugging Face Trainer needs {', '.join(_MISSING)}: pip install transformers "
                f"accelerate torch (the [test-all] extra)", allow_module_level=True)

import memviz  # noqa: E402
from fake_cupti import CBID_cuMemAlloc_v2  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def hf(monkeypatch):
    """memviz.integrations.huggingface imported afresh (tests/integration/test_integrations.py
    imports it over a stand-in transformers)."""
    monkeypatch.delitem(sys.modules, "memviz.integrations.huggingface", raising=False)
    return importlib.import_module("memviz.integrations.huggingface")


def make_trainer(fake, tmp_path, *, callbacks=(), report_to="none", max_steps=4, fail=None,
                 kept=None):
    """A Trainer of a tiny model; ``fail["at"]``: how many items the dataset
    gives before it raises (None: it does not), read at each item."""
    import torch
    import transformers

    kept = [] if kept is None else kept

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x=None, labels=None):
            kept.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))
            return {"loss": (self.layer(x).squeeze(-1) - labels).pow(2).mean()}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            if fail is not None and fail["at"] is not None:
                if fail.setdefault("served", 0) >= fail["at"]:
                    raise ValueError(f"bad sample {i}")
                fail["served"] += 1
            return {"x": torch.randn(4), "labels": torch.tensor(0.0)}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, logging_steps=2,
        per_device_train_batch_size=4, report_to=report_to, use_cpu=True, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    return transformers.Trainer(model=Model(), args=args, train_dataset=Data(),
                                callbacks=list(callbacks))


def memviz_keys(logs, start="memviz/"):
    return {k[k.index(start):]: v for k, v in logs.items() if start in k}


def expected(steps):
    """The metrics of a window of step records, worked out from the records."""
    last = steps[-1].devices[0]
    return {"memviz/cuda0/current_MiB": last.current / MiB,
            "memviz/cuda0/peak_MiB": max(s.devices[0].peak for s in steps) / MiB,
            "memviz/cuda0/growth_MiB": sum(s.devices[0].growth for s in steps) / MiB,
            "memviz/step_time_ms": sum(s.duration_ns for s in steps) / len(steps) / 1e6}


def _csv_reporter(path):
    import transformers

    class CSVReporter(transformers.TrainerCallback):
        """A reporter of one's own: every log as a row of a CSV file."""

        def __init__(self):
            self.rows = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.rows.append({"step": state.global_step, **logs})

        def on_train_end(self, args, state, control, **kwargs):
            fields = list(dict.fromkeys(k for r in self.rows for k in r))
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fields)
                w.writeheader()
                w.writerows(self.rows)

    return CSVReporter()


def _tensorboard_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_attach_sends_the_metrics_to_report_to_and_replaces_nothing(fake, tmp_path, hf, monkeypatch,
                                                                    capsys):
    pytest.importorskip("tensorboard", reason="the TensorBoard reporter needs tensorboard: "
                                              "pip install tensorboard")
    import transformers
    from transformers.integrations import TensorBoardCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    train, log = transformers.Trainer.train, transformers.Trainer.log
    reporter = _csv_reporter(tmp_path / "logs.csv")
    trainer = make_trainer(fake, tmp_path, callbacks=[reporter], report_to="tensorboard")
    order = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert order == [transformers.trainer_callback.DefaultFlowCallback, TensorBoardCallback,
                     type(reporter), transformers.trainer_callback.PrinterCallback]
    def shadowed():  # instance attributes over the class's methods
        return {k for k in vars(trainer) if callable(getattr(type(trainer), k, None))}

    before = shadowed()
    cb = hf.attach(trainer, diagnose=False)
    # Just before the first callback that reads the logs; the rest keep their order.
    assert [type(c) for c in trainer.callback_handler.callbacks] == order[:1] + [hf.MemvizCallback] + order[1:]
    trainer.train()

    # Nothing of the Trainer was replaced: no attribute set, the class's methods as they were.
    assert shadowed() == before and "train" not in vars(trainer) and "log" not in vars(trainer)
    assert transformers.Trainer.train is train and transformers.Trainer.log is log
    assert trainer.train.__func__ is train and trainer.log.__func__ is log

    steps = cb.tracker.steps
    assert len(steps) == 4 and not cb.tracker.running
    want = [expected(steps[0:2]), expected(steps[2:4])]
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in history] == [2, 4]
    assert [memviz_keys(e) for e in history] == want
    # TensorBoard (report_to), read back from its event files: train/memviz/... at steps 2 and 4
    scalars = _tensorboard_scalars(tmp_path / "tb")
    for name in want[0]:
        got = scalars["train/" + name]
        assert [s for s, _ in got] == [2, 4], name
        assert [v for _, v in got] == pytest.approx([w[name] for w in want], rel=1e-6), name
    assert scalars["train/memviz/cuda0/growth_MiB"][0][1] == 16.0  # 8 MiB kept per step
    # the CSV reporter, given to Trainer(callbacks=...)
    with open(tmp_path / "logs.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
    assert [{k: float(v) for k, v in memviz_keys(r).items()} for r in rows] == \
        [pytest.approx(w) for w in want]
    # and the printed logs (PrinterCallback, disable_tqdm=True)
    assert capsys.readouterr().out.count("'memviz/cuda0/current_MiB'") >= 2


def test_callback_given_to_the_trainer_reaches_log_history_and_says_report_to_does_not(
        fake, tmp_path, hf, caplog):
    """Trainer(callbacks=[MemvizCallback()]) comes after report_to's
    integrations: they have read the logs before its on_log runs. The metrics
    still reach log_history and the callbacks after it; it says so once."""
    import transformers

    class Capture(transformers.TrainerCallback):  # stands where report_to's callbacks are
        def __init__(self):
            self.logged = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append(dict(logs))

    first, cb, last = Capture(), hf.MemvizCallback(diagnose=False), Capture()
    trainer = make_trainer(fake, tmp_path, callbacks=[first, cb, last])
    trainer.args.report_to = ["tensorboard"]  # as TrainingArguments(report_to="tensorboard") leaves it
    with caplog.at_level(logging.WARNING, logger="memviz"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "not placed with attach" in r.getMessage()]
    assert len(said) == 1 and "attach(trainer)" in said[0], said
    steps = cb.tracker.steps
    want = [expected(steps[0:2]), expected(steps[2:4])]
    assert [memviz_keys(e) for e in trainer.state.log_history if "loss" in e] == want
    assert [memviz_keys(x) for x in last.logged if "loss" in x] == want
    assert not any(memviz_keys(x) for x in first.logged)


def test_a_training_that_raises(fake, tmp_path, hf, caplog):
    """No callback hears of it: the tracker the callback started runs on
    until the next train() (or callback.finish(exc)), which stops it and logs
    its findings; the Trainer is not touched."""
    fail = {"at": 4 * 9}  # the tenth batch
    trainer = make_trainer(fake, tmp_path, max_steps=12, fail=fail)
    cb = hf.attach(trainer)
    with pytest.raises(ValueError, match="bad sample"):
        trainer.train()
    first = cb.tracker
    assert first.running and "train" not in vars(trainer)
    n = len(first.steps)
    assert 7 <= n <= 9  # the batches before the bad one (the data loader may read ahead)
    fail["at"] = None  # the same trainer, trained again on good data
    with caplog.at_level(logging.WARNING, logger="memviz"):
        trainer.train()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the previous training did not end before this one began" in text
    assert "rises 8 MiB per step" in text  # the failed run's finding
    assert not first.running and len(first.steps) == n
    assert cb.tracker is not first and not cb.tracker.running and len(cb.tracker.steps) == 12
    assert memviz.active_tracker() is None

    # callback.finish(exc) in the except: at once
    trainer = make_trainer(fake, tmp_path, max_steps=12, fail={"at": 4 * 9})
    cb = hf.attach(trainer)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memviz"):
        try:
            trainer.train()
        except ValueError as e:
            cb.finish(e)
    assert not cb.tracker.running and isinstance(cb.error, ValueError)
    assert [f.kind for f in cb.findings] == ["growth"]
    assert any("ValueError: bad sample" in r.getMessage() for r in caplog.records)


def test_a_tracker_the_user_started_is_never_stopped(fake, tmp_path, hf):
    trainer = make_trainer(fake, tmp_path, max_steps=12, fail={"at": 4 * 3})
    cb = hf.attach(trainer, diagnose=False)
    with memviz.track() as t:
        with pytest.raises(ValueError) as e:
            trainer.train()
        cb.finish(e.value)
        assert t.running and memviz.active_tracker() is t and cb.tracker is t and len(t.steps) >= 1
