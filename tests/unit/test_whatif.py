"""What if (issue 30) on the CPU: a trace's PyTorch requests replayed
through the model of PyTorch's caching allocator (src/whatif.h) under
other settings. Each rule is checked on request streams whose layout is
worked out by hand, and random streams are run on the stand-in allocator
(tests/stand_in_allocator, which follows the same rules) under each
setting: the model, fed the trace of one run under the defaults, must
predict the stand-in's own reserved memory under the others."""

import contextlib
import gc
import json
import platform
import random
import subprocess
import sys

import pytest

import memviz
from conftest import ROOT

torch = pytest.importorskip("torch", reason="the PyTorch integration needs torch (pip install torch)")

import stand_in_allocator as sa  # noqa: E402
from memviz import _core  # noqa: E402
from memviz.analysis.whatif import parse_setting, rows_text  # noqa: E402
from memviz.torch import allocator as route_mod  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route patches a C++ vtable on x86-64 glibc only")

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def builds(stand_in_root):
    return lambda name, **defines: sa.build(stand_in_root / name, **defines)


@pytest.fixture
def standin(builds, fake, request):
    memviz.frames.add_library_path(str(ROOT / "tests" / "stand_in_allocator"))
    made = []

    def make(name="default", **defines):
        a = sa.StandInAnswers(builds(f"{request.node.name}-{name}".replace("/", "_"), **defines),
                              fake.lib.fake_alloc, fake.lib.fake_free)
        made.append(a)
        return a

    yield make
    t = memviz.active_tracker()
    if t is not None:
        t.stop()
    gc.collect()
    assert _core.allocator_state()["outstanding"] == 0
    route_mod._reset_for_tests()


def _play(ans, ops):
    """Run ops ("a", key, bytes[, stream]) / ("f", key) / ("e",) (empty_cache)
    on the stand-in; returns its reserved memory at its highest. On another
    stream than the default, a raw block (caching_allocator_alloc): a
    tensor's allocate() does not say its stream, a raw allocation does."""
    live, top = {}, ans.reserved()
    for op in ops:
        if op[0] == "a":
            stream = op[3] if len(op) > 3 else 0
            ans.set_stream(stream)
            live[op[1]] = ans.raw_alloc(op[2]) if stream else ans.alloc(op[2])[0]
            top = max(top, ans.reserved())
        elif op[0] == "f":
            x = live.pop(op[1])
            if isinstance(x, int):
                ans.raw_free(x)
            del x  # a tensor goes now, as `del t` in a program
        else:
            ans.empty_cache()
    ans.set_stream(0)
    for x in live.values():
        if isinstance(x, int):
            ans.raw_free(x)
    live.clear()
    return top


@contextlib.contextmanager
def _recording(standin, tmp_path, name):
    """Tracking into a trace on a fresh stand-in under the defaults: yields
    the stand-in, the trace's path and what the route's probe left cached
    (part of the record), which then goes (a recorded empty_cache), so the
    stream starts on an empty pool."""
    ans = standin(name)
    path = tmp_path / f"{name}.memviz"
    with memviz.track(trace=str(path)) as t:
        r = t.torch.use_answers(ans)
        assert r.route == "allocator", r.reason
        probe = ans.reserved()
        ans.empty_cache()
        yield ans, path, probe


def _record(standin, tmp_path, ops, name="rec"):
    """A trace of ops run on a fresh stand-in under the defaults, and its
    reserved peak as the stand-in had it."""
    with _recording(standin, tmp_path, name) as (ans, path, probe):
        top = max(probe, _play(ans, ops))
    return memviz.load(str(path)), top


def _alloc_line():
    """The line of _play that asks the stand-in for a block (the user's line)."""
    import inspect
    src, first = inspect.getsourcelines(_play)
    return first + next(i for i, ln in enumerate(src) if "ans.alloc(op[2])" in ln)


def _rows(trace, *settings, device_memory=None):
    return trace.whatif(*settings, device_memory=device_memory)


# ---- each rule, worked out by hand ------------------------------------------------------


