"""No test asserts on wall-clock time: a bound on elapsed seconds fails on a
loaded machine and says nothing on a fast one. Timings belong to
benchmarks/ (benchmarks/bench_bounds.py holds the bounds the tests had).

Read from the tests' own code, as syntax: in each function, a name assigned
from a clock (time.perf_counter, time.time, time.monotonic and their _ns
forms) holds a reading; a difference of readings is a duration, and so is a
name assigned from one and what a function returns when it returns one
(open_page's seconds), wherever it is called. An assert that compares a
duration is reported; readings compared in order (a timestamp between two
readings) or passed as data are not bounds. Hang guards (a deadline in a
while loop, a subprocess timeout) are not asserts and stay. What a child
process's code string measures, or a duration passed through data, is not
seen."""

import ast
from pathlib import Path

from conftest import ROOT

CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "time_ns", "monotonic_ns"}


def _is_clock(call):
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr in CLOCKS and isinstance(f.value, ast.Name) \
        and f.value.id == "time"


def _called(call):
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _reading(expr, readings):
    """A clock reading (or one moved by a constant: a deadline)."""
    return any((isinstance(n, ast.Call) and _is_clock(n)) or (isinstance(n, ast.Name) and n.id in readings)
               for n in ast.walk(expr))


def _duration(expr, readings, durations, duration_functions):
    """Elapsed time: a difference of readings, or what holds or returns one."""
    for n in ast.walk(expr):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and (
                _reading(n.left, readings) or _reading(n.right, readings)):
            return True
        if isinstance(n, ast.Name) and n.id in durations:
            return True
        if isinstance(n, ast.Call) and _called(n) in duration_functions:
            return True
    return False


def _pairs(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for t in targets:
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
            yield from zip(t.elts, node.value.elts)
        else:
            yield t, node.value


def _times(func, duration_functions):
    """The names of ``func`` that hold a clock reading, and those that hold a duration."""
    readings, durations = set(), set()
    while True:
        before = len(readings) + len(durations)
        for node in ast.walk(func):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                for target, value in _pairs(node):
                    names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                    if _duration(value, readings, durations, duration_functions):
                        durations |= names
                    elif _reading(value, readings):
                        readings |= names
        if len(readings) + len(durations) == before:
            return readings, durations


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def duration_functions(trees):
    """Names of the functions (in any of the files) that return a duration."""
    found = set()
    while True:
        before = len(found)
        for tree in trees:
            for func in _functions(tree):
                readings, durations = _times(func, found)
                if any(isinstance(r, ast.Return) and r.value is not None
                       and _duration(r.value, readings, durations, found) for r in ast.walk(func)):
                    found.add(func.name)
        if len(found) == before:
            return found


def wall_clock_asserts(tree, functions):
    """(line, source) of each assert that compares a duration."""
    out = []
    for func in _functions(tree):
        readings, durations = _times(func, functions)
        for node in ast.walk(func):
            if isinstance(node, ast.Assert):
                for cmp in ast.walk(node.test):
                    if isinstance(cmp, ast.Compare) and any(
                            _duration(side, readings, durations, functions) for side in [cmp.left, *cmp.comparators]):
                        out.append((node.lineno, ast.unparse(node.test)))
                        break
    return sorted(set(out))


def test_the_check_finds_a_wall_clock_bound():
    bad = ast.parse(
        "import time\n"
        "def open_it():\n    start = time.perf_counter()\n    return time.perf_counter() - start\n"
        "def test_a():\n    t0 = time.perf_counter()\n    x = 1\n    elapsed = time.perf_counter() - t0\n"
        "    assert x == 1\n    assert elapsed < 0.5, elapsed\n"
        "def test_b():\n    seconds = open_it()\n    assert seconds < 5\n"
        "def test_c():\n    deadline = time.monotonic() + 60\n    while time.monotonic() < deadline:\n"
        "        pass\n    assert time.monotonic() - deadline < 1\n"
        # not bounds: readings in order, a reading as data, a counter beside a deadline
        "def test_d(ts, snap):\n    before = time.monotonic_ns()\n    after = time.monotonic_ns()\n"
        "    assert before <= ts <= after\n    assert snap(at_ns=before) == snap(at_ns=after)\n"
        "    runs, stop = 0, time.monotonic() + 1\n    assert runs >= 0\n")
    functions = duration_functions([bad])
    assert functions == {"open_it"}
    assert [line for line, _ in wall_clock_asserts(bad, functions)] == [10, 13, 18]


def test_no_test_asserts_on_wall_clock_time():
    files = sorted((ROOT / "tests").rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    functions = duration_functions(trees.values())
    found = [f"{path.relative_to(ROOT)}:{line}: assert {src}"
             for path, tree in trees.items() for line, src in wall_clock_asserts(tree, functions)]
    assert not found, "wall-clock bounds belong to benchmarks/ (bench_bounds.py):\n" + "\n".join(found)
    assert len(files) > 60 and Path(__file__).resolve() in {p.resolve() for p in files}
