"""``memviz report --format table|stats|summary``: memray's other views of a
trace (memviz/report/views.py), each worked out here from what the trace
was made of; the command line around them (``--top``, ``-o``/``--force``,
several ranks' files, ``--whatif``); control characters of names escaped;
the README's usage block of ``memviz report`` against the parser.

Allocations go through the libcupti test double.
"""

import re
import shutil

import pytest

import memviz
from conftest import ROOT, here
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemAllocHost_v2, CBID_cuMemFree_v2
from memviz.__main__ import main
from memviz.report.summary import short_path
from memviz.report.views import VIEWS, stats_report, summary_report, table_report

MiB = 1 << 20
HERE = short_path(__file__)  # as the reports write it


def weights(fake, kept):
    for _ in range(2):
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, 256 * MiB)); L = here()  # noqa: E702
    return L


def small_buffers(fake, kept):
    for _ in range(6):
        kept.append(fake.alloc(CBID_cuMemAlloc_v2, MiB)); L = here()  # noqa: E702
    return L


def model(fake, kept):
    """Calls both: a line of the user's that owns nothing itself."""
    w = weights(fake, kept); C1 = here()  # noqa: E702
    s = small_buffers(fake, kept); C2 = here()  # noqa: E702
    return w, s, C1, C2


@pytest.fixture
def recorded(fake, tmp_path):
    """A trace: 512 MiB of weights (two allocations, one line), six 1 MiB
    buffers (one line), both called from model(); 64 MiB allocated and freed
    before the peak; 4 KiB of pinned host memory."""
    path = tmp_path / "run.memviz"
    kept = []
    with memviz.track(trace=str(path)) as t:
        tmp = fake.alloc(CBID_cuMemAlloc_v2, 64 * MiB); T = here()  # noqa: E702
        fake.free(CBID_cuMemFree_v2, tmp)
        w, s, c1, c2 = model(fake, kept)
        fake.alloc(CBID_cuMemAllocHost_v2, 4096); H = here()  # noqa: E702
    return {"path": path, "tracker": t, "weights": w, "small": s, "calls": (c1, c2), "temp": T,
            "host": H}


def section(text, head):
    """The lines of ``text`` from the one starting with ``head`` to the next blank one."""
    lines = text.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith(head))
    end = next((k for k in range(i + 1, len(lines)) if not lines[k].strip()), len(lines))
    return lines[i:end]


def test_table_lists_the_lines_live_at_each_peak(recorded):
    trace = memviz.load(str(recorded["path"]))
    text = table_report(trace)
    cuda = section(text, "cuda:0 at its peak, 518 MiB (8 allocations live):")
    assert cuda[1].split() == ["size", "share", "allocations", "line"]
    rows = [r.split() for r in cuda[2:]]
    assert rows == [["512", "MiB", "98.8%", "2", f"{HERE}:{recorded['weights']}", "in", "weights"],
                    ["6", "MiB", "1.2%", "6", f"{HERE}:{recorded['small']}", "in", "small_buffers"]]
    host = section(text, "pinned host at its peak, 4 KiB (1 allocation live):")
    assert host[2].split() == ["4", "KiB", "100.0%", "1", f"{HERE}:{recorded['host']}", "in", "recorded"]
    assert f":{recorded['temp']} " not in text  # freed before the peak
    # --top: the rest summed up in one row
    cut = section(table_report(trace, top=1), "cuda:0 at its peak")
    assert len(cut) == 4 and cut[3].split() == ["6", "MiB", "1.2%", "6", "(1", "more", "lines)"]
    # a tracker, stopped, reads the same
    live = table_report(recorded["tracker"])
    assert live[live.index("\ncuda:0"):] == text[text.index("\ncuda:0"):]


