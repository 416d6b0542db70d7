"""A report that reads at a glance (issue 28, item 3), checked in a real
headless Chromium on the sample shipped with memviz and on a run recorded
through ``memviz run`` with the CUPTI test double:

* the time axis opens where memory moves, or on the steps when there are some;
* each chart is as tall as what it holds (a 4-byte pinned-host chart is a strip);
* the icicle starts at the user's script, not at runpy's or memviz's frames;
* the step line of memviz's bytes says so (it is not the device's total);
* the driver's "memory outside" figure is in the HTML (at the top) and JSON;
* the charts' numbers are the report's totals;
* ``memviz report`` on the sample says it is a sample and shows no path of
  the machine it was recorded on.

Browser tests skip, saying what to install, before selenium is imported
(tests/integration/test_html_report.py's need_browser).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import memviz
from conftest import ROOT, line_of
from memviz._units import format_size
from memviz.capture import cupti as _capture
from memviz.__main__ import main as cli_main
from memviz.cli.report import json_report
from memviz.report import render
from memviz.report.text import text_report
from test_html_report import _browser, embedded_data, need_browser, open_page, save_artifact

MiB = 1 << 20
SAMPLE = ROOT / "memviz" / "data" / "sample.memviz"
#: the shipped sample is a small training run (examples/train_sample.py), and
#: the line of its module that runs it
SCRIPT = "examples/train_sample.py"
MAIN_LINE = line_of(str(ROOT / SCRIPT), "sys.exit(main())")
HELD = 600 * MiB  # what the driver says the recorded process held (the run's script says so)
QUIET_S = 0.5  # the run's quiet start (an import), before any memory moves
STEPS = 8
#: paths of the machine the shipped sample was recorded on, and of any machine
MACHINE_PATH = re.compile(r"(?<![\w.])/(root|opt|home|work|usr|tmp|var)/")


def _units(text):
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


@pytest.fixture(scope="module")
def browser():
    need_browser()  # skips, saying what to install, before selenium is imported
    b = _browser()
    yield b
    b.quit()


def _page(browser, tmp_path, trace, name):
    from selenium.webdriver.common.by import By

    path = tmp_path / name
    path.write_text(render(trace), encoding="utf-8")
    browser.get_log("browser")
    open_page(browser, path)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
    charts = {int(c.get_attribute("data-device")): c
              for c in browser.find_elements(By.CSS_SELECTOR, "svg.timeline")}
    return embedded_data(path.read_text(encoding="utf-8")), charts


def _moves_us(trace):
    """(first, last) allocation or free of the run, microseconds from its start."""
    stamps = [p[0] for p in trace.timeline()]
    return (min(stamps) - trace.started_ns) // 1000, (max(stamps) - trace.started_ns) // 1000


def _drawn(chart, when):
    """{line name: bytes} a chart's row of values 'at the peak' or 'at the end' shows."""
    from selenium.webdriver.common.by import By

    wrap = chart.find_element(By.XPATH, "ancestor::div[@class='chart']")
    row = wrap.find_element(By.CSS_SELECTOR, f'p.values[data-when="{when}"]')
    return {s.get_attribute("data-name"): int(s.get_attribute("data-bytes"))
            for s in row.find_elements(By.TAG_NAME, "span")}


def _check_numbers(browser, charts, trace):
    """The charts and the summary show the report's totals; the peak is inside the view."""
    from selenium.webdriver.common.by import By

    totals = trace.totals()
    doc = json_report(trace)
    for d in doc["devices"]:
        dev, chart = d["device"], charts[d["device"]]
        assert _drawn(chart, "at the peak")["device memory (memviz)"] == totals[dev]["peak"] == d["peak"]
        assert _drawn(chart, "at the end")["device memory (memviz)"] == totals[dev]["current"] == d["current"]
        assert chart.find_elements(By.CSS_SELECTOR, "circle.peak"), f"{d['name']}: the peak is out of view"
        top = _units(chart.find_elements(By.CSS_SELECTOR, "g.axis text.ytick")[-1].text)
        assert totals[dev]["peak"] <= top < 2 * totals[dev]["peak"]
    rows = browser.find_elements(By.CSS_SELECTOR, "#mvz-summary table tbody tr")
    shown = {r.find_elements(By.TAG_NAME, "td")[0].text: r.find_elements(By.TAG_NAME, "td")[2]
             .get_attribute("title") for r in rows}
    assert shown == {d["name"]: f"{d['peak']:,} bytes" for d in doc["devices"]}


