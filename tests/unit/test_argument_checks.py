"""Bad arguments are refused with a message: memviz errors naming the
argument, what was given and what is accepted (track options, the reading
API, the step sinks), TypeError for a wrong type and ValueError for a wrong
value."""

import errno
import os
import pickle

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2
import memviz.report as html  # render and the notebook views

MiB = 1 << 20


def no_temp_files(folder):
    left = [n for n in os.listdir(folder) if "tmp" in n]
    assert not left, left


# ---- 15. bad arguments: memviz errors naming the argument, what was given, what is accepted


@pytest.mark.parametrize("kwargs, words", [
    ({"depth": True}, ["depth", "True (bool)", "from 1 to"]),
    ({"depth": 2.0}, ["depth", "2.0 (float)", "whole number"]),
    ({"depth": 0}, ["depth", "0 (int)", "from 1 to"]),
    ({"gpu": "yes"}, ["gpu", "'yes' (str)", "True or False"]),
    ({"precise": 1}, ["precise", "1 (int)", "True or False"]),
    ({"autograd": "on"}, ["autograd", "'on'", "True or False"]),
    ({"frame_filter": "lib"}, ["frame_filter", "'lib'", "FrameFilter"]),
    ({"trace": 3}, ["trace", "3 (int)", "file path"]),
    ({"trace": b"x.memviz"}, ["trace", "bytes"]),
    ({"dpeth": 3}, ["'dpeth'", "depth", "options"]),
])
def test_track_options_are_checked(kwargs, words):
    for make in (memviz.track, memviz.Tracker, memviz.start):
        if make is memviz.Tracker and "dpeth" in kwargs:
            continue  # Python's own TypeError names an unknown keyword argument
        with pytest.raises(memviz.InvalidArgument) as e:
            make(**kwargs)
        for w in words:
            assert w in str(e.value), (w, str(e.value))
    assert isinstance(e.value, (ValueError, TypeError)) and isinstance(e.value, memviz.MemvizError)
    assert memviz.active_tracker() is None


def test_type_errors_are_typeerrors_and_value_errors_valueerrors():
    with pytest.raises(TypeError):
        memviz.track(depth="3")
    with pytest.raises(ValueError):
        memviz.track(depth=10_000)
    with pytest.raises(memviz.InvalidArgumentType):
        memviz.label(3)
    with pytest.raises(memviz.InvalidArgument, match="non-empty str"):
        memviz.label("")
    e = memviz.InvalidArgumentType("x")
    assert isinstance(pickle.loads(pickle.dumps(e)), memviz.InvalidArgumentType)


def test_reading_api_arguments_are_checked(fake, tmp_path):
    with memviz.track(torch=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    t.save(tmp_path / "t.memviz")
    loaded = memviz.load(tmp_path / "t.memviz")
    snap = t.snapshot()
    for obj in (t, loaded):
        for call in (lambda: obj.peak_snapshot(True), lambda: obj.peak_snapshot("0"),
                     lambda: obj.current_bytes(0.0), lambda: obj.peak_bytes(False)):
            with pytest.raises(memviz.InvalidArgumentType, match="device"):
                call()
        assert obj.current_bytes(0) == MiB
    with pytest.raises(memviz.InvalidArgumentType, match="at_ns"):
        loaded.snapshot(at_ns="now")
    calls = [
        (lambda: snap.statistics("bogus"), memviz.InvalidArgument, "key_type 'bogus'"),
        (lambda: snap.statistics("lineno", cumulative="yes"), memviz.InvalidArgumentType, "cumulative"),
        (lambda: snap.statistics("label", cumulative=True), memviz.InvalidArgument, "cumulative"),
        (lambda: snap.compare_to(None), memviz.InvalidArgumentType, "old_snapshot"),
        (lambda: snap.filter(3), memviz.InvalidArgumentType, "predicate"),
        (lambda: snap.total_bytes(True), memviz.InvalidArgumentType, "device"),
        (lambda: snap.allocations[0].traceback.format(limit="2"), memviz.InvalidArgumentType, "limit"),
        (lambda: memviz.load(3), memviz.InvalidArgumentType, "memviz.load(path)"),
        (lambda: memviz.load(tmp_path / "t.memviz", recover="yes"), memviz.InvalidArgumentType, "recover"),
        (lambda: t.save(None), memviz.InvalidArgumentType, "Tracker.save(path)"),
        (lambda: t.to_html(3), memviz.InvalidArgumentType, "path of the HTML report"),
        (lambda: t.to_perfetto(""), memviz.InvalidArgument, "path of the Perfetto trace"),
        (lambda: html.render(t, title=3), memviz.InvalidArgumentType, "title"),
        (lambda: html.tracker_repr_html(t, top=True), memviz.InvalidArgument, "top"),
        (lambda: memviz.diagnose(t, warmup=True), memviz.InvalidArgumentType, "warmup"),
        (lambda: memviz.diagnose(3), memviz.InvalidArgumentType, "memviz.diagnose()"),
        (lambda: memviz.parse_size("lots"), memviz.InvalidArgument, "cannot parse size"),
        (lambda: memviz.format_size("1"), memviz.InvalidArgumentType, "format_size"),
        (lambda: memviz.frames.add_library_path(3), memviz.InvalidArgumentType, "FrameFilter path"),
        (lambda: memviz.FrameFilter(library_paths=[""]), memviz.InvalidArgument, "empty path"),
    ]
    for call, kind, word in calls:
        with pytest.raises(kind, match=word.replace("(", r"\(").replace(")", r"\)")) as e:
            call()
        assert isinstance(e.value, memviz.MemvizError)
    no_temp_files(tmp_path)


def test_step_sink_arguments_are_checked(fake, tmp_path):
    with memviz.track(torch=False) as t:
        with pytest.raises(memviz.InvalidArgumentType, match="'jsnol'.*jsonl="):
            t.on_step(jsnol=str(tmp_path / "s.jsonl"))
        with pytest.raises(memviz.InvalidArgumentType, match="jsonl=.*3 \\(int\\)"):
            t.on_step(jsonl=3)
        with pytest.raises(memviz.OutputError, match="the csv step file.*What to do") as e:
            t.on_step(csv=str(tmp_path / "missing" / "s.csv"))
        assert isinstance(e.value, OSError) and e.value.errno == errno.ENOENT
        with pytest.raises(memviz.InvalidArgument, match="print_every"):
            t.on_step(print_every=True)
        handle = t.on_step(jsonl=tmp_path / "s.jsonl")
        t.step()
        handle.remove()
    assert (tmp_path / "s.jsonl").read_text().count("\n") == 1
