"""Graph leaks on CPU: a loop that keeps its losses as tensors keeps every
step's autograd graph alive; memviz.diagnose() finds it with the holder and
the line that keeps it, and the same loop keeping ``loss.item()`` is clean.
"""

import os

import pytest

import memviz

torch = pytest.importorskip("torch", reason="graph leaks are about PyTorch's autograd")

from memviz.torch.graph import GraphRecorder, holders, keep_line  # noqa: E402

THIS = os.path.abspath(__file__)
history = []


def _line(marker):
    with open(THIS) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(64, 32)


def step(model, opt, x_val):
    """One training step, then an evaluation with autograd on (returns its loss)."""
    x = torch.randn(64, 32)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return model(x_val).pow(2).mean()  # EVAL


def train(t, steps, keep_tensor):
    model, opt, x_val = _setup()
    for _ in range(steps):
        val = step(model, opt, x_val)
        if keep_tensor:
            history.append(val)  # KEEP
        else:
            history.append(val.item())
        t.step()


@pytest.fixture
def graph_tracker():
    with memviz.track(gpu=False) as t:
        own = None
        if getattr(t, "graph", None) is None:  # graph residency not asked for: record it ourselves
            own = t.graph = GraphRecorder().start()
        try:
            yield t
        finally:
            if own is not None:
                own.stop()
    history.clear()


def test_planted_leak_is_found_with_its_holder_and_line(graph_tracker):
    t = graph_tracker
    train(t, 20, keep_tensor=True)
    f, = memviz.diagnose(t)
    assert f.kind == "growth"
    assert "autograd graphs of 17 of the last 17 steps are still reachable" in f.message
    assert "list `history` in module test_graph_leak" in f.message
    assert f.numbers["holder"] == "list `history` in module test_graph_leak"
    assert f.numbers["kept_at"] == f"{THIS}:{_line('# KEEP')}"
    assert f.numbers["graph_bytes"] > 0
    locations = [ln.location for ln in f.lines]
    assert locations[0] == f"{THIS}:{_line('# KEEP')}"
    assert f"{THIS}:{_line('# EVAL')}" in locations  # the line whose tensors the graphs hold
    assert "loss.item()" in f.fix


def test_graphs_made_after_the_last_step_are_not_counted_as_a_step(graph_tracker):
    # The evaluation runs after t.step(): the last one belongs to no recorded
    # step, so 20 steps (3 of warm-up) hold graphs in 17 of their 17, not 18.
    t = graph_tracker
    model, opt, x_val = _setup()
    for _ in range(20):
        step(model, opt, x_val)
        t.step()
        history.append(model(x_val).pow(2).mean())  # KEEP AFTER
    f, = memviz.diagnose(t)
    assert "autograd graphs of 17 of the last 17 steps are still reachable" in f.message
    assert f.numbers["graph_steps_alive"] == 17
    assert f.numbers["kept_at"] == f"{THIS}:{_line('# KEEP AFTER')}"


def test_graph_steps_never_exceed_the_steps_counted(graph_tracker):
    # Graphs in every recorded step and after the last: at most one per step.
    t = graph_tracker
    model, opt, x_val = _setup()
    history.append(model(x_val).sum())  # before the first step (warm-up)
    for i in range(12):
        history.append(step(model, opt, x_val))
        t.step()
        history.append(model(x_val).sum())
    f, = memviz.diagnose(t, warmup=2)
    assert f.numbers["graph_steps_alive"] == 10
    assert "graphs of 10 of the last 10 steps" in f.message


def test_same_loop_with_item_is_clean(graph_tracker):
    t = graph_tracker
    train(t, 20, keep_tensor=False)
    assert memviz.diagnose(t) == []


def test_leak_into_a_running_functions_local_list(graph_tracker):
    t = graph_tracker
    model, opt, x_val = _setup()
    losses = []
    for _ in range(12):
        losses.append(step(model, opt, x_val))  # LOCAL
        t.step()
    f, = memviz.diagnose(t)
    assert f.numbers["holder"] == "list `losses` (a local of test_leak_into_a_running_functions_local_list)"
    assert f.numbers["kept_at"] == f"{THIS}:{_line('# LOCAL')}"


