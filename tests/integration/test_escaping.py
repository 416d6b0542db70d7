"""Text a terminal, a page or JSON cannot take as it is: file names that are
not UTF-8 in `memviz diff` and the pytest plugin's summary, NaN and
infinities in the JSON report and the step files (written as null), and
control characters and bidi overrides from a trace (shown escaped in the
text, HTML and notebook reports).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import memviz
from conftest import HANG, child_env, complete
from fake_cupti import CBID_cuMemAlloc_v2
from memviz.cli.diff import diff_main, diff_text
from memviz.cli.report import main as report_main
from test_pytest_plugin import GPU, run  # (imports torch once, before pytester's inner runs)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
#: a file name with the byte 0xff, as Python sees it (the surrogate \udcff)
ODD = os.fsdecode(b"/tmp/d\xffir/model.py")


def strict_json(text):
    """json.loads that refuses NaN and Infinity (which JSON does not have)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def odd_trace(fake, path, sizes, info=None):
    """A saved trace whose allocations come from a file named ODD, one step each."""
    ns = {}
    exec(compile("def grow(fake, cbid, size):\n    return fake.alloc(cbid, size)\n", ODD, "exec"), ns)
    with memviz.track(torch=False) as t:
        for size in sizes:
            ns["grow"](fake, CBID_cuMemAlloc_v2, size)
            t.step(**(info or {}))
    t.save(str(path))
    return path


# ---- 1. memviz diff with a file name that is not UTF-8 ----------------------------------


def test_diff_of_traces_with_a_file_name_that_is_not_utf8(fake, tmp_path, capsys):
    a = odd_trace(fake, tmp_path / "a.memviz", [MiB])
    b = odd_trace(fake, tmp_path / "b.memviz", [MiB, 2 * MiB])
    out = tmp_path / "d.txt"
    assert diff_main([str(a), str(b), "-o", str(out)]) == 0, capsys.readouterr().err
    text = out.read_bytes().decode("utf-8")
    assert "/tmp/d\\xffir/model.py:2" in text and "+2 MiB" in text
    diff_text(memviz.load(str(a)), memviz.load(str(b))).encode("utf-8")  # stdout too
    out = tmp_path / "d.json"
    assert diff_main([str(a), str(b), "--format", "json", "-o", str(out)]) == 0
    doc = strict_json(out.read_bytes().decode("utf-8"))
    assert doc["devices"][0]["lines"][0]["file"] == ODD  # JSON keeps the name exactly


# ---- 2. NaN and infinities in the JSON report --------------------------------------------


def test_json_report_writes_nan_and_infinity_as_null(fake, tmp_path, capsys):
    trace = odd_trace(fake, tmp_path / "t.memviz", [MiB],
                      info={"loss": float("nan"), "scale": float("inf"), "lr": 0.5})
    out = tmp_path / "r.json"
    assert report_main([str(trace), "--format", "json", "-o", str(out)]) == 0
    doc = strict_json(out.read_text(encoding="utf-8"))
    assert doc["steps"][0]["info"] == {"loss": None, "scale": None, "lr": 0.5}
    assert doc["devices"][0]["top_lines_at_peak"][0]["file"] == ODD  # still lossless


def test_step_files_write_nan_as_null_and_perfetto_stays_json(fake, tmp_path):
    jl, cs, pf = tmp_path / "s.jsonl", tmp_path / "s.csv", tmp_path / "p.json"
    with memviz.track(torch=False) as t:
        t.on_step(jsonl=jl, csv=cs)
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        t.step(loss=float("nan"), scale=float("-inf"), lr=0.5)
    assert strict_json(jl.read_text().splitlines()[0])["info"] == {"loss": None, "scale": None,
                                                                  "lr": 0.5}
    import csv
    with open(cs, newline="", encoding="utf-8") as f:
        row = list(csv.DictReader(f))[0]
    assert strict_json(row["info"]) == {"loss": None, "scale": None, "lr": 0.5}
    t.to_perfetto(str(pf))
    doc = strict_json(pf.read_text(encoding="utf-8"))
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert steps and steps[0]["args"]["lr"] == 0.5  # (the loss is there as the text "nan")


# ---- 3. the pytest plugin's summary with a file name that is not UTF-8 -------------------


