"""Backward by forward line in every report (memviz/model/lines.py).

PyTorch's backward runs on its engine threads, which have no Python frames;
the autograd integration labels them with the node they run and the forward
line that made it. Here a native thread of the libcupti test double plays
the engine thread: a hook (Python run on that thread, as autograd's pre-hooks
are) sets the node label the integration sets, then the thread allocates with
no frames. Every view must show those allocations under
``file:line (backward: NODE)``, never ``<thread pt_autograd_0>``; the
``"traceback"`` key keeps the raw frames; a frameless thread with no node
stays ``<thread NAME>``."""

import html as _html
import json
import os
import re

import pytest

import memviz
import memviz.cli.diff as D
from conftest import line_of
from fake_cupti import CBID_cuMemAlloc_v2
from memviz import _core
from memviz.cli.report import json_report
from memviz.model.lines import UNKNOWN_FORWARD, BackwardFrame, line_frame, where
from memviz.model.snapshot import encode_node_label
from memviz.model.traceback import Frame
from memviz.report import render
from memviz.report.notebook import snapshot_repr_html, tracker_repr_html
from memviz.report.text import text_report

MiB = 1 << 20
HERE = os.path.abspath(__file__)


def forward_line() -> int:
    return line_of(HERE, "# FORWARD")


def backward(fake, node, forward, size, thread="pt_autograd_0"):
    """An allocation of the engine thread ``thread`` inside ``node``, labelled
    as memviz's autograd pre-hooks label it (memviz/torch/hooks.py)."""
    lid = _core.label_intern(encode_node_label(node, forward)) if node else 0
    fake.alloc_in_native_thread_after(lambda: _core.label_set(lid), CBID_cuMemAlloc_v2, size,
                                      device=0, thread_name=thread)


def train_step(fake, with_backward=True, addmm=2):
    """Forward: 8 MiB on one line; backward on pt_autograd_0: ``addmm``
    AddmmBackward0 buffers of 16 MiB and a MulBackward0 one (4 MiB) of that
    line, a node whose forward line is unknown (2 MiB); and 1 MiB of a
    frameless thread running no node."""
    fwd = f"{HERE}:{forward_line()}"
    fake.lib.fake_alloc(CBID_cuMemAlloc_v2, 8 * MiB, 0, 0)  # FORWARD
    if with_backward:
        for _ in range(addmm):
            backward(fake, "AddmmBackward0", fwd, 16 * MiB)
        backward(fake, "MulBackward0", fwd, 4 * MiB)
        backward(fake, "NoSaveBackward", None, 2 * MiB)
    backward(fake, None, None, MiB, thread="nccl_worker")


@pytest.fixture
def run(fake, tmp_path):
    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        train_step(fake)
    return t, path


def addmm_text(path_shown: str = HERE) -> str:
    return f"{path_shown}:{forward_line()} (backward: AddmmBackward0)"


def test_statistics_group_backward_under_the_forward_line_and_node(run):
    t, _ = run
    snap = t.snapshot()
    L = forward_line()
    stats = {s.key: (s.size, s.count) for s in snap.statistics("lineno")}
    assert stats == {
        Frame(HERE, L, "train_step"): (8 * MiB, 1),
        BackwardFrame(HERE, L, "", "AddmmBackward0"): (32 * MiB, 2),
        BackwardFrame(HERE, L, "", "MulBackward0"): (4 * MiB, 1),
        BackwardFrame(UNKNOWN_FORWARD, 0, "", "NoSaveBackward"): (2 * MiB, 1),
        Frame("<thread nccl_worker>", 0, ""): (MiB, 1),
    }
    shown = [str(s.key) for s in snap.statistics("lineno")]
    assert shown == [addmm_text(), f"{HERE}:{L}", f"{HERE}:{L} (backward: MulBackward0)",
                     f"{UNKNOWN_FORWARD} (backward: NoSaveBackward)", "<thread nccl_worker>"]
    assert not any("pt_autograd" in s for s in shown)
    key = snap.statistics("lineno")[0].key
    assert (key.filename, key.lineno, key.autograd_node) == (HERE, L, "AddmmBackward0")
    assert isinstance(key, Frame) and key != Frame(HERE, L, "") and Frame(HERE, L).autograd_node is None
    # "filename": the forward line's file holds forward and backward alike
    files = {s.key: s.size for s in snap.statistics("filename")}
    assert files == {HERE: 44 * MiB, UNKNOWN_FORWARD: 2 * MiB, "<thread nccl_worker>": MiB}
    cumulative = {str(s.key): s.size for s in snap.statistics("lineno", cumulative=True)}
    assert cumulative[addmm_text()] == 32 * MiB
    # "traceback": the raw frames; the engine thread's allocations have none
    raw = {str(s.key): s.size for s in snap.statistics("traceback")}
    assert raw["<thread pt_autograd_0>"] == 38 * MiB and raw["<thread nccl_worker>"] == MiB
    # the rule's owner answers the same for one allocation
    a = next(a for a in snap if a.autograd_node == "MulBackward0")
    assert str(line_frame(a)) == where(a) == f"{HERE}:{L} (backward: MulBackward0)"
    assert "(backward: MulBackward0)" in repr(a)


def test_compare_to_and_filters_use_the_same_keys(fake, run):
    t, _ = run
    with memviz.track(torch=False) as before:
        train_step(fake, with_backward=False)
    diffs = {str(d.key): (d.size_diff, d.count_diff) for d in t.snapshot().compare_to(before.snapshot())}
    L = forward_line()
    assert diffs[addmm_text()] == (32 * MiB, 2)
    assert diffs[f"{HERE}:{L}"] == (0, 0)
    assert diffs[f"{UNKNOWN_FORWARD} (backward: NoSaveBackward)"] == (2 * MiB, 1)
    assert not any("pt_autograd" in k for k in diffs)
    kept = t.snapshot().filter_traces([memviz.Filter(True, HERE, L)])
    assert kept.total_bytes() == 44 * MiB
    raw = t.snapshot().filter_traces([memviz.Filter(True, "<thread pt_autograd_0>", all_frames=True)])
    assert raw.total_bytes() == 38 * MiB


