"""The Lightning and transformers callbacks when training fails.

Neither framework is installed here, so each is stood in for by a few lines
that call the real callback classes in the framework's own order:

* Lightning (``trainer/call.py:_call_and_handle_interrupt``): on_train_start,
  on_train_batch_end per batch, on_train_end; when anything raises,
  ``on_exception(trainer, pl_module, exception)`` on every callback, then
  teardown, then the exception goes on.
* transformers (``Trainer.__init__`` builds the callback list, flow callback,
  ``report_to`` integrations, then ``callbacks=``; ``train()`` ->
  ``_inner_training_loop``: on_train_begin, on_step_begin / on_step_end per
  step, on_train_end; ``add_callback`` appends, ``pop_callback`` removes). It
  has no exception event: an exception escapes ``train()`` and no callback
  hears of it.

Allocations go through the libcupti test double. The real Trainer, where
transformers is installed, is in tests/integration/test_huggingface.py.
"""

import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CUDA_ERROR_OUT_OF_MEMORY

MiB = 1 << 20


class _Callback:
    """lightning.pytorch.callbacks.Callback: every hook a no-op."""

    def on_train_start(self, trainer, pl_module):
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass

    def on_train_end(self, trainer, pl_module):
        pass

    def on_exception(self, trainer, pl_module, exception):
        pass

    def teardown(self, trainer, pl_module, stage):
        pass


class _TrainerCallback:
    """transformers.TrainerCallback: every event a no-op taking **kwargs."""

    def on_init_end(self, args, state, control, **kwargs):
        pass

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_step_begin(self, args, state, control, **kwargs):
        pass

    def on_step_end(self, args, state, control, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, **kwargs):
        pass


@pytest.fixture
def frameworks(monkeypatch):
    mods = {}
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks", "transformers"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["lightning.pytorch.callbacks"].Callback = _Callback
    mods["transformers"].TrainerCallback = _TrainerCallback
    for name in ("memviz.integrations.lightning", "memviz.integrations.huggingface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import memviz.integrations.huggingface as hf
    import memviz.integrations.lightning as pl

    return SimpleNamespace(lightning=pl.MemvizCallback, hf=hf.MemvizCallback)


# ---- Lightning's call order ---------------------------------------------------------------


class LightningTrainer:
    def __init__(self, callbacks):
        self.callbacks = callbacks
        self.global_step = 0

    def fit(self, training_step, batches):
        """`Trainer.fit` -> `_call_and_handle_interrupt(self, self._fit_impl, ...)`."""
        module = SimpleNamespace()
        try:
            for cb in self.callbacks:
                cb.on_train_start(self, module)
            for i, batch in enumerate(batches):
                out = training_step(batch, i)
                self.global_step += 1
                for cb in self.callbacks:
                    cb.on_train_batch_end(self, module, out, batch, i)
            for cb in self.callbacks:
                cb.on_train_end(self, module)
        except BaseException as exception:
            for cb in self.callbacks:  # _interrupt()
                cb.on_exception(self, module, exception)
            for cb in self.callbacks:  # trainer._teardown()
                cb.teardown(self, module, "fit")
            raise


def leaky_step(fake, kept, fail_at, oom=False):
    def step(batch, i):
        if i == fail_at:
            if oom:
                fake.alloc(CBID_cuMemAlloc_v2, 512 * MiB, result=CUDA_ERROR_OUT_OF_MEMORY)
            raise RuntimeError("training_step failed")
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))
        return None
    return step


@pytest.mark.parametrize("zero", [True, False])
def test_lightning_findings_are_logged_on_rank_zero_only(fake, frameworks, caplog, zero):
    """As Lightning's own messages: one copy of each finding, from rank zero;
    every rank keeps its own in callback.findings."""
    cb = frameworks.lightning()
    trainer = LightningTrainer([cb])
    trainer.is_global_zero = zero
    kept = []
    with caplog.at_level(logging.WARNING, logger="memviz"):
        trainer.fit(leaky_step(fake, kept, fail_at=-1), [SimpleNamespace(shape=(4, 8))] * 12)
    assert [f.kind for f in cb.findings] == ["growth"]
    logged = [r for r in caplog.records if r.name == "memviz" and "growth" in r.getMessage().lower()]
    assert bool(logged) is zero, [r.getMessage() for r in caplog.records]