def test_rounding_pools_and_segment_sizes(standin, tmp_path):
    """1000 B rounds to 1 KiB in a 2 MiB small segment; 1 MiB is still small
    (the same segment); 1 MiB + 1 is large: a 20 MiB segment, whose rest
    (over 1 MiB) is split off and then holds 12 MiB."""
    trace, real = _record(standin, tmp_path, [("a", 1, 1000), ("a", 2, MiB), ("a", 3, MiB + 1),
                                              ("a", 4, 12 * MiB)])
    row, = _rows(trace)
    assert row.recorded and row.reserved_peak == real == 2 * MiB + 20 * MiB
    assert row.allocated_peak == 1024 + MiB + (MiB + 512) + 12 * MiB
    assert row.retries == 0 and row.oom is None


def test_large_blocks_split_only_past_1_mib(standin, tmp_path):
    """5 MiB in a fresh 20 MiB segment: the 15 MiB rest is split off; 14.5 MiB
    then takes all 15 MiB (a rest of 0.5 MiB is not split): no new segment."""
    trace, real = _record(standin, tmp_path, [("a", 1, 5 * MiB), ("a", 2, 14 * MiB + 512 * KiB)])
    row, = _rows(trace)
    assert row.reserved_peak == real == 20 * MiB
    assert row.allocated_peak == 20 * MiB and row.unused_at_peak == 0


def test_max_split_size_keeps_oversize_blocks_whole(standin, tmp_path):
    """100 MiB freed; 50 MiB: under the defaults it splits the cached 100 MiB
    block (130 MiB reserved); with max_split_size_mb:64 an oversize block is
    not given to a smaller request: a new 50 MiB segment (180 MiB)."""
    ops = [("a", 1, 30 * MiB), ("a", 2, 100 * MiB), ("f", 2), ("a", 3, 50 * MiB)]
    trace, real = _record(standin, tmp_path, ops)
    base, split = _rows(trace, "max_split_size_mb:64")
    assert base.reserved_peak == real == 130 * MiB
    assert split.reserved_peak == 180 * MiB and split.cuda_mallocs == base.cuda_mallocs + 1
    assert split.largest_free_at_peak == 100 * MiB  # the oversize block, cached, unused


def test_roundup_power2_divisions(standin, tmp_path):
    """With 4 divisions, 1.1 MiB rounds to 1.25 MiB (steps of 256 KiB between
    1 and 2 MiB): ten of them fill 12.5 MiB of one 20 MiB segment."""
    ops = [("a", k, 1100 * KiB) for k in range(10)]
    trace, _ = _record(standin, tmp_path, ops)
    base, div = _rows(trace, "roundup_power2_divisions:4")
    assert base.allocated_peak == 10 * 1100 * KiB
    assert div.allocated_peak == 10 * 1280 * KiB and div.reserved_peak == 20 * MiB


def test_a_smaller_card_runs_out_of_memory_at_the_line_and_retries_first(standin, tmp_path):
    """A 60 MiB card (no context recorded here): 20 MiB, then 30 MiB freed and
    cached (50 reserved), then 31 MiB (a 32 MiB segment): no room, the cached
    segment is flushed (a retry) and it fits (52); then 20 MiB more: refused
    even after a flush, named with its line and what was live."""
    ops = [("a", 1, 20 * MiB), ("a", 2, 30 * MiB), ("f", 2), ("a", 3, 31 * MiB), ("a", 4, 20 * MiB)]
    trace, _ = _record(standin, tmp_path, ops)
    row, = _rows(trace, device_memory="60MiB")
    assert row.retries == 2 and row.flushes == 2  # the 31 MiB request, then the refused one
    assert row.oom is not None and row.oom.requested == 20 * MiB
    assert row.oom.line.endswith(f"test_whatif.py:{_alloc_line()}"), row.oom.line
    # the 31 MiB request's 32 MiB segment is not split (1 MiB left over): a 32 MiB block
    assert row.oom.reserved == 52 * MiB and sum(b for _, b in row.oom.top) == 52 * MiB
    assert row.headroom < 0
    text = rows_text([row])
    assert "out of memory at" in text and "OOM" in text


def test_a_fraction_of_the_card_needs_the_recorded_card(standin, tmp_path):
    trace, _ = _record(standin, tmp_path, [("a", 1, 20 * MiB)])
    with pytest.raises(memviz.InvalidArgument, match="does not record the card's memory"):
        _rows(trace, device_memory=0.9)


