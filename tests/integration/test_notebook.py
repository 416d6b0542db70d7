"""The %%memviz cell magic: in an in-process IPython shell (allocations fired
through the test double), and in a real Jupyter kernel driven by nbclient
(pip install nbclient ipykernel nbformat; skipped where they are absent)."""

import os
import sys
from pathlib import Path

import pytest

import memviz
from memviz.integrations import ipython as _ipython

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_options_are_parsed_and_bad_ones_explained():
    o = _ipython.parse_options("--no-gpu --top 3")
    assert (o.no_gpu, o.top, o.depth) == (True, 3, None)
    assert _ipython.parse_options("").top == 10
    for bad, why in (("--top 0", "positive whole number"), ("--top x", "positive whole number"),
                     ("--frobnicate", "unrecognized arguments"), ("--top '3", "cannot read")):
        with pytest.raises(_ipython.MagicUsageError, match=why) as e:
            _ipython.parse_options(bad)
        assert "Usage: %%memviz" in str(e.value)


def test_a_depth_memviz_cannot_keep_is_a_usage_error_of_the_magic():
    """--depth is checked against the frames memviz keeps at most, as
    `memviz run --depth` is: the usage line, not an error from inside track()."""
    from memviz import _core

    assert _ipython.parse_options(f"--depth {_core.MAX_DEPTH}").depth == _core.MAX_DEPTH
    with pytest.raises(_ipython.MagicUsageError, match=f"from 1 to {_core.MAX_DEPTH}, got "
                                                        f"{_core.MAX_DEPTH + 1}") as e:
        _ipython.parse_options(f"--depth {_core.MAX_DEPTH + 1}")
    assert "Usage: %%memviz" in str(e.value)


@pytest.fixture
def shell():
    IPython = pytest.importorskip("IPython", reason="the cell magic needs IPython (pip install ipython)")
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    memviz.load_ipython_extension(sh)
    yield sh
    InteractiveShell.clear_instance()
    del IPython


def run_cell(shell, text):
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        result = shell.run_cell(text)
    htmls = [o.data["text/html"] for o in out.outputs if "text/html" in o.data]
    return result, htmls, out


def test_cell_magic_tracks_the_cell_and_shows_the_report(shell, fake):
    from fake_cupti import CBID_cuMemAlloc_v2

    shell.user_ns.update(fake=fake, CBID=CBID_cuMemAlloc_v2)
    result, htmls, _ = run_cell(shell, "%%memviz --top 2\nx = fake.alloc(CBID, 6 << 20)\n"
                                       "y = fake.alloc(CBID, 2 << 20)\n")
    assert result.success
    html, = htmls
    assert "memviz" in html and "<svg" in html and "Top lines at the peak" in html
    assert "<script" not in html and "8 MiB" in html
    t = shell.user_ns["_memviz"]
    assert isinstance(t, memviz.Tracker) and not t.running and t.current_bytes() == 8 * MiB
    lines = {s.key.lineno for s in t.snapshot().statistics("lineno")}
    assert lines == {1, 2}  # the cell's own lines


@pytest.mark.skipif(sys.version_info < (3, 11), reason="call names need column positions (3.11+)")
def test_calls_in_a_cell_are_named_through_the_notebooks_aliases(shell, fake):
    """A cell's code object is gone when the next cell reads the tracker, and
    cells belong to no module file: their globals are IPython's __main__."""
    import types

    from fake_cupti import CBID_cuMemAlloc_v2

    ops = types.ModuleType("gpu_ops")
    ops.alloc = fake._c.fake_alloc
    shell.user_ns.update(G=ops, CBID=CBID_cuMemAlloc_v2)
    result, _, _ = run_cell(shell, "%%memviz\nw = G.alloc(CBID, 4 << 20, 0, 0)\n")
    assert result.success
    result, _, _ = run_cell(shell, "import gc; gc.collect(); ops = [a.op for a in _memviz.snapshot()]\n")
    assert result.success and shell.user_ns["ops"] == ["gpu_ops.alloc"], shell.user_ns["ops"]