def test_lightning_callback_stops_its_tracker_when_training_step_raises(fake, frameworks, caplog):
    cb = frameworks.lightning()
    trainer = LightningTrainer([cb])
    kept = []
    with caplog.at_level(logging.WARNING, logger="memviz"):
        with pytest.raises(RuntimeError, match="training_step failed"):
            trainer.fit(leaky_step(fake, kept, fail_at=20, oom=True), [SimpleNamespace(shape=(4, 8))] * 30)
    t = cb.tracker
    assert t is not None and not t.running and memviz.active_tracker() is None
    assert not fake.is_subscribed()
    # It keeps what it saw: 20 steps, the leak, the failed allocation.
    assert len(t.steps) == 20 and t.current_bytes() == 20 * 8 * MiB
    assert [f.size for f in t.failures] == [512 * MiB]
    assert [f.kind for f in cb.findings] == ["growth"]
    assert cb.oom_report is not None and cb.oom_report.requested == 512 * MiB
    assert isinstance(cb.error, RuntimeError)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RuntimeError: training_step failed" in text
    assert "rises 8 MiB per step" in text and "Out of memory on cuda:0: 512 MiB requested" in text
    # Nothing is left running: a new tracker is a top-level one.
    with memviz.track() as t2:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert t2.current_bytes() == MiB and t.current_bytes() == 20 * 8 * MiB


def test_lightning_callback_leaves_a_tracker_the_user_started(fake, frameworks, caplog):
    cb = frameworks.lightning()
    trainer = LightningTrainer([cb])
    kept = []
    with memviz.track() as t:
        with caplog.at_level(logging.WARNING, logger="memviz"):
            with pytest.raises(RuntimeError):
                trainer.fit(leaky_step(fake, kept, fail_at=3), [None] * 5)
        assert t.running and memviz.active_tracker() is t and fake.is_subscribed()
        assert len(t.steps) == 3 and cb.tracker is t
    assert not any("stopped" in r.getMessage() for r in caplog.records)


def test_lightning_callback_passed_a_tracker_does_not_stop_it(fake, frameworks):
    t = memviz.start()
    try:
        cb = frameworks.lightning(t, diagnose=False)
        with pytest.raises(KeyboardInterrupt):
            LightningTrainer([cb]).fit(lambda b, i: (_ for _ in ()).throw(KeyboardInterrupt()), [None])
        assert t.running
    finally:
        t.stop()


def test_a_callback_given_a_tracker_not_running_says_so(fake, frameworks):
    """A tracker passed but never started: the training records no step; the
    callback says so at its start, and its end's findings are none (no
    "rule failed ... please report" warning)."""
    import warnings

    t = memviz.track()
    cb = frameworks.lightning(t)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LightningTrainer([cb]).fit(lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 2)
    said = [str(w.message) for w in caught]
    assert any("not running" in m and "start it first" in m for m in said), said
    assert not any("rule failed" in m for m in said), said
    assert cb.findings == [] and t.steps == []
    assert memviz.diagnose(memviz.track()) == []


def test_lightning_callback_used_for_two_fits_records_both(fake, frameworks):
    cb = frameworks.lightning(diagnose=False)
    trainer = LightningTrainer([cb])
    trainer.fit(lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 3)
    first = cb.tracker
    trainer.fit(lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 4)
    second = cb.tracker
    assert second is not first and not first.running and not second.running
    assert (len(first.steps), len(second.steps)) == (3, 4)
    assert memviz.active_tracker() is None


def test_a_callbacks_step_files_take_every_training(fake, frameworks, tmp_path):
    """jsonl= and csv= are closed when a training ends; the next training of
    the same callback appends its steps (they were dropped without a word)."""
    cb = frameworks.lightning(diagnose=False, jsonl=str(tmp_path / "s.jsonl"), csv=str(tmp_path / "s.csv"))
    trainer = LightningTrainer([cb])
    trainer.fit(lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 3)
    trainer.fit(lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 4)
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1, 2, 0, 1, 2, 3]
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and sum(r.startswith("step,") for r in rows) == 1
    assert len(rows) >= 1 + 7


