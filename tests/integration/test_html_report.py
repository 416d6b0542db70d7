"""The HTML report and the notebook views, from allocations fired through the
libcupti test double; then the page opened in a real headless Chromium.

Browser tests need Debian's chromium and chromedriver and Selenium:

    apt-get install -y chromium chromium-driver && pip install selenium

(MEMVIZ_CHROMIUM / MEMVIZ_CHROMEDRIVER override where they are looked for).
Screenshots go to pytest's tmp_path and, when MEMVIZ_ARTIFACTS names a
folder, are copied there too.
"""

import json
import os
import re
import shutil
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import memviz
from fake_cupti import (CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, CBID_cuMemHostAlloc,
                        CUDA_ERROR_OUT_OF_MEMORY)
from memviz import _core
from memviz.report import findings_repr_html, read, render, snapshot_repr_html
from memviz.report import tracker_repr_html, write
from memviz.report.html import json_for_script
from memviz.report.text import text_report

MiB = 1 << 20
EVIL = "</script><script>alert(1)</script>"
EVIL_FILE = f"/tmp/{EVIL}.py"  # a code object's file name can be anything

# Functions "defined in" a file whose name would close a <script> element.
_evil_ns: dict = {}
exec(compile("def evil_alloc(fake, cbid, size):\n    return fake.alloc(cbid, size)\n",
             EVIL_FILE, "exec"), _evil_ns)
evil_alloc = _evil_ns["evil_alloc"]


def load_weights(fake):
    return fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)  # WEIGHTS


def workspace(fake):
    return fake.alloc(CBID_cuMemAlloc_v2, 32 * MiB)  # WORKSPACE


def record_run(fake):
    """A small run: several lines, labels, threads, frees, two devices,
    pinned host memory and a failed allocation."""
    with memviz.track() as t:
        weights = [load_weights(fake) for _ in range(3)]
        with memviz.label(EVIL):
            evil_alloc(fake, CBID_cuMemAlloc_v2, 2 * MiB)
        ws = workspace(fake)
        time.sleep(0.002)
        fake.free(CBID_cuMemFree_v2, ws)
        with memviz.label("data loading"):
            fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        th = threading.Thread(target=lambda: fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB), name="loader")
        th.start()
        th.join()
        fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 5 * MiB, device=0, thread_name="pt_autograd_0")
        fake.set_device(1)
        fake.alloc(CBID_cuMemAlloc_v2, 160 * MiB)
        fake.set_device(0)
        fake.alloc(CBID_cuMemHostAlloc, MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=CUDA_ERROR_OUT_OF_MEMORY)
        time.sleep(0.002)
        fake.free(CBID_cuMemFree_v2, weights[0])
    return t


def embedded_data(page):
    m = re.search(r'<script type="application/json" class="memviz-data">(.*?)</script>', page, re.S)
    assert m, "the data element is missing"
    return json.loads(m.group(1))


@pytest.fixture
def run(fake):
    return record_run(fake)


# ---- structure --------------------------------------------------------------


def test_page_is_one_offline_file_with_all_sections(run):
    page = render(run, title="my run")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<title>my run</title>" in page
    assert page.count("<script") == 2  # the data and the inlined script, nothing else
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and not re.search(r"""url\(\s*['"]?(?!#)""", page)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    d = embedded_data(page)
    assert [c["name"] for c in d["timeline"]["charts"]] == ["cuda:0", "cuda:1", "pinned host"]
    cuda0 = d["timeline"]["charts"][0]
    assert cuda0["peak"]["v"] == run.totals()[0]["peak"] == (3 * 8 + 2 + 32) * MiB
    total = cuda0["series"][0]
    assert total["kind"] == "total" and total["v"][0] == 0 and max(total["v"]) == cuda0["peak"]["v"]
    assert total["t"] == sorted(total["t"])
    assert {f["name"] for f in d["flames"]} == {"cuda:0", "cuda:1", "pinned host"}
    assert d["flames"][0]["tree"][1] == (3 * 8 + 2 + 32) * MiB  # root = all live at the peak
    table = d["tables"]["lines"]
    assert [c["key"] for c in table["columns"]][:5] == ["line", "device", "function", "source", "size"]
    lines = {row[0].rsplit(":", 1)[-1]: row for row in table["rows"]}
    assert lines[str(_line_of("# WEIGHTS"))][1] == "cuda:0"
    assert lines[str(_line_of("# WEIGHTS"))][4:6] == [24 * MiB, 3]
    assert lines[str(_line_of("# WORKSPACE"))][4] == 32 * MiB
    assert [r[4] for r in table["rows"]] == sorted((r[4] for r in table["rows"]), reverse=True)
    assert len(d["failures"]) == 1 and d["failures"][0][1] == 80 << 30
    assert "test_html_report.py" in d["failures"][0][4]
    assert {r[0] for r in d["tables"]["labels"]["rows"]} >= {"<no label>"}
    calls = {r[0]: r[1] for r in d["tables"]["calls"]["rows"]}  # what the innermost frames called
    if sys.version_info >= (3, 11):
        assert calls.get("self._c.fake_alloc", 0) > 0, calls
    end_labels = {r[0] for r in d["tables"]["live at end"]["rows"]}
    assert any("pt_autograd_0" in r for r in end_labels)


