"""The Lightning and transformers callbacks when training fails.

Neither framework is installed here, so each is stood in for by a few lines
that call the real callback classes in the framework's own order:

* Lightning (``trainer/call.py:_call_and_handle_interrupt``): on_train_start,
  on_train_batch_end per batch, on_train_end; when anything raises,
  ``on_exception(trainer, pl_module, exception)`` on every callback, then
  teardown, then the exception goes on.
* transformers (``Trainer.__init__`` ends with ``callback_handler.on_init_end``;
  ``train()`` -> ``_inner_training_loop``: on_train_begin, on_step_begin /
  on_step_end per step, on_train_end). It has no exception event: an exception
  escapes ``train()`` and no callback hears of it.

Allocations go through the libcupti test double.
"""

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


# ---- transformers' call order -------------------------------------------------------------


class CallbackHandler:
    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

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
    def __init__(self, callbacks, dataset):
        self.args = SimpleNamespace()
        self.callback_handler = CallbackHandler(callbacks)
        self.dataset = dataset
        self.state = SimpleNamespace(global_step=0)
        self.control = SimpleNamespace()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb)

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


def test_hf_callback_stops_its_tracker_when_the_dataset_raises(fake, frameworks, caplog):
    cb = frameworks.hf()
    kept = []
    trainer = HFTrainer([cb], dataset(fake, 30, fail_at=20, kept=kept))
    with caplog.at_level(logging.WARNING, logger="memviz"):
        with pytest.raises(ValueError, match="bad sample 20"):
            trainer.train()
    t = cb.tracker
    assert not t.running and memviz.active_tracker() is None and not fake.is_subscribed()
    assert [r.info["global_step"] for r in t.steps] == list(range(1, 21))
    assert [f.kind for f in cb.findings] == ["growth"] and isinstance(cb.error, ValueError)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "ValueError: bad sample 20" in text and "rises 8 MiB per step" in text
    # train() again on the same trainer: a new tracker, stopped at the end.
    trainer.dataset = dataset(fake, 2)
    assert trainer.train() == "done"
    assert cb.tracker is not t and not cb.tracker.running and len(cb.tracker.steps) == 2
    assert memviz.active_tracker() is None


def test_hf_callback_added_after_init_finishes_a_failed_run_at_the_next_train(fake, frameworks, caplog):
    """Without on_init_end the callback cannot wrap the first train(): the
    tracker of a run that raised is finished (and logged) by the next
    on_train_begin, whose train() then is covered."""
    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([], dataset(fake, 5, fail_at=2))
    trainer.add_callback(cb)
    with pytest.raises(ValueError):
        trainer.train()
    first = cb.tracker
    assert first.running  # no framework event said training ended
    trainer.dataset = dataset(fake, 5, fail_at=1)
    with caplog.at_level(logging.WARNING, logger="memviz"):
        with pytest.raises(ValueError):
            trainer.train()
    assert not first.running and len(first.steps) == 2
    assert not cb.tracker.running and cb.tracker is not first and len(cb.tracker.steps) == 1
    assert memviz.active_tracker() is None
    assert any("did not end" in r.getMessage() for r in caplog.records)


def test_hf_callback_leaves_a_tracker_the_user_started(fake, frameworks):
    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([cb], dataset(fake, 5, fail_at=2))
    with memviz.track() as t:
        with pytest.raises(ValueError):
            trainer.train()
        assert t.running and memviz.active_tracker() is t and len(t.steps) == 2


def test_hf_wrapped_train_keeps_its_result_and_signature(fake, frameworks):
    cb = frameworks.hf(diagnose=False)
    trainer = HFTrainer([cb], dataset(fake, 3))
    assert trainer.train() == "done" and not cb.tracker.running
    assert trainer.train.__wrapped__.__func__ is HFTrainer.train
    HFTrainer([cb], dataset(fake, 1))  # a second trainer with the same callback: wrapped too