# ---- transformers' call order -------------------------------------------------------------


class CallbackHandler:
    def __init__(self, callbacks):
        self.callbacks = []
        for cb in callbacks:
            self.add_callback(cb)

    def add_callback(self, cb):
        self.callbacks.append(cb() if isinstance(cb, type) else cb)

    def pop_callback(self, cb):
        for c in self.callbacks:
            if (isinstance(c, cb) if isinstance(cb, type) else c == cb):
                self.callbacks.remove(c)
                return c
        return None

    def call_event(self, event, args, state, control, **kwargs):
        for cb in self.callbacks:
            result = getattr(cb, event)(args, state, control, model=None, processing_class=None,
                                        optimizer=None, lr_scheduler=None, train_dataloader=None,
                                        eval_dataloader=None, **kwargs)
            if result is not None:
                control = result
        return control

    def on_init_end(self, args, state, control):
        return self.call_event("on_init_end", args, state, control)

    def on_train_begin(self, args, state, control):
        return self.call_event("on_train_begin", args, state, control)

    def on_step_begin(self, args, state, control):
        return self.call_event("on_step_begin", args, state, control)

    def on_step_end(self, args, state, control):
        return self.call_event("on_step_end", args, state, control)

    def on_train_end(self, args, state, control):
        return self.call_event("on_train_end", args, state, control)


class HFTrainer:
    def __init__(self, callbacks, dataset, report_to=()):
        self.args = SimpleNamespace(report_to=list(report_to))
        self.callback_handler = CallbackHandler(callbacks)
        self.dataset = dataset
        self.state = SimpleNamespace(global_step=0, is_world_process_zero=True)
        self.control = SimpleNamespace()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def add_callback(self, cb):
        self.callback_handler.add_callback(cb)

    def pop_callback(self, cb):
        return self.callback_handler.pop_callback(cb)

    def train(self):
        return self._inner_training_loop()

    def _inner_training_loop(self):
        h = self.callback_handler
        self.state.global_step = 0
        self.control = h.on_train_begin(self.args, self.state, self.control)
        for batch in self.dataset():
            self.control = h.on_step_begin(self.args, self.state, self.control)
            batch()
            self.state.global_step += 1
            self.control = h.on_step_end(self.args, self.state, self.control)
        self.control = h.on_train_end(self.args, self.state, self.control)
        return "done"


def dataset(fake, n, fail_at=None, kept=None):
    """A dataset whose item `fail_at` raises (as a broken sample would)."""
    def items():
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"bad sample {i}")
            yield (lambda: kept.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))) if kept is not None \
                else (lambda: None)
    return items


def test_hf_callback_finishes_a_failed_run_at_the_next_train(fake, frameworks, caplog):
    """No event says train() raised: the tracker the callback started runs
    on until the next on_train_begin, which stops it (keeping what it saw)
    and logs its findings, then starts a new one."""
    cb = frameworks.hf()
    kept = []
    trainer = HFTrainer([cb], dataset(fake, 30, fail_at=20, kept=kept))
    with pytest.raises(ValueError, match="bad sample 20"):
        trainer.train()
    first = cb.tracker
    assert first.running and memviz.active_tracker() is first and cb.error is None
    trainer.dataset = dataset(fake, 2)
    with caplog.at_level(logging.WARNING, logger="memviz"):
        assert trainer.train() == "done"
    assert not first.running and [r.info["global_step"] for r in first.steps] == list(range(1, 21))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the previous training did not end before this one began" in text
    assert "rises 8 MiB per step" in text
    assert cb.tracker is not first and not cb.tracker.running and len(cb.tracker.steps) == 2
    assert memviz.active_tracker() is None and not fake.is_subscribed()


