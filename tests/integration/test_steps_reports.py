"""Steps and findings in every report: `memviz run`'s, `memviz report` in text,
JSON and HTML (drawn in a real headless Chromium), and the notebook view.

A leaking loop is fired through the libcupti test double: each step keeps 8 MiB
more (and uses a 64 MiB workspace it frees), with t.step() after each step, so
memviz.diagnose() finds "rises 8 MiB per step" and names the line that keeps it.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memviz
from conftest import line_of
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
from memviz.capture import cupti as _capture
from memviz.cli.report import json_report, main as report_main
from memviz.report.summary import step_summary
from memviz.report.text import WIDTH, text_report
from memviz.report import render, tracker_repr_html

MiB = 1 << 20
THIS = os.path.abspath(__file__)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def leaky_step(fake, keep):
    tmp = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB)  # WORKSPACE
    keep.append(fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB))  # LEAK
    fake.free(CBID_cuMemFree_v2, tmp)


def leaky_run(fake, steps=STEPS, trace=None):
    keep = []
    with memviz.track(torch=False, trace=trace) as t:
        for i in range(steps):
            leaky_step(fake, keep)
            t.step(loss=1.0 / (i + 1))
    return t


LEAK = line_of(THIS, "# LEAK")


def flat(text):
    return " ".join(text.split())


def section(report, title):
    """The lines of a report section, from its title to the next blank line."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def assert_text_has_steps_and_growth(report, leak_file=THIS, leak_line=LEAK, steps=STEPS):
    assert not [line for line in report.splitlines() if len(line) > WIDTH]
    steps_lines = section(report, "Steps:")
    head = steps_lines[0]
    assert f"{steps} recorded" in head and f"steps 0 to {steps - 1}" in head, steps_lines
    rows = {line.split("  ")[1].strip(): line for line in steps_lines[2:] if line.startswith("  cuda:")}
    cur = rows["cuda:0 current"].split()
    # first, last, min, max, trend per step
    assert cur[2:] == ["8", "MiB", f"{8 * steps}", "MiB", "8", "MiB", f"{8 * steps}", "MiB",
                       "+8", "MiB"], rows
    peak = rows["cuda:0 peak"].split()
    assert peak[2:4] == ["72", "MiB"] and peak[4:6] == [f"{8 * steps + 64}", "MiB"], rows
    assert peak[-2:] == ["+8", "MiB"]
    findings = section(report, "Findings")
    text = flat("\n".join(findings))
    assert "[growth] Live GPU memory on cuda:0 rises 8 MiB per step" in text
    evidence = [line for line in findings if f":{leak_line}: +" in line]
    assert evidence, findings
    assert f"{os.path.basename(leak_file)}:{leak_line}: +{8 * (steps - 3)} MiB (grew in" in evidence[0]
    src = findings[findings.index(evidence[0]) + 1]
    assert "keep.append(" in src  # the line's source under it
    assert "fix: Find what these lines keep" in text


# ---- the text report ------------------------------------------------------------


def test_text_report_of_a_live_tracker_has_steps_and_findings(fake):
    t = leaky_run(fake)
    report = text_report(t, outside={})
    assert_text_has_steps_and_growth(report)
    # The sections sit between what PyTorch/the failures say and memory outside.
    assert report.index("Steps:") < report.index("Findings") < report.index("Memory outside")


def test_without_steps_the_reports_say_nothing_extra(fake, tmp_path):
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
    report = text_report(t, outside={})
    assert "Steps" not in report and "Findings" not in report
    doc = json_report(t)
    assert doc["step_summary"] is None and doc["findings"] == [] and doc["findings_error"] is None
    page_data = _embedded(render(t))
    assert page_data["step_plot"] is None
    assert "Steps" not in tracker_repr_html(t) and "findings" not in tracker_repr_html(t)


