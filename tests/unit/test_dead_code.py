"""Dead code that was removed stays removed: none of the names below is
defined again anywhere in memviz/ (a function, a class, a method, a
property, a variable or attribute assigned, or an import's alias). Read from
the code as text (ast), nothing imported.

To bring one back on purpose, with a caller, take it off REMOVED."""

import ast

from conftest import ROOT

PACKAGE = ROOT / "memviz"

#: (where it was, name): removed as unused (issue 23)
REMOVED = [
    ("memviz/report/html.py", "_finite"),
    ("memviz/torch/graph.py", "_owner_name"),
    ("memviz/trace/reader.py", "_columns"),  # tests build replay's columns from events()
    ("memviz/trace/writer.py", "bytes_written"),
    ("memviz/analysis/findings.py", "KINDS"),
    ("memviz/trace/format.py", "event_struct"),  # only _columns used it
]


def definitions(source: str) -> "dict[str, int]":
    """{name: first line} of every name ``source`` defines, at any depth."""
    out: "dict[str, int]" = {}

    def add(name, node):
        out.setdefault(name, node.lineno)

    def targets(t, node):
        if isinstance(t, ast.Name):
            add(t.id, node)
        elif isinstance(t, ast.Attribute):  # self.x = ...
            add(t.attr, node)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e, node)
        elif isinstance(t, ast.Starred):
            targets(t.value, node)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node.name, node)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t, node)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets(node.target, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                add(a.asname or a.name.split(".")[0], node)
    return out


def reappeared(files) -> "list[str]":
    """'path:line defines name' for each name of REMOVED that ``files``
    ((path, source) pairs) define."""
    names = {name for _where, name in REMOVED}
    found = []
    for path, source in files:
        for name, line in sorted(definitions(source).items()):
            if name in names:
                found.append(f"{path}:{line} defines {name}")
    return found


def test_removed_dead_code_stays_removed():
    files = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))]
    assert len(files) > 50
    found = reappeared(files)
    assert not found, ("removed as dead code (tests/test_dead_code.py REMOVED: "
                       + ", ".join(n for _w, n in REMOVED) + "), defined again:\n" + "\n".join(found))


def test_the_check_sees_each_kind_of_definition():
    """The check above can fail: every way of defining a name is seen."""
    source = ("import os as KINDS\n"
              "def _finite(x):\n    return x\n"
              "class C:\n"
              "    @property\n    def bytes_written(self):\n        return 0\n"
              "    def f(self):\n        self._columns = 1\n"
              "        (event_struct := 2)\n"
              "_owner_name: int = 3\n")
    found = reappeared([("memviz/made_up.py", source)])
    assert set(found) == {"memviz/made_up.py:1 defines KINDS", "memviz/made_up.py:2 defines _finite",
                          "memviz/made_up.py:6 defines bytes_written", "memviz/made_up.py:9 defines _columns",
                          "memviz/made_up.py:10 defines event_struct", "memviz/made_up.py:11 defines _owner_name"}
    assert reappeared([("memviz/made_up.py", "x = _finite\nKINDS.count(1)\n")]) == []  # uses are not definitions