def test_text_report(run, monkeypatch):
    t, _ = run
    monkeypatch.chdir(os.path.dirname(HERE))  # the path is shown from the cwd: room for the source whatever the cwd
    report = text_report(t, outside={})
    assert f"test_backward_lines.py:{forward_line()} (backward: AddmmBackward0)" in report
    assert "(backward: MulBackward0)" in report and "<thread nccl_worker>" in report
    assert "<thread pt_autograd" not in report
    row = next(r for r in report.splitlines() if "(backward: AddmmBackward0)" in r)
    assert "32 MiB" in row and "2 allocs" in row and "fake.lib.f" in row  # the forward line's source


def test_json_report(run):
    _, path = run
    doc = json.loads(json.dumps(json_report(memviz.load(str(path)))))
    for key in ("top_lines_at_peak", "top_lines_at_end"):
        lines = doc["devices"][0][key]
        top = lines[0]
        assert (top["file"], top["line"], top["backward"], top["size"], top["count"]) == \
            (HERE, forward_line(), "AddmmBackward0", 32 * MiB, 2)
        assert top["where"] == addmm_text()
        assert {x["where"] for x in lines} >= {f"{HERE}:{forward_line()}", "<thread nccl_worker>"}
        assert not any(x["file"].startswith("<thread pt_autograd") for x in lines)
        assert [x["backward"] for x in lines if x["file"] == "<thread nccl_worker>"] == [None]


def test_html_report_data(run):
    t, path = run
    for source in (t, memviz.load(str(path))):
        page = render(source)
        m = re.search(r'<script type="application/json" class="memviz-data">(.*?)</script>', page, re.S)
        data = json.loads(m.group(1))
        shown = [row[0] for row in data["tables"]["lines"]["rows"]]
        assert shown[0] == f"{os.path.relpath(HERE)}:{forward_line()} (backward: AddmmBackward0)"
        assert "<thread nccl_worker>" in shown
        assert not any(s.startswith("<thread pt_autograd") for s in shown)
        at_end = [row[0] for row in data["tables"]["live at end"]["rows"]]
        assert at_end[0] == shown[0]


def test_notebook_views(run):
    t, _ = run
    for view in (tracker_repr_html(t), snapshot_repr_html(t.snapshot())):
        text = _html.unescape(view)
        assert f"{os.path.relpath(HERE)}:{forward_line()} (backward: AddmmBackward0)" in text
        assert "<thread nccl_worker>" in text
        assert "pt_autograd" not in text


def test_memviz_diff(fake, run, tmp_path, capsys):
    _, pb = run
    pa = tmp_path / "a.memviz"
    with memviz.track(trace=str(pa), torch=False):
        train_step(fake, with_backward=False)
    doc = D.compare(memviz.load(str(pa)), memviz.load(str(pb)))
    rows = {r["key"]: r for r in doc["devices"][0]["lines"]}
    addmm = rows[f"{os.path.relpath(HERE)}:{forward_line()} (backward: AddmmBackward0)"]
    assert (addmm["file"], addmm["line"], addmm["backward"]) == (HERE, forward_line(), "AddmmBackward0")
    assert (addmm["a"], addmm["b"], addmm["count_a"], addmm["count_b"]) == (0, 32 * MiB, 0, 2)
    assert not any("pt_autograd" in k for k in rows)
    assert D.main([str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "(backward: AddmmBackward0)" in out and "pt_autograd" not in out


def test_a_failure_in_backward_names_its_forward_line():
    from memviz.model.failures import FailedAllocation
    from memviz.model.snapshot import ThreadInfo

    f = FailedAllocation(80 << 30, 0, "device", 0, ThreadInfo(1, 1, "pt_autograd_0"), None, 0,
                         memviz.Traceback(), 2, None, "AddmmBackward0", "train.py:15")
    assert str(f).startswith("train.py:15 (backward: AddmmBackward0): failed to allocate")
    plain = FailedAllocation(1, 0, "device", 0, ThreadInfo(1, 1, "pt_autograd_0"), None, 0,
                             memviz.Traceback(), 2)
    assert str(plain).startswith("<thread pt_autograd_0>: failed")


def test_merged_report_of_ranks_keeps_backward_lines_apart(fake, monkeypatch, tmp_path):
    from memviz.report.ranks import rank_report, rank_text

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    paths = []
    for rank, addmm in ((0, 2), (1, 1)):
        for k, v in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2), ("TORCHELASTIC_RUN_ID", "r")):
            monkeypatch.setenv(k, str(v))
        with memviz.track(trace=str(tmp_path / "run.memviz"), torch=False) as t:
            train_step(fake, addmm=addmm)
        paths.append(t.trace_path)
    doc = rank_report([memviz.load(p) for p in paths])
    # only the AddmmBackward0 row differs: the forward line's own row is equal on both ranks
    assert [(x["file"], x["line"], x["backward"], x["bytes"]) for x in doc["lines"]] == [
        (HERE, forward_line(), "AddmmBackward0", {"0": 32 * MiB, "1": 16 * MiB})]
    text = rank_text(doc)
    assert f"test_backward_lines.py:{forward_line()} (backward: AddmmBackward0)" in text
    assert "pt_autograd" not in text