def test_steps_without_findings_say_so(fake):
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, 16 * MiB)
        for _ in range(8):
            t.step()
    report = text_report(t, outside={})
    steps_lines = section(report, "Steps:")
    assert "8 recorded" in steps_lines[0]
    assert steps_lines[2].split()[2:] == ["16", "MiB"] * 4 + ["+0", "B"], steps_lines
    assert section(report, "Findings")[0].startswith("Findings (memviz.diagnose): none")


@pytest.mark.parametrize("steps", [1, 7])
def test_too_few_steps_are_said_to_be_too_few(fake, steps):
    t = leaky_run(fake, steps=steps)
    report = text_report(t, outside={})
    assert f"{steps} recorded" in section(report, "Steps:")[0]
    findings = flat(" ".join(section(report, "Findings")))
    assert f"none; {steps} step{' is' if steps == 1 else 's are'} too few" in findings
    assert "skip 3 warm-up steps and need 5 more" in findings
    cur = section(report, "Steps:")[2].split()
    if steps == 1:  # no trend from one step
        assert cur[2:] == ["8", "MiB"] * 4 + ["-"]
        assert "trend:" not in " ".join(section(report, "Steps:"))


def test_a_diagnosis_that_fails_is_said_and_the_report_still_comes(fake, monkeypatch):
    t = leaky_run(fake, steps=6)

    def broken():
        raise RuntimeError("rule exploded")

    monkeypatch.setattr(t, "diagnose", broken)
    report = text_report(t, outside={})
    assert "6 recorded" in report
    assert "diagnose() failed: RuntimeError: rule exploded" in flat(report)
    doc = json_report(t)
    assert doc["findings"] == [] and "rule exploded" in doc["findings_error"]


def test_summary_per_device_with_min_max_and_trend(fake):
    """Two devices; cuda:1 goes up and down, so min/max are not first/last."""
    keep = []
    levels = [3, 1, 4, 1, 5, 9, 2, 6]  # MiB live on cuda:1 at each step's end
    with memviz.track(torch=False) as t:
        live1 = []
        for i, level in enumerate(levels):
            keep.append(fake.alloc(CBID_cuMemAlloc_v2, MiB))
            fake.set_device(1)
            for a in live1:
                fake.free(CBID_cuMemFree_v2, a)
            live1 = [fake.alloc(CBID_cuMemAlloc_v2, MiB) for _ in range(level)]
            fake.set_device(0)
            t.step()
    s = step_summary(t)
    assert s["count"] == 8 and (s["first_step"], s["last_step"]) == (0, 7)
    assert s["trend_from_step"] == 3  # after the warm-up diagnose() skips
    by = {d["name"]: d for d in s["devices"]}
    assert set(by) == {"cuda:0", "cuda:1"}
    c0 = by["cuda:0"]["current"]
    assert (c0["first"], c0["last"], c0["min"], c0["max"], c0["trend_per_step"]) == \
        (MiB, 8 * MiB, MiB, 8 * MiB, MiB)
    c1 = by["cuda:1"]["current"]
    assert (c1["first"], c1["last"], c1["min"], c1["max"]) == (3 * MiB, 6 * MiB, MiB, 9 * MiB)
    assert (c1["min_step"], c1["max_step"]) == (1, 5)
    xs = [3, 4, 5, 6, 7]
    ys = [v * MiB for v in levels[3:]]
    mx, my = sum(xs) / 5, sum(ys) / 5
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert c1["trend_per_step"] == round(slope)
    p1 = by["cuda:1"]["peak"]  # the old blocks are freed before the new ones come
    assert p1["max"] == 9 * MiB and p1["max_step"] == 5
    assert "allocated" not in by["cuda:0"]  # no PyTorch numbers: not made up
    report = text_report(t, outside={})
    assert "cuda:1 current" in report and "cuda:1 peak" in report


# ---- memviz report: text, JSON, HTML of a saved trace -------------------------------


