"""The C core's files form layers: no file calls back up into one that calls it.

Each src/*.c is compiled alone to an object file (with Python's include
paths, as setup.py builds it); `nm` then says which external names each
object defines and which it needs from elsewhere. File A depends on file B
when A needs a name only B defines. The graph must have no cycle (a loop
A -> B -> ... -> A, direct or through others): the layer order that
docs/architecture.md describes. Skipped (with the reason) without a C
compiler or nm.
"""

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
CC = os.environ.get("CC", "cc")

pytestmark = pytest.mark.skipif(
    shutil.which(CC) is None or shutil.which("nm") is None,
    reason="needs a C compiler and nm (binutils) to read the object files' symbols",
)


def _compile(c_file, out_dir):
    obj = Path(out_dir) / (c_file.stem + ".o")
    includes = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
    cmd = [CC, "-std=c11", "-O0", "-fexceptions", "-c", str(c_file), "-o", str(obj)]
    cmd += [f"-I{p}" for p in sorted(includes)] + [f"-I{SRC}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{c_file.name} does not compile alone:\n{res.stderr}"
    return obj


def _symbols(obj):
    """(defined external names, undefined names) of one object file."""
    def nm(*flags):
        res = subprocess.run(["nm", *flags, str(obj)], capture_output=True, text=True, check=True)
        return {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}

    return nm("--defined-only", "-g"), nm("-u")


def dependency_graph(src_dir, out_dir):
    """{file: {file it needs a name from: sorted names}} over src_dir/*.c."""
    files = sorted(Path(src_dir).glob("*.c"))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objs = list(pool.map(lambda f: _compile(f, out_dir), files))
    defined, needed = {}, {}
    for f, obj in zip(files, objs):
        defined[f.name], needed[f.name] = _symbols(obj)
    owner = {}
    for name, syms in defined.items():
        for s in syms:
            owner.setdefault(s, set()).add(name)
    graph = {name: {} for name in defined}
    for name, syms in needed.items():
        for s in syms:
            for other in owner.get(s, ()):
                if other != name:
                    graph[name].setdefault(other, []).append(s)
    return {a: {b: sorted(v) for b, v in deps.items()} for a, deps in graph.items()}


def find_cycle(graph):
    """One cycle of the graph as a list of nodes [a, b, ..., a], or None."""
    state = {}  # 1: on the current path, 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def describe(graph, cycle):
    return " -> ".join(
        f"{a} ({', '.join(graph[a][b][:3])})" for a, b in zip(cycle, cycle[1:])
    ) + f" -> {cycle[-1]}"


def test_no_loops_between_c_files(tmp_path):
    graph = dependency_graph(SRC, tmp_path)
    cycle = find_cycle(graph)
    assert cycle is None, "C files call each other in a loop: " + describe(graph, cycle)


def test_the_check_sees_a_loop(tmp_path):
    """The check can fail: two files that call each other make a cycle."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.c").write_text("int b_fn(void);\nint a_fn(void) { return b_fn(); }\n")
    (src / "b.c").write_text("int c_fn(void);\nint b_fn(void) { return c_fn(); }\n")
    (src / "c.c").write_text("int a_fn(void);\nint c_fn(void) { return a_fn(); }\n")
    (src / "d.c").write_text("int a_fn(void);\nint d_fn(void) { return a_fn(); }\n")
    graph = dependency_graph(src, tmp_path)
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"a.c", "b.c", "c.c"}
    assert "d.c" not in cycle
    assert "b_fn" in describe(graph, cycle)


def test_data_symbols_count_as_dependencies(tmp_path):
    """Reading another file's variable is a dependency too (nm lists it)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.c").write_text("extern int b_var;\nint a_var = 1;\nint a_fn(void) { return b_var; }\n")
    (src / "b.c").write_text("extern int a_var;\nint b_var = 2;\nint b_fn(void) { return a_var; }\n")
    graph = dependency_graph(src, tmp_path)
    assert find_cycle(graph) is not None


def test_every_c_file_is_built():
    """setup.py's source list names every src/*.c (a file left out would
    escape this check and fail to link)."""
    text = (ROOT / "setup.py").read_text()
    missing = [f.name for f in SRC.glob("*.c") if f'"src/{f.name}"' not in text]
    assert not missing, f"src files not in setup.py's sources: {missing}"