def test_cell_that_raises_still_stops_tracking_and_reports(shell, fake):
    from fake_cupti import CBID_cuMemAlloc_v2

    shell.user_ns.update(fake=fake, CBID=CBID_cuMemAlloc_v2)
    result, htmls, _ = run_cell(shell, "%%memviz\nfake.alloc(CBID, 1 << 20)\nraise ValueError('boom')\n")
    assert len(htmls) == 1 and "1 MiB" in htmls[0]
    assert memviz.active_tracker() is None
    assert shell.user_ns["_memviz"].current_bytes() == MiB


def test_line_magic_tracks_one_statement(shell, fake):
    """%memviz [options] STATEMENT: the statement as a one-line cell."""
    from fake_cupti import CBID_cuMemAlloc_v2
    from memviz.integrations.ipython import split_line

    assert split_line("--top 3 --no-gpu x = f(--y)") == ("--top 3 --no-gpu", "x = f(--y)")
    shell.user_ns.update(fake=fake, CBID=CBID_cuMemAlloc_v2)
    result, htmls, _ = run_cell(shell, "%memviz --top 1 x = fake.alloc(CBID, 3 << 20)\n")
    assert result.success
    html, = htmls
    assert "3 MiB" in html
    t = shell.user_ns["_memviz"]
    assert t.current_bytes() == 3 * MiB and shell.user_ns["x"]
    result, htmls, _ = run_cell(shell, "%memviz --top 2\n")  # no statement: the usage
    assert "Usage: %%memviz" in htmls[0] and "%memviz [options] STATEMENT" in htmls[0]


def test_cell_lines_show_with_their_source_in_a_terminal_shell(shell, fake):
    """IPython's terminal shell names cells <ipython-input-N-...> and keeps
    their source in linecache: the report shows the line and its source."""
    from fake_cupti import CBID_cuMemAlloc_v2
    from memviz.report.text import text_report

    shell.user_ns.update(fake=fake, CBID=CBID_cuMemAlloc_v2, memviz=memviz)
    result, _, _ = run_cell(shell, "t = memviz.track().start()\n"
                                   "x = fake.alloc(CBID, 5 << 20)  # the cell's own line\n"
                                   "t.stop()\n")
    assert result.success
    text = text_report(shell.user_ns["t"], top=3)
    assert "<ipython-input-" in text and ":2" in text, text
    assert "x = fake.alloc(CBID, 5 << 20)" in text, text


def test_bad_options_show_what_to_do_and_run_nothing(shell):
    shell.user_ns["ran"] = False
    result, htmls, _ = run_cell(shell, "%%memviz --top zero\nran = True\n")
    assert len(htmls) == 1 and "Usage: %%memviz" in htmls[0] and "positive whole number" in htmls[0]
    assert shell.user_ns["ran"] is False


