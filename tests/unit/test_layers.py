"""The package's floors (docs/architecture.md): every import, at module level
or inside a function, goes to a lower floor or stays in its own folder, and
the import graph has no loop. Read from the code's own imports, as text
(nothing is imported to draw the graph), plus each module imported alone."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "memviz"

#: floor of each part, bottom (0) to top; a module may import its own part
#: and the parts below it, never one above
FLOORS = [
    ("memviz._core", 0), ("memviz._errors", 0), ("memviz._package", 0),
    ("memviz._progress", 0), ("memviz._interrupts", 0), ("memviz._units", 1),
    ("memviz._args", 2), ("memviz._output_files", 3),
    ("memviz.model", 4), ("memviz.capture", 5), ("memviz.torch", 6), ("memviz.trace", 7),
    ("memviz.analysis", 8), ("memviz.report", 9), ("memviz.export", 10),
    ("memviz.outputs", 11), ("memviz.loaded", 12), ("memviz.tracker", 13),
    ("memviz.cli", 14), ("memviz.integrations", 14), ("memviz.__main__", 15), ("memviz", 16),
]


def _part(module: str) -> str:
    """The FLOORS entry a module belongs to (the longest prefix)."""
    best = None
    for name, _floor in FLOORS:
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best):
                best = name
    assert best is not None, f"{module} is on no floor: add its folder to FLOORS and docs/architecture.md"
    return best


def _modules(package=PACKAGE):
    """{dotted name: path} of every module of ``package`` (a folder)."""
    out = {}
    for p in sorted(package.rglob("*.py")):
        parts = list(p.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(modules):
    """{module: {imported module: first line}} for memviz's own modules."""
    known = set(modules) | {"memviz._core"}

    def norm(m):
        while m and m not in known:
            m = m.rpartition(".")[0]
        return m or None

    graph = {}
    for mod, path in modules.items():
        edges = {}
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    m = ".".join(base + ([node.module] if node.module else []))
                else:
                    m = node.module or ""
                for a in node.names:  # `from memviz.x import y` imports memviz.x.y when that is a module
                    targets.append(f"{m}.{a.name}" if f"{m}.{a.name}" in known else m)
            for t in targets:
                t = norm(t) if t.startswith("memviz") else None
                if t and t != mod:
                    edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_loop():
    graph = _imports(_modules())
    loops = _cycles(graph)
    detail = ["  " + " ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in graph[a] if b in comp)
              for comp in loops]
    assert not loops, "import loops:\n" + "\n".join(detail)


def _upward(graph):
    """Each import of ``graph`` that does not go down a floor or stay in its
    own part (FLOORS), as text."""
    floor = dict(FLOORS)
    upward = []
    for mod, edges in sorted(graph.items()):
        here = _part(mod)
        for target, line in sorted(edges.items()):
            there = _part(target)
            if there != here and floor[there] >= floor[here]:
                upward.append(f"{mod} (line {line}) imports {target}: {here} is floor {floor[here]}, "
                              f"{there} floor {floor[there]}")
    return upward


def test_every_import_goes_down_or_stays_in_its_folder():
    upward = _upward(_imports(_modules()))
    assert not upward, "imports that do not go down:\n" + "\n".join(upward)


def test_the_checks_see_a_loop_and_an_upward_import(tmp_path):
    """The two checks above can fail: a made-up memviz package, read by the
    same functions, whose model imports the tracker (a floor above it)
    inside a function, and whose analysis imports the report (above it)
    at module level by a relative import; the tracker imports the model
    back, which closes a loop. Imports that go down or stay in their folder
    are not reported."""
    pkg = tmp_path / "memviz"
    for folder in ("model", "analysis", "report"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_units.py").write_text("X = 1\n")
    (pkg / "model" / "a.py").write_text(
        "from memviz._units import X  # down: fine\n"
        "from memviz.model import b  # its own folder: fine\n"
        "\n"
        "def f():\n"
        "    import memviz.tracker  # up\n"
        "    return memviz.tracker\n")
    (pkg / "model" / "b.py").write_text("")
    (pkg / "analysis" / "c.py").write_text("from ..report import html  # up\nfrom ..model import a  # down\n")
    (pkg / "report" / "html.py").write_text("")
    (pkg / "tracker.py").write_text("from memviz.model.a import f  # down\n")

    graph = _imports(_modules(pkg))
    assert graph["memviz.model.a"] == {"memviz._units": 1, "memviz.model.b": 2, "memviz.tracker": 5}
    assert _cycles(graph) == [["memviz.model.a", "memviz.tracker"]]
    floor = dict(FLOORS)
    assert _upward(graph) == [
        f"memviz.analysis.c (line 1) imports memviz.report.html: memviz.analysis is floor "
        f"{floor['memviz.analysis']}, memviz.report floor {floor['memviz.report']}",
        f"memviz.model.a (line 5) imports memviz.tracker: memviz.model is floor {floor['memviz.model']}, "
        f"memviz.tracker floor {floor['memviz.tracker']}"]


def test_every_module_imports_alone():
    """Each module imported first, in a fresh interpreter: a loop that the
    graph missed (an import made another way) fails here."""
    names = [m for m in _modules() if m != "memviz.__main__"]
    code = ("import importlib, subprocess, sys\n"
            "bad = []\n"
            "for name in sys.argv[1:]:\n"
            "    p = subprocess.run([sys.executable, '-c', f'import {name}'], capture_output=True, text=True)\n"
            "    if p.returncode and 'which is not installed' not in p.stderr:  # an optional framework\n"
            "        bad.append(f'{name}: {p.stderr.strip().splitlines()[-1]}')\n"
            "print('\\n'.join(bad))\n")
    p = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=600,
                       cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", "modules that fail to import alone:\n" + p.stdout


@pytest.mark.parametrize("folder", ["model", "capture", "trace", "analysis"])
def test_the_lower_floors_import_no_torch(folder):
    """The floors below memviz/torch read PyTorch's figures only through
    objects handed to them; none imports torch itself at module level."""
    for path in (PACKAGE / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "torch" for a in node.names), path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", path
