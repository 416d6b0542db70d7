"""Exports: Chrome trace JSON for Perfetto, and torch's memory snapshot pickle
read back by PyTorch's own memory_viz functions (skipped without torch)."""

import json
import pickle
import stat
import subprocess
import sys
from collections import Counter

import pytest

import memviz
from memviz.export import perfetto, torch_snapshot
from test_html_report import (EVIL, PARAM_BYTES, MiB, StubTrace, _line_of, categorised_run, record_run,
                              stub_event)


@pytest.fixture
def run(fake):
    return record_run(fake)


def load_events(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["displayTimeUnit"] == "ms"
    return doc["traceEvents"]


def _check_spans_pair_up(events):
    begins = Counter(e["id"] for e in events if e["ph"] == "b")
    ends = Counter(e["id"] for e in events if e["ph"] == "e")
    assert begins == ends and all(n == 1 for n in begins.values())


# ---- Perfetto / chrome://tracing ----------------------------------------------


def test_perfetto_has_processes_counters_and_allocations(run, tmp_path):
    path = tmp_path / "trace.json"
    n = perfetto.write(run, path)
    events = load_events(path)
    assert n == len(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"cuda:0 (memviz)", "cuda:1 (memviz)", "pinned host (memviz)"} <= set(names.values())
    pid = {v.split(" ")[0] if not v.startswith("pinned") else "host": k for k, v in names.items()}

    live = [e for e in events if e["ph"] == "C" and e["name"] == "live bytes"]
    assert {e["pid"] for e in live} == {pid["cuda:0"], pid["cuda:1"], pid["host"]}
    assert max(e["args"]["bytes"] for e in live if e["pid"] == pid["cuda:0"]) == run.totals()[0]["peak"]
    assert all(e["ts"] >= 0 for e in events if "ts" in e)

    spans = [e for e in events if e["ph"] == "b"]
    assert len(spans) == len(run.snapshot())  # each allocation live at the end, to the end
    _check_spans_pair_up(events)
    weights = [e for e in spans if e["args"]["line"].endswith(f":{_line_of('# WEIGHTS')}")]
    assert len(weights) == 2 and weights[0]["args"]["size"] == 8 * MiB
    assert weights[0]["args"]["kind"] == "device" and weights[0]["args"]["stack"]
    assert any(e["args"].get("label") == EVIL for e in spans)
    assert any(e["args"].get("thread") == "pt_autograd_0" and e["args"]["line"].startswith("<thread")
               for e in spans)
    freed = [e for e in events if e["ph"] == "i" and e.get("cat") == "allocation"]
    assert freed and all("after the peak" in e["args"]["freed"] for e in freed)
    assert {e["args"]["size"] for e in freed} == {32 * MiB, 8 * MiB}  # workspace, weights[0]
    fail, = [e for e in events if e.get("cat") == "failure"]
    assert fail["args"]["size"] == 80 << 30 and fail["args"]["cuda_error"] == 2
    assert any(e["ph"] == "i" and e["name"].startswith("peak ") for e in events)


def test_perfetto_from_a_trace_with_events_categories_and_steps(run, tmp_path):
    path = tmp_path / "stub.json"
    perfetto.write(StubTrace(run), path)
    events = load_events(path)
    _check_spans_pair_up(events)
    cats = {e["name"] for e in events if e["ph"] == "C" and e["name"].startswith("category: ")}
    assert cats == {"category: parameter", "category: activation"}
    param = [e["args"]["bytes"] for e in events if e["name"] == "category: parameter"]
    assert max(param) == 24 * MiB and param[-1] == 16 * MiB
    steps = [e for e in events if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2"]
    assert steps[1]["args"]["loss"] == 0.25
    allocated = [e for e in events if e["ph"] == "C" and e["name"] == "torch allocated"]
    assert [e["args"]["bytes"] for e in allocated] == [MiB, 2 * MiB, 3 * MiB]
    assert len([e for e in events if e["ph"] == "b"]) == 10  # every allocation of the history


def test_tracker_method_and_error_message(run, tmp_path):
    run.to_perfetto(str(tmp_path / "t.json"))
    assert load_events(tmp_path / "t.json")
    with pytest.raises(memviz.OutputError, match="cannot write the Perfetto trace.*What to do"):
        perfetto.write(run, tmp_path / "no" / "such" / "dir.json")


# ---- torch.cuda.memory._dump_snapshot format ------------------------------------


@pytest.fixture
def memory_viz():
    pytest.importorskip("torch", reason="reading the snapshot back needs torch (pip install torch)")
    from torch.cuda import _memory_viz
    return _memory_viz


def _identity_flamegraph(tmp_path):
    """A stand-in for flamegraph.pl (which torch would download): prints its input."""
    script = tmp_path / "flamegraph.sh"
    script.write_text("#!/bin/sh\ncat\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_torch_snapshot_is_read_by_torch_memory_viz(run, tmp_path, memory_viz):
    path = tmp_path / "snap.pickle"
    info = torch_snapshot.write(run, path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert info["memviz"] == {"pinned_host_left_out": 1, "failed_left_out": 1, "history": False}
    live = [a for a in run.snapshot().allocations if a.device >= 0]
    assert len(snap["segments"]) == len(live)
    assert sum(s["total_size"] for s in snap["segments"]) == sum(a.size for a in live)
    assert len(snap["device_traces"]) == 2
    for seg in snap["segments"]:
        block, = seg["blocks"]
        assert block["state"] == "active_allocated" and block["size"] == seg["total_size"]

    summary = memory_viz.segsum(snap)  # asserts its own accounting
    assert f"segments: {len(live)}" in summary
    text = memory_viz.trace(snap)
    assert "Device 0" in text and "Device 1" in text and "cudaMalloc" in text
    script = _identity_flamegraph(tmp_path)
    lines = memory_viz.memory(snap, format_flamegraph=lambda s: memory_viz.format_flamegraph(s, script))
    weights = [x for x in lines.splitlines()
               if f"test_html_report.py:{_line_of('# WEIGHTS')}:load_weights;" in x]
    assert len(weights) == 2 and all(x.endswith(" 8388608") for x in weights)
    assert "<thread pt_autograd_0>:0:no Python frames" in lines  # the frameless one
    assert "test_html_report.py" in memory_viz.segments(snap, format_flamegraph=lambda s: s)
    for html in (memory_viz.segment_plot(snap), memory_viz.trace_plot(snap),
                 memory_viz.trace_plot(snap, plot_segments=True)):
        assert "snapshot.pickle" in html  # the viewer page with the data embedded
    memory_viz.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snap)))

    # torch's own command line reads the file.
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "total_allocated" in out.stdout


def test_torch_snapshot_from_a_history_has_frees_and_categories(run, tmp_path, memory_viz):
    snap = torch_snapshot.build(StubTrace(run))
    assert snap["memviz"]["history"] is True
    trace0 = snap["device_traces"][0]
    actions = Counter(e["action"] for e in trace0)
    assert actions["alloc"] == actions["segment_alloc"] == 8
    assert actions["free_requested"] == actions["free_completed"] == actions["segment_free"] == 2
    cats = {e.get("category") for e in trace0}
    assert {"parameter", "activation", "unknown"} <= cats  # the viewer needs "unknown"
    text = memory_viz.trace(snap)
    assert "free completed" in text
    memory_viz.segsum(snap)
    memory_viz.trace_plot(snap, filter_freed=True)


def test_torch_snapshot_of_backward_allocations(fake, tmp_path, memory_viz):
    """Allocations made during backward carry the autograd node; frameless ones
    get it in their pseudo frame."""
    import torch

    from fake_cupti import CBID_cuMemAlloc_v2

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            fake.alloc(CBID_cuMemAlloc_v2, 64 * 1024)
            return g * 2

    x = torch.randn(4, requires_grad=True)
    with memviz.track(torch=True, autograd=True) as t:
        Double.apply(x).sum().backward()
    a, = t.snapshot().allocations
    assert a.autograd_node == "DoubleBackward"
    snap = torch_snapshot.build(t)
    assert snap["segments"][0]["blocks"][0]["frames"]
    frameless = a._replace(traceback=memviz.Traceback())
    frames = torch_snapshot._frame_list(frameless)
    assert frames[0]["filename"].startswith("<thread ") and "DoubleBackward" in frames[0]["name"]
    memory_viz.segsum(snap)


def test_torch_snapshot_error_message(run, tmp_path):
    with pytest.raises(memviz.OutputError, match="cannot write the torch snapshot.*What to do"):
        torch_snapshot.write(run, tmp_path / "no" / "such.pickle")


def test_report_and_exports_of_a_loaded_trace_file(fake, tmp_path):
    """The same views from a .memviz file read back with memviz.load."""
    from memviz.report import render, tracker_repr_html
    from test_html_report import embedded_data, load_weights, workspace

    from fake_cupti import CBID_cuMemFree_v2

    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path)) as t:
        kept = [load_weights(fake) for _ in range(2)]
        fake.free(CBID_cuMemFree_v2, workspace(fake))
    loaded = memviz.load(str(path))
    d = embedded_data(render(loaded))
    assert d["timeline"]["charts"][0]["peak"]["v"] == t.peak_bytes(0) == 48 * MiB
    assert {r[0].rsplit(":", 1)[-1] for r in d["tables"]["lines"]["rows"]} == {
        str(_line_of("# WEIGHTS")), str(_line_of("# WORKSPACE"))}
    assert "<script" not in tracker_repr_html(loaded)
    events = list(perfetto.events(loaded))
    assert sum(1 for e in events if e["ph"] == "b") == len(kept) + 1  # every allocation, the freed one too
    assert sum(1 for e in events if e["ph"] == "e" and not e.get("args")) == 1
    snap = torch_snapshot.build(loaded)
    assert sum(s["total_size"] for s in snap["segments"]) == 16 * MiB


