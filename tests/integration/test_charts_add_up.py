"""The timeline's series add up (issue 22, items 7 and 8): on the allocator
route, PyTorch's blocks lie inside its segments, so every byte counts once
at every moment. Device memory (memviz's totals) is the segments and what
lies outside PyTorch; PyTorch's tensors are a series of their own inside the
segments; the category lines add up to the device memory and, at the peak
and at the end, are what ``statistics("category")`` says. The same for
``timeline()``, the HTML report (its data, and its numbers as a real
Chromium draws them) and the Perfetto counters, of a live tracker, a
stopped tracker that streamed a trace, and the trace loaded back. And the
memory beyond memviz's record is split into what memviz names and an
unexplained rest, in the text, JSON and HTML reports.

Real paths: the C core through the libcupti test double and the stand-in
for PyTorch's caching allocator (tests/unit/test_allocator_route.py)."""

import bisect
import json
import os
import subprocess
import sys
import time

import pytest

import memviz
from conftest import ROOT
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.capture import device as _device
from memviz.model import pytorch as P
from memviz.report import render
from test_html_report import browser, embedded_data, open_page  # noqa: F401 - fixture

# The stand-in's libraries can be loaded from one build folder per process
# only (see tests/integration/test_diff.py): these tests run in a child pytest process,
# which test_in_a_child_process starts, where they are its only users.
CHILD = os.environ.get("MEMVIZ_TEST_CHARTS_CHILD") == "1"
try:  # the allocator route's fixtures need torch (the integration attaches with it)
    from test_allocator_route import pytestmark as route_mark
    if CHILD:
        from test_allocator_route import _attach, builds, standin  # noqa: F401 - fixtures
except pytest.skip.Exception as e:
    route_mark = pytest.mark.skip(reason=str(e))
pytestmark = [route_mark]
child = pytest.mark.skipif(not CHILD, reason="runs in the child process of test_in_a_child_process")


@pytest.mark.skipif(CHILD, reason="the child process itself")
def test_in_a_child_process():
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__],
                       cwd=str(ROOT), env=dict(os.environ, MEMVIZ_TEST_CHARTS_CHILD="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    ran = sum(1 for line in open(__file__) if line.startswith("@child")) + 2  # + the other kinds
    assert "failed" not in last and "error" not in last, p.stdout[-3000:]
    # every one passed, but the browser's where no Chromium is (its skip is shown below)
    assert f"{ran} passed" in last or f"{ran - 1} passed" in last, p.stdout[-3000:]
    for line in p.stdout.splitlines():  # what the child skipped (a browser missing), shown here
        if line.startswith("SKIPPED") and "child process itself" not in line:
            print(line)

MiB = 1 << 20
HELD = 400 * MiB       # what the driver says the process holds when tracking stops
UNSEEN = 64 * MiB      # PyTorch's reserved memory beyond the segments memviz recorded
PLATEAU = 0.02         # seconds the peak lasts (the HTML chart's times are microseconds)


def run(ans, fake, t):
    """Blocks in segments, memory outside PyTorch, a segment made for a big
    block (the peak), given back after; blocks and segments live at the end."""
    _attach(t, ans)
    a, _ = ans.alloc(3 * MiB)                        # a 20 MiB segment (PyTorch's for 1-10 MiB)
    own = fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)    # outside PyTorch
    tmp = fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
    b, _ = ans.alloc(MiB)                            # the small pool: a 2 MiB segment
    fake.free(CBID_cuMemFree_v2, tmp)
    time.sleep(PLATEAU)
    c, _ = ans.alloc(24 * MiB)                       # its own segment: the peak
    time.sleep(PLATEAU)
    del c
    ans.empty_cache()                                # that segment goes back
    d, _ = ans.alloc(30 * MiB)                       # a new 30 MiB segment
    del a
    time.sleep(PLATEAU)
    return own, b, d


@pytest.fixture
def record(standin, fake, tmp_path, monkeypatch):  # noqa: F811
    """record(trace=False): a stopped tracker of the run (the last one
    started: a tracker started after it would freeze its copy, which keeps
    no categories); with ``trace``, streamed to a file: (tracker, the file
    loaded). PyTorch's reserved figure and the driver's are what a GPU would
    give, so the outside section has numbers."""
    ans = standin()
    # PyTorch's memory_stats: its segments (the stand-in's) and UNSEEN more.
    monkeypatch.setattr(P, "_memory_stats", lambda: {0: {
        "allocated": ans.allocated(), "reserved": sum(v.size for v in ans.view()) + UNSEEN}})
    monkeypatch.setattr(_device, "process_device_memory", lambda: {0: (HELD, _device.SOURCE_NVML)})

    def make(trace=False):
        path = tmp_path / "run.memviz"
        with memviz.track(trace=str(path) if trace else None) as t:
            kept = run(ans, fake, t)
        del kept
        ans.empty_cache()
        return (t, memviz.load(str(path))) if trace else t

    return make