def test_leak_into_an_object_attribute(graph_tracker):
    class Meter:
        def __init__(self):
            self.values = []

        def append(self, v):
            self.values.append(v)  # METER

    t = graph_tracker
    model, opt, x_val = _setup()
    meter = Meter()
    for _ in range(12):
        meter.append(step(model, opt, x_val))
        t.step()
    f, = memviz.diagnose(t)
    assert f.numbers["holder"] == "list `values` of a Meter object"
    assert f.numbers["kept_at"] == f"{THIS}:{_line('# METER')}"


def test_graph_recorder_can_be_passed_explicitly():
    rec = GraphRecorder().start()
    try:
        with memviz.track(gpu=False, torch=False) as t:
            train(t, 12, keep_tensor=True)
    finally:
        rec.stop()
    try:
        f, = memviz.diagnose(t, graph=rec)
        assert f.numbers["graph_bytes"] > 0 and f.numbers["graph_steps_alive"] == 9
    finally:
        history.clear()


def test_one_graph_kept_to_the_end_is_not_a_leak(graph_tracker):
    # the loop variable keeps the last step's graph; that is not growth
    t = graph_tracker
    model, opt, x_val = _setup()
    for _ in range(12):
        last = model(x_val).sum()
        t.step()
    assert memviz.diagnose(t) == [] and last is not None


# ---- the helpers ------------------------------------------------------------------------


def test_autograd_mark_orders_nodes_and_creates_nothing():
    m = GraphRecorder.autograd_mark()
    assert GraphRecorder.autograd_mark() == m  # creating no node itself
    kept = [torch.ones(2, requires_grad=True).mul(3)]
    assert kept[0].grad_fn._sequence_nr() > m
    assert GraphRecorder.roots_since(m) == kept
    assert GraphRecorder.roots_since(GraphRecorder.autograd_mark()) == []


def test_holders_and_keep_line(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("cache = {}\nlog = []\n\ndef f(x):\n    y = x\n    log.append(y)  # here\n    cache['k'] = y\n")
    assert keep_line("log", str(src)) == 6
    assert keep_line("cache", str(src)) == 7
    assert keep_line("nothing", str(src)) is None
    w = torch.ones(1, requires_grad=True)
    kept = [w * 2]
    hs = holders(kept[0])
    assert hs[0].description == "list `kept` (a local of test_holders_and_keep_line)"


def test_keep_line_skips_strings_and_plain_values(tmp_path):
    src = tmp_path / "loop.py"
    src.write_text('"""Docs: history.append(loss) keeps the graph."""\n'
                   "history = []\n"
                   "def f(loss):\n"
                   "    history.append(loss.item())\n"
                   "    history.append(float(loss))\n"
                   "    history.append(loss)\n")
    assert keep_line("history", str(src)) == 6


def test_leaking_example_shows_the_graph_leak_on_cpu():
    import json
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the example runs its GPU part (tests/gpu covers it)")
    example = os.path.join(os.path.dirname(THIS), "..", "..", "examples", "leaking_loop.py")
    runs = {}
    for args in ((), ("--fixed",)):
        p = subprocess.run([sys.executable, example, "--json", *args], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        first, result = p.stdout.splitlines()[0], p.stdout.splitlines()[-1]
        assert first.startswith("leaking_loop.py: the GPU part needs a CUDA GPU, and ") and first.endswith(".")
        runs[args] = json.loads(result[len("RESULT "):])
    leak = runs[()]
    assert leak["where"] == "cpu" and leak["kinds"] == ["growth"]
    numbers = leak["findings"][0]["numbers"]
    assert numbers["holder"] == "list `history` in module __main__"
    assert numbers["kept_at"].endswith("leaking_loop.py:" + str(_line_in(example, "history.append(val_loss)  # the bug: keeps the tensor and its graph")))
    assert runs[("--fixed",)]["kinds"] == []


def _line_in(path, text):
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return i
    raise AssertionError(text)


HISTORY: list = []


def test_a_module_global_is_named_before_a_stray_dict_that_holds_the_same_list():
    """gc.get_referrers lists young objects first: a dict left over from
    reading a frame's locals ({"obj": the list}) must not hide the module
    global that really keeps it (it named "list `obj`" in CI)."""
    from memviz.torch.graph import _owner

    stray = [{"obj": HISTORY} for _ in range(8)]  # noqa: F841 - they must exist while _owner looks
    text = _owner(HISTORY)[0]
    assert text == f"`HISTORY` in module {__name__}", text
