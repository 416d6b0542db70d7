"""Snapshots at scale: Tracker.top(n) is snapshot().statistics()[:n], from
groups the C core makes, without an object per live allocation."""

import pytest

import memviz
from fake_cupti import CBID_cuMemAlloc_v2


# ---- item 11: snapshots at scale ---------------------------------------------


def _same(stats, top):
    return [(str(s.key), s.size, s.count) for s in stats] == [(str(s.key), s.size, s.count) for s in top]


def test_top_is_the_statistics_head_without_an_object_per_allocation(fake, tmp_path):
    """Issue 24, item 11: snapshot() builds an object per live allocation
    (8 million took 55 s and 4 GB); Tracker.top(n) gives statistics()[:n]
    from groups the C core makes, live, nested and once frozen."""
    def site_a(n):
        fake.alloc_loop(n, 4096)  # many allocations, one line

    def site_b():
        for i in range(30):
            fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)

    lib = tmp_path / "deep_library.py"  # 20 library frames inside the user's line
    lib.write_text("def down(alloc, n):\n    return alloc() if n == 0 else down(alloc, n - 1)\n")
    memviz.frames.add_library_path(str(tmp_path))
    import importlib.util
    spec = importlib.util.spec_from_file_location("deep_library", lib)
    deep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deep)

    with memviz.track(torch=False) as t:
        site_a(20000)
        site_b()
        import functools
        deep.down(functools.partial(fake._c.fake_alloc, CBID_cuMemAlloc_v2, 9 << 20, 0, 0), 20)  # DEEP
        with memviz.label("lab"):
            fake.alloc(CBID_cuMemAlloc_v2, 3 << 20)
        fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 5 << 20)  # no Python frames
        with memviz.track(torch=False) as inner:
            site_b()
            site_a(100)
        for key in ("lineno", "filename", "label", "thread", "device"):
            stats = t.snapshot().statistics(key)
            assert _same(stats, t.top(None, key)), key
            assert _same(stats[:2], t.top(2, key)), key
        assert t.top(1)[0].count == 20100 and t.top(1)[0].size == 20100 * 4096
        nine = [s for s in t.top(None) if s.size == 9 << 20]
        assert len(nine) == 1 and nine[0].key.filename == __file__, nine  # this file's line, past 21 frames
        assert "DEEP" in open(__file__).read().splitlines()[nine[0].key.lineno - 1]
        assert _same(inner.snapshot().statistics("lineno"), inner.top(None))
        assert t.top(0) == []
    with memviz.track(torch=False):  # the store goes on: t reads its frozen copy
        fake.alloc(CBID_cuMemAlloc_v2, 7 << 20)
    assert _same(t.snapshot().statistics("lineno"), t.top(None))
    with pytest.raises(memviz.MemvizError):
        t.top(-1)