def value_at(ts, vs, t):
    i = bisect.bisect_right(ts, t) - 1
    return vs[i] if i >= 0 else 0


def stats(snap, dev=0):
    return {str(s.key): s.size for s in snap.by_device().get(dev, snap).statistics("category") if s.size}


def blocks(snap, dev=0):
    return sum(a.size for a in snap.allocations if a.kind == "block" and a.device == dev)


def check_chart(ch, rec, exact):
    """One device's chart: never more than device memory, and the totals, the
    tensors and the categories at the peak and at the end."""
    tot = rec.totals()[ch["device"]]
    series = {s["name"]: s for s in ch["series"]}
    total = series["device memory (memviz)"]
    tensors = series["PyTorch tensors"]
    cats = [s for s in ch["series"] if s["kind"] == "category"]
    assert max(total["v"]) == tot["peak"] == ch["peak"]["v"]
    times = sorted({t for s in ch["series"] for t in s["t"]})
    for t in times:
        device = value_at(total["t"], total["v"], t)
        assert 0 <= value_at(tensors["t"], tensors["v"], t) <= device, t
        added = sum(value_at(s["t"], s["v"], t) for s in cats)
        assert added == device if exact else added <= device, t  # without events: a lower bound
    for when, t, snap, figure in (("peak", ch["peak"]["t"], rec.peak_snapshot(0), tot["peak"]),
                                  ("end", times[-1], rec.snapshot(), tot["current"])):
        assert value_at(total["t"], total["v"], t) == figure, when
        assert value_at(tensors["t"], tensors["v"], t) == blocks(snap), when
        got = {s["name"]: value_at(s["t"], s["v"], t) for s in cats}
        assert {k: v for k, v in got.items() if v} == stats(snap), when
        assert sum(got.values()) == figure == snap.total_bytes(), when


@child
@pytest.mark.parametrize("kind", ["tracker", "streamed", "loaded"])
def test_the_html_charts_count_every_byte_once(record, kind):
    both = None if kind == "tracker" else record(trace=True)
    rec = record() if both is None else both[kind == "loaded"]
    exact = kind != "tracker"  # a tracker without a trace keeps no history
    d = embedded_data(render(rec))
    (ch,) = [c for c in d["timeline"]["charts"] if c["device"] == 0]
    assert d["timeline"]["category_note"].startswith("from the recorded events" if exact else "from the allocations")
    check_chart(ch, rec, exact)
    # PyTorch's categories; a trace keeps those its tracker gave (as memviz diff reads them)
    assert {"unused_pool", "outside_pytorch", "other_pytorch"} <= stats(rec.peak_snapshot(0)).keys()
    if kind == "loaded":
        streamed, loaded = both
        assert stats(loaded.peak_snapshot(0)) == stats(streamed.peak_snapshot(0))
        assert stats(loaded.snapshot()) == stats(streamed.snapshot())


@child
def test_timeline_is_the_device_memory_live_and_loaded(record):
    streamed, loaded = record(trace=True)
    for rec in (streamed, loaded):
        tot = rec.totals()[0]
        pts = [(ts, v) for ts, dev, v in rec.timeline() if dev == 0]
        assert max(v for _, v in pts) == tot["peak"]
        assert value_at([p[0] for p in pts], [p[1] for p in pts], tot["peak_timestamp_ns"]) == tot["peak"]
        assert pts[-1][1] == tot["current"]
    # the loaded trace's timeline is the tracker's that wrote it, point for point
    assert [p for p in loaded.timeline() if p[1] == 0] == [p for p in streamed.timeline() if p[1] == 0]


@child
def test_at_the_peak_nanosecond_the_block_the_segment_was_made_for_counts(record):
    """The store dates a block when it was asked for, before the segment made
    for it; the trace writes it after that segment. At the peak (the
    segment's time) the series hold that block, as the peak's set does."""
    from memviz.report._categories import memory_series

    for rec in record(trace=True):
        tot = rec.totals()[0]
        peak, end = rec.peak_snapshot(0), rec.snapshot()
        mem = memory_series(rec, list(end.allocations), list(peak.allocations),
                            {0: tot["peak_timestamp_ns"]}, rec.stopped_ns)
        at = tot["peak_timestamp_ns"]
        got = {c: value_at(ts, vs, at) for c, (ts, vs) in mem.categories[0].items()}
        assert {c: v for c, v in got.items() if v} == stats(peak)
        assert value_at(*mem.tensors[0], at) == blocks(peak) >= 6 * MiB


@child
def test_a_trace_whose_blocks_are_all_freed_still_has_its_segments(standin, fake, tmp_path):  # noqa: F811
    """Segments that held blocks count as PyTorch's pool even when none is
    live (the shipped sample's end): not as memory of unknown use."""
    ans = standin()
    with memviz.track(trace=str(tmp_path / "t.memviz")) as t:
        _attach(t, ans)
        x, _ = ans.alloc(3 * MiB)
        del x
    end = memviz.load(str(tmp_path / "t.memviz")).snapshot()
    assert end.segments and stats(end)["unused_pool"] == sum(g.size for g in end.segments)
    ans.empty_cache()