def test_stats_count_the_run_and_the_peak(recorded):
    text = stats_report(memviz.load(str(recorded["path"])), top=1)
    cuda = text.split("cuda:0:", 1)[1].split("pinned host:", 1)[0]
    assert "Whole run: 9 allocations made (582 MiB in all), 1 freed, 0 failed." in cuda
    assert "Peak: 518 MiB; live at the end: 518 MiB (8 allocations)." in cuda
    assert "At the peak: 8 allocations live, 518 MiB." in cuda
    hist = section(cuda.lstrip("\n"), "  At the peak")[2:]
    assert hist[0].strip() == "min: 1 MiB" and hist[-1].strip() == "max: 256 MiB"
    bins = [x.split(":") for x in hist[2:-2]]
    assert len(bins) == 10 and bins[0][0].strip() == "< 1.74 MiB" and bins[-1][0].strip() == "<=256 MiB"
    counts = [int(b[1].split()[0]) for b in bins]
    assert counts[0] == 6 and counts[-1] == 2 and sum(counts) == 8
    assert "#" * 25 in hist[2] and hist[-3].count("#") == round(25 * 2 / 6)
    assert re.search(r"518 MiB +8 +device", cuda)
    # top 1 by size is the weights' line, by count the buffers' line
    assert f"Top 1 line by size:\n    - {HERE}:{recorded['weights']} in weights -> 512 MiB" in cuda
    assert f"Top 1 line by number of allocations:\n    - {HERE}:{recorded['small']} in small_buffers -> 6" \
        in cuda
    host = text.split("pinned host:", 1)[1]
    assert "Whole run: 1 allocation made (4 KiB in all), 0 freed, 0 failed." in host
    assert "<=4 KiB : 1 " in host


def test_summary_counts_callees_under_their_callers(recorded):
    text = summary_report(memviz.load(str(recorded["path"])))
    cuda = section(text, "cuda:0 at its peak, 518 MiB:")
    assert cuda[1].split() == ["total", "total%", "own", "own%", "allocations", "line"]
    rows = {" ".join(r.split()[7:]): r.split()[:7] for r in cuda[2:]}
    c1, c2 = recorded["calls"]
    assert rows[f"{HERE}:{recorded['weights']} in weights"][:7] == \
        ["512", "MiB", "98.8%", "512", "MiB", "98.8%", "2"]
    assert rows[f"{HERE}:{c1} in model"][:7] == ["512", "MiB", "98.8%", "0", "B", "0.0%", "2"]
    assert rows[f"{HERE}:{c2} in model"][:7] == ["6", "MiB", "1.2%", "0", "B", "0.0%", "6"]
    assert rows[f"{HERE}:{recorded['small']} in small_buffers"][:7] == \
        ["6", "MiB", "1.2%", "6", "MiB", "1.2%", "6"]
    # The fixture's line that called model() holds all of it; sorted by total, then own.
    fixture_line = [k for k in rows if k.endswith(" in recorded")]
    assert len(fixture_line) == 1 and rows[fixture_line[0]][:3] == ["518", "MiB", "100.0%"]
    assert all(r.split()[1] == "MiB" for r in cuda[2:])
    totals = [float(r.split()[0]) for r in cuda[2:]]
    assert totals == sorted(totals, reverse=True)
    # no frame of pytest's own (a library) that owns nothing
    assert not any("_pytest" in k or "pluggy" in k for k in rows)
    cut = section(summary_report(memviz.load(str(recorded["path"])), top=2), "cuda:0 at its peak")
    # of the lines at 512 MiB, the one that owns them first; the three left own the buffers
    assert len(cut) == 5 and cut[3].endswith(f"{HERE}:{recorded['weights']} in weights")
    assert cut[4] == "  ... 3 more lines, owning 6 MiB (1.2%)"


def test_views_escape_control_characters_of_names(fake, tmp_path):
    path = tmp_path / "evil.memviz"
    scope = {}
    exec(compile("def evil(fake, cbid):\n    return fake.alloc(cbid, 1 << 20)\n",
                 "clear\x1b[2J\u202escreen.py", "exec"), scope)
    with memviz.track(trace=str(path)):
        scope["evil"](fake, CBID_cuMemAlloc_v2)
    trace = memviz.load(str(path))
    for view in (table_report, stats_report, summary_report):
        text = view(trace)
        assert "\x1b" not in text and "\u202e" not in text, view
        assert "clear\\x1b[2J\\u202escreen.py:2 in evil" in text, view