def _line_of(marker):
    with open(__file__) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


def test_a_file_name_or_label_that_closes_script_does_not_inject(run):
    page = render(run)
    assert EVIL not in page and "<script>alert" not in page
    assert page.count("</script>") == 2
    d = embedded_data(page)  # and the data still says exactly what was recorded
    names = {n[1] for n in d["names"]}
    assert EVIL_FILE in names
    end = d["tables"]["live at end"]["rows"]
    assert any(r[-1] == EVIL_FILE for r in end)
    assert json.loads(json_for_script({"s": EVIL + "\u2028&"})) == {"s": EVIL + "\u2028&"}
    assert "<" not in json_for_script(EVIL) and "&" not in json_for_script("&")


def test_title_is_escaped_and_checked(run):
    page = render(run, title="<b>x</b> & y")
    assert "<title>&lt;b&gt;x&lt;/b&gt; &amp; y</title>" in page
    with pytest.raises(TypeError, match="title must be a str"):
        render(run, title=3)


def test_write_creates_the_file_and_says_when_it_cannot(run, tmp_path):
    out = write(run, tmp_path / "r.html")
    assert open(out, encoding="utf-8").read().startswith("<!DOCTYPE html>")
    with pytest.raises(memviz.OutputError, match="cannot write the HTML report.*What to do"):
        write(run, tmp_path / "missing" / "r.html")


def test_a_tracker_that_never_started_says_so():
    with pytest.raises(memviz.NotTracking, match="never started"):
        render(memviz.Tracker(gpu=False))