@child
def test_perfetto_counters_count_every_byte_once(record):
    from memviz.export.perfetto import events

    for rec in record(trace=True):
        tot = rec.totals()[0]
        tracks = {}
        for e in events(rec):
            if e["ph"] == "C" and e["pid"] == 1:
                t, v = tracks.setdefault(e["name"], ([], []))
                if t and t[-1] == e["ts"]:
                    v[-1] = e["args"]["bytes"]
                else:
                    t.append(e["ts"])
                    v.append(e["args"]["bytes"])
        live, tensors = tracks.pop("live bytes"), tracks.pop("PyTorch tensors")
        cats = {k: v for k, v in tracks.items() if k.startswith("category: ")}
        assert max(live[1]) == tot["peak"] and live[1][-1] == tot["current"]
        for t in sorted({t for tr in tracks.values() for t in tr[0]} | set(live[0])):
            device = value_at(*live, t)
            assert 0 <= value_at(*tensors, t) <= device
            assert sum(value_at(*c, t) for c in cats.values()) == device, t


@child
def test_the_reports_carry_the_outside_section(record):
    from memviz.cli.report import json_report
    from memviz.report.text import text_report

    streamed, loaded = record(trace=True)
    current = loaded.totals()[0]["current"]
    expected = {"device": 0, "name": "cuda:0", "held": HELD, "source": _device.SOURCE_NVML,
                "recorded": current, "beyond": HELD - current,
                "named": [{"what": "PyTorch's pool outside memviz's record (segments made before tracking)",
                           "bytes": UNSEEN}],
                "unexplained": HELD - current - UNSEEN}
    report = json.loads(json.dumps(json_report(loaded)))
    assert report["outside"] == {"devices": [expected], "why_none": None, "notes": []}
    assert embedded_data(render(loaded))["outside"] == report["outside"]
    text = text_report(loaded, outside=loaded.outside)
    section = text.split("Memory outside the tracked allocations")[1]
    lines = [ln.strip() for ln in section.splitlines()]
    assert f"cuda:0      {(HELD - current) // MiB} MiB outside   (process holds 400 MiB, memviz saw {current // MiB} MiB)" \
        in lines
    assert "64 MiB  PyTorch's pool outside memviz's record (segments made before tracking)" in lines
    assert f"{(HELD - current - UNSEEN) // MiB} MiB  unexplained" in lines
    assert "CUDA context" not in section.split("unexplained")[0]  # PyTorch's memory is not the context's
    # Allocations recorded as made before tracking, where something gives them,
    # take the PyTorch figure's place, by category.
    before = {0: {"parameter": 32 * MiB, "unused_pool": 16 * MiB}}
    got = json_report(loaded, before_tracking=before)["outside"]["devices"][0]
    assert got["before_tracking"] == before[0] and got["named"] == []
    assert got["unexplained"] == HELD - current - 48 * MiB
    assert "made before tracking: parameter" in text_report(loaded, outside=loaded.outside,
                                                            before_tracking=before)
    # a stopped tracker asks the driver now
    live = json_report(streamed)["outside"]["devices"][0]
    assert live["held"] == HELD and live["beyond"] == HELD - streamed.totals()[0]["current"]


@child
def test_the_chart_as_chromium_draws_it_adds_up(record, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    _streamed, loaded = record(trace=True)
    path = tmp_path / "report.html"
    path.write_text(render(loaded), encoding="utf-8")
    browser.get_log("browser")
    open_page(browser, path)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
    chart = browser.find_elements(By.CSS_SELECTOR, "#mvz-timeline .chart")[0]
    tot = loaded.totals()[0]
    for when, snap, figure in (("at the peak", loaded.peak_snapshot(0), tot["peak"]),
                               ("at the end", loaded.snapshot(), tot["current"])):
        row = chart.find_element(By.CSS_SELECTOR, f'p.values[data-when="{when}"]')
        drawn = {s.get_attribute("data-name"): int(s.get_attribute("data-bytes"))
                 for s in row.find_elements(By.TAG_NAME, "span")}
        assert drawn.pop("device memory (memviz)") == figure, when
        assert drawn.pop("PyTorch tensors") == blocks(snap), when
        assert {k: v for k, v in drawn.items() if v} == stats(snap), when
        assert sum(drawn.values()) == figure
    assert f"peak {tot['peak'] // MiB} MiB" in chart.text
    outside = browser.find_element(By.ID, "mvz-outside").text
    assert "PyTorch\u2019s pool outside memviz\u2019s record" in outside or "PyTorch's pool" in outside
    assert "64 MiB" in outside and "unexplained" in outside