def test_exports_keep_their_formats_frame_order(run):
    """memviz.Traceback runs oldest first (tracemalloc's order); torch's snapshot
    and the Perfetto stacks list the innermost frame first, as before."""
    a = next(a for a in run.snapshot().allocations if a.traceback
             and a.traceback.user_frame.lineno == _line_of("# WEIGHTS"))
    innermost = a.traceback[-1]
    stack = perfetto._alloc_args(a, a.size)["stack"]
    assert stack[0] == f"{innermost.filename}:{innermost.lineno} {innermost.name}"
    assert stack == [f"{f.filename}:{f.lineno} {f.name}" for f in reversed(a.traceback)][:16]
    frames = torch_snapshot._frame_list(a)
    assert [(f["filename"], f["line"]) for f in frames] == [(f.filename, f.lineno) for f in reversed(a.traceback)]


# ---- the whole history: a peak made by temporaries ------------------------------


def temporaries(fake):
    """8 MiB kept; the peak (72 MiB) comes from two temporaries made, then freed."""
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

    keep = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
    small = fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)  # TEMP SMALL
    big = fake.alloc(CBID_cuMemAlloc_v2, 48 * MiB)  # TEMP BIG
    fake.free(CBID_cuMemFree_v2, small)
    fake.free(CBID_cuMemFree_v2, big)
    return keep


