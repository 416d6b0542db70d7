"""benchmarks/bench_toggle.py's summaries, from made-up processes: the step
itself needs a GPU, the arithmetic that the device's results are read with
does not. The two-build comparison (--against) pairs processes in the order
they ran and reports this build's ratio minus the other's."""

import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_toggle as bt  # noqa: E402


def run(rec, off):
    return {"route": "allocator", "times_ns": {"rec:2": rec, "off": off}}


MODES = bt.parse_modes("rec:2,off")


def test_summary_is_the_median_of_each_processs_median_round_ratio(capsys):
    runs = [run([100, 100, 100], [97, 98, 99]), run([200, 200, 200], [190, 196, 200]),
            run([10, 10, 10], [9.9, 9.9, 9.9])]
    s = bt.summarize(runs, MODES)
    assert s["rec:2"]["median_ratio"] == 1.0
    assert s["off"]["per_process_ratio"] == pytest.approx([0.98, 0.98, 0.99])
    assert s["off"]["median_ratio"] == pytest.approx(0.98)
    assert s["off"]["ratio_spread"] == pytest.approx([0.98, 0.99])
    assert s["off"]["rounds"] == 9
    assert "off      over rec:2: 0.9800" in capsys.readouterr().out


def test_two_builds_are_compared_pair_by_pair():
    this = [run([100] * 3, [98] * 3), run([100] * 3, [97] * 3), run([100] * 3, [96] * 3)]
    other = [run([100] * 3, [97] * 3), run([100] * 3, [98] * 3), run([100] * 3, [95] * 3)]
    c = bt.compare(this, other, MODES)
    assert list(c) == ["off"]  # the baseline is not compared with itself
    assert c["off"]["differences"] == pytest.approx([0.01, -0.01, 0.01])
    assert c["off"]["median_difference"] == pytest.approx(0.01)
    assert (c["off"]["pairs"], c["off"]["pairs_above_zero"]) == (3, 2)


def test_against_a_folder_without_the_benchmark_says_what_to_give(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_toggle.py"), "--against",
                        str(tmp_path), "--procs", "1", "--modes", "rec:2,off", "--out",
                        str(tmp_path / "t.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "give the root of a checkout of memviz" in p.stderr, p.stderr
    assert not (tmp_path / "t.json").exists()
    assert "Traceback" not in p.stderr


def test_pieces_are_points_of_the_step_with_the_route_bypassed(capsys):
    # rec:2 the baseline; rec:130 saves 2 ns of 100; off saves 4 ns; off's step is 96 ns
    modes = bt.parse_modes("rec:2,rec:130,off")
    runs = [{"route": "allocator", "times_ns": {"rec:2": [100, 100, 100], "rec:130": [98, 98, 98],
                                                "off": [96, 96, 96]}},
            {"route": "allocator", "times_ns": {"rec:2": [200, 200, 200], "rec:130": [197, 197, 197],
                                                "off": [192, 192, 192]}}]
    p = bt.pieces(runs, modes)
    assert list(p) == ["rec:2", "rec:130"]  # off is the reference, not a piece
    assert p["rec:2"]["per_process_share"] == pytest.approx([4 / 96, 8 / 192])
    assert p["rec:130"]["per_process_share"] == pytest.approx([2 / 96, 3 / 192])
    assert p["rec:130"]["median_share"] == pytest.approx((2 / 96 + 3 / 192) / 2)
    out = capsys.readouterr().out
    assert "rec:2      recording's share (off saves): +4.17% of the step" in out
    assert bt.pieces(runs, bt.parse_modes("rec:2,rec:130")) == {}  # no off: nothing to read it by