def test_hf_callback_finish_stops_its_tracker_at_once(fake, frameworks, caplog):
    cb = frameworks.hf()
    kept = []
    trainer = HFTrainer([cb], dataset(fake, 30, fail_at=20, kept=kept))
    with caplog.at_level(logging.WARNING, logger="memviz"):
        try:
            trainer.train()
        except ValueError as e:
            cb.finish(e)
    t = cb.tracker
    assert not t.running and memviz.active_tracker() is None and not fake.is_subscribed()
    assert len(t.steps) == 20 and t.current_bytes() == 20 * 8 * MiB
    assert [f.kind for f in cb.findings] == ["growth"] and isinstance(cb.error, ValueError)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "ValueError: bad sample 20" in text and "rises 8 MiB per step" in text
    cb.finish()  # nothing left to finish: no second message
    assert sum("is stopped" in r.getMessage() for r in caplog.records) == 1


def test_hf_callback_collected_with_its_trainer_finishes_its_tracker(fake, frameworks, caplog):
    import gc

    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([cb], dataset(fake, 5, fail_at=3))
    with pytest.raises(ValueError):
        trainer.train()
    t = cb.tracker
    assert t.running
    with caplog.at_level(logging.WARNING, logger="memviz"):
        del cb, trainer
        gc.collect()
    assert not t.running and len(t.steps) == 3 and memviz.active_tracker() is None
    assert any("garbage-collected before training ended" in r.getMessage() for r in caplog.records)