def test_size_does_not_grow_with_the_number_of_events():
    def site(n):
        _core._synthetic(0x7000000000, 4096, True, n)

    def keep(n):
        _core._synthetic(0x9000000000, 512, False, n)

    sizes = []
    for n in (2_000, 200_000):
        with memviz.track(gpu=False) as t:
            site(n)
            keep(n // 20)
        page = render(t)  # its time: benchmarks/bench_bounds.py (render)
        sizes.append(len(page))
    assert sizes[1] < 600_000 and sizes[1] < 4 * sizes[0]


def test_downsample_keeps_maxima_ends_and_bounds_points():
    ts = list(range(100_000))
    vs = [(i * 7919) % 1000 for i in ts]
    vs[54_321] = 10**9
    t2, v2 = read.downsample(ts, vs, 4000)
    assert len(t2) <= 4002 and t2[0] == 0 and t2[-1] == 99_999
    assert 10**9 in v2 and t2 == sorted(t2)
    assert read.downsample([1, 2], [3, 4], 10) == ([1, 2], [3, 4])


# ---- duck-typed traces: categories, steps, findings, events ------------------


def stub_event(op, timestamp_ns, allocation):
    """An event shaped as a recording's events() gives them (memviz.load(path).events()):
    what happened, when, and the allocation it concerns."""
    return SimpleNamespace(op=op, timestamp_ns=timestamp_ns, seq=allocation.seq, allocation=allocation,
                           **{k: getattr(allocation, k) for k in (
                               "device", "address", "size", "kind", "stream", "thread", "label",
                               "traceback", "autograd_node", "forward", "category")})


class StubTrace:
    """The reading API of a loaded trace, with categories, steps, findings and events."""

    def __init__(self, tracker, with_events=True):
        self._t = tracker
        self.started_ns, self.stopped_ns = tracker.started_ns, tracker.stopped_ns
        base = tracker.started_ns
        self.steps = [{"step": i, "timestamp_ns": base + (i + 1) * 1000,
                       "allocated": {0: (i + 1) * MiB}, "reserved": {"0": 2 * (i + 1) * MiB},
                       "loss": 0.5 / (i + 1), "note": "warm-up" if i == 0 else ""}
                      for i in range(3)]
        if not with_events:
            self.events = None

    def _cat(self, snap):
        return memviz.Snapshot([a._replace(category="parameter" if a.size == 8 * MiB else "activation")
                                for a in snap.allocations])

    def snapshot(self):
        return self._cat(self._t.snapshot())

    def peak_snapshot(self, device=None):
        return self._cat(self._t.peak_snapshot(device))

    def totals(self):
        return self._t.totals()

    def timeline(self):
        return self._t.timeline()

    @property
    def failures(self):
        return self._t.failures

    def capture_info(self):
        return {"gpu_enabled": True, "library": "libcupti.so (stub)"}

    def diagnose(self):
        return [{"kind": "growth", "message": "allocated grows 8 MiB per step",
                 "numbers": {"bytes_per_step": 8 * MiB, "steps": 3}, "lines": ["train.py:42"],
                 "fix": "do not keep the loss tensor: append loss.item()"}]

    def events(self):
        end = {(a.device, a.address) for a in self.snapshot().allocations}
        known = {(a.device, a.address): a for a in
                 list(self.peak_snapshot().allocations) + list(self.snapshot().allocations)}
        for a in sorted(known.values(), key=lambda a: a.timestamp_ns):
            yield stub_event("alloc", a.timestamp_ns, a)
        for key, a in known.items():
            if key not in end:
                yield stub_event("free", self.stopped_ns - 1, a)


@pytest.mark.parametrize("with_events", [True, False])
def test_categories_steps_and_findings_of_a_duck_typed_trace(run, with_events):
    stub = StubTrace(run, with_events)
    d = embedded_data(render(stub))
    cuda0 = d["timeline"]["charts"][0]
    kinds = {s["name"]: s["kind"] for s in cuda0["series"]}
    assert kinds["parameter"] == kinds["activation"] == "category"
    assert kinds["torch allocated"] == kinds["torch reserved"] == "step"
    param = next(s for s in cuda0["series"] if s["name"] == "parameter")
    assert max(param["v"]) == 24 * MiB and param["v"][-1] == 16 * MiB  # one freed at the end
    assert ("recorded events" in d["timeline"]["category_note"]) == with_events
    cats = {r[0]: r[1] for r in d["tables"]["categories"]["rows"]}
    assert cats["parameter"] == 24 * MiB
    assert [c["key"] for c in d["steps"]["columns"]][:2] == ["step", "time"]
    assert {c["key"]: c["type"] for c in d["steps"]["columns"]}["allocated"] == "bytes"
    assert d["findings"][0]["fix"].startswith("do not keep")
    assert d["meta"]["library"] == "libcupti.so (stub)"


# ---- a real recording's events: a stopped tracker that streamed its trace ----------------


PARAM_BYTES = (256 * 256 + 256) * 4  # nn.Linear(256, 256)'s weight and bias


def categorised_run(fake, path):
    """A stopped tracker that streamed its trace to ``path``, with PyTorch's
    categories: a Linear's parameters (their storages, as the driver's), a
    1 MiB temporary freed before the peak (so no snapshot holds it), an 8 MiB
    one freed after it, and 4 MiB kept. Returns the tracker and the model (the
    categories of a stopped tracker's snapshots read the live parameters)."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(256, 256)
    with memviz.track(trace=str(path)) as t:
        for p in model.parameters():
            s = p.untyped_storage()
            fake.alloc_at(s.data_ptr(), s.nbytes())
        early = fake.alloc(CBID_cuMemAlloc_v2, MiB)  # EARLY
        fake.free(CBID_cuMemFree_v2, early)
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)  # TEMP
        fake.free(CBID_cuMemFree_v2, tmp)
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)  # KEPT
    assert t.events() is not None  # the history: the trace read back
    return t, model


def test_category_series_of_a_stopped_tracker_come_from_its_streamed_trace(fake, tmp_path):
    """The timeline's memory by category, replayed from the trace a stopped
    tracker streamed: the 1 MiB freed before the peak shows, which no
    snapshot holds (without events the series are a lower bound)."""
    t, _model = categorised_run(fake, tmp_path / "run.memviz")
    d = embedded_data(render(t))
    assert d["timeline"]["category_note"] == "from the recorded events"
    series = {s["name"]: s["v"] for s in d["timeline"]["charts"][0]["series"] if s["kind"] == "category"}
    # the early temporary is in no snapshot, so its category is not known
    assert set(series) == {"parameter", "outside_pytorch", "<unknown>"}
    assert max(series["parameter"]) == series["parameter"][-1] == PARAM_BYTES
    assert max(series["outside_pytorch"]) == 8 * MiB and series["outside_pytorch"][-1] == 4 * MiB
    assert max(series["<unknown>"]) == MiB and series["<unknown>"][-1] == 0


def leak_step(fake, keep):
    keep.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))  # LEAK


def test_real_step_records_and_findings(fake, tmp_path):
    keep = []
    with memviz.track() as t:
        for i in range(8):
            leak_step(fake, keep)
            t.step(loss=1.0 / (i + 1), batch=(4, 128))
    d = embedded_data(render(t))
    cols = {c["key"]: c["type"] for c in d["steps"]["columns"]}
    assert cols["time"] == "time" and cols["duration"] == "time"
    assert cols["current"] == cols["growth"] == cols["peak"] == "bytes"
    assert cols["loss"] == "num" and cols["batch"] == "text"
    row = dict(zip(cols, d["steps"]["rows"][-1]))
    assert row["step"] == "7" and row["current"] == 64 * MiB and row["batch"] == "(4, 128)"
    assert row["top growing line"].endswith(f":{_line_of('# LEAK')} (+8 MiB)")
    series = {s["name"]: s for s in d["timeline"]["charts"][0]["series"]}
    assert "device total" not in series  # memviz's numbers at each step are not the device's total
    assert series["device memory (memviz) at step ends"]["v"][-1] == 64 * MiB
    growth = next(f for f in d["findings"] if f["kind"] == "growth")
    assert growth["numbers_text"]["bytes_per_step"] == "8 MiB"
    assert any(f":{_line_of('# LEAK')}: +" in line for line in growth["lines"])
    html = findings_repr_html(t.diagnose())
    assert "8 MiB" in html and "Fix:" in html and "rises" in html


def test_diagnose_that_fails_or_is_missing_does_not_break_the_report(run):
    class Broken(StubTrace):
        def diagnose(self):
            raise ImportError("no module named memviz.analysis.diagnose")

    d = embedded_data(render(Broken(run)))
    assert d["findings"] is None and "not available" in d["findings_note"]
    assert read.findings(object())[0] is None


# ---- notebook views -----------------------------------------------------------


def test_tracker_repr_html_is_compact_scriptless_and_escaped(run):
    out = tracker_repr_html(run, top=3)
    assert "<script" not in out and "<svg" in out and "polygon" in out
    assert "cuda:0" in out and "cuda:1" in out and "pinned host" in out
    assert out.count("<tr><td class=\"n\">") <= 3 + 3  # top 3 lines (+ device rows use td)
    assert EVIL not in out
    assert "1 failed allocation" in out
    assert run._repr_html_() == tracker_repr_html(run)
    with pytest.raises(ValueError, match="top must be a positive int"):
        tracker_repr_html(run, top=0)
    assert "not started" in tracker_repr_html(memviz.Tracker(gpu=False))


def test_snapshot_and_findings_repr_html(run):
    snap = run.snapshot()
    out = snapshot_repr_html(snap, top=2)
    assert "memviz snapshot" in out and "more line(s)" in out and "<script" not in out
    f = findings_repr_html(StubTrace(run).diagnose())
    assert "8 MiB" in f and "Fix:" in f and "train.py:42" in f and "steps: 3" in f
    assert "no problem found" in findings_repr_html([])


# ---- in a real browser ------------------------------------------------------


def need_browser():
    """Skip, saying what to install, unless Selenium, Chromium and
    chromedriver are here; (browser, driver) paths. A browser test calls it
    before importing selenium or doing any work."""
    pytest.importorskip("selenium", reason="browser tests need Selenium: pip install selenium")
    binary = os.environ.get("MEMVIZ_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = os.environ.get("MEMVIZ_CHROMEDRIVER") or shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("browser tests need Chromium and chromedriver: "
                    "apt-get install -y chromium chromium-driver")
    return binary, driver


def _browser():
    binary, driver = need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,2200", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Under benchmarks/sanitize.sh the sanitizer runtime is preloaded for this
    # process; the browser and its driver are not built for it.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    return webdriver.Chrome(service=Service(driver, env=env), options=opts)


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    yield b
    b.quit()


def open_page(browser, path):
    """Open a report file; returns seconds until its script had drawn everything."""
    start = time.perf_counter()
    browser.get("file://" + str(path))
    for _ in range(200):
        if browser.execute_script("return document.querySelector('.mvz').getAttribute('data-ready')"):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"the report never finished drawing; console: {browser.get_log('browser')}")
    return time.perf_counter() - start


def save_artifact(browser, tmp_path, name):
    shot = tmp_path / name
    browser.save_screenshot(str(shot))
    dest = os.environ.get("MEMVIZ_ARTIFACTS")
    if dest:
        os.makedirs(dest, exist_ok=True)
        shutil.copy(shot, os.path.join(dest, name))
    return shot


def test_report_draws_in_chromium_zooms_and_sorts(run, browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path = write(run, tmp_path / "report.html", title="memviz test run")
    browser.get_log("browser")  # drop anything from before
    open_page(browser, path)  # its time: benchmarks/bench_bounds.py (page)
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - the injected alert(1) must not exist
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []

    # Timeline: one SVG per device, an area path with real content, the peak marked.
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.timeline")
    assert len(charts) == 3
    first = charts[0]
    d_attr = first.find_element(By.CSS_SELECTOR, "path.series").get_attribute("d")
    assert d_attr.count("L") >= 6
    assert first.find_elements(By.CSS_SELECTOR, "circle.peak")
    ticks_before = [t.text for t in first.find_elements(By.CSS_SELECTOR, "g.axis text")]
    # The y axis reaches above each device's peak, in the units memviz prints.
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for chart, dev in zip(charts, (0, 1, -1)):
        top = chart.find_elements(By.CSS_SELECTOR, "g.axis text.ytick")[-1].text  # the highest y tick
        number, unit = top.split()
        assert run.totals()[dev]["peak"] <= float(number) * units[unit] < 2 * run.totals()[dev]["peak"]
    assert "peak 160 MiB" in charts[1].text

    # Drag across the first chart zooms every chart; double-click resets.
    overlay = first.find_element(By.CSS_SELECTOR, "rect.overlay")
    w = overlay.size["width"]
    ActionChains(browser).move_to_element_with_offset(overlay, int(-w * 0.3), 0).click_and_hold() \
        .move_by_offset(int(w * 0.4), 0).release().perform()
    first = browser.find_elements(By.CSS_SELECTOR, "svg.timeline")[0]
    ticks_zoomed = [t.text for t in first.find_elements(By.CSS_SELECTOR, "g.axis text")]
    assert ticks_zoomed != ticks_before
    assert "double-click" in browser.find_element(By.CSS_SELECTOR, "#mvz-timeline .hint").text
    ActionChains(browser).double_click(first.find_element(By.CSS_SELECTOR, "rect.overlay")).perform()
    first = browser.find_elements(By.CSS_SELECTOR, "svg.timeline")[0]
    assert [t.text for t in first.find_elements(By.CSS_SELECTOR, "g.axis text")] == ticks_before

    # Flame graph: rectangles for the stacks; clicking one zooms into it.
    flame = browser.find_element(By.CSS_SELECTOR, "svg.flame")
    rects = flame.find_elements(By.TAG_NAME, "rect")
    assert len(rects) >= 4
    widths = sorted(float(r.get_attribute("width")) for r in rects)
    assert widths[-1] > 500
    texts = [t.text for t in flame.find_elements(By.TAG_NAME, "text")]
    assert any("load_weights" in t for t in texts) and any("workspace" in t for t in texts)
    target = next(t for t in flame.find_elements(By.TAG_NAME, "text") if "workspace" in t.text)
    target.find_element(By.XPATH, "..").find_element(By.TAG_NAME, "rect").click()
    flame = browser.find_element(By.CSS_SELECTOR, "svg.flame")
    assert any("workspace" in t.text for t in flame.find_elements(By.TAG_NAME, "text"))
    assert not any("load_weights" in t.text for t in flame.find_elements(By.TAG_NAME, "text"))

    # Tables: sorting by a header changes the order; the evil label shows as text.
    table = browser.find_element(By.CSS_SELECTOR, "#mvz-tables table")

    def first_col():
        return [r.find_elements(By.TAG_NAME, "td")[0].text
                for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")]

    before = first_col()
    assert len(before) >= 3
    size_header = next(h for h in table.find_elements(By.TAG_NAME, "th") if h.text.strip() == "size")
    size_header.click()
    assert size_header.get_attribute("aria-sort") == "ascending"
    after = first_col()
    assert after != before and sorted(after) == sorted(before) and after == before[::-1]
    browser.find_element(By.CSS_SELECTOR, "button[data-table='labels']").click()
    labels = browser.find_element(By.CSS_SELECTOR, "#mvz-tables table").text
    assert EVIL in labels and "<no label>" in labels
    assert "80 GiB" in browser.find_element(By.ID, "mvz-failures").text

    ActionChains(browser).double_click(browser.find_element(By.CSS_SELECTOR, "svg.flame rect")).perform()
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.flame rect")) == len(rects)
    browser.find_element(By.CSS_SELECTOR, "button[data-table='lines']").click()
    browser.execute_script("window.scrollTo(0, 0)")
    shot = save_artifact(browser, tmp_path, "html_report.png")
    assert shot.stat().st_size > 10_000
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []


def test_duck_typed_trace_with_steps_draws_in_chromium(run, browser, tmp_path):
    from selenium.webdriver.common.by import By

    path = write(StubTrace(run), tmp_path / "stub.html")
    browser.get_log("browser")
    open_page(browser, path)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
    assert browser.find_element(By.ID, "mvz-steps").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert "do not keep the loss" in browser.find_element(By.ID, "mvz-findings").text
    legend = browser.find_element(By.CSS_SELECTOR, ".legend").text
    assert "parameter" in legend and "torch allocated" in legend
    save_artifact(browser, tmp_path, "html_report_steps.png")


# ---- the deepest stacks the core records (hardening issue, item 7) ----------


def _deep_alloc(fake, frames_left, size):
    if frames_left > 1:
        return _deep_alloc(fake, frames_left - 1, size)
    return fake.alloc(CBID_cuMemAlloc_v2, size)  # DEEP


def _tree_depth(node):
    depth, todo = 0, [(node, 1)]
    while todo:
        n, d = todo.pop()
        depth = max(depth, d)
        todo += [(c, d + 1) for c in (n[3] if len(n) > 3 else [])]
    return depth


def record_deep(fake, tmp_path, trace=None):
    """Allocations under stacks as deep as the core keeps (MAX_DEPTH) and deeper."""
    depth = _core.MAX_DEPTH
    with memviz.track(depth=depth, trace=trace) as t:
        _deep_alloc(fake, depth - 5, 8 * MiB)  # fits: every frame kept
        _deep_alloc(fake, depth + 40, 16 * MiB)  # cut at MAX_DEPTH frames
        t.step(batch=(2, 3))
    return t


def test_html_report_of_the_deepest_stacks(fake, tmp_path):
    import sys as _sys

    t = record_deep(fake, tmp_path)
    deepest = max(len(a.traceback) for a in t.peak_snapshot().allocations)
    assert deepest == _core.MAX_DEPTH
    old = _sys.getrecursionlimit()
    # Whatever the caller's own stack takes: the report needs no deep recursion.
    _sys.setrecursionlimit(len(__import__("inspect").stack(0)) + 120)
    try:
        page = render(t)
        page.encode("utf-8")
        text = text_report(t, outside={})
    finally:
        _sys.setrecursionlimit(old)
    d = embedded_data(page)
    tree = d["flames"][0]["tree"]
    assert tree[1] == 24 * MiB
    assert _tree_depth(tree) >= _core.MAX_DEPTH + 1  # root, (marker,) then every kept frame
    names = [n[0] for n in d["names"]]
    assert any(n.startswith("[outer frames not kept: stack deeper than 256]") for n in names)
    assert f"test_html_report.py:{_line_of('# DEEP')}" in text


def test_exports_and_trace_of_the_deepest_stacks(fake, tmp_path):
    import pickle
    import sys as _sys

    trace = tmp_path / "deep.memviz"
    t = record_deep(fake, tmp_path, trace=str(trace))
    t.save(str(tmp_path / "saved.memviz"))
    old = _sys.getrecursionlimit()
    _sys.setrecursionlimit(len(__import__("inspect").stack(0)) + 120)
    try:
        for obj in (t, memviz.load(str(trace)), memviz.load(str(tmp_path / "saved.memviz"))):
            obj.to_perfetto(str(tmp_path / "p.json"))
            obj.to_torch_snapshot(str(tmp_path / "s.pickle"))
            page = render(obj)
            memviz.diagnose(obj)
    finally:
        _sys.setrecursionlimit(old)
    events = json.load(open(tmp_path / "p.json", encoding="utf-8"))["traceEvents"]
    assert any(e.get("args", {}).get("size") == 16 * MiB for e in events)
    snap = pickle.load(open(tmp_path / "s.pickle", "rb"))
    assert max(len(s["frames"]) for s in snap["segments"]) == _core.MAX_DEPTH
    assert _tree_depth(embedded_data(page)["flames"][0]["tree"]) >= _core.MAX_DEPTH + 1


def test_report_json_for_script_takes_any_depth():
    """Issue 24, item 12: any depth is taken, and what is written reads back
    with a plain json.loads at the default limits (3.12's C recursion limit
    stopped it at 3,000 levels): containers past JSON_MAX_DEPTH are cut."""
    import sys as _sys

    from memviz.report.html import JSON_CUT, JSON_MAX_DEPTH

    deep = cur = []
    for _ in range(3000):
        nxt = [1.5, float("nan")]
        cur.append(nxt)
        cur = nxt
    old = _sys.getrecursionlimit()
    _sys.setrecursionlimit(len(__import__("inspect").stack(0)) + 120)
    try:
        text = json_for_script({"deep": deep, "n": [float("inf"), 2]})
    finally:
        _sys.setrecursionlimit(old)
    assert text.startswith('{"deep":[[1.5,null,[1.5,null,[') and text.endswith(']]]],"n":[null,2]}')
    assert text.count("[") == text.count("]") and text.count(JSON_CUT) == 1
    back = json.loads(text)
    n, node = 1, back["deep"][0]
    while len(node) > 2:
        assert node[:2] == [1.5, None]
        if node[2] == JSON_CUT:
            break
        n, node = n + 1, node[2]
    # {"deep": [ is 2 levels, then a level each
    assert n == JSON_MAX_DEPTH - 2 and back["n"] == [None, 2]


def test_file_names_that_are_not_utf8_are_shown_escaped(fake, tmp_path):
    # Hardening issue, item 9: a code object's file name with byte 0xff
    # ('\udcff' in Python) in the page, the notebook views and the file.
    name = os.fsdecode(b"/tmp/d\xffir/model.py")
    ns: dict = {}
    exec(compile("def grow(fake, cbid, size):\n    return fake.alloc(cbid, size)\n", name, "exec"), ns)
    with memviz.track() as t:
        for _ in range(6):
            ns["grow"](fake, CBID_cuMemAlloc_v2, 8 * MiB)
            t.step(note=os.fsdecode(b"x\xfe"))
    shown = "/tmp/d\\xffir/model.py"
    page = render(t)
    page.encode("utf-8")
    d = embedded_data(page)
    assert [n[1] for n in d["names"] if "model.py" in n[1]] == [shown]
    assert any(r[-1] == shown for r in d["tables"]["lines"]["rows"])
    write(t, tmp_path / "r.html")
    assert json.dumps(shown)[1:-1] in (tmp_path / "r.html").read_bytes().decode("utf-8")
    for view in (tracker_repr_html(t), snapshot_repr_html(t.snapshot()),
                 findings_repr_html(memviz.diagnose(t))):
        view.encode("utf-8")
    assert "d\\xffir" in tracker_repr_html(t)


def test_the_values_at_the_peak_are_read_at_the_nanosecond(fake, tmp_path):
    """The drawn series count in microseconds; a peak and the free right after
    it (here in C, a few hundred nanoseconds apart) fall in one. The values
    'at the peak' are read at the peak's own nanosecond, so the device line
    there is the peak, not what the free left (test_report_glance once saw
    8 MiB less under load)."""
    path = tmp_path / "tight.memviz"
    with memviz.track(trace=str(path)):
        base = fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        for _ in range(50):  # an allocation and its free, back to back from C
            fake.lib.fake_alloc_free_loop(CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, 1, 64 * MiB)
        fake.free(CBID_cuMemFree_v2, base)
    tr = memviz.load(str(path))
    chart = embedded_data(render(tr))["timeline"]["charts"][0]
    assert chart["peak"]["v"] == tr.totals()[0]["peak"] == 72 * MiB
    assert chart["peak"]["values"]["device memory (memviz)"] == 72 * MiB, chart["peak"]