def test_empty_cache_in_the_program_is_replayed(standin, tmp_path):
    """The program freed its cache between two phases: the second phase's
    segments are new ones, not the first's (the peak is one phase's)."""
    ops = [("a", 1, 40 * MiB), ("f", 1), ("e",), ("a", 2, 60 * MiB)]
    trace, real = _record(standin, tmp_path, ops)
    row, = _rows(trace)
    assert real == row.reserved_peak == 60 * MiB


def test_expandable_segments_grow_in_granules(standin, tmp_path):
    """Three 12 MiB requests: a 12 MiB segment each (36 MiB); in one
    expandable segment, 20 MiB granules mapped as needed: two (40 MiB)."""
    ops = [("a", k, 12 * MiB) for k in range(3)]
    trace, _ = _record(standin, tmp_path, ops)
    base, exp = _rows(trace, "expandable_segments:True")
    assert base.reserved_peak == 36 * MiB
    # mappings: two, and the route's probe's small granule (given back before the stream starts)
    assert exp.reserved_peak == 40 * MiB and exp.cuda_mallocs == 2 + 1


def test_expandable_segments_give_back_every_whole_free_granule(standin, tmp_path):
    """As PyTorch's unmap_block and find_expandable_block do. One expandable
    segment, 20 MiB granules: a (30 MiB) maps [0, 40); b (15 MiB) maps
    [40, 60) and takes [30, 45). a freed, then empty_cache(): of the free
    [0, 30) the whole granule [0, 20) is unmapped (a hole; [20, 30) stays
    mapped and free), of [45, 60) nothing: 40 MiB reserved. d (35 MiB) fits
    no free block; the hole, with the free block after it, holds only 30 MiB
    before b, so d maps [60, 80) after the free [45, 60): 60 MiB at most.
    (Unmapping only a segment's free end would have kept [0, 20) mapped and
    grown to 80 MiB for d.)"""
    ops = [("a", "a", 30 * MiB), ("a", "b", 15 * MiB), ("f", "a"), ("e",), ("a", "d", 35 * MiB)]
    trace, _ = _record(standin, tmp_path, ops)
    exp, = _rows(trace, "expandable_segments:True")[1:]
    assert exp.reserved_peak == 60 * MiB and exp.cuda_mallocs == 3 + 1, exp  # + the probe's (above)
    assert exp.allocated_peak == (15 + 35) * MiB


def test_a_recording_under_expandable_segments_counts_its_mapped_granules(standin, fake, tmp_path):
    """Recorded under expandable segments, PyTorch's reserved memory is the
    granules it maps (cuMemCreate of 2 or 20 MiB), not segments: the
    recorded reserved peak the first row is checked against counts them
    (other physical memory, a 6 MiB handle here, is not PyTorch's)."""
    from fake_cupti import CBID_cuMemCreate, CBID_cuMemRelease

    with _recording(standin, tmp_path, "vmm") as (ans, path, _):
        g1 = fake.alloc(CBID_cuMemCreate, 20 * MiB)
        g2 = fake.alloc(CBID_cuMemCreate, 20 * MiB)
        other = fake.alloc(CBID_cuMemCreate, 6 * MiB)
        fake.free(CBID_cuMemRelease, g2)
        g3 = fake.alloc(CBID_cuMemCreate, 2 * MiB)
        block = ans.alloc(4 * MiB)[0]  # a 20 MiB segment of the stand-in's: 20 + 20 + 2 MiB at most
        del block
        for h in (g1, g3, other):
            fake.free(CBID_cuMemRelease, h)
    trace = memviz.load(str(path))
    trace.end["pytorch_peak"]["0"]["alloc_conf"] = "expandable_segments:True"
    row, = _rows(trace)
    expected = 20 * MiB + 20 * MiB + 2 * MiB
    assert any(f"({expected:,} B)" in n for n in row.notes), row.notes
    trace.end["pytorch_peak"]["0"]["alloc_conf"] = ""  # the same trace read as under the defaults
    row, = _rows(trace)
    assert not row.notes, row.notes  # its segment alone: 20 MiB, as the model replays it


