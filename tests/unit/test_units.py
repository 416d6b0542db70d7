"""Tests for memviz._units (format_size / parse_size)."""

import pytest

from memviz._units import format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (10 * KiB, "10 KiB"),
        (int(12.5 * MiB), "12.5 MiB"),
        (256 * MiB, "256 MiB"),
        (1000 * MiB, "1000 MiB"),
        (GiB, "1 GiB"),
        (GiB - 1, "1 GiB"),  # rounds up into the next unit, never "1024 MiB"
        (3 * GiB // 2, "1.5 GiB"),
        (int(1.25 * GiB), "1.25 GiB"),
        (80 * GiB, "80 GiB"),
        (TiB, "1 TiB"),
        (33.4, "33 B"),  # averages may be fractional
        (256 * MiB / 3, "85.3 MiB"),
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_size_sign():
    assert format_size(256 * MiB, sign=True) == "+256 MiB"
    assert format_size(-256 * MiB, sign=True) == "-256 MiB"
    assert format_size(-1536) == "-1.5 KiB"
    assert format_size(0, sign=True) == "+0 B"


def test_format_size_rejects_non_numbers():
    with pytest.raises(TypeError):
        format_size("1 GiB")
    with pytest.raises(TypeError):
        format_size(True)


@pytest.mark.parametrize(
    "text, n",
    [
        (1024, 1024),
        (0, 0),
        (2e9, 2_000_000_000),
        ("1024", 1024),
        ("2 GiB", 2 * GiB),
        ("2GiB", 2 * GiB),
        ("512MB", 512_000_000),
        ("512 MiB", 512 * MiB),
        ("1.5 GiB", 3 * GiB // 2),
        ("1.5 gib", 3 * GiB // 2),
        (" 4 kib ", 4 * KiB),
        ("3 KB", 3000),
        ("1 TB", 10**12),
        ("1 TiB", TiB),
        ("10 B", 10),
        ("10 bytes", 10),
        (".5 KiB", 512),
        ("1_000 MB", 10**9),
        ("1.1 KiB", 1126),  # 1126.4 rounded to whole bytes
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize("bad", ["", "abc", "GiB", "1.2.3", "1 2", "1e9", "1__0"])
def test_parse_size_malformed(bad):
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["2 G", "5 M", "3 gigs", "1 Kb/s"])
def test_parse_size_unknown_unit(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    msg = str(info.value)
    assert "KiB" in msg and "MB" in msg


@pytest.mark.parametrize("bad", [-1, "-1", "-2 GiB", -1.0])
def test_parse_size_negative(bad):
    with pytest.raises(ValueError, match="negative"):
        parse_size(bad)


def test_parse_size_other_errors():
    with pytest.raises(ValueError, match="whole number"):
        parse_size(1.5)
    with pytest.raises(ValueError, match="finite"):
        parse_size(float("inf"))
    with pytest.raises(TypeError):
        parse_size(True)
    with pytest.raises(TypeError):
        parse_size([1024])


def test_round_trip():
    for n in (1, 1536, 256 * MiB, 3 * GiB // 2, 80 * GiB):
        assert parse_size(format_size(n)) == n


def test_heap_kinds_sorts_objects_by_type_in_order():
    """_core.heap_kinds, the categories' pass over gc.get_objects(): subclasses
    of the tensor and optimizer types by their MRO (an __instancecheck__ or a
    proxy is not consulted), the graph type exactly, order kept."""
    import weakref

    from memviz import _core

    class Tensor: pass
    class Param(Tensor): pass
    class Optim: pass
    class Adam(Optim): pass
    class Graph: pass
    class SubGraph(Graph): pass

    class Liar:  # claims to be a tensor through __class__
        __class__ = Tensor

    t1, p, t2, a, g, sg, liar = Tensor(), Param(), Tensor(), Adam(), Graph(), SubGraph(), Liar()
    proxy = weakref.proxy(t1)
    objs = [1, "x", t1, p, a, proxy, g, sg, liar, t2, Optim]
    tensors, optims, graphs = _core.heap_kinds(objs, Tensor, Optim, Graph)
    assert tensors == [t1, p, t2] and optims == [a] and graphs == [g]
    assert _core.heap_kinds(objs, None, None, None) == ([], [], [])
    assert _core.heap_kinds(iter([]), Tensor, Optim, Graph) == ([], [], [])
    with pytest.raises(TypeError, match="must be a type or None"):
        _core.heap_kinds(objs, "Tensor", Optim, Graph)
    # more distinct types than the memo's first size
    many = [type(f"T{i}", (Tensor if i % 2 else object,), {})() for i in range(5000)]
    assert len(_core.heap_kinds(many, Tensor, None, None)[0]) == 2500
    # None: the collector's own objects, read within the call
    tensors, optims, graphs = _core.heap_kinds(None, Tensor, Optim, Graph)
    assert {id(x) for x in (t1, p, t2)} <= {id(x) for x in tensors} and liar not in tensors
    assert a in optims and g in graphs and sg not in graphs
    with pytest.raises(TypeError, match="sequence of objects or None"):
        _core.heap_kinds(5, Tensor, Optim, Graph)


def test_referrers_leave_out_a_tuple_still_being_built():
    """_core.referrers is gc.get_referrers without the tuples a tuple() call
    is still filling: holding one in a list while that call went on made
    its resize fail (SystemError in the user's code, src/module_heap.c).
    Here the generator that feeds tuple() looks, so the tuple is mid-build:
    with unfilled slots (after 2 items of 10), and full (after 10 items,
    before the resize the 11th brings)."""
    import gc

    from memviz import _core

    x = object()
    history = [(x, 1)]  # a complete tuple with one owner: a holder
    seen = {}

    def feed(n):
        for _ in range(n):
            yield x
        # names only: a list holding the tuple must be gone before tuple() goes on
        seen[n] = ([type(r).__name__ for r in gc.get_referrers(x) if r is not history[0]],
                   [type(r).__name__ for r in _core.referrers(x) if r is not history[0]],
                   any(r is history[0] for r in _core.referrers(x)))
        yield 2

    for n in (2, 10):
        t = tuple(feed(n))
        assert len(t) == n + 1
        gcs, ours, holder = seen[n]
        assert "tuple" in gcs, gcs          # gc's list holds the tuple being built
        assert "tuple" not in ours and holder, ours
    assert any(r is history for r in _core.referrers(history[0]))
    assert _core.referrers(object()) == []
