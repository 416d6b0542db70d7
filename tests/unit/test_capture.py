"""The real CUPTI code path, driven through the libcupti test double.

Each test fires "driver" memory callbacks the way CUDA would (from the
calling thread, inside the call) and checks what memviz attributes them to.
"""

import asyncio
import functools
import os
import sys
import threading

import pytest

import memviz
from conftest import here, line_of
from fake_cupti import (CBID_cuMemAddressFree, CBID_cuMemAddressReserve, CBID_cuMemAlloc_v2,
                        CBID_cuMemAllocAsync, CBID_cuMemAllocAsync_ptsz,
                        CBID_cuMemAllocFromPoolAsync, CBID_cuMemAllocFromPoolAsync_ptsz,
                        CBID_cuMemAllocHost_v2, CBID_cuMemAllocManaged, CBID_cuMemAllocPitch_v2,
                        CBID_cuMemCreate, CBID_cuMemFree_v2, CBID_cuMemFreeAsync,
                        CBID_cuMemFreeAsync_ptsz, CBID_cuMemFreeHost, CBID_cuMemHostAlloc,
                        CBID_cuMemMap, CBID_cuMemRelease, CBID_cuMemUnmap,
                        CUDA_ERROR_OUT_OF_MEMORY, DOMAIN_DRIVER_API)

MiB = 1 << 20
THIS = os.path.abspath(__file__)


def lines(snapshot):
    """{(basename, lineno): (size, count)} of the user's lines."""
    out = {}
    for s in snapshot.statistics("lineno"):
        out[(os.path.basename(s.key.filename), s.key.lineno)] = (s.size, s.count)
    return out


def only_line(snapshot):
    stats = snapshot.statistics("lineno")
    assert len(stats) == 1, [str(s) for s in stats]
    return stats[0]


# ---- attribution ----------------------------------------------------------


def test_alloc_is_attributed_to_its_line(fake):
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 256 * MiB); line = here()  # noqa: E702
    stat = only_line(t.snapshot())
    assert (stat.key.filename, stat.key.lineno) == (THIS, line)
    assert (stat.size, stat.count) == (256 * MiB, 1)
    assert str(stat).startswith(f"{THIS}:{line}: size=256 MiB, count=1")
    assert t.current_bytes() == 256 * MiB
    assert t.peak_bytes(0) == 256 * MiB


def inner_alloc(fake, size):
    return fake.alloc(CBID_cuMemAlloc_v2, size)  # INNER


def outer_alloc(fake, size):
    return inner_alloc(fake, size)  # OUTER


def _line_of(marker):
    return line_of(THIS, marker)


def test_nested_calls_keep_the_full_traceback(fake):
    with memviz.track() as t:
        outer_alloc(fake, MiB); call_line = here()  # noqa: E702
    a, = t.snapshot().allocations
    frames = [(f.filename, f.lineno, f.name) for f in reversed(a.traceback) if f.filename == THIS]
    assert frames[:3] == [
        (THIS, _line_of("# INNER"), "inner_alloc"),
        (THIS, _line_of("# OUTER"), "outer_alloc"),
        (THIS, call_line, "test_nested_calls_keep_the_full_traceback"),
    ]
    assert a.traceback.user_frame.lineno == _line_of("# INNER")
    # The wrapper of the test double is library code here: skipped for "lineno".
    assert "fake_cupti" in a.traceback[-1].filename  # the innermost frame


class Model:
    def build(self, fake):
        return fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)  # METHOD

    @staticmethod
    def static(fake):
        return fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)  # STATIC


def counting(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)  # DECORATOR WRAPPER
    return wrapper


@counting
def decorated(fake):
    return fake.alloc(CBID_cuMemAlloc_v2, 7 * MiB)  # DECORATED


def gen_allocs(fake, n):
    for _ in range(n):
        yield fake.alloc(CBID_cuMemAlloc_v2, 11 * MiB)  # GENERATOR


async def coro_alloc(fake):
    await asyncio.sleep(0)
    return fake.alloc(CBID_cuMemAlloc_v2, 13 * MiB)  # COROUTINE


def test_methods_lambdas_comprehensions_generators_coroutines_decorators(fake):
    with memviz.track() as t:
        Model().build(fake)
        Model.static(fake)
        decorated(fake)
        list(gen_allocs(fake, 2))
        asyncio.run(coro_alloc(fake))
        f = lambda: fake.alloc(CBID_cuMemAlloc_v2, 17 * MiB); lam = here()  # noqa: E702,E731
        f()
        [fake.alloc(CBID_cuMemAlloc_v2, 19 * MiB) for _ in range(3)]; comp = here()  # noqa: E702
        {i: fake.alloc(CBID_cuMemAlloc_v2, 23 * MiB) for i in range(2)}; dcomp = here()  # noqa: E702
    got = lines(t.snapshot())
    name = os.path.basename(THIS)
    assert got == {
        (name, _line_of("# METHOD")): (3 * MiB, 1),
        (name, _line_of("# STATIC")): (5 * MiB, 1),
        (name, _line_of("# DECORATED")): (7 * MiB, 1),
        (name, _line_of("# GENERATOR")): (22 * MiB, 2),
        (name, _line_of("# COROUTINE")): (13 * MiB, 1),
        (name, lam): (17 * MiB, 1),
        (name, comp): (57 * MiB, 3),
        (name, dcomp): (46 * MiB, 2),
    }
    # The names of the frames are the functions' qualified names.
    by_line = {a.traceback.user_frame.lineno: a.traceback.user_frame.name for a in t.snapshot()}
    # Code objects carry qualified names from 3.11 on.
    assert by_line[_line_of("# METHOD")] == ("Model.build" if sys.version_info >= (3, 11) else "build")
    assert by_line[_line_of("# COROUTINE")] == "coro_alloc"
    assert by_line[lam].endswith("<lambda>")