def test_real_kernel_runs_the_magic(monkeypatch, fake_path):
    """A real kernel, with memviz pointed at the libcupti test double, so the
    magic runs the same capture path as on a GPU machine."""
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (pip install nbclient ipykernel nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (pip install nbclient ipykernel nbformat)")
    pytest.importorskip("ipykernel", reason="needs ipykernel (pip install nbclient ipykernel nbformat)")
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    monkeypatch.setenv("MEMVIZ_CUPTI_LIBRARY", fake_path)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext memviz\n"
                                  "from fake_cupti import FakeCupti, CBID_cuMemAlloc_v2\n"
                                  f"fake = FakeCupti({fake_path!r})\n"
                                  "import memviz, os, fake_cupti  # the double's wrapper is not user code\n"
                                  "memviz.frames.add_library_path(os.path.dirname(fake_cupti.__file__))\n"),
        nbformat.v4.new_code_cell(
            "%%memviz --top 3\n"
            "def make_buffers(n):\n"
            "    return [fake.alloc(CBID_cuMemAlloc_v2, 4 << 20) for _ in range(n)]\n"
            "buffers = make_buffers(10)\n"),
        nbformat.v4.new_code_cell("print(type(_memviz).__name__, _memviz.current_bytes())"),
        nbformat.v4.new_code_cell("%%memviz --no-gpu\nx = 1\n"),
    ]
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()

    def html_of(cell):
        return [o["data"]["text/html"] for o in cell.outputs if o.get("output_type") == "display_data"
                and "text/html" in o.get("data", {})]

    html = html_of(nb.cells[1])
    assert len(html) == 1, nb.cells[1].outputs
    assert "Top lines at the peak" in html[0] and "make_buffers" in html[0] and "40 MiB" in html[0]
    assert "<svg" in html[0] and "GPU capture on" in html[0]
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert printed.strip() == f"Tracker {40 << 20}"
    off = html_of(nb.cells[3])
    assert len(off) == 1 and "GPU capture off" in off[0] and "No GPU allocation was recorded" in off[0]


def _polygon_levels(html):
    """The bytes each point of the first sparkline's polygon stands for."""
    import re

    svg = html[html.index("<svg"):]
    height = int(re.search(r'height="(\d+)"', svg).group(1))
    points = re.search(r'<polygon points="([^"]+)"', svg).group(1).split()
    peak_bytes = 656 * MiB
    top = peak_bytes * 1.08
    return [(height - 2 - float(p.split(",")[1])) * top / (height - 4) for p in points]


def test_sparkline_shows_the_sawtooth_of_steps(fake):
    """A timeline that alternates 512 and 656 MiB (a step's activations come
    and go) must not be drawn as a flat line at 656 MiB: each bucket of the
    sparkline keeps its minimum and its maximum."""
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
    from memviz.report.notebook import tracker_repr_html

    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 512 * MiB)
        for _ in range(1500):  # far more points than the sparkline's 200 buckets
            fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 144 * MiB))
    values = [v for ts, d, v in t.timeline() if d == 0]
    assert {512 * MiB, 656 * MiB} <= set(values) and len(values) > 2000
    levels = _polygon_levels(tracker_repr_html(t))
    near = lambda v, want: abs(v - want) < 0.01 * want  # noqa: E731
    lows = sum(near(v, 512 * MiB) for v in levels)
    highs = sum(near(v, 656 * MiB) for v in levels)
    assert lows > 100 and highs > 100, (lows, highs)
    # up and down all along, not one rise and one fall. The buckets are by time: a
    # loaded machine that pauses this thread leaves some of them empty (84 changes on
    # CI under load, against about 200 here), so the bound asks only for many.
    steps = [v for v in levels if near(v, 512 * MiB) or near(v, 656 * MiB)]
    changes = sum(1 for a, b in zip(steps, steps[1:]) if near(a, 512 * MiB) != near(b, 512 * MiB))
    assert changes > 30, changes


def test_sparkline_keeps_the_peak_and_a_lone_dip():
    from memviz.report.notebook import _sparkline

    ts = list(range(0, 100_000, 10))
    vs = [656 * MiB] * len(ts)
    vs[5000] = 0  # one free-everything moment
    vs[7000] = 900 * MiB  # the peak
    svg = _sparkline(list(zip(ts, vs)), 900 * MiB, ts[7000], ts[0], ts[-1])
    import re
    height = 56
    pts = re.search(r'<polygon points="([^"]+)"', svg).group(1).split()
    # without the polygon's corners at the ends, which stand at 0
    ys = [float(p.split(",")[1]) for p in pts if 0 < float(p.split(",")[0]) < 420]
    assert min(ys) == pytest.approx(height - 2 - 900 * MiB * (height - 4) / (900 * MiB * 1.08), abs=0.06)
    assert max(ys) == pytest.approx(height - 2, abs=0.06)  # the dip to 0 is drawn