def test_pytest_summary_escapes_file_names_that_are_not_utf8(fake):
    from memviz.integrations import pytest_plugin

    lines = []
    rep = type("TR", (), {"write_sep": lambda self, *a, **k: None,
                          "write_line": lambda self, text, **k: lines.append(text)})()
    plugin = pytest_plugin._Runner.__new__(pytest_plugin._Runner)
    plugin.every_test = True
    plugin.capture = lambda: (True, "")
    plugin.config = type("C", (), {"getoption": lambda self, name, default=None: None})()
    plugin.results = [{"nodeid": "t.py::test_\udcff", "peak_bytes": MiB, "leaked_bytes": 0,
                       "top_lines": [{"line": f"{ODD}:2"}]}]
    plugin.pytest_terminal_summary(rep)
    text = "\n".join(lines)
    text.encode("utf-8")
    assert "/tmp/d\\xffir/model.py:2" in text and "t.py::test_\\xff" in text


def test_pytest_failure_report_escapes_file_names_that_are_not_utf8(pytester, fake):
    src = GPU + f"""
ns = {{}}
exec(compile("def grow(fake, cbid, size):\\n    return fake.alloc(cbid, size)\\n", {ODD!r}, "exec"), ns)
kept = []

@pytest.mark.memviz(leaks=True)
def test_leaks():
    kept.append(ns["grow"](fake, CBID_cuMemAlloc_v2, 2 * MiB))
"""
    r = run(pytester, src, "--memviz", "--junitxml=j.xml")
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "Still alive, by line:\n    /tmp/d\\xffir/model.py:2" in out, out
    (pytester.path / "j.xml").read_text(encoding="utf-8").encode("utf-8")


# ---- 6. control characters and bidi overrides from a trace are shown escaped --------------------


OSC52, CLEAR, COLOUR, RLO = "\x1b]52;c;aGVsbG8=\x07", "\x1b[2J\x1b[H", "\x1b[31m", "\u202e"

_HOSTILE = f"""
import sys, threading
import memviz
from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2
fake = FakeCupti()
ns = {{"fake": fake, "CB": CBID_cuMemAlloc_v2}}
exec(compile("def f():\\n    return fake.alloc(CB, 1 << 20)\\n", {f"/tmp/evil{OSC52}{CLEAR}{RLO}.py"!r}, "exec"), ns)
name = {f"fn{COLOUR}{RLO}"!r}
ns["f"].__code__ = ns["f"].__code__.replace(co_name=name, co_qualname=name)


def work():
    with memviz.label({f"label{OSC52}{RLO}" + chr(7) + chr(0x9b) + chr(13)!r}):
        ns["f"]()
with memviz.track(trace=sys.argv[1], torch=False) as t:
    th = threading.Thread(target=work, name={f"thread{CLEAR}{RLO}"!r})
    th.start()
    th.join()
    t.step()
"""


def test_control_characters_and_bidi_overrides_from_a_trace_are_shown_escaped(fake, fake_path, tmp_path):
    """A file name that writes the clipboard (OSC 52) and clears the screen,
    a function name that changes colours, a label with BEL, a C1 CSI and a
    carriage return, a thread name with a right-to-left override: the text
    report, the notebook views and the HTML report show each as an escape,
    never the character itself."""
    from memviz._units import _CONTROL
    from memviz.report import html as page, notebook
    from memviz.report.text import text_report

    script, path = tmp_path / "hostile.py", tmp_path / "hostile.memviz"
    script.write_text(_HOSTILE)
    p = subprocess.run([sys.executable, str(script), str(path)], cwd=tmp_path, env=child_env(fake_path),
                       capture_output=True, text=True, timeout=HANG)
    assert p.returncode == 0, p.stderr
    loaded = complete(str(path))
    a = next(a for a in loaded.snapshot().allocations if a.size == MiB)
    assert RLO in a.label and any(OSC52 in f.filename for f in a.traceback)  # kept as they are
    outputs = {"text": text_report(loaded, outside={}), "notebook": loaded._repr_html_(),
               "notebook snapshot": notebook.snapshot_repr_html(loaded.snapshot()),
               "html": page.render(loaded)}
    for what, out in outputs.items():
        raw = {c for c in _CONTROL.findall(out) if c not in ("\n" if what == "text" else "\n\t")}
        assert not raw, (what, raw)
    text = outputs["text"]
    assert "\\x1b]52;c;aGVsbG8=\\x07" in text and "\\u202e" in text, text
    assert "\\u202e" in outputs["html"] and "\\x1b" in outputs["notebook"]