def thread_worker(fake, size, barrier):
    barrier.wait()
    for _ in range(50):
        fake.alloc(CBID_cuMemAlloc_v2, size)  # THREAD


@pytest.mark.parametrize("hold_gil", [False, True], ids=["gil-released", "gil-held"])
def test_eight_python_threads_at_once(fake, hold_gil):
    ctl = fake.with_gil(hold_gil)
    barrier = threading.Barrier(8)
    threads = [threading.Thread(target=thread_worker, args=(ctl, (i + 1) * 4096, barrier),
                                name=f"worker-{i}") for i in range(8)]
    with memviz.track() as t:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    snap = t.snapshot()
    assert len(snap) == 400
    by_thread = {}
    for a in snap:
        assert a.traceback.user_frame.lineno == _line_of("# THREAD")
        by_thread.setdefault(a.thread.name, set()).add(a.size)
    assert by_thread == {f"worker-{i}": {(i + 1) * 4096} for i in range(8)}


def test_threads_that_run_one_after_another_keep_their_names(fake):
    """glibc gives an ended thread's ident (threading.get_ident()) to the next
    thread: each thread must still be named by its own threading name."""
    def work():
        fake.alloc(CBID_cuMemAlloc_v2, 4096)

    with memviz.track() as t:
        for i in range(50):
            th = threading.Thread(target=work, name=f"seq-{i}")
            th.start()
            th.join()
    snap = t.snapshot()
    assert sorted(a.thread.name for a in snap) == sorted(f"seq-{i}" for i in range(50))
    assert len({a.thread.native_id for a in snap}) == 50


def test_names_of_ended_threads_are_pruned_but_not_those_in_use(fake, monkeypatch):
    from memviz.model import threads as _threads
    from memviz.capture import threads as _threads

    monkeypatch.setattr(_threads, "_SEEN_KEEP", 8)
    monkeypatch.setattr(_threads, "_seen_prune_at", 8)

    def work(i):
        if i % 3 == 0:
            fake.alloc(CBID_cuMemAlloc_v2, 4096)

    with memviz.track() as t:
        for i in range(60):
            th = threading.Thread(target=work, args=(i,), name=f"p-{i}")
            th.start()
            th.join()
        assert len(_threads.SEEN_THREADS) <= 2 * 20 + 2  # the 20 that allocated, and a few more
    assert sorted(a.thread.name for a in t.snapshot()) == sorted(f"p-{i}" for i in range(0, 60, 3))


def test_threads_past_the_table_are_counted_and_named_as_such(fake):
    """Past the C table's 4,096 rows, threads share one row that says so (and
    are counted in capture_info()), rather than the table's last thread's."""
    extra = 5
    n = memviz._core.MAX_THREADS + extra
    with memviz.track() as t:
        for i in range(n):
            fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 4096 + i, thread_name=f"n{i}")
    names = {a.size - 4096: a.thread.name for a in t.snapshot()}
    assert len(names) == n
    assert [names[i] for i in range(n - extra)] == [f"n{i}" for i in range(n - extra)]
    assert {names[i] for i in range(n - extra, n)} == {f"<threads past the first {n - extra}>"}
    store = t.capture_info()["store"]
    assert (store["threads"], store["dropped_threads"]) == (n - extra, extra)


DYING_ON_A_WORKER = """
import json, sys, threading
sys.path[:0] = [{root!r}, {tests!r}]
import memviz
from fake_cupti import FakeCupti
fake = FakeCupti({fake_path!r}, hold_gil={hold_gil!r})
named = []
if {namer_adopts!r}:  # a call namer that adopts pending stacks while a frame is being resolved
    def namer(code, offset):
        named.append(code.co_name)
        memviz._core.resolve([])
        return None
    memviz._core.set_call_namer(namer)
def worker():
    for i in range({n}):
        ns = {{}}
        src = "def f%d(fake):\\n    return fake.alloc({cbid}, 4096)\\n" % i
        exec(compile(src, "<gen %d>" % i, "exec"), ns)
        ns["f%d" % i](fake)
        ns.clear()  # the function and its code object die here, on this thread
with memviz.track() as t:
    th = threading.Thread(target=worker)
    th.start()
    th.join()  # the main thread runs no Python meanwhile: no pending call
frames = sorted({{(f.filename, f.lineno, f.name) for a in t.snapshot() for f in a.traceback
                  if f.filename.startswith("<gen ")}})
print("RESULT " + json.dumps([len(t.snapshot()), frames, sorted(named)]), flush=True)
"""


@pytest.mark.parametrize("hold_gil,namer_adopts", [(False, False), (True, False), (False, True)],
                         ids=["gil-released", "gil-held", "namer-adopts"])
def test_code_objects_that_die_on_a_worker_thread_before_they_are_kept(fake_path, hold_gil,
                                                                        namer_adopts):
    """A worker thread runs exec'd functions that allocate and then drops
    them, while the main thread waits in join(): each code object dies before
    any thread could take a reference to it. Python < 3.12 used to read the
    freed code objects (a segfault); every frame must resolve, on every
    version, also when Python run while a frame is resolved (the call namer)
    adopts the other pending stacks. In a subprocess, so that a crash fails
    this test only."""
    import json
    import subprocess

    n = 300
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    code = DYING_ON_A_WORKER.format(root=root, tests=os.path.join(root, "tests"), fake_path=fake_path,
                                    hold_gil=hold_gil, namer_adopts=namer_adopts, n=n,
                                    cbid=CBID_cuMemAlloc_v2)
    env = dict(os.environ, MEMVIZ_CUPTI_LIBRARY=fake_path)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    result, = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    count, frames, named = result
    assert count == n
    assert frames == sorted([f"<gen {i}>", 2, f"f{i}"] for i in range(n))
    if namer_adopts:  # frames were resolved as their code objects died
        # Nearly all: a code object whose stack another path adopted first
        # (kept alive, so it no longer dies there) is resolved later instead;
        # seen once under a loaded full suite. Every frame resolved: above.
        assert set(named) <= {f"f{i}" for i in range(n)} and len(named) >= n - 10, named