@pytest.fixture(params=["loaded", "tracker"])
def temp_trace(request, fake, tmp_path):
    """A loaded trace, or the stopped tracker that streamed it (track(trace=...))."""
    path = tmp_path / "temps.memviz"
    with memviz.track(trace=str(path), torch=False) as t:
        temporaries(fake)
    return memviz.load(str(path)) if request.param == "loaded" else t


def _timeline_peak(trace, alloc="alloc", free="free_completed"):
    """The highest live bytes of a device trace, as memory_viz's timelines
    sum it: + each alloc, - each completed free (segments with plot_segments)."""
    cur = peak = 0
    for e in trace:
        if e["action"] == alloc:
            cur += e["size"]
        elif e["action"] == free:
            cur -= e["size"]
        peak = max(peak, cur)
    return peak


def test_torch_snapshot_of_a_trace_carries_every_alloc_and_free(temp_trace, tmp_path, memory_viz, capsys):
    path = tmp_path / "temps.pickle"
    temp_trace.to_torch_snapshot(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["memviz"]["history"] is True
    trace0 = snap["device_traces"][0]
    by_action = {a: [e["size"] for e in trace0 if e["action"] == a]
                 for a in ("segment_alloc", "alloc", "free_requested", "free_completed", "segment_free")}
    assert by_action["segment_alloc"] == by_action["alloc"] == [8 * MiB, 16 * MiB, 48 * MiB]
    for a in ("free_requested", "free_completed", "segment_free"):
        assert by_action[a] == [16 * MiB, 48 * MiB]
    times = [e["time_us"] for e in trace0]
    assert times == sorted(times)
    temps = [e for e in trace0 if e["action"] == "alloc" and e["size"] > 8 * MiB]
    here = open(__file__).read().splitlines()
    lines = [next(f["line"] for f in e["frames"] if f["filename"] == __file__) for e in temps]
    assert [here[n - 1].rstrip()[-8:] for n in lines] == ["MP SMALL", "TEMP BIG"]
    assert temp_trace.peak_bytes(0) == 72 * MiB
    assert _timeline_peak(trace0) == temp_trace.peak_bytes(0)
    assert _timeline_peak(trace0, "segment_alloc", "segment_free") == temp_trace.peak_bytes(0)

    # PyTorch's own reader: its text trace, segment summary and viewer pages.
    text = memory_viz.trace(snap)
    assert text.count("cudaMalloc(") == 3 and text.count("cudaFree(") == 2
    assert text.count("free completed for") == 2
    assert "total_reserved: 8.0MiB" in memory_viz.segsum(snap)
    for html in (memory_viz.trace_plot(snap), memory_viz.trace_plot(snap, plot_segments=True),
                 memory_viz.segment_plot(snap)):
        assert "snapshot.pickle" in html
    # Pairing each free with its alloc leaves exactly what is live at the end.
    kept = memory_viz.filter_alloc_free_pairs(pickle.loads(pickle.dumps(snap)))
    assert "without free_requested" not in capsys.readouterr().out
    left = [e for e in kept["device_traces"][0] if e["action"] == "alloc"]
    assert [e["size"] for e in left] == [8 * MiB]


def test_perfetto_of_a_trace_carries_every_alloc_and_free(temp_trace, tmp_path):
    path = tmp_path / "temps.json"
    perfetto.write(temp_trace, path)
    events = load_events(path)
    _check_spans_pair_up(events)
    spans = {e["id"]: e for e in events if e["ph"] == "b"}
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert sorted(e["args"]["size"] for e in spans.values()) == [8 * MiB, 16 * MiB, 48 * MiB]
    for uid, b in spans.items():
        live_at_end = ends[uid].get("args", {}).get("live_at_end", False)
        assert live_at_end == (b["args"]["size"] == 8 * MiB)
        assert ends[uid]["ts"] >= b["ts"]
    live = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "live bytes"]
    assert max(live) == temp_trace.peak_bytes(0) == 72 * MiB
    assert not any(e["ph"] == "i" and e.get("cat") == "allocation" for e in events)