def test_under_expandable_segments_a_granule_given_back_is_a_release_of_the_cache(standin, fake, tmp_path):
    """Under expandable segments PyTorch gives a granule back only when it
    releases cached memory (the program's empty_cache(), or its retry):
    replayed under the defaults, the cached 30 MiB segment goes then, and
    40 MiB is a segment of its own (40 MiB at most, not 70)."""
    from fake_cupti import CBID_cuMemCreate, CBID_cuMemRelease

    with _recording(standin, tmp_path, "vmm-release") as (ans, path, _):
        x = ans.alloc(30 * MiB)[0]
        del x
        fake.free(CBID_cuMemRelease, fake.alloc(CBID_cuMemCreate, 20 * MiB))
        y = ans.alloc(40 * MiB)[0]
        del y
    trace = memviz.load(str(path))
    trace.end["pytorch_peak"]["0"]["alloc_conf"] = "expandable_segments:True"
    _, plain = _rows(trace, "expandable_segments:False")
    assert plain.reserved_peak == 40 * MiB, plain
    # recorded without expandable segments, a physical handle is another library's (NCCL's
    # cuMem buffers): giving it back says nothing of PyTorch's cache
    trace.end["pytorch_peak"]["0"]["alloc_conf"] = ""
    rec, = _rows(trace)
    assert rec.reserved_peak == 70 * MiB and not rec.notes, rec


def test_a_request_no_expandable_segment_could_hold_is_an_out_of_memory_point(standin, tmp_path):
    """2 TiB: more address space than an expandable segment spans (PyTorch's
    spans 9/8 of the card); the model refuses it there (found by the trace
    fuzzer: it was taken for the host running out of memory)."""
    trace, _ = _record(standin, tmp_path, [("a", 1, 1 * MiB), ("a", 2, 2 << 40)])
    base, exp = _rows(trace, "expandable_segments:True")
    assert base.oom is None and base.reserved_peak == 2 * MiB + (2 << 40)
    assert exp.oom is not None and exp.oom.requested == 2 << 40, exp


def test_expandable_best_fit_keeps_the_growing_end_free(standin, tmp_path):
    """PyTorch's best fit under expandable segments counts the block that
    ends the mapped part as the size it could grow to, so a request takes a
    larger block that cannot grow instead. One 20 MiB granule: a 4, b 10,
    c 2 MiB, the end's 4 MiB free; b freed. 3 MiB takes b's 10 (not the
    end's 4), 4 MiB takes the 7 MiB rest of b (not the end), and 5 MiB then
    fits nowhere: a second granule, 40 MiB. (Taking the smallest block
    that fits, as without expandable segments, would stay at 20 MiB: the
    H200's churn and transformer were over-predicted by 6 and 2 granules.)"""
    ops = [("a", "a", 4 * MiB), ("a", "b", 10 * MiB), ("a", "c", 2 * MiB), ("f", "b"),
           ("a", "d", 3 * MiB), ("a", "e", 4 * MiB), ("a", "g", 5 * MiB)]
    trace, _ = _record(standin, tmp_path, ops)
    exp, = _rows(trace, "expandable_segments:True")[1:]
    assert exp.reserved_peak == 40 * MiB


def test_ties_go_to_the_lower_address_as_the_driver_gave_it(standin, fake, tmp_path):
    """PyTorch's best fit takes, of free blocks of one size, the one at the
    lower address, so where the driver puts a segment matters. The driver
    places a new region below the others (S2 below S1). Two 20 MiB segments,
    each holding an 8 and a 12 MiB block; the 8s freed: two free 8 MiB
    blocks. z (8 MiB) takes S2's, the lower; then y2's free leaves S2 not
    wholly free, and 20 MiB needs a third segment: 60 MiB. A model that
    placed segments in the order made would take S1's and fit 20 MiB in the
    wholly free S2 (40 MiB). While its segments are the recording's, the
    model puts them at the recorded addresses: the recorded settings and
    one that makes the same segments (roundup_power2_divisions:4) match."""
    ops = [("a", "x1", 8 * MiB), ("a", "y1", 12 * MiB), ("a", "x2", 8 * MiB), ("a", "y2", 12 * MiB),
           ("f", "x1"), ("f", "x2"), ("a", "z", 8 * MiB), ("f", "y2"), ("a", "w", 20 * MiB)]
    fake.lib.fake_addresses_like_driver(1)
    trace, real = _record(standin, tmp_path, ops)
    assert real == 60 * MiB
    rec, rounded = _rows(trace, "roundup_power2_divisions:4")
    assert rec.reserved_peak == rounded.reserved_peak == 60 * MiB
    ans = standin("rounded")
    ans.reset()
    ans.configure(roundup_power2_divisions=4)
    fake.lib.fake_addresses_like_driver(1)
    assert _play(ans, ops) == 60 * MiB