def test_frameless_native_thread_has_its_name_and_no_frames(fake):
    with memviz.track() as t:
        fake.alloc_in_native_thread(CBID_cuMemAlloc_v2, 2 * MiB, device=1, thread_name="pt_autograd_1")
    a, = t.snapshot().allocations
    assert len(a.traceback) == 0
    assert a.thread.name == "pt_autograd_1"
    assert a.device == 1
    stat, = t.snapshot().statistics("label")
    assert stat.key == "<thread pt_autograd_1>"


def test_label_reaches_a_frameless_thread(fake):
    """A hook running Python on a C++ thread sets a label; the thread's later
    allocation, made with no Python frames, carries it (autograd's case)."""
    with memviz.track() as t:
        fake.alloc_in_native_thread_after(
            lambda: memviz._core.label_set(memviz._core.label_intern("MmBackward0")),
            CBID_cuMemAlloc_v2, 4 * MiB, device=0, thread_name="engine")
    a, = t.snapshot().allocations
    assert len(a.traceback) == 0
    assert a.label == "MmBackward0"
    assert a.thread.name == "engine"


def test_label_context_manager_is_thread_local_and_nests(fake):
    seen = {}

    def other():
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)

    with memviz.track() as t:
        with memviz.label("data loading"):
            fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
            th = threading.Thread(target=other)
            th.start()
            th.join()
            with memviz.label("inner"):
                fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
            fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)
    for a in t.snapshot():
        seen[a.size // MiB] = a.label
    assert seen == {2: "data loading", 1: None, 3: "inner", 4: "data loading", 5: None}
    stats = {s.key: s.size for s in t.snapshot().statistics("label")}
    assert stats["data loading"] == 6 * MiB


def _sizes_to_labels(t):
    return {a.size // MiB: a.label for a in t.snapshot()}


def test_label_blocks_ending_out_of_order_leave_no_label_behind(fake):
    """Two generators (or asyncio tasks) whose label blocks end out of order:
    once both ended, the thread has no label (it kept one of them for good,
    into later trackers too)."""
    def gen(name):
        with memviz.label(name):
            yield
            yield

    with memviz.track() as t:
        a, b = gen("A"), gen("B")
        next(a), next(b)  # A entered, then B
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)  # the innermost open block: B
        next(a, None), next(a, None)  # A ends first
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)  # B still open
        next(b, None), next(b, None)
        fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
    assert _sizes_to_labels(t) == {1: "B", 2: "B", 3: None}
    assert memviz._core.label_get() == 0
    with memviz.track() as later:
        fake.alloc(CBID_cuMemAlloc_v2, 4 * MiB)
    assert _sizes_to_labels(later) == {4: None}


def test_asyncio_tasks_labels_end_with_their_blocks(fake):
    import asyncio

    async def work(name, delay):
        with memviz.label(name):
            await asyncio.sleep(delay)

    async def both():
        await asyncio.gather(work("A", 0.01), work("B", 0.02))

    with memviz.track() as t:
        asyncio.run(both())
        fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
    assert _sizes_to_labels(t) == {1: None}
    assert memviz._core.label_get() == 0