@pytest.mark.parametrize("source", ["tracker", "streamed", "saved"])
def test_perfetto_of_a_real_recording_has_every_alloc_and_free(fake, tmp_path, source):
    """to_perfetto() of a stopped tracker that streamed its trace, of that
    trace loaded, and of a trace the tracker saved (its events: the peak set,
    then frees of what was not live any more, then the rest of the live set):
    one span per allocation, ended when it was freed or at the end."""
    t, _model = categorised_run(fake, tmp_path / "run.memviz")
    if source == "saved":
        t.save(str(tmp_path / "saved.memviz"))
    obj = {"tracker": t, "streamed": memviz.load(str(tmp_path / "run.memviz")),
           "saved": memviz.load(str(tmp_path / "saved.memviz")) if source == "saved" else None}[source]
    obj.to_perfetto(str(tmp_path / "out.json"))
    events = load_events(tmp_path / "out.json")
    _check_spans_pair_up(events)
    spans = {e["id"]: e for e in events if e["ph"] == "b"}
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    sizes = {"streamed": [1024, 262144, MiB, 4 * MiB, 8 * MiB], "tracker": [1024, 262144, MiB, 4 * MiB, 8 * MiB],
             "saved": [1024, 262144, 4 * MiB, 8 * MiB]}[source]  # a saved trace keeps no history
    assert sorted(b["args"]["size"] for b in spans.values()) == sizes
    freed = {b["args"]["size"] for uid, b in spans.items() if not ends[uid].get("args", {}).get("live_at_end")}
    assert freed == ({8 * MiB} if source == "saved" else {MiB, 8 * MiB})
    for uid, b in spans.items():
        assert ends[uid]["ts"] >= b["ts"]
        assert b["args"].get("op") != "alloc"  # an event's op is not the call that allocated
        assert b["args"]["kind"] == "device" and b["args"]["stack"]
    lines = {b["args"]["size"]: b["args"]["line"] for b in spans.values()}
    assert lines[8 * MiB].endswith(f":{_line_of('# TEMP')}")
    if source != "saved":
        assert lines[MiB].endswith(f":{_line_of('# EARLY')}")  # in no snapshot: from its event
    assert not any(e["ph"] == "i" and e.get("cat") == "allocation" for e in events)
    cats = {e["name"]: e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"].startswith("category: ")}
    # a trace file keeps the categories its tracker gave (the END record's), as the tracker knows them
    assert cats["category: parameter"] == PARAM_BYTES and cats["category: outside_pytorch"] == 4 * MiB


class AllocatorRouteStub(StubTrace):
    """A history on PyTorch's allocator route: a 20 MiB segment holding two
    blocks, the first at the segment's own address."""

    BASE = 0x7F00_0000_0000

    def events(self):
        t, a = self._t.started_ns, self.BASE
        some = self._t.snapshot().allocations[0]
        made = {}
        for i, (op, kind, addr, size) in enumerate([
                ("alloc", "device", a, 20 * MiB), ("alloc", "block", a, 8 * MiB),
                ("alloc", "block", a + 8 * MiB, 4 * MiB), ("free", "block", a, 8 * MiB),
                ("free", "block", a + 8 * MiB, 4 * MiB), ("free", "device", a, 20 * MiB)]):
            ts = t + (i + 1) * 1000
            if op == "alloc":
                made[(addr, kind)] = some._replace(address=addr, size=size, device=2, kind=kind,
                                                   timestamp_ns=ts, seq=ts, category=None)
            yield stub_event(op, ts, made[(addr, kind)])


def test_exports_of_an_allocator_route_history_keep_blocks_inside_segments(run, memory_viz):
    snap = torch_snapshot.build(AllocatorRouteStub(run))
    trace2 = snap["device_traces"][2]
    assert [(e["action"], e["addr"] - AllocatorRouteStub.BASE, e["size"] // MiB) for e in trace2] == [
        ("segment_alloc", 0, 20), ("alloc", 0, 8), ("alloc", 8 * MiB, 4),
        ("free_requested", 0, 8), ("free_completed", 0, 8),
        ("free_requested", 8 * MiB, 4), ("free_completed", 8 * MiB, 4), ("segment_free", 0, 20)]
    assert _timeline_peak(trace2) == 12 * MiB  # the blocks: active memory
    assert _timeline_peak(trace2, "segment_alloc", "segment_free") == 20 * MiB  # reserved
    assert "cudaFree(" in memory_viz.trace(snap)

    events = [e for e in perfetto.events(AllocatorRouteStub(run)) if e.get("pid") == 3]
    _check_spans_pair_up(events)
    spans = [e for e in events if e["ph"] == "b"]
    assert sorted((e["args"]["kind"], e["args"]["size"] // MiB) for e in spans) == [
        ("block", 4), ("block", 8), ("device", 20)]
    assert not any(e["ph"] == "e" and e.get("args", {}).get("live_at_end") for e in events)