def _check_heights(charts, trace):
    """Each chart's height follows what it holds: the device holding the most
    gets the full height, a 4-byte pinned-host chart a strip."""
    totals = trace.totals()
    heights = {dev: int(c.get_attribute("height")) for dev, c in charts.items()}
    most = max(totals, key=lambda d: totals[d]["peak"])
    small = [d for d in totals if totals[d]["peak"] < totals[most]["peak"] / 1000]
    for d in small:  # a few bytes (pinned host memory): a strip
        assert heights[d] < 0.5 * heights[most], heights
    order = sorted(heights, key=lambda d: totals[d]["peak"])
    assert [heights[d] for d in order] == sorted(heights.values()), heights


def _icicle_rows(browser):
    """The icicle's labels by row, top (the root) first."""
    from selenium.webdriver.common.by import By

    rows = {}
    for g in browser.find_elements(By.CSS_SELECTOR, "svg.flame g"):
        rect = g.find_element(By.TAG_NAME, "rect")
        texts = g.find_elements(By.TAG_NAME, "text")
        if texts:
            rows.setdefault(int(float(rect.get_attribute("y")) // 18), []).append(texts[0].text)
    return [rows[k] for k in sorted(rows)]


# ---- the sample shipped with memviz ------------------------------------------------


def test_the_sample_page_reads_at_a_glance(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    trace = memviz.load(str(SAMPLE))
    assert trace.sample is not None and trace.sample["script"] == SCRIPT
    d, charts = _page(browser, tmp_path, trace, "sample.html")

    # Headed as a sample; no path of the machine it was recorded on, on the page or in its data.
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("SAMPLE (recorded on ")
    assert trace.sample["machine"] in browser.find_element(By.CSS_SELECTOR, "#mvz-summary p.sample").text
    body = browser.find_element(By.TAG_NAME, "body").text
    assert not MACHINE_PATH.search(body), MACHINE_PATH.search(body)
    assert d["meta"]["library"] == "libcupti.so.13"
    assert not [n for n in d["names"] if MACHINE_PATH.search(n[1])]

    # The axis opens where memory moves, not on the whole run.
    first, last = _moves_us(trace)
    run = (trace.stopped_ns - trace.started_ns) // 1000
    for chart in charts.values():
        start, end = int(chart.get_attribute("data-start")), int(chart.get_attribute("data-end"))
        assert first - 0.1 * (last - first) <= start <= first, (start, first)
        assert last <= end <= run and end - start <= 1.2 * (last - first), (start, end, first, last, run)
        if start > 0:
            assert chart.find_elements(By.CSS_SELECTOR, "text.xtick")[0].text != "0.00 ms"
    hint = browser.find_element(By.CSS_SELECTOR, "#mvz-timeline p.hint")
    opened = int(charts[0].get_attribute("data-start"))
    # memory moves from the run's first milliseconds to its end: the whole run is where it moves
    assert ("the steps" if trace.steps else "where memory moves") in hint.text if opened else \
        hint.text.startswith("showing the whole run")
    _check_numbers(browser, charts, trace)
    _check_heights(charts, trace)

    # The icicle starts at the script; the launcher's frames are left out, and named.
    rows = _icicle_rows(browser)
    # (beside it, what threads without Python frames hold: the backward's engine thread)
    assert rows[0] == ["all"] and rows[1][0] == f"<module> (train_sample.py:{MAIN_LINE})", rows[:3]
    assert all(r.startswith("<thre") for r in rows[1][1:]), rows[1]
    assert not [t for row in rows for t in row if "record_sample" in t or "runpy" in t]
    note = browser.find_element(By.CSS_SELECTOR, "#mvz-flame p.launchers").text
    assert "record_sample.py" in note and "runpy" in note
    root = d["flames"][0]["tree"]
    assert d["names"][root[3][0][0]] == ["<module>", SCRIPT, MAIN_LINE]

    # The driver's figure beyond memviz's record, at the top of the page as in the JSON and text.
    outside = json_report(trace)["outside"]["devices"][0]
    line = browser.find_element(By.CSS_SELECTOR, "#mvz-summary p.outside-summary")
    assert int(line.get_attribute("data-held")) == outside["held"] == trace.outside[0][0]
    assert int(line.get_attribute("data-beyond")) == outside["beyond"] == outside["held"] - outside["recorded"]
    beyond = format_size(outside["beyond"])
    assert f"{beyond} beyond its record" in line.text
    assert beyond in browser.find_element(By.ID, "mvz-outside").text
    assert f"{beyond} outside" in text_report(trace, outside=trace.outside)

    # The whole run is a click away, and double-click comes back to where memory moves.
    if opened:
        browser.find_element(By.CSS_SELECTOR, "#mvz-timeline button.whole-run").click()
        chart = browser.find_elements(By.CSS_SELECTOR, "svg.timeline")[0]
        assert chart.find_elements(By.CSS_SELECTOR, "text.xtick")[0].text == "0.00 ms"
        assert hint.get_attribute("data-view") == "whole"
        ActionChains(browser).double_click(chart.find_element(By.CSS_SELECTOR, "rect.overlay")).perform()
        chart = browser.find_elements(By.CSS_SELECTOR, "svg.timeline")[0]
        assert int(chart.get_attribute("data-start")) == opened > 0
    save_artifact(browser, tmp_path, "glance_sample.png")


def test_memviz_report_on_the_sample_says_so_and_shows_no_machine_path(tmp_path, capsys):
    copy = tmp_path / "copy.memviz"
    shutil.copy(SAMPLE, copy)
    meta = json.loads((SAMPLE.parent / "sample.json").read_text())
    for path in (SAMPLE, copy):  # the shipped file, and a copy of it elsewhere
        assert cli_main(["report", str(path)]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"SAMPLE (recorded on {meta['date']}, not on this machine): {meta['script']}\n")
        assert "not this machine's data" in " ".join(text.split()) and meta["machine"] in " ".join(text.split())
        assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text)
        assert "capture: CUPTI libcupti.so.13 " in text
        # its lines as recorded, wherever it is read from (tmp_path has no examples/)
        gelu = line_of(str(ROOT / SCRIPT), "h = F.gelu(self.up(self.ln2(x)))")
        assert f"{SCRIPT}:{gelu}" in text and "h = F.gelu(self.up(self.ln2(x)))" in text
        # a training run: steps, the backward by its forward line, and a finding naming the lines
        assert "Steps: 12 recorded" in text and re.search(r"train_sample\.py:\d+ \(backward: \w+Backward0\)", text)
        assert "[growth] PyTorch's allocated memory" in text and f"{SCRIPT}:{gelu}: +" in text
        assert "<no Python frames>" not in text.split("Findings")[1].split("Memory outside")[0]
        assert cli_main(["report", str(path), "--format", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["sample"] == {k: meta[k] for k in ("machine", "date", "script")}
        assert doc["command"] == SCRIPT
        assert doc["outside"]["devices"][0]["held"] > doc["outside"]["devices"][0]["recorded"]
        assert not MACHINE_PATH.search(json.dumps({k: v for k, v in doc.items() if k != "trace"}))


# ---- a run through `memviz run`, with the CUPTI test double ---------------------------------


RUN_SCRIPT = """\
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, CBID_cuMemHostAlloc
    import memviz
    from memviz.capture import device as _device

    # What the driver would say the process holds (the CUPTI test double has no NVML).
    _device.process_device_memory = lambda: {{0: ({held}, _device.SOURCE_NVML)}}
    fake = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"])
    memviz.frames.add_library_path({fake_dir!r})
    MiB = 1 << 20
    time.sleep({quiet})  # an import: nothing moves


    def load_model():
        return [fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB) for _ in range(4)]


    history = []


    def train_step():
        acts = [fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB) for _ in range(6)]
        history.append(fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB))
        for a in acts:
            fake.free(CBID_cuMemFree_v2, a)


    def main():
        weights = load_model()
        fake.alloc(CBID_cuMemHostAlloc, 4)
        t = memviz.active_tracker()
        for _ in range({steps}):
            train_step()
            time.sleep(0.003)
            t.step()
        return weights


    kept = main()
    time.sleep({quiet})  # the end of the script: nothing moves
"""


@pytest.fixture(scope="module")
def recorded_run(fake_path, tmp_path_factory):
    """A training loop with a quiet start and end, run by `memviz run -o`."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "train.py").write_text(textwrap.dedent(RUN_SCRIPT.format(
        tests=str(ROOT / "tests"), fake_dir=str(ROOT / "tests" / "fake_cupti"), held=HELD, quiet=QUIET_S,
        steps=STEPS)))
    env = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                _capture.ENV_LIBRARY: fake_path})
    p = subprocess.run([sys.executable, "-m", "memviz", "run", "-o", "run.memviz", "train.py"], cwd=folder,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return memviz.load(str(folder / "run.memviz"))


def test_a_recorded_run_reads_at_a_glance(browser, recorded_run, tmp_path):
    from selenium.webdriver.common.by import By

    trace = recorded_run
    assert getattr(trace, "sample", None) is None and len(trace.steps) == STEPS
    d, charts = _page(browser, tmp_path, trace, "run.html")

    # The axis opens on the steps: not on the quiet start or end.
    first, _last = _moves_us(trace)
    marks = [(s.timestamp_ns - trace.started_ns) // 1000 for s in trace.steps]
    run = (trace.stopped_ns - trace.started_ns) // 1000
    assert first > QUIET_S * 1e6 * 0.9 and run - marks[-1] > QUIET_S * 1e6 * 0.9
    span = marks[-1] - first
    for chart in charts.values():
        start, end = int(chart.get_attribute("data-start")), int(chart.get_attribute("data-end"))
        assert first - 0.1 * span <= start <= first, (start, first)
        assert marks[-1] <= end <= marks[-1] + 0.1 * span, (end, marks)
    assert "the steps" in browser.find_element(By.CSS_SELECTOR, "#mvz-timeline p.hint").text
    _check_numbers(browser, charts, trace)
    _check_heights(charts, trace)

    # The step line of memviz's bytes says what it is; nothing claims the device's total.
    legend = browser.find_element(By.CSS_SELECTOR, "#mvz-timeline .legend").text
    assert "device memory (memviz) at step ends" in legend and "device total" not in legend
    step = next(s for s in d["timeline"]["charts"][0]["series"] if s["kind"] == "step")
    assert step["name"] == "device memory (memviz) at step ends"
    assert step["v"] == [s.devices[0].current for s in trace.steps]
    plot_legend = browser.find_element(By.CSS_SELECTOR, "#mvz-steps .legend").text
    assert "device memory (memviz) at the step\u2019s end" in plot_legend and "device total" not in plot_legend
    heights = {int(s.get_attribute("data-device")): int(s.get_attribute("height"))
               for s in browser.find_elements(By.CSS_SELECTOR, "svg.step-plot")}
    assert heights[-1] < 0.6 * heights[0], heights

    # The icicle starts at the script memviz run ran; memviz's and runpy's frames are named, not drawn.
    rows = _icicle_rows(browser)
    assert rows[1] == [f"<module> (train.py:{_line(trace, 'kept = main()')})"], rows[:3]
    assert not [t for row in rows for t in row if "runpy" in t or "run.py" in t or "__main__" in t]
    note = browser.find_element(By.CSS_SELECTOR, "#mvz-flame p.launchers").text
    assert "memviz/cli/run.py" in note and "runpy" in note

    # The driver's figure: in the JSON, at the top of the page and in its section.
    current = trace.totals()[0]["current"]
    outside = json_report(trace)["outside"]["devices"][0]
    assert (outside["held"], outside["recorded"], outside["beyond"]) == (HELD, current, HELD - current)
    line = browser.find_element(By.CSS_SELECTOR, "#mvz-summary p.outside-summary")
    assert int(line.get_attribute("data-beyond")) == HELD - current
    assert f"{format_size(HELD - current)} beyond its record" in line.text
    assert "600 MiB" in browser.find_element(By.ID, "mvz-outside").text
    save_artifact(browser, tmp_path, "glance_run.png")


def _line(trace, text):
    """The line number of ``text`` in the recorded script."""
    path = os.path.join(os.path.dirname(trace.path), "train.py")
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == text)


def test_a_stack_without_a_launcher_keeps_its_root():
    """`python script.py` has no runpy frame: its stacks are drawn whole."""
    from types import SimpleNamespace

    from memviz.report._data import _flame, _Names, _script_starts

    def frame(name, filename, lineno):
        return SimpleNamespace(name=name, filename=filename, lineno=lineno, compiled=None)

    plain = [frame("<module>", "train.py", 9), frame("main", "train.py", 5)]
    launched = [frame("<module>", "/x/launch.py", 3), frame("_run_code", "<frozen runpy>", 88)] + plain
    old = [frame("_run_code", "/usr/lib/python3.10/runpy.py", 86)] + plain
    assert _script_starts(plain) == 0 and _script_starts(launched) == 2 and _script_starts(old) == 1
    assert _script_starts([frame("_run_code", "<frozen runpy>", 88)]) == 0  # nothing below it: kept

    names, launchers = _Names(), []
    # a plain list is a stack innermost first (memviz.model.traceback.innermost_first)
    buckets = [[MiB, 1, SimpleNamespace(traceback=list(reversed(frames)), device=0)]
               for frames in (plain, launched)]
    tree = _flame(buckets, names, None, launchers)
    assert [names.table[c[0]] for c in tree[3]] == [["<module>", "train.py", 9]]  # both stacks, one root
    assert tree[3][0][1] == 2 * MiB and launchers == ["launch.py", "runpy"]