def test_the_decorator_labels_generators_and_async_functions_only_while_they_run(fake):
    import asyncio

    lab = memviz.label("loader")

    @lab
    def batches(n):
        for _ in range(n):
            fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
            got = yield
            assert got == "sent"

    @lab
    async def fetch():
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
        await asyncio.sleep(0)
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
        return "fetched"

    @lab
    async def stream():
        for _ in range(2):
            fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB)
            yield 1
            await asyncio.sleep(0)

    async def consume():
        got = [x async for x in stream()]
        fake.alloc(CBID_cuMemAlloc_v2, 6 * MiB)  # between and after: no label
        return got

    with memviz.track() as t:
        g = batches(2)
        next(g)
        fake.alloc(CBID_cuMemAlloc_v2, 5 * MiB)  # the caller, the generator suspended
        g.send("sent")
        g.close()
        assert asyncio.run(fetch()) == "fetched"
        assert asyncio.run(consume()) == [1, 1]
    by_size = {}
    for a in t.snapshot():
        by_size.setdefault(a.size // MiB, set()).add(a.label)
    assert by_size == {1: {"loader"}, 2: {"loader"}, 3: {"loader"}, 5: {None}, 6: {None}}
    assert memviz._core.label_get() == 0
    assert batches.__name__ == "batches" and fetch.__name__ == "fetch"


def test_a_label_block_ended_on_another_thread_raises_nothing(fake):
    """A generator entered a label on one thread and was finished on
    another: no raw AttributeError; the first thread's label goes back when
    it next uses a label."""
    def gen():
        with memviz.label("moved"):
            yield

    with memviz.track() as t:
        g = gen()
        next(g)
        th = threading.Thread(target=lambda: next(g, None))
        th.start()
        th.join()
        with memviz.label("next"):
            fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    assert _sizes_to_labels(t) == {1: "next", 2: None}
    assert memviz._core.label_get() == 0


LABELS_PAST_THE_TABLE = """
import json, sys, warnings
sys.path[:0] = [{root!r}, {tests!r}]
import memviz
from fake_cupti import FakeCupti
fake = FakeCupti({fake_path!r})
n = {n}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with memviz.track(trace={trace!r}, torch=False) as t:
        for i in range(n):
            with memviz.label(f"step {{i}}"):
                fake.alloc({cbid}, 4096 + i)
        with memviz.label("x" * 5000):  # fits neither: no id left
            fake.alloc({cbid}, 1)
by_size = {{a.size: a.label for a in t.snapshot()}}
loaded = {{a.size: a.label for a in memviz.load({trace!r}).snapshot()}}
print("RESULT " + json.dumps(dict(
    labels=[by_size[4096 + i] for i in range(n)], big=by_size[1], same=by_size == loaded,
    store=t.capture_info()["store"],
    warnings=[str(w.message) for w in caught if issubclass(w.category, memviz.CaptureWarning)])))
"""

ARENA_PAST_ITS_SIZE = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
import memviz
memviz._core.init()
# 4,300 labels of 1,000 characters: 4.3 MB of text; 4,190 fit in 4 MiB, and 114 bytes are left
ids = [memviz.label(f"{{i:04}}" + "x" * 996)._id for i in range(4300)]
small = memviz.label("small")._id
print("RESULT " + json.dumps(dict(names=[memviz._core.label_name(i) for i in ids],
                                  small=memviz._core.label_name(small),
                                  info=memviz._core.stats()["labels_overflowed"])))
"""


def _run_script(template, **kw):
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    code = template.format(root=root, tests=os.path.join(root, "tests"), **kw)
    env = dict(os.environ, MEMVIZ_CUPTI_LIBRARY=kw.get("fake_path", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    result, = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return result


def test_labels_past_the_table_share_one_overflow_label(fake_path, tmp_path):
    """label(f"step {i}") used to raise MemoryError from step 65,533 on, for
    the rest of the process. Past the table, labels share one overflow label,
    counted in capture_info() and said once in a warning. (A subprocess: the
    table lives as long as the process.)"""
    n = 65600
    r = _run_script(LABELS_PAST_THE_TABLE, fake_path=fake_path, n=n, cbid=CBID_cuMemAlloc_v2,
                    trace=str(tmp_path / "labels.memviz"))
    overflow = memviz._core.LABEL_OVERFLOW
    room = sum(label != overflow for label in r["labels"])
    assert room > 65000 and r["store"]["labels"] == 65534  # ids 1 to 65,534; 65,535 is the overflow's
    assert r["labels"] == [f"step {i}" for i in range(room)] + [overflow] * (n - room)
    assert r["big"] == overflow
    assert r["same"]  # the trace file keeps the overflow label too
    assert r["store"]["labels_overflowed"] == n - room + 1
    assert len(r["warnings"]) == 1 and f"'step {room}'" in r["warnings"][0]


def test_label_text_past_the_arena_overflows_too():
    r = _run_script(ARENA_PAST_ITS_SIZE)
    fits = sum(name != memviz._core.LABEL_OVERFLOW for name in r["names"])
    assert fits == (4 << 20) // 1001
    assert r["names"][:fits] == [f"{i:04}" + "x" * 996 for i in range(fits)]
    assert set(r["names"][fits:]) == {memviz._core.LABEL_OVERFLOW}
    assert r["small"] == "small"  # short labels still fit what is left
    assert r["info"] == 4300 - fits


def test_label_names_with_nul_or_lone_surrogates_are_refused(fake):
    from memviz._errors import InvalidArgument

    for bad in ("a\0b", "data\udcff"):
        with pytest.raises(InvalidArgument) as e:
            memviz.label(bad)
        assert isinstance(e.value, memviz.MemvizError) and isinstance(e.value, ValueError)
        assert repr(bad) in str(e.value)
    with memviz.track() as t:
        with memviz.label("a\0b".replace("\0", " ")):
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert [a.label for a in t.snapshot()] == ["a b"]


def test_internal_labels_keep_surrogates_exactly(fake):
    """Autograd labels name forward lines, whose file names may not be UTF-8
    (surrogates): interned and read back unchanged."""
    text = "\x01MmBackward0\x1f/data/d\udcff/train.py:3"
    lid = memviz._core.label_intern(text)
    assert memviz._core.label_name(lid) == text
    with pytest.raises(ValueError):
        memviz._core.label_intern("a\0b")
    with pytest.raises(ValueError):  # trace events keep 16 bits of the label id
        memviz._core.label_set(1 << 16)


def test_depth_limits_the_stack(fake):
    def rec(n):
        return rec(n - 1) if n else fake.alloc(CBID_cuMemAlloc_v2, MiB)

    with memviz.track(depth=5) as t:
        rec(20)
    a, = t.snapshot().allocations
    assert len(a.traceback) == 5


# ---- frees, peaks, kinds ----------------------------------------------------


def test_frees_and_the_peak_set(fake):
    with memviz.track() as t:
        a = fake.alloc(CBID_cuMemAlloc_v2, 1 * MiB); la = here()  # noqa: E702
        b = fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB); lb = here()  # noqa: E702
        fake.free(CBID_cuMemFree_v2, a)
        fake.free(CBID_cuMemFree_v2, b)
        fake.alloc(CBID_cuMemAlloc_v2, MiB // 2); lc = here()  # noqa: E702
        fake.free(CBID_cuMemFree_v2, 0xDEAD000)  # never allocated while tracking
    name = os.path.basename(THIS)
    assert lines(t.snapshot()) == {(name, lc): (MiB // 2, 1)}
    assert lines(t.peak_snapshot()) == {(name, la): (MiB, 1), (name, lb): (2 * MiB, 1)}
    assert list(t.totals()) == [0], t.totals()
    tot = t.totals()[0]
    assert (tot["current"], tot["peak"], tot["allocs"], tot["frees"]) == (MiB // 2, 3 * MiB, 3, 2)
    assert t.capture_info()["store"]["unmatched_frees"] == 1


def test_peak_set_survives_later_churn(fake):
    with memviz.track() as t:
        keep = [fake.alloc(CBID_cuMemAlloc_v2, MiB) for _ in range(10)]
        for x in keep:
            fake.free(CBID_cuMemFree_v2, x)
        for _ in range(5000):  # lots of small traffic below the peak
            fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 4096))
    peak = t.peak_snapshot(0)
    assert peak.total_bytes() == 10 * MiB and len(peak) == 10
    assert t.peak_bytes() == 10 * MiB and t.current_bytes() == 0


@pytest.mark.parametrize("alloc_cbid, free_cbid", [
    (CBID_cuMemAllocAsync, CBID_cuMemFreeAsync),
    (CBID_cuMemAllocAsync_ptsz, CBID_cuMemFreeAsync_ptsz),
    (CBID_cuMemAllocFromPoolAsync, CBID_cuMemFreeAsync),
    (CBID_cuMemAllocFromPoolAsync_ptsz, CBID_cuMemFreeAsync_ptsz),
    (CBID_cuMemAllocPitch_v2, CBID_cuMemFree_v2),
])
def test_stream_ordered_and_pitched_allocations(fake, alloc_cbid, free_cbid):
    with memviz.track() as t:
        x = fake.alloc(alloc_cbid, 8 * MiB, stream=0x77); line = here()  # noqa: E702
        y = fake.alloc(alloc_cbid, 1 * MiB, stream=0x77)
        fake.free(free_cbid, y, stream=0x77)
    a, = t.snapshot().allocations
    assert (a.address, a.size, a.kind, a.traceback.user_frame.lineno) == (x, 8 * MiB, "device", line)
    if alloc_cbid != CBID_cuMemAllocPitch_v2:
        assert a.stream == 0x77


def test_kinds_host_managed_physical(fake):
    with memviz.track() as t:
        h = fake.alloc(CBID_cuMemHostAlloc, 1 * MiB)
        fake.alloc(CBID_cuMemAllocHost_v2, 2 * MiB)
        fake.alloc(CBID_cuMemAllocManaged, 4 * MiB)
        handle = fake.alloc(CBID_cuMemCreate, 8 * MiB)
        va = fake.alloc(CBID_cuMemAddressReserve, 64 * MiB)
        fake.map(CBID_cuMemMap, va, 8 * MiB, handle)
        mid = t.snapshot()
        fake.map(CBID_cuMemUnmap, va, 8 * MiB)
        fake.free(CBID_cuMemAddressFree, va)
        fake.free(CBID_cuMemRelease, handle)
        fake.free(CBID_cuMemFreeHost, h)
    kinds = {a.kind: (a.device, a.size) for a in mid}
    assert kinds == {"host": (-1, 1 * MiB), "managed": (0, 4 * MiB), "physical": (0, 8 * MiB)} or \
        sorted((a.kind, a.device, a.size) for a in mid) == sorted([
            ("host", -1, 1 * MiB), ("host", -1, 2 * MiB), ("managed", 0, 4 * MiB),
            ("physical", 0, 8 * MiB)])
    # Reserving address space is not memory; mapping does not count twice.
    assert t.totals()[0]["peak"] == 12 * MiB
    assert t.totals()[-1]["current"] == 2 * MiB
    calls = t.capture_info()["store"]["calls"]
    assert (calls["reserve"], calls["map"], calls["unmap"], calls["address_free"]) == (1, 1, 1, 1)


def test_devices_are_kept_apart(fake):
    def on(dev, size):
        fake.set_device(dev)
        return fake.alloc(CBID_cuMemAlloc_v2, size)

    with memviz.track() as t:
        on(0, MiB)
        on(3, 5 * MiB)
        fake.set_device(0)
    assert t.current_bytes(0) == MiB and t.current_bytes(3) == 5 * MiB
    assert {d: s.total_bytes() for d, s in t.snapshot().by_device().items()} == {0: MiB, 3: 5 * MiB}


def test_failed_allocation_is_recorded_with_size_and_line(fake):
    with memviz.track() as t:
        got = fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=CUDA_ERROR_OUT_OF_MEMORY); line = here()  # noqa: E702
    assert got == 0
    assert len(t.snapshot()) == 0
    f, = t.failures
    assert (f.size, f.device, f.result, f.traceback.user_frame.lineno) == (80 << 30, 0, 2, line)
    assert t.totals()[0]["failed"] == 1
    assert "failed to allocate 80 GiB" in str(f)


# ---- subscription, conflicts and errors --------------------------------------


def test_only_memory_callbacks_are_enabled_and_stop_unsubscribes(fake):
    with memviz.track():
        assert fake.is_subscribed()
        assert fake.is_enabled(DOMAIN_DRIVER_API, CBID_cuMemAlloc_v2)
        assert fake.enabled_count() == 20
        assert fake.domain_enable_calls() == 0
    assert not fake.is_subscribed()
    # Another tool (torch.profiler) can subscribe after the block.
    fake.set_conflict(None)
    with memviz.track() as t2:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert t2.current_bytes() == MiB


def test_another_subscriber_is_named(fake):
    """cupti=True: CUPTI or nothing (without it, tests/integration/test_cupti_sharing.py)."""
    fake.set_conflict("Kineto (torch.profiler)")
    with pytest.raises(memviz.CaptureConflict) as e:
        memviz.track(cupti=True).start()
    assert e.value.holder == "Kineto (torch.profiler)"
    assert "Kineto (torch.profiler)" in str(e.value)
    assert memviz.active_tracker() is None


@pytest.mark.parametrize("code, words", [(15, "driver"), (35, "administrators")])
def test_cupti_that_cannot_start_raises_capture_unavailable(fake, code, words):
    fake.set_subscribe_error(code)
    with pytest.raises(memviz.CaptureUnavailable) as e:
        memviz.track().start()
    assert words in str(e.value)
    assert any("cuptiSubscribe" in x for x in e.value.tried)
    # gpu=False still works.
    with memviz.track(gpu=False) as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert not t.gpu_enabled and t.current_bytes() == 0


def test_double_start_is_refused(fake):
    """(Nesting is allowed: tests/unit/test_nesting.py.)"""
    with memviz.track() as t:
        with pytest.raises(memviz.AlreadyTracking, match="already running"):
            t.start()
    with pytest.raises(memviz.AlreadyTracking, match="run once"):
        t.start()
    with pytest.raises(memviz.NotTracking):
        t.stop()
    with pytest.raises(memviz.NotTracking):
        memviz.stop()
    with pytest.raises(memviz.NotTracking):
        memviz.track().snapshot()


def test_start_stop_functions(fake):
    t = memviz.start()
    fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert memviz.stop() is t
    assert t.current_bytes() == MiB


def test_exception_inside_the_block_stops_and_keeps_data(fake):
    with pytest.raises(ZeroDivisionError):
        with memviz.track() as t:
            fake.alloc(CBID_cuMemAlloc_v2, MiB)
            1 / 0
    assert not t.running and not fake.is_subscribed()
    assert t.current_bytes() == MiB


def test_older_tracker_stays_readable_after_a_new_one(fake):
    with memviz.track() as t1:
        fake.alloc(CBID_cuMemAlloc_v2, MiB); l1 = here()  # noqa: E702
    with memviz.track() as t2:
        fake.alloc(CBID_cuMemAlloc_v2, 2 * MiB)
    assert t2.current_bytes() == 2 * MiB
    assert t1.current_bytes() == MiB
    assert only_line(t1.snapshot()).key.lineno == l1
    diff = t2.snapshot().compare_to(t1.snapshot(), "lineno")
    assert sorted(d.size_diff for d in diff) == [-MiB, 2 * MiB]


def test_capture_info_names_the_library(fake, fake_path):
    assert memviz.available()
    info = memviz.capture_info()
    assert info["available"] and os.path.realpath(info["library"]) == os.path.realpath(fake_path)
    assert info["version"] == 130001 and info["found_by"] == "MEMVIZ_CUPTI_LIBRARY"
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    ti = t.capture_info()
    assert ti["gpu_enabled"] and ti["store"]["calls"]["alloc"] == 1


def test_static_module_memory_from_activity_records(fake):
    with memviz.track() as t:
        assert fake.activity_enabled()
        fake.emit_memory2(1, 6, 0x7000_0000, 3 * MiB, 0, 123, "globals", "/x/libcublasLt.so.13")
        fake.emit_memory2(1, 3, 0x7100_0000, 5 * MiB, 0, 124, "dev", "/x/libfoo.so")  # not static
        snap = t.snapshot()  # flushes activity records first
    a, = [a for a in snap if a.kind == "static"]
    assert (a.address, a.size, a.label) == (0x7000_0000, 3 * MiB, "CUDA module globals (libcublasLt.so.13)")
    assert len(snap) == 1
    assert not fake.activity_enabled()


# ---- concurrency, fork and exit ----------------------------------------------


def test_native_threads_hammering_the_store(fake):
    with memviz.track() as t:
        assert fake.alloc_many_in_native_threads(8, 5000, 4096) == 0
    tot = t.totals()[0]
    assert (tot["allocs"], tot["frees"], tot["current"]) == (40000, 40000, 0)
    assert 4096 <= tot["peak"] <= 8 * 4096


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_while_tracking(fake):
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
        pid = os.fork()
        if pid == 0:  # child: capture is off, nothing crashes
            try:
                fake.alloc(CBID_cuMemAlloc_v2, MiB)
                ok = memviz.active_tracker() is None and not memviz._core.active()
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        fake.alloc(CBID_cuMemAlloc_v2, MiB)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.current_bytes() == 2 * MiB


def test_a_plugin_that_fails_to_start_leaves_nothing_running(fake, monkeypatch):
    """A plugin that raises in on_start: the plugins started before it are
    stopped (here the PyTorch integration's autograd hooks, when torch is
    installed: conftest checks none are left), and CUPTI is unsubscribed."""
    import importlib.util

    from memviz import tracker as _tracker

    from memviz.capture.events import CaptureEvents

    class Boom(CaptureEvents):
        stopped = False

        def on_start(self, tracker):
            raise RuntimeError("plugin failed")

        def on_stop(self, tracker):
            Boom.stopped = True

    original = _tracker.Tracker._attach

    def attach(self, session):
        original(self, session)
        session.subscribe(self, Boom())  # starts after the integration, which goes first

    monkeypatch.setattr(_tracker.Tracker, "_attach", attach)
    has_torch = importlib.util.find_spec("torch") is not None
    t = memviz.track(autograd=True) if has_torch else memviz.track()
    with pytest.raises(RuntimeError, match="plugin failed"):
        t.start()
    assert memviz.active_tracker() is None and not fake.is_subscribed()
    assert not Boom.stopped  # it never started
    if has_torch:
        assert t.torch in _tracker._session.started(t) and not t.graph.running


# ---- named records (the C core's rows) ----------------------------------------

RECORD_FIELDS = {
    "AllocationRow": ("address", "size", "device", "kind", "stream", "thread", "label",
                      "timestamp_ns", "stack_id", "seq", "requested", "flags"),
    "FailureRow": ("size", "device", "kind", "stream", "thread", "label", "timestamp_ns",
                   "stack_id", "result"),
    "SiteRow": ("stack_id", "live_bytes", "live_count", "peak_bytes", "alloc_count",
                "alloc_bytes"),
    "TimelinePoint": ("timestamp_ns", "device", "bytes"),
    "ThreadRow": ("native_id", "ident", "name", "serial"),
    "StepTotals": ("current", "window_peak", "live_count"),
    "StepChange": ("stack_id", "live_bytes", "live_count", "delta_bytes", "delta_count", "block_bytes",
                   "block_delta"),
    "Frame": ("filename", "lineno", "name"),
    "StoreCopy": ("live", "totals", "peaks", "timeline", "when_ns", "tensor_peaks", "block_totals"),
    "StepMark": ("devices", "changes"),
    "WindowOpen": ("id", "start_ns", "live"),
    "StartResult": ("result", "step", "error", "holder", "activity", "activity_error", "cupti", "shared_with"),
}


def _is_record(obj, name):
    """obj is a _core.<name>: a tuple whose fields are also its named attributes."""
    from memviz import _core

    cls = getattr(_core, name)
    assert type(obj) is cls, (type(obj), name)
    assert isinstance(obj, tuple) and len(obj) == len(RECORD_FIELDS[name])
    assert tuple(getattr(obj, f) for f in RECORD_FIELDS[name]) == tuple(obj)
    return True


def test_record_types_have_named_documented_fields():
    from memviz import _core

    for name, fields in RECORD_FIELDS.items():
        cls = getattr(_core, name)
        assert cls.__module__ == "memviz._core" and cls.__name__ == name
        assert cls.n_fields == cls.n_sequence_fields == len(fields)
        assert cls.__doc__
        for f in fields:
            assert getattr(cls, f).__doc__, f"{name}.{f} has no docstring"


def test_rows_are_named_records_in_the_old_order(fake):
    import pickle

    from memviz import _core

    with memviz.track() as t:
        keep = fake.alloc(CBID_cuMemAlloc_v2, 3 * MiB); line = here()  # noqa: E702
        gone = fake.alloc(CBID_cuMemAlloc_v2, MiB)
        fake.free(CBID_cuMemFree_v2, gone)
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=CUDA_ERROR_OUT_OF_MEMORY)

        live = [r for r in _core.live() if r.address == keep]
        assert len(live) == 1 and _is_record(live[0], "AllocationRow")
        r = live[0]
        assert (r[0], r[1], r[2], r[3]) == (keep, 3 * MiB, 0, _core.KIND_DEVICE)
        assert r.seq == r.timestamp_ns == r[7] == r[9] and r.stack_id == r[8] > 0
        assert pickle.loads(pickle.dumps(r)) == r  # importable type: rows pickle
        assert tuple(r) == r  # still equal to the plain tuple

        assert any(p.address == keep for p in _core.peak_live(0))
        assert all(_is_record(p, "AllocationRow") for p in _core.peak_live(0))
        fail = [f for f in _core.failures() if f.size == 80 << 30]
        assert fail and _is_record(fail[-1], "FailureRow")
        assert fail[-1].result == fail[-1][8] == CUDA_ERROR_OUT_OF_MEMORY
        sites = {s.stack_id: s for s in _core.sites()}
        assert _is_record(sites[r.stack_id], "SiteRow") and sites[r.stack_id].live_bytes >= 3 * MiB
        points = _core.timeline()
        assert points and all(_is_record(p, "TimelinePoint") for p in points)
        threads = _core.threads()
        assert _is_record(threads[r.thread], "ThreadRow")
        assert threads[r.thread].ident == threading.get_ident()

        (stack,) = _core.resolve([r.stack_id]).values()
        assert all(_is_record(f, "Frame") for f in stack)
        assert (THIS, line) in {(f.filename, f.lineno) for f in stack}

        c = _core.copy()
        assert _is_record(c, "StoreCopy") and c.live is c[0] and c.when_ns == c[4]
        assert all(_is_record(x, "AllocationRow") for x in c.live + c.peaks)
        w = _core.window_open()
        try:
            assert _is_record(w, "WindowOpen") and w.live == w[2]
            assert _core.copy(w.id).live == []
        finally:
            _core.window_close(w.id)
        mark = _core.step_mark()
        assert _is_record(mark, "StepMark")
        devs, changes = mark  # unpacks as before
        assert _is_record(devs[0], "StepTotals") and devs[0].current == devs[0][0]
        assert all(_is_record(x, "StepChange") for x in changes)
    assert t.current_bytes() == 3 * MiB


# ---- replay: a loaded trace through the store's rules ----------------------------

def _replay_oracle(op, addr, size, kind, dev):
    """The rules replay() follows, written plainly: an ALLOC at a live address
    retires it, a FREE of an unknown address is ignored, blocks do not count
    in the device totals; a device's peak is the first ALLOC that reached it."""
    end, live, cur, peak, peak_i = [0] * len(op), {}, {}, {}, {}
    for i, (o, a, s, k, d) in enumerate(zip(op, addr, size, kind, dev)):
        if o not in (1, 2):
            continue
        j = live.pop((a, k), None)
        if j is not None:
            end[j] = i
            if kind[j] != 5:
                cur[dev[j]] -= size[j]
        if o == 1:
            live[(a, k)] = i
            if k != 5:
                cur[d] = cur.get(d, 0) + s
                if cur[d] > peak.get(d, 0):
                    peak[d], peak_i[d] = cur[d], i
    devices = sorted({d for o, d in zip(op, dev) if o in (1, 3)})
    return {"end": list(end), "live": sorted(live.values()),
            "alloc_idx": [i for i, o in enumerate(op) if o == 1],
            "fail_idx": [i for i, o in enumerate(op) if o == 3],
            "cur": {d: cur.get(d, 0) for d in devices}, "peak": {d: peak.get(d, 0) for d in devices},
            "peak_i": {d: peak_i.get(d, -1) for d in devices}}


def _columns(events):
    from array import array

    op, addr, size, kind, dev = zip(*events) if events else ((),) * 5
    return (bytes(op), array("Q", addr), array("Q", size), bytes(kind), array("b", dev))


def test_replay_follows_the_store_rules_on_random_events():
    import random

    from memviz import _core

    rng = random.Random(13)
    for trial in range(200):
        events = []
        for _ in range(rng.randrange(0, 120)):
            k = rng.choice([0, 1, 3, 4, 5])
            # one address pool per key space, so exact kinds and key spaces agree
            a = (k + 1) << 40 | rng.randrange(6) << 12
            events.append((rng.choice([1, 1, 1, 2, 2, 3, 4, 5]), a, rng.randrange(0, 5) << 20, k,
                           rng.choice([0, 1, -1, 7])))
        cols = _columns(events)
        got = _core.replay(*cols)
        want = _replay_oracle(*cols)
        assert got["end"].typecode == "q"
        assert {**got, "end": list(got["end"])} == want, (trial, events)


def test_replay_retires_across_kinds_of_one_key_space():
    """As the store: device, host, managed and static memory share addresses
    (one key space); an ALLOC at a live address of another kind retires it."""
    from memviz import _core

    A = 1 << 30
    got = _core.replay(*_columns([(1, A, 10, 0, 0), (1, A, 20, 2, 0), (2, A, 0, 2, 0)]))
    assert list(got["end"]) == [1, 2, 0] and got["live"] == []
    assert got["cur"] == {0: 0} and got["peak"] == {0: 20} and got["peak_i"] == {0: 1}
    # blocks and physical handles have key spaces of their own
    got = _core.replay(*_columns([(1, A, 10, 0, 0), (1, A, 4, 5, 0), (1, A, 8, 4, 0)]))
    assert got["live"] == [0, 1, 2] and got["cur"] == {0: 18}


def test_replay_rejects_ragged_or_misaligned_columns():
    from array import array

    from memviz import _core

    op, addr, size, kind, dev = _columns([(1, 4096, 1, 0, 0), (2, 4096, 0, 0, 0)])
    with pytest.raises(ValueError, match="size has 1 events, op has 2"):
        _core.replay(op, addr, array("Q", [1]), kind, dev)
    with pytest.raises(ValueError, match="not a whole number"):
        _core.replay(op, addr, bytes(9), kind, dev)
    with pytest.raises(TypeError):
        _core.replay(op, addr, size, kind, [0, 0])
    unaligned = memoryview(b"\0" + addr.tobytes())[1:]
    got = _core.replay(op, unaligned, size, kind, dev)
    assert list(got["end"]) == [1, 0] and got["live"] == []


def test_replay_matches_the_loaded_trace(fake, tmp_path):
    """On a trace the store recorded, replay() gives what the plain rules
    give, and the loaded trace reads its figures through it."""
    from memviz import _core

    path = tmp_path / "run.memviz"
    with memviz.track(trace=str(path), torch=False):
        kept = [fake.alloc(CBID_cuMemAlloc_v2, (i + 1) * MiB) for i in range(6)]
        for a in kept[::2]:
            fake.free(CBID_cuMemFree_v2, a)
        host = fake.alloc(CBID_cuMemHostAlloc, 3 * MiB)
        fake.alloc(CBID_cuMemAlloc_v2, 80 << 30, result=CUDA_ERROR_OUT_OF_MEMORY)
        fake.free(CBID_cuMemFreeHost, host)
        fake.alloc(CBID_cuMemAlloc_v2, 9 * MiB)
    loaded = memviz.load(path)
    from memviz.model.snapshot import KIND_NAMES

    ops, kinds = {"alloc": 1, "free": 2, "failed": 3}, {k: i for i, k in enumerate(KIND_NAMES)}
    cols = _columns([(ops[e.op], e.address, e.size if e.op != "free" else 0, kinds[e.kind], e.device)
                     for e in loaded.events()])
    assert cols[0].count(1) == 8 and cols[0].count(2) == 4 and cols[0].count(3) == 1
    got = _core.replay(*cols)
    want = _replay_oracle(*cols)
    # the loaded trace's own (streaming) replay says the same
    _op, addr, size, _kind, dev = cols
    assert [r[:3] for r in loaded._rp.live()] == [(addr[j], size[j], dev[j]) for j in got["live"]]
    assert {d: v["peak"] for d, v in loaded._devices().items()} == got["peak"]
    assert got["end"].tolist() == list(want["end"])
    assert {k: v for k, v in got.items() if k != "end"} == \
        {k: v for k, v in want.items() if k != "end"}
    assert got["fail_idx"] and got["live"] and got["peak"][0] >= 9 * MiB


# ---- the callback profile: a benchmark's hook, not a user's switch --------


def test_no_environment_variable_turns_capture_off(fake, monkeypatch):
    """MEMVIZ_CALLBACK_PROFILE was read at start, and "noop" recorded
    nothing; the profile is now only the benchmarks' _core hook."""
    monkeypatch.setenv("MEMVIZ_CALLBACK_PROFILE", "noop")
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
    assert t.current_bytes() == 8 * MiB


def test_the_callback_profile_hook(fake):
    core = memviz._core
    calls = core.stats()["profile_calls"]
    assert core._callback_profile("noop") == "off"
    try:
        with memviz.track() as t:
            fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        assert t.current_bytes() == 0  # CUPTI's dispatch alone: nothing recorded
        assert core.stats()["profile_calls"] > calls
        assert core._callback_profile("time") == "noop"
        with memviz.track() as t:
            fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
        assert t.current_bytes() == 8 * MiB
        assert core.stats()["profile_ns"] > 0
    finally:
        assert core._callback_profile("off") == "time"
    calls = core.stats()["profile_calls"]
    with memviz.track() as t:
        fake.alloc(CBID_cuMemAlloc_v2, 8 * MiB)
    assert t.current_bytes() == 8 * MiB
    assert core.stats()["profile_calls"] == calls  # the plain callback counts nothing
    with pytest.raises(ValueError):
        core._callback_profile("fast")