def _embedded(page):
    import re

    m = re.search(r'<script type="application/json" class="memviz-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


@pytest.fixture(params=["saved", "streamed"])
def leaky_trace(request, fake, tmp_path):
    path = tmp_path / "leak.memviz"
    if request.param == "saved":
        leaky_run(fake).save(str(path))
    else:
        leaky_run(fake, trace=str(path))
    return path


def test_memviz_report_text_json_and_html_show_the_growth(leaky_trace, tmp_path, capsys):
    assert report_main([str(leaky_trace)]) == 0
    text = capsys.readouterr().out
    assert_text_has_steps_and_growth(text)

    out = tmp_path / "r.json"
    assert report_main([str(leaky_trace), "--format", "json", "-o", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert len(doc["steps"]) == STEPS  # the records, as before
    s = doc["step_summary"]
    assert s["count"] == STEPS and s["devices"][0]["name"] == "cuda:0"
    cur = s["devices"][0]["current"]
    assert (cur["first"], cur["last"], cur["trend_per_step"]) == (8 * MiB, 8 * STEPS * MiB, 8 * MiB)
    assert doc["findings_error"] is None
    growth = next(f for f in doc["findings"] if f["kind"] == "growth")
    assert "rises 8 MiB per step" in growth["message"] and growth["device"] == 0
    assert growth["step_ranges"] == [[3, STEPS - 1]]
    assert growth["numbers"]["bytes_per_step"] == 8 * MiB
    line = growth["lines"][0]
    assert (line["file"], line["line"]) == (THIS, LEAK)
    assert line["location"] == f"{THIS}:{LEAK}" and line["bytes"] == 8 * (STEPS - 3) * MiB
    assert line["note"].startswith("grew in")
    assert growth["fix"]

    html_out = tmp_path / "r.html"
    assert report_main([str(leaky_trace), "--format", "html", "-o", str(html_out)]) == 0
    d = _embedded(html_out.read_text(encoding="utf-8"))
    plot = d["step_plot"]
    assert plot["steps"] == list(range(STEPS))
    dev = plot["devices"][0]
    assert dev["name"] == "cuda:0"
    assert dev["series"]["current"] == [8 * (i + 1) * MiB for i in range(STEPS)]
    assert dev["series"]["peak"] == [(8 * i + 72) * MiB for i in range(STEPS)]
    growth = next(f for f in d["findings"] if f["kind"] == "growth")
    assert growth["step_ranges"] == [[3, STEPS - 1]] and growth["device"] == 0
    assert any(f":{LEAK}: +" in ln for ln in growth["lines"])


# ---- memviz run's report and its trace ----------------------------------------------


def test_memviz_run_report_shows_the_growth_and_its_trace_does_too(tmp_path, fake_path):
    body = f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import memviz
        from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
        lib = FakeCupti({fake_path!r}).lib
        t = memviz.active_tracker()
        keep = []
        for i in range({STEPS}):
            tmp = lib.fake_alloc(CBID_cuMemAlloc_v2, 64 << 20, 0, 0)
            keep.append(lib.fake_alloc(CBID_cuMemAlloc_v2, 8 << 20, 0, 0))  # KEEPS
            lib.fake_free(CBID_cuMemFree_v2, tmp, 0, 0)
            t.step()
    """
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != _capture.ENV_LIBRARY}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env[_capture.ENV_LIBRARY] = fake_path
    p = subprocess.run([sys.executable, "-m", "memviz", "run", "-o", "run.memviz", "train.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    report = p.stderr[p.stderr.index("memviz report"):p.stderr.index("memviz: trace written")]
    keeps = line_of(str(path), "# KEEPS")
    assert_text_has_steps_and_growth(report, str(path), keeps)
    p2 = subprocess.run([sys.executable, "-m", "memviz", "report", "run.memviz"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=120)
    assert p2.returncode == 0, p2.stderr
    assert_text_has_steps_and_growth(p2.stdout, str(path), keeps)
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "memviz", "report", "run.memviz", "--format", "json"], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout)
    growth = next(f for f in doc["findings"] if f["kind"] == "growth")
    assert (growth["lines"][0]["file"], growth["lines"][0]["line"]) == (str(path), keeps)


# ---- the notebook view -----------------------------------------------------------------


def test_notebook_view_of_a_tracker_and_a_loaded_trace_shows_steps_and_findings(fake, tmp_path):
    t = leaky_run(fake)
    path = tmp_path / "leak.memviz"
    t.save(str(path))
    loaded = memviz.load(str(path))
    for obj in (t, loaded):
        html = obj._repr_html_()
        assert "<script" not in html
        assert "Steps" in html and f"{STEPS} recorded" in html
        assert 'class="mvz-steps"' in html  # the per-step plot (static SVG)
        marks = html.count('class="finding-mark"')
        assert marks >= 1
        assert "rises 8 MiB per step" in html and f"{os.path.basename(THIS)}:{LEAK}" in html
        assert "+8 MiB" in html  # the trend


# ---- the HTML page in a real browser ---------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    from test_html_report import _browser

    b = _browser()
    yield b
    b.quit()


def test_steps_plot_draws_in_chromium_with_the_finding_marked(leaky_trace, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from test_html_report import open_page, save_artifact

    page = tmp_path / "steps.html"
    assert report_main([str(leaky_trace), "--format", "html", "-o", str(page)]) == 0
    browser.get_log("browser")
    open_page(browser, page)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
    steps = browser.find_element(By.ID, "mvz-steps")
    plots = steps.find_elements(By.CSS_SELECTOR, "svg.step-plot")
    assert len(plots) == 1 and plots[0].get_attribute("data-device") == "0"
    plot = plots[0]
    series = {p.get_attribute("data-name"): p.get_attribute("d")
              for p in plot.find_elements(By.CSS_SELECTOR, "path.step-series")}
    assert set(series) == {"current", "peak"}
    for d in series.values():  # one point per step, rising left to right (y grows downwards)
        pts = [tuple(map(float, seg[1:].split())) for seg in d.replace("L", "|L").replace("M", "|M").split("|")
               if seg]
        assert len(pts) == STEPS
        assert [p[0] for p in pts] == sorted(p[0] for p in pts)
        assert [p[1] for p in pts] == sorted((p[1] for p in pts), reverse=True)
    assert len(plot.find_elements(By.CSS_SELECTOR, "circle.step-dot")) == 2 * STEPS
    # The growth finding shades steps 3 to 11: from between steps 2 and 3 to the last step.
    marks = plot.find_elements(By.CSS_SELECTOR, "g.finding-mark[data-kind='growth']")
    assert len(marks) == 1
    assert (marks[0].get_attribute("data-first"), marks[0].get_attribute("data-last")) == ("3", str(STEPS - 1))
    rect = marks[0].find_element(By.TAG_NAME, "rect")
    cur = [tuple(map(float, seg[1:].split())) for seg in
           series["current"].replace("L", "|L").replace("M", "|M").split("|") if seg]
    x0, w = float(rect.get_attribute("x")), float(rect.get_attribute("width"))
    assert cur[2][0] < x0 < cur[3][0] and x0 + w >= cur[-1][0]
    assert "growth" in marks[0].text
    # Hovering the mark tells the finding; the summary table and the cards are there.
    ActionChains(browser).move_to_element(rect).perform()
    tip = browser.find_element(By.CSS_SELECTOR, ".mvz-tip")
    assert "rises 8 MiB per step" in tip.text and "steps 3" in tip.text
    summary = steps.find_element(By.CSS_SELECTOR, "table.narrow").text
    assert "cuda:0 current" in summary and "cuda:0 peak" in summary and "8 MiB" in summary
    card = browser.find_element(By.CSS_SELECTOR, "#mvz-findings .card[data-kind='growth']")
    assert "rises 8 MiB per step" in card.text and f":{LEAK}: +" in card.text
    assert f"steps 3\u2013{STEPS - 1}" in card.text.lower()  # the kind line is upper case (CSS)
    marks[0].click()  # goes to its card
    assert browser.execute_script(
        "var r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= innerHeight", card)
    browser.execute_script("arguments[0].scrollIntoView()", steps)
    shot = save_artifact(browser, tmp_path, "html_report_step_plot.png")
    assert shot.stat().st_size > 10_000
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
