"""How long the HTML report takes to render, and to open in a browser, for a
run of 1,000,000 allocation events.

    python benchmarks/bench_html.py [--events 1000000] [--no-browser] [--trace]

Builds the run through the capture path (memviz._core._synthetic: the store,
stack capture and interning exactly as a CUPTI callback runs them) from four
call sites: kept 4 KiB buffers, 1 MiB temporaries freed at once, kept 512 B
buffers and 64 KiB temporaries. Then renders memviz.report.render(tracker)
and opens the file in headless Chromium (Debian's chromium + chromedriver
through Selenium), timing from navigation until the page's script has drawn
everything. With --trace the run is also streamed to a .memviz file, loaded
with memviz.load and rendered from there. Prints JSON.

Targets: render < 5 s on 2 cores, page open < 2 s.
"""

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import memviz  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.report import render  # noqa: E402


def kept_small(n):
    _core._synthetic(0x100000000000, 4096, False, n)


def temporaries(n):
    _core._synthetic(0x200000000000, 1 << 20, True, n)


def kept_tiny(n):
    _core._synthetic(0x300000000000, 512, False, n)


def medium_temporaries(n):
    _core._synthetic(0x400000000000, 64 << 10, True, n)


def build(events, trace_path=None):
    """A stopped tracker that saw ``events`` allocation + free events."""
    kept, pairs = int(events * 0.15), int(events * 0.30)
    tiny = int(events * 0.10)
    medium = (events - kept - 2 * pairs - tiny) // 2
    kwargs = {"gpu": False}
    if trace_path:
        kwargs["trace"] = trace_path
    with memviz.track(**kwargs) as t:
        kept_small(kept)
        temporaries(pairs)
        kept_tiny(tiny)
        medium_temporaries(medium)
    return t, kept + 2 * pairs + tiny + 2 * medium


def timed_render(obj):
    start = time.perf_counter()
    page = render(obj, title="memviz benchmark")
    return page, time.perf_counter() - start


def open_in_chromium(path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return {"skipped": "pip install selenium"}
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not binary or not driver_path:
        return {"skipped": "apt-get install -y chromium chromium-driver"}
    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        d.get("about:blank")  # the browser's own start-up is not the page's cost
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            d.get("file://" + path)
            while not d.execute_script("return document.querySelector('.mvz').getAttribute('data-ready')"):
                time.sleep(0.005)
            wall = time.perf_counter() - start
            nav = d.execute_script(
                "var t = performance.getEntriesByType('navigation')[0];"
                "return [t.domContentLoadedEventEnd, t.loadEventEnd];")
            runs.append({"wall_s": round(wall, 3), "dom_content_loaded_ms": round(nav[0], 1),
                         "load_event_end_ms": round(nav[1], 1)})
        errors = [e for e in d.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        return {"runs": runs, "best_wall_s": min(r["wall_s"] for r in runs),
                "console_errors": len(errors), "browser": d.capabilities.get("browserVersion")}
    finally:
        d.quit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also render a loaded .memviz trace")
    a = ap.parse_args()
    if a.events < 100:
        ap.error("--events must be at least 100")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
           "cpus": os.cpu_count(), "python": platform.python_version()}
    tmp = tempfile.mkdtemp(prefix="memviz-bench-html-")
    trace_path = os.path.join(tmp, "run.memviz") if a.trace else None
    start = time.perf_counter()
    t, n = build(a.events, trace_path)
    out.update(events=n, build_s=round(time.perf_counter() - start, 3),
               live_at_end=t.totals()[0]["live_count"], peak_bytes=t.peak_bytes(0))
    page, seconds = timed_render(t)
    html_path = os.path.join(tmp, "report.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
    out["tracker"] = {"render_s": round(seconds, 3), "html_bytes": len(page.encode("utf-8"))}
    if not a.no_browser:
        out["tracker"]["chromium"] = open_in_chromium(html_path)
    if trace_path:
        start = time.perf_counter()
        loaded = memviz.load(trace_path)
        out["trace"] = {"file_bytes": os.path.getsize(trace_path),
                        "load_s": round(time.perf_counter() - start, 3)}
        page, seconds = timed_render(loaded)
        out["trace"].update(render_s=round(seconds, 3), html_bytes=len(page.encode("utf-8")))
    out["targets"] = {"render_s": 5, "page_open_s": 2}
    print(json.dumps(out, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