def test_views_of_a_trace_without_gpu_allocations(tmp_path):
    path = tmp_path / "none.memviz"
    with memviz.track(gpu=False, trace=str(path)):
        pass
    for view in (table_report, stats_report, summary_report):
        assert view(memviz.load(str(path))).rstrip().endswith("No GPU allocation was recorded.")
        with pytest.raises(ValueError, match="top must be a positive int"):
            view(memviz.load(str(path)), top=0)


def test_the_sample_trace_in_every_view(capsys):
    sample = ROOT / "memviz" / "data" / "sample.memviz"
    for fmt in VIEWS:
        assert main(["report", str(sample), "--format", fmt, "--top", "3"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"memviz {fmt}: ") and "cuda:0" in out and "examples/train_sample.py:" in out, out
        # recorded through examples/record_sample.py (runpy.run_path): the launcher's
        # frames hold every byte under them, and are no line of the script's
        body = out.split("\n", 1)[1]
        assert "record_sample.py:" not in body and "runpy" not in body, body


# ---- the command line --------------------------------------------------------------------


def test_cli_writes_each_view_to_stdout_or_a_file(recorded, tmp_path, capsys):
    path = str(recorded["path"])
    for fmt, view in zip(VIEWS, (table_report, stats_report, summary_report)):
        want = view(memviz.load(path), top=1)
        assert main(["report", path, "--format", fmt, "--top", "1"]) == 0
        assert capsys.readouterr().out == want
        out = tmp_path / f"r.{fmt}.txt"
        assert main(["report", path, "--format", fmt, "--top", "1", "-o", str(out)]) == 0
        assert out.read_text() == want
        out.write_text("keep me")
        assert main(["report", path, "--format", fmt, "-o", str(out)]) == 2  # exists: refused
        err = capsys.readouterr().err
        assert "exists" in err and "--force" in err and out.read_text() == "keep me"
        assert main(["report", path, "--format", fmt, "-o", str(out), "--force"]) == 0
        assert out.read_text() == view(memviz.load(path))  # --top 10, the default
        assert main(["report", path, "--format", fmt, "-o", path, "-f"]) == 2  # never over the trace
        assert "the trace being reported" in capsys.readouterr().err


def test_cli_refuses_the_views_for_several_ranks_and_with_whatif(recorded, tmp_path, capsys):
    from memviz.cli.report import ONE_TRACE

    assert ONE_TRACE == VIEWS
    a, b = tmp_path / "run.rank0.memviz", tmp_path / "run.rank1.memviz"
    shutil.copy(recorded["path"], a)
    shutil.copy(recorded["path"], b)
    for fmt in VIEWS:
        assert main(["report", str(a), str(b), "--format", fmt]) == 2
        err = capsys.readouterr().err
        assert f"--format {fmt} shows one trace, and 2 files were given" in err
        assert f"memviz report FILE --format {fmt}" in err and "--format text, json or html" in err
        assert main(["report", str(a), "--format", fmt, "--whatif", "expandable_segments:True"]) == 2
        assert "memviz whatif FILE" in capsys.readouterr().err


def test_the_readme_usage_of_memviz_report_is_the_parsers():
    """The README's usage block of ``memviz report`` names every option of the
    parser with argparse's metavar (choices written a|b|c, as argparse's {a,b,c})."""
    from memviz.cli.report import FORMATS, report_parser

    def options(text):
        text = re.sub(r"\{([^}]*)\}", lambda m: m.group(1).replace(",", "|"), " ".join(text.split()))
        return dict(re.findall(r"\[(-{1,2}[\w-]+)(?: ([^\]\[ ]+))?\]", text))

    parser = report_parser("python -m memviz report")
    assert parser.usage is None  # argparse's own line, from the options
    generated = options(parser.format_usage())
    generated.pop("-h")
    assert generated["--format"] == "|".join(FORMATS)
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(python -m memviz report \[.*?)```", readme, re.S).group(1)
    assert options(block) == generated
    assert block.rstrip().endswith("trace [trace ...]")