def test_hf_callback_finishes_a_failed_run_when_the_process_exits(fake_path, tmp_path):
    """The process exits after train() raised: the exit hook finishes the
    tracker the callback started and logs its findings (before memviz stops
    every tracker at exit)."""
    import subprocess
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, types
        sys.path.insert(0, {str(tests)!r})
        sys.path.insert(0, {str(tests.parent)!r})
        sys.modules["transformers"] = types.ModuleType("transformers")
        class TrainerCallback:  # the stand-in: events are no-ops
            def on_log(self, args, state, control, **kwargs):
                pass
        sys.modules["transformers"].TrainerCallback = TrainerCallback
        from types import SimpleNamespace
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
        from memviz.integrations.huggingface import MemvizCallback
        lib = FakeCupti({fake_path!r}).lib
        cb = MemvizCallback()
        args, state = SimpleNamespace(report_to=[]), SimpleNamespace(global_step=0)
        cb.on_train_begin(args, state, None)
        for step in range(1, 21):
            lib.fake_alloc(CBID_cuMemAlloc_v2, 8 << 20, 0, 0)
            state.global_step = step
            cb.on_step_end(args, state, None)
        raise RuntimeError("out of data")
    """))
    import os
    import sys

    from memviz.capture import cupti as _capture

    env = {**os.environ, _capture.ENV_LIBRARY: fake_path}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and "RuntimeError: out of data" in p.stderr, p.stderr
    assert "training did not end before the process exited" in p.stderr, p.stderr
    assert "rises 8 MiB per step" in p.stderr, p.stderr


def test_hf_callback_leaves_a_tracker_the_user_started(fake, frameworks):
    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([cb], dataset(fake, 5, fail_at=2))
    with memviz.track() as t:
        with pytest.raises(ValueError) as e:
            trainer.train()
        cb.finish(e.value)
        assert t.running and memviz.active_tracker() is t and len(t.steps) == 2
        assert cb.error is e.value
        trainer.dataset = dataset(fake, 1)
        trainer.train()  # the next train(): the user's tracker still
        assert t.running and len(t.steps) == 3


def test_hf_callback_replaces_nothing_on_its_trainer(fake, frameworks):
    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([cb], dataset(fake, 3))
    before = dict(vars(trainer))
    assert trainer.train() == "done" and not cb.tracker.running
    assert set(vars(trainer)) == set(before) and "train" not in vars(trainer) and "log" not in vars(trainer)
    assert trainer.train.__func__ is HFTrainer.train and HFTrainer.train.__name__ == "train"


# ---- metrics through the framework's own logging -------------------------------------------
#
# Lightning: DeviceStatsMonitor's convention (callbacks/device_stats_monitor.py): at a logging
# step (`trainer._logger_connector.should_update_logs`: (_batches_that_stepped + 1) %
# log_every_n_steps == 0), `logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop.
# _batches_that_stepped)` on each of `trainer.loggers`, names joined with `logger.group_separator`;
# `_batches_that_stepped` grows after on_train_batch_end.
# transformers 5 (trainer.py, Trainer.log): `state.log_history.append({**logs, "step": ...})`,
# then `callback_handler.on_log(args, state, control, logs)`, the report_to callbacks first.

from memviz.integrations.callbacks import step_metrics  # noqa: E402


class CaptureLogger:
    """A Lightning logger (lightning.pytorch.loggers.Logger) keeping what it is sent."""

    def __init__(self, group_separator="/"):
        self.group_separator = group_separator
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


class LoggingLightningTrainer(LightningTrainer):
    def __init__(self, callbacks, loggers, log_every_n_steps=50):
        super().__init__(callbacks)
        self.loggers = loggers
        self.logger = loggers[0] if loggers else None
        self.log_every_n_steps = log_every_n_steps
        self.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0))
        trainer = self

        class Connector:
            @property
            def should_update_logs(self):
                return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0

        self._logger_connector = Connector()

    def fit(self, training_step, batches):
        module = SimpleNamespace()
        for cb in self.callbacks:
            cb.on_train_start(self, module)
        for i, batch in enumerate(batches):
            out = training_step(batch, i)
            self.global_step += 1
            for cb in self.callbacks:
                cb.on_train_batch_end(self, module, out, batch, i)
            self.fit_loop.epoch_loop._batches_that_stepped += 1
        for cb in self.callbacks:
            cb.on_train_end(self, module)


def expected(steps, sep="/", prefix="memviz"):
    """The metrics of a window of step records, worked out from the records."""
    last = steps[-1].devices[0]
    base = f"{prefix}{sep}cuda0{sep}"
    return {f"{base}current_MiB": last.current / MiB,
            f"{base}peak_MiB": max(s.devices[0].peak for s in steps) / MiB,
            f"{base}growth_MiB": sum(s.devices[0].growth for s in steps) / MiB,
            f"{prefix}{sep}step_time_ms": sum(s.duration_ns for s in steps) / len(steps) / 1e6}


def test_lightning_callback_sends_steps_to_every_logger_at_logging_steps(fake, frameworks):
    seen = []
    cb = frameworks.lightning(diagnose=False, callback=seen.append)
    slash, dot = CaptureLogger("/"), CaptureLogger(".")
    trainer = LoggingLightningTrainer([cb], [slash, dot], log_every_n_steps=2)
    kept = []
    trainer.fit(leaky_step(fake, kept, fail_at=None), [None] * 6)
    steps = cb.tracker.steps
    assert len(steps) == 6 and seen == steps  # today's sinks still get every record
    # Steps 1, 3, 5 log (Lightning's step numbers), each with the two steps since the last.
    assert [s for s, _ in slash.calls] == [s for s, _ in dot.calls] == [1, 3, 5]
    for k, (_, metrics) in enumerate(slash.calls):
        window = steps[2 * k: 2 * k + 2]
        assert metrics == expected(window)
        assert metrics["memviz/cuda0/growth_MiB"] == 16.0  # 8 MiB kept per step
    assert dot.calls[0][1] == expected(steps[0:2], sep=".")


def test_lightning_callback_without_a_logger_or_with_metrics_off(fake, frameworks):
    seen = []
    cb = frameworks.lightning(diagnose=False, callback=seen.append)
    LoggingLightningTrainer([cb], [], log_every_n_steps=1).fit(
        lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 3)
    assert len(seen) == 3 and cb._core.pending == []  # nowhere to send: nothing kept for later
    logger = CaptureLogger()
    cb = frameworks.lightning(diagnose=False, metrics=False, callback=seen.append)
    LoggingLightningTrainer([cb], [logger], log_every_n_steps=1).fit(
        lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 3)
    assert logger.calls == [] and len(seen) == 6


def test_lightning_callback_prefix_and_bad_options(fake, frameworks):
    logger = CaptureLogger()
    cb = frameworks.lightning(diagnose=False, prefix="gpu_mem")
    LoggingLightningTrainer([cb], [logger], log_every_n_steps=1).fit(
        lambda b, i: fake.alloc(CBID_cuMemAlloc_v2, MiB), [None] * 2)
    assert [s for s, _ in logger.calls] == [0, 1]
    assert logger.calls[1][1] == expected(cb.tracker.steps[1:2], prefix="gpu_mem")
    with pytest.raises(memviz.InvalidArgumentType, match="metrics"):
        frameworks.lightning(metrics="yes")
    for bad in ("", "mem:viz"):
        with pytest.raises(memviz.InvalidArgument, match="prefix"):
            frameworks.hf(prefix=bad)
    with pytest.raises(memviz.InvalidArgumentType, match="prefix"):
        frameworks.hf(prefix=3)


def test_step_metrics_of_no_records_and_of_several_devices(fake):
    assert step_metrics([]) == {}
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
        t.step()
        fake.set_device(1)
        try:
            fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        finally:
            fake.set_device(0)
        t.step()
    m = step_metrics(t.steps, sep=".")
    assert m["memviz.cuda0.current_MiB"] == 2.0 and m["memviz.cuda1.current_MiB"] == 4.0
    assert m["memviz.cuda1.peak_MiB"] == 4.0 and "memviz.cuda0.allocated_MiB" not in m  # no PyTorch


class LoggingCallbackHandler(CallbackHandler):
    def on_log(self, args, state, control, logs):
        return self.call_event("on_log", args, state, control, logs=logs)


class Reporter(_TrainerCallback):
    """A report_to integration (TensorBoardCallback, WandbCallback): what on_log gives it."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