def test_past_the_recorded_segments_the_driver_fills_the_lowest_hole(standin, fake, tmp_path):
    """Once a setting makes other segments than the recording (here the first
    request, 9 MiB + 1, rounds to 10 MiB under roundup_power2_divisions:4
    and gets a 10 MiB segment instead of 20), the model places segments as
    the driver does (whatif_va.h). S1 (20 MiB for a and b) leaves 12 MiB of
    its 32 MiB region free; S2 (12 MiB for c) fills that hole, above S1. With
    b and c freed, d (12 MiB) takes b's place, the lower address, so S2
    stays wholly free and S1 holds d: once a goes, 20 MiB fits nowhere (a
    third segment: 52 MiB). Placing S2 below S1 instead would put d in S2,
    leave S1 wholly free and fit 20 MiB there (32 MiB)."""
    ops = [("a", "p", 9 * MiB + 1), ("f", "p"), ("e",),
           ("a", "a", 8 * MiB), ("a", "b", 12 * MiB), ("a", "c", 12 * MiB), ("f", "b"), ("f", "c"),
           ("a", "d", 12 * MiB), ("f", "a"), ("a", "f", 20 * MiB)]
    fake.lib.fake_addresses_like_driver(1)
    trace, real = _record(standin, tmp_path, ops)
    rec, rounded = _rows(trace, "roundup_power2_divisions:4")
    assert rec.reserved_peak == real == 52 * MiB
    ans = standin("rounded")
    ans.reset()
    ans.configure(roundup_power2_divisions=4)
    fake.lib.fake_addresses_like_driver(1)
    assert _play(ans, ops) == rounded.reserved_peak == 52 * MiB


def test_garbage_collection_frees_the_oldest_cached_segments_under_a_fraction(standin, tmp_path):
    """A card fraction of 100 MiB, threshold 0.5: past 50 MiB reserved, the
    oldest whole free segments go before a new one is made (PyTorch does this
    only with a memory fraction set)."""
    ops = [("a", 1, 30 * MiB), ("f", 1), ("a", 2, 40 * MiB), ("f", 2), ("a", 3, 44 * MiB)]
    trace, _ = _record(standin, tmp_path, ops)
    trace.end.setdefault("pytorch_peak", {}).setdefault("0", {})["total_memory"] = 100 * MiB
    plain, collected = _rows(trace, "garbage_collection_threshold:0.5", device_memory=1.0)
    # without collection: 44 MiB finds no room (70 + 44 > 100), a flush frees both cached segments
    assert (plain.reserved_peak, plain.retries) == (70 * MiB, 1)
    # with it: past 50 MiB, the older cached segment (30 MiB) goes first; 40 + 44 fits
    assert (collected.reserved_peak, collected.retries) == (84 * MiB, 0)


# ---- the stand-in runs the same streams ---------------------------------------------------


def _stream(seed, n=600):
    rng = random.Random(seed)
    ops, live, key = [], [], 0
    sizes = [rng.choice([256, 4000, 700 * KiB, int(1.5 * MiB), 6 * MiB, 24 * MiB, 90 * MiB])
             for _ in range(40)]
    for _ in range(n):
        if live and rng.random() < 0.45:
            ops.append(("f", live.pop(rng.randrange(len(live)))))
        else:
            key += 1
            base = rng.choice(sizes)
            ops.append(("a", key, max(1, int(base * rng.uniform(0.5, 1.5))), rng.choice([0, 0, 0, 7])))
            live.append(key)
    return ops


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_predictions_equal_the_stand_in_run_under_each_setting(standin, fake, tmp_path, seed):
    fake.lib.fake_addresses_like_driver(1)  # as the H200's driver places memory (whatif_va.h)
    ops = _stream(seed)
    trace, real = _record(standin, tmp_path, ops, name=f"rec{seed}")
    settings = {"max_split_size_mb:64": dict(max_split_size=64 * MiB),
                "roundup_power2_divisions:4": dict(roundup_power2_divisions=4),
                "max_split_size_mb:40,roundup_power2_divisions:2": dict(max_split_size=40 * MiB,
                                                                         roundup_power2_divisions=2)}
    rows = _rows(trace, *settings)
    assert rows[0].reserved_peak == real, rows[0]
    for row, (conf, kw) in zip(rows[1:], settings.items()):
        ans = standin(f"run{seed}-{len(conf)}")
        ans.reset()
        ans.configure(**kw)
        fake.lib.fake_addresses_like_driver(1)  # a fresh process's driver
        assert row.reserved_peak == _play(ans, ops), conf


