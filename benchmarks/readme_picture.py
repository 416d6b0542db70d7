"""Render a trace's HTML report and screenshot it in headless Chromium: docs/report.png.

    python benchmarks/readme_picture.py                      # memviz/data/sample.memviz
    python benchmarks/readme_picture.py run.memviz -o shot.png --width 1280 --height 1400

The README shows docs/report.png; regenerate it whenever the sample trace is
re-recorded (examples/record_sample.py). Needs Selenium, Chromium and
chromedriver (apt-get install -y chromium chromium-driver; pip install
selenium); MEMVIZ_CHROMIUM and MEMVIZ_CHROMEDRIVER name other binaries, as
for tests/integration/test_html_report.py. The page is opened from a temporary file, the
screenshot is taken once its script has drawn everything, and the PNG is
written to a temporary file first, then renamed over the old one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "memviz", "data", "sample.memviz")


def _browser(width, height):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise SystemExit("readme_picture.py needs Selenium: pip install selenium") from None
    binary = os.environ.get("MEMVIZ_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = os.environ.get("MEMVIZ_CHROMEDRIVER") or shutil.which("chromedriver")
    if not binary or not driver:
        raise SystemExit("readme_picture.py needs Chromium and chromedriver: "
                         "apt-get install -y chromium chromium-driver")
    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--disable-extensions",
                "--no-first-run", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def picture(trace_path, out, width=1280, height=1400, title=None):
    """Write the PNG of ``trace_path``'s HTML report to ``out``; returns ``out``.

    memviz's sample (or a copy) is marked by memviz.load (LoadedTrace.sample):
    its page is headed as a sample, its lines read as recorded
    (sample.json has the script's text), and no path of the machine it was
    recorded on is shown."""
    import memviz
    from memviz.report import html

    page = html.render(memviz.load(trace_path), title=title)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        page_path = os.path.join(tmp, "report.html")
        with open(page_path, "w", encoding="utf-8") as f:
            f.write(page)
        browser = _browser(width, height)
        try:
            browser.get("file://" + page_path)
            for _ in range(500):
                if browser.execute_script(
                        "return document.querySelector('.mvz').getAttribute('data-ready')"):
                    break
                time.sleep(0.02)
            else:
                raise SystemExit("readme_picture.py: the report never finished drawing; browser "
                                 f"console: {browser.get_log('browser')}")
            shot = os.path.join(tmp, "report.png")
            if not browser.save_screenshot(shot):
                raise SystemExit("readme_picture.py: the browser took no screenshot")
        finally:
            browser.quit()
        fd, part = tempfile.mkstemp(prefix=".report.", suffix=".png", dir=os.path.dirname(out))
        os.close(fd)
        shutil.copyfile(shot, part)
        os.chmod(part, 0o644)
        os.replace(part, out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="readme_picture.py", description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", default=SAMPLE, help="default: memviz/data/sample.memviz")
    parser.add_argument("-o", "--output", default=os.path.join(ROOT, "docs", "report.png"))
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1400)
    parser.add_argument("--title", default=None, help="the page's title (default: the trace's)")
    opts = parser.parse_args(argv)
    out = picture(opts.trace, opts.output, opts.width, opts.height, opts.title)
    print(f"readme_picture.py: wrote {out} ({os.path.getsize(out):,} bytes)")


if __name__ == "__main__":
    sys.exit(main())