class Flow(_TrainerCallback):
    """DefaultFlowCallback: no on_log of its own."""


class LoggingHFTrainer(HFTrainer):
    """HFTrainer with Trainer.log and logging_steps, as transformers 5 has them."""

    def __init__(self, callbacks, dataset, logging_steps=2, report_to=()):
        self.logging_steps = logging_steps
        self.args = SimpleNamespace(report_to=list(report_to))
        self.callback_handler = LoggingCallbackHandler(callbacks)
        self.dataset = dataset
        self.state = SimpleNamespace(global_step=0, log_history=[], is_world_process_zero=True)
        self.control = SimpleNamespace()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def log(self, logs, start_time=None):
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _inner_training_loop(self):
        h = self.callback_handler
        self.state.global_step = 0
        self.control = h.on_train_begin(self.args, self.state, self.control)
        for batch in self.dataset():
            self.control = h.on_step_begin(self.args, self.state, self.control)
            batch()
            self.state.global_step += 1
            self.control = h.on_step_end(self.args, self.state, self.control)
            if self.state.global_step % self.logging_steps == 0:  # _maybe_log_save_evaluate
                self.log({"loss": 0.5, "learning_rate": 1e-3})
        self.log({"train_runtime": 1.0})  # the end-of-training summary
        self.control = h.on_train_end(self.args, self.state, self.control)
        return "done"


def memviz_keys(logs):
    return {k: v for k, v in logs.items() if k.startswith("memviz/")}


def test_hf_attach_puts_the_callback_before_report_to(fake, frameworks, caplog):
    hf = sys.modules["memviz.integrations.huggingface"]
    flow, reporter, mine, printer = Flow(), Reporter(), Reporter(), Reporter()
    seen = []
    trainer = LoggingHFTrainer([flow, reporter, mine], dataset(fake, 5, kept=[]), logging_steps=2,
                               report_to=["tensorboard"])
    trainer.add_callback(printer)
    with caplog.at_level(logging.WARNING, logger="memviz"):
        cb = hf.attach(trainer, diagnose=False, callback=seen.append)
        assert trainer.train() == "done"
    # Before the first callback with an on_log of its own; the others keep their order.
    assert trainer.callback_handler.callbacks == [flow, cb, reporter, mine, printer]
    steps = cb.tracker.steps
    assert len(seen) == 5
    # Logged at steps 2 and 4 (two steps each) and in the summary (step 5): every log
    # that follows new steps has their metrics, in log_history and for every callback.
    windows = [steps[0:2], steps[2:4], steps[4:5]]
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [2, 4, 5]
    for k, (entry, window) in enumerate(zip(history, windows)):
        want = expected(window)
        assert memviz_keys(entry) == want
        assert all(memviz_keys(r.logged[k]) == want for r in (reporter, mine, printer))
    assert history[0]["loss"] == 0.5 and history[2]["train_runtime"] == 1.0
    assert not any("not placed with attach" in r.getMessage() for r in caplog.records)
    assert "log" not in vars(trainer) and "train" not in vars(trainer)
    with pytest.raises(memviz.InvalidArgument, match="has a MemvizCallback already"):
        hf.attach(trainer)
    assert cb.attach(trainer) is cb  # moving it again: the same order
    assert trainer.callback_handler.callbacks == [flow, cb, reporter, mine, printer]
    with pytest.raises(memviz.InvalidArgumentType, match="Trainer"):
        hf.attach(object())