# ---- settings, the API, the command ---------------------------------------------------------


@pytest.mark.parametrize("conf, words", [
    ("backend:cudaMallocAsync", "driver's own pool"),
    ("max_split_size_mb:10", "more than 20"),
    ("garbage_collection_threshold:1.5", "between 0 and 1"),
    ("expandable_segments:maybe", "True or False"),
    ("bogus:1", "not a PyTorch allocator setting"),
    ("roundup_power2_divisions:3", "power of two"),
])
def test_settings_the_model_cannot_follow_are_refused_with_the_reason(conf, words):
    with pytest.raises(memviz.InvalidArgument, match=words):
        parse_setting(conf)


def test_settings_without_effect_are_said_so():
    _, _, notes = parse_setting("release_lock_on_cudamalloc:True,max_split_size_mb:128")
    assert any("does not change device memory" in n for n in notes)


def test_a_tracker_without_a_trace_says_what_to_do(standin):
    with memviz.track() as t:
        pass
    with pytest.raises(memviz.InvalidArgument, match="trace="):
        t.whatif("expandable_segments:True")


def test_the_command_writes_text_and_json(standin, tmp_path):
    trace, _ = _record(standin, tmp_path, [("a", 1, 5 * MiB), ("a", 2, 3 * MiB)])
    env = dict(__import__("os").environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "memviz", "whatif", trace.path, "--alloc-conf",
                        "max_split_size_mb:64", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["format"] == "memviz-whatif" and len(doc["rows"]) == 2
    assert doc["rows"][0]["recorded"] and doc["rows"][1]["setting"] == "max_split_size_mb:64"
    p = subprocess.run([sys.executable, "-m", "memviz", "whatif", trace.path, "--alloc-conf", "bogus:1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "not a PyTorch allocator setting" in p.stderr


def test_the_report_carries_a_what_if_section(standin, tmp_path):
    """memviz report --whatif: a section of the text, JSON and HTML reports
    (the page draws it from its data: the table and the out-of-memory points)."""
    trace, _ = _record(standin, tmp_path, [("a", 1, 20 * MiB), ("a", 2, 30 * MiB)])
    from memviz.report import html
    rows = _rows(trace, "max_split_size_mb:64", device_memory="40MiB")
    page = html.render(trace, whatif=rows)
    assert '"format":"memviz-whatif"' in page.replace(" ", "") and "What if: other allocator settings" in page
    env = dict(__import__("os").environ, PYTHONPATH=str(ROOT))
    for fmt, words in (("text", ("memviz whatif:", "out of memory at")), ("json", ('"whatif"', '"oom": {'))):
        p = subprocess.run([sys.executable, "-m", "memviz", "report", trace.path, "--whatif", "max_split_size_mb:64",
                            "--device-memory", "40MiB", "--format", fmt], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == 0 and all(w in p.stdout for w in words), p.stderr


def test_several_ranks_with_whatif_are_refused_with_what_to_do(tmp_path):
    sample = ROOT / "memviz" / "data" / "sample.memviz"
    env = dict(__import__("os").environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "memviz", "report", str(sample), str(sample), "--whatif",
                        "expandable_segments:True"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "memviz whatif FILE" in p.stderr, p.stderr


def test_the_refused_request_carries_its_label_to_name_a_backward_line(standin, tmp_path, monkeypatch):
    """The out-of-memory point keeps the refused request's label: a request
    the backward made with no Python frames is named by its node's forward
    line, as every other view names it (on the H200 the transformer's was
    '<no Python frames>' while PyTorch raised at loss.backward())."""
    import memviz.analysis.whatif as W

    with _recording(standin, tmp_path, "labelled") as (ans, path, _):
        a = ans.alloc(20 * MiB)[0]
        b = ans.alloc(30 * MiB)[0]
        del b
        c = ans.alloc(31 * MiB)[0]
        with memviz.label("the refused one"):
            d = ans.alloc(20 * MiB)[0]
        del a, c, d
    trace = memviz.load(str(path))
    seen = []
    real = W._line
    monkeypatch.setattr(W, "_line", lambda tr, stack, label=0: seen.append(label) or real(tr, stack, label))
    row, = _rows(trace, device_memory="60MiB")
    assert row.oom is not None and row.oom.requested == 20 * MiB
    assert trace._labels[seen[-1]] == "the refused one"  # the last call names the refused request


def test_a_backward_request_is_named_by_its_forward_line():
    from memviz.analysis.whatif import _line
    from memviz.model.snapshot import encode_node_label

    class Recording:
        frame_filter = None
        _labels = {3: encode_node_label("MmBackward0", "train.py:15"),
                   4: encode_node_label("AddBackward0", "#9"), 5: "a user label",
                   6: encode_node_label("ViewBackward0", None)}

        def _resolve(self, ids):
            return {9: [("/home/me/train.py", 21, "forward")]} if 9 in ids else {}

    r = Recording()
    assert _line(r, 0, 3) == "train.py:15 (backward: MmBackward0)"
    assert _line(r, 0, 4) == "/home/me/train.py:21 (backward: AddBackward0)"
    assert _line(r, 0, 5) == "<no Python frames>"
    assert _line(r, 0, 6) == "<forward line unknown> (backward: ViewBackward0)"
    assert _line(r, 0) == "<no Python frames>" and _line(r, 7) == "<stack 7>"


def test_a_refused_backward_request_names_the_line_that_called_backward(standin, tmp_path):
    """A request with no Python frames (the autograd engine's thread) is
    named by the line that called backward(), where PyTorch raises the
    error, when the last request with Python frames before it was PyTorch's
    first gradient, asked for inside torch.autograd's backward (on the H200
    the transformer's refused request was named by its node's forward line
    while PyTorch raised at loss.backward())."""
    ans = standin("backward_caller")
    # a code object of PyTorch's backward() (its file and function as PyTorch's)
    fake_torch = tmp_path / "site-packages" / "torch" / "autograd" / "__init__.py"
    scope = {"ans": ans, "MiB": MiB}
    exec(compile("def backward():\n"
                 "    first_grad = ans.alloc(512)\n"
                 "    ans.lib.sa_native_thread(1, 1, 30 * MiB)  # the engine thread's request\n"
                 "    return first_grad\n", str(fake_torch), "exec"), scope)
    path = tmp_path / "backward.memviz"
    with memviz.track(trace=str(path)) as t:
        assert t.torch.use_answers(ans).route == "allocator"
        ans.empty_cache()
        grad = scope["backward"]()  # the line that called backward()
        called_at = sys._getframe().f_lineno - 1
        ans.lib.sa_native_free_kept()
        del grad
    trace = memviz.load(str(path))
    row, = _rows(trace, device_memory="16MiB")
    assert row.oom is not None and row.oom.requested == 30 * MiB
    assert row.oom.line.endswith(f"test_whatif.py:{called_at}"), row.oom.line
    assert row.oom.backward == "a backward pass"  # no node label in this stand-in
    assert row.to_dict()["oom"]["backward"] == "a backward pass"
    from memviz.analysis.whatif import rows_text
    assert f"test_whatif.py:{called_at} (in the backward: a backward pass)" in rows_text([row])

    # a frameless request whose last framed request was not PyTorch's backward keeps the old name
    path2 = tmp_path / "plain.memviz"
    with memviz.track(trace=str(path2)) as t:
        assert t.torch.use_answers(ans).route == "allocator"
        ans.empty_cache()
        keep = ans.alloc(512)
        ans.lib.sa_native_thread(1, 1, 30 * MiB)
        ans.lib.sa_native_free_kept()
        del keep
    row, = _rows(memviz.load(str(path2)), device_memory="16MiB")
    assert row.oom is not None and row.oom.backward is None and row.oom.line == "<no Python frames>"