def test_hf_callback_after_report_to_fills_log_history_and_says_so(fake, frameworks, caplog):
    """Trainer(callbacks=[MemvizCallback()]) comes after report_to's callbacks:
    too late for them; the metrics still reach log_history and the
    callbacks after it, and the callback says once that attach() is the way."""
    reporter, after = Reporter(), Reporter()
    cb = frameworks.hf(diagnose=False)
    trainer = LoggingHFTrainer([reporter, cb, after], dataset(fake, 4, kept=[]), logging_steps=2,
                               report_to=["tensorboard"])
    with caplog.at_level(logging.WARNING, logger="memviz"):
        trainer.train()
        steps = cb.tracker.steps
        trainer.dataset = dataset(fake, 2, kept=[])
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "not placed with attach" in r.getMessage()]
    assert len(said) == 1 and "['tensorboard']" in said[0] and "attach(trainer)" in said[0]
    history = trainer.state.log_history[:3]  # the first train(): steps 2, 4 and the summary
    assert [memviz_keys(e) for e in history] == [expected(steps[0:2]), expected(steps[2:4]), {}]
    assert [memviz_keys(x) for x in after.logged[:3]] == [memviz_keys(e) for e in history]
    assert all(not memviz_keys(x) for x in reporter.logged)  # before memviz's on_log: too early


def test_hf_callback_without_report_to_says_nothing(fake, frameworks, caplog):
    cb = frameworks.hf(diagnose=False)
    trainer = LoggingHFTrainer([cb], dataset(fake, 2, kept=[]), logging_steps=1)
    with caplog.at_level(logging.WARNING, logger="memviz"):
        trainer.train()
    assert not caplog.records
    assert [bool(memviz_keys(e)) for e in trainer.state.log_history] == [True, True, False]


def test_hf_metrics_off(fake, frameworks):
    reporter = Reporter()
    seen = []
    trainer = LoggingHFTrainer([reporter], dataset(fake, 4, kept=[]), logging_steps=2)
    sys.modules["memviz.integrations.huggingface"].attach(
        trainer, diagnose=False, metrics=False, callback=seen.append)
    trainer.train()
    assert len(seen) == 4 and not any(memviz_keys(e) for e in trainer.state.log_history + reporter.logged)


# ---- the real frameworks, where installed -------------------------------------------------


def _fresh(monkeypatch, name):
    monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib

    return importlib.import_module(name)


def test_real_lightning_trainer_sends_memviz_metrics_to_its_logger(fake, tmp_path, monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    torch = pytest.importorskip("torch")
    MemvizCallback = _fresh(monkeypatch, "memviz.integrations.lightning").MemvizCallback
    from lightning.pytorch.loggers import Logger

    class Capture(Logger):
        def __init__(self):
            super().__init__()
            self.calls = []

        @property
        def name(self):
            return "capture"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

    kept = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            kept.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=4)
    logger, cb = Capture(), MemvizCallback(diagnose=False)
    trainer = pl.Trainer(max_steps=6, logger=logger, callbacks=[cb], log_every_n_steps=2,
                         accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Module(), data)
    mine = [(s, memviz_keys(m)) for s, m in logger.calls if memviz_keys(m)]
    theirs = [s for s, m in logger.calls if "loss" in m]
    steps = cb.tracker.steps
    assert len(steps) == 6 and [s for s, _ in mine] == theirs == [1, 3, 5]  # with self.log's steps
    for k, (_, m) in enumerate(mine):
        assert m == expected(steps[2 * k: 2 * k + 2])
