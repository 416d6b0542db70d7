"""The C core's files keep the layers, names and lock order that
docs/architecture.md documents.

Each src/*.c is compiled alone to an object file (with Python's include
paths, as setup.py builds it); `nm` then says which external names each
object defines and which it needs from elsewhere. File A depends on file B
when A needs a name only B defines. Read against the doc's tables:

* the C layer table ("## The C core"): every src file is in it once, and
  every include and every call goes down or sideways (to a file of its own
  layer), never up; and no loop of calls at all, sideways included;
* the names ("### Names"): every name a file exports starts with `mvz_`
  and the file's name, or with the short form the doc's table gives it;
* the lock order ("### Locks"): the table names exactly the mutexes src/
  holds, and no code takes one while it holds another unless the table
  allows it (read from the source: which function takes which lock, and
  which functions it calls while holding one; a straight read of each
  function, so a lock released on one branch only may hide a nesting, never
  invent one).

Skipped (with the reason) without a C compiler or nm.
"""

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").exists())
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"
CC = os.environ.get("CC", "cc")

needs_cc = pytest.mark.skipif(
    shutil.which(CC) is None or shutil.which("nm") is None,
    reason="needs a C compiler and nm (binutils) to read the object files' symbols",
)


# ---- the object files ------------------------------------------------------

def _compile(c_file, out_dir):
    obj = Path(out_dir) / (c_file.stem + ".o")
    includes = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
    cmd = [CC, "-std=c11", "-O0", "-fexceptions", "-c", str(c_file), "-o", str(obj)]
    cmd += [f"-I{p}" for p in sorted(includes)] + [f"-I{c_file.parent}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{c_file.name} does not compile alone:\n{res.stderr}"
    return obj


def _symbols(obj):
    """(defined external names, undefined names) of one object file."""
    def nm(*flags):
        res = subprocess.run(["nm", *flags, str(obj)], capture_output=True, text=True, check=True)
        return {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}

    return nm("--defined-only", "-g"), nm("-u")


def object_symbols(src_dir, out_dir):
    """{file.c: (defined external names, undefined names)} over src_dir/*.c."""
    files = sorted(Path(src_dir).glob("*.c"))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objs = list(pool.map(lambda f: _compile(f, out_dir), files))
    return {f.name: _symbols(obj) for f, obj in zip(files, objs)}


def dependency_graph(src_dir, out_dir, symbols=None):
    """{file: {file it needs a name from: sorted names}} over src_dir/*.c."""
    symbols = symbols or object_symbols(src_dir, out_dir)
    owner = {}
    for name, (defined, _) in symbols.items():
        for s in defined:
            owner.setdefault(s, set()).add(name)
    graph = {name: {} for name in symbols}
    for name, (_, needed) in symbols.items():
        for s in needed:
            for other in owner.get(s, ()):
                if other != name:
                    graph[name].setdefault(other, []).append(s)
    return {a: {b: sorted(v) for b, v in deps.items()} for a, deps in graph.items()}


def include_graph(src_dir):
    """{file: [headers of src_dir it includes]} over src_dir/*.c and *.h."""
    files = sorted(Path(src_dir).glob("*.[ch]"))
    here = {f.name for f in files}
    inc = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    return {f.name: [h for h in inc.findall(f.read_text()) if h in here] for f in files}


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


@pytest.fixture(scope="module")
def core_symbols(tmp_path_factory):
    if shutil.which(CC) is None or shutil.which("nm") is None:
        pytest.skip("needs a C compiler and nm (binutils) to read the object files' symbols")
    return object_symbols(SRC, tmp_path_factory.mktemp("objects"))


# ---- the doc's tables ------------------------------------------------------

def _section(text, heading):
    """The text under a markdown heading, up to the next heading of its level or above."""
    level = heading.split()[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def _table(section):
    """The rows of the first markdown table in a section, as lists of cells."""
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    return cells[2:]  # past the header and its rule


def _names(cell):
    return re.findall(r"`([^`]+)`", cell)


def doc_layers(text):
    """{src file: layer} from the C layer table. A header whose .c is in
    the table takes the .c's layer; a blank layer cell continues the row
    above's."""
    layers, layer = {}, None
    for row in _table(_section(text, "## The C core")):
        if row[0]:
            layer = int(re.match(r"\d+", row[0]).group())
        for name in _names(row[1]):
            assert name not in layers, f"{name} is twice in the C layer table"
            layers[name] = layer
    for name in list(layers):
        if name.endswith(".c"):
            layers.setdefault(name[:-2] + ".h", layers[name])
    return layers


def doc_prefixes(text):
    """{file.c: [allowed prefixes]} from the names table (short forms)."""
    return {_names(row[0])[0]: _names(row[1]) for row in _table(_section(text, "### Names"))}


def doc_locks(text):
    """{lock: (file, {locks it may be held while taking})} from the lock table."""
    locks = {}
    for row in _table(_section(text, "### Locks")):
        lock, file = _names(row[0])[0], _names(row[1])[0]
        locks[lock] = (file, set(_names(row[3])))
    return locks


def layer_violations(layers, graph, includes):
    """Every include or call that goes up a layer, as text; and the src
    files the table leaves out."""
    bad = []
    missing = sorted(set(includes) - set(layers))
    for a, hs in includes.items():
        for h in hs:
            if a in layers and h in layers and layers[h] > layers[a]:
                bad.append(f"{a} (layer {layers[a]}) includes {h} (layer {layers[h]})")
    for a, deps in graph.items():
        for b, names in deps.items():
            if a in layers and b in layers and layers[b] > layers[a]:
                bad.append(f"{a} (layer {layers[a]}) calls {b} (layer {layers[b]}): {', '.join(names[:3])}")
    return missing, bad


def prefix_violations(symbols, short_forms):
    bad = []
    for name, (defined, _) in sorted(symbols.items()):
        allowed = [f"mvz_{name[:-2]}_"] + short_forms.get(name, [])
        bad += [f"{name}: {s}" for s in sorted(defined)
                if not any(s == p or (p.endswith("_") and s.startswith(p)) for p in allowed)]
    return bad


# ---- the locks, read from the source ---------------------------------------

_FUNC = re.compile(r"^[A-Za-z_][^;{}()]*?\b([A-Za-z_]\w*)\s*\([^;{}]*\)\s*\n?\{", re.M)
_MACRO = re.compile(r"^#define\s+(\w+)\(\)\s+(\w+)\(\)", re.M)
_LOCK_DECL = re.compile(r"\bpthread_mutex_t\s+(\w+)\s*[;=]")
_LOCK_OP = re.compile(r"\bpthread_mutex_(lock|trylock|unlock)\s*\(\s*&\s*(?:\w+\s*(?:->|\.)\s*)*(\w+)\s*\)")
_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def _strip_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def source_functions(src_dir):
    """{function name: [(file, body)]} of every function defined in
    src_dir's .c and .h files (static ones too; a name defined in two
    files keeps both bodies), with `#define X() y()` macros as calls."""
    funcs = {}
    for f in sorted(Path(src_dir).glob("*.[ch]")):
        text = _strip_comments(f.read_text())
        for m in _MACRO.finditer(text):
            funcs.setdefault(m.group(1), []).append((f.name, f"{m.group(2)}();"))
        for m in _FUNC.finditer(text):
            depth, i = 0, m.end() - 1
            for i in range(m.end() - 1, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    break
            funcs.setdefault(m.group(1), []).append((f.name, text[m.end():i]))
    return funcs


def source_locks(src_dir):
    """{(file, lock name): declared} for every pthread_mutex_t in src_dir
    (a struct member counts as its struct's: `sched.mu`)."""
    found = set()
    for f in sorted(Path(src_dir).glob("*.[ch]")):
        text = _strip_comments(f.read_text())
        for m in _LOCK_DECL.finditer(text):
            struct = re.search(r"typedef struct\s*\{[^{}]*$", text[: m.start()])
            name = m.group(1)
            if struct:
                close = re.match(r"[^{}]*\}\s*(\w+)", text[m.start():])
                name = f"{close.group(1)}.{name}"
            found.add((f.name, name))
    return found


def lock_nestings(funcs):
    """{(held, taken): "where"} for every lock taken while another is held,
    directly or through the functions called meanwhile. A function that
    returns holding a lock it took (the store's lock_store) or releases one
    its caller took counts as taking or releasing it where it is called."""
    def ops(body):
        """The body as a list of ('lock'|'unlock', name) and ('call', fn)."""
        out = []
        for m in re.finditer(rf"{_LOCK_OP.pattern}|{_CALL.pattern}", body):
            if m.group(1):
                out.append(("unlock" if m.group(1) == "unlock" else "lock", m.group(2)))
            elif m.group(3) in funcs:
                out.append(("call", m.group(3)))
        return out

    bodies = {name: [ops(b) for _, b in defs] for name, defs in funcs.items()}
    summary, nested = {}, {}

    def summarize(fn):
        """(locks fn may take, locks it returns holding, locks it releases)."""
        if fn in summary:
            return summary[fn]
        summary[fn] = (set(), set(), set())  # while in progress: a recursive call takes nothing
        takes, acquires, releases = set(), set(), set()
        for body in bodies.get(fn, ()):
            held = []
            for op, name in body:
                if op == "lock":
                    for h in held:
                        nested.setdefault((h, name), f"{fn} takes {name} holding {h}")
                    takes.add(name)
                    held.append(name)
                elif op == "unlock":
                    if name in held:
                        held.remove(name)
                    else:
                        releases.add(name)
                else:
                    t, a, r = summarize(name)
                    takes |= t
                    for x in t:
                        for h in held:
                            if h != x:
                                nested.setdefault((h, x), f"{fn} calls {name}, which takes {x}, holding {h}")
                    held += [x for x in a if x not in held]
                    for x in r:
                        if x in held:
                            held.remove(x)
                        else:
                            releases.add(x)
            acquires |= set(held)
        summary[fn] = (takes, acquires, releases)
        return summary[fn]

    for fn in bodies:
        summarize(fn)
    return nested


def _short(lock):
    return lock.split(".")[-1]


# ---- the tests -------------------------------------------------------------

def test_no_loops_between_c_files(core_symbols):
    graph = dependency_graph(SRC, None, core_symbols)
    cycle = find_cycle(graph)
    assert cycle is None, "C files call each other in a loop: " + describe(graph, cycle)


def test_includes_and_calls_go_down_the_documented_layers(core_symbols):
    layers = doc_layers(DOC.read_text())
    missing, bad = layer_violations(layers, dependency_graph(SRC, None, core_symbols), include_graph(SRC))
    assert not missing, f"src files missing from docs/architecture.md's C layer table: {missing}"
    gone = sorted(n for n in layers if not (SRC / n).exists() and not n.endswith(".h"))
    assert not gone, f"the C layer table names files src/ does not have: {gone}"
    assert not bad, "arrows that run up the C layers:\n" + "\n".join(bad)


def test_every_exported_name_takes_its_files_prefix(core_symbols):
    short_forms = doc_prefixes(DOC.read_text())
    assert all((SRC / f).exists() for f in short_forms), short_forms
    bad = prefix_violations(core_symbols, short_forms)
    assert not bad, "exported names without their file's prefix (mvz_<file>_ or the doc's short form):\n" + "\n".join(bad)


# Exported names no other file needs, and why each stays exported.
USED_ALONE = {
    "PyInit__core": "Python looks it up",
    "mvz_allocator_trip_hits": "the tripwires' assembly reads it",
    "mvz_allocator_trip_table": "defined in assembly, read by name",
    "mvz_allocator_trip_targets": "the tripwires' assembly jumps through it",
    "mvz_store_new_stack_hook": "codeobj.c sets it on Python before 3.12 only (Py_AddPendingCall there)",
    "mvz_replay_event": "replay.h's one-event step; replay.c's chunk and column replays call it",
    "mvz_tw_write": "trace_writer.h's plain write (trace_writer.c is another change's file)",
}


def test_no_exported_name_is_dead(core_symbols):
    """Dead code stays removed (nodes.c's mvz_nodes_attached, store.c's
    mvz_store_alloc_at and mvz_store_block_totals, replay.c's
    mvz_replay_peak_set): every name a file exports is needed by another,
    or is in USED_ALONE with its reason."""
    needed = set().union(*(undefined for _, undefined in core_symbols.values()))
    dead = sorted(f"{f}: {s}" for f, (defined, _) in core_symbols.items()
                  for s in defined if s not in needed and s not in USED_ALONE)
    assert not dead, "exported names nothing else uses (make them static, or remove them):\n" + "\n".join(dead)
    exported = set().union(*(defined for defined, _ in core_symbols.values()))
    assert set(USED_ALONE) <= exported, sorted(set(USED_ALONE) - exported)


def test_the_lock_table_names_every_mutex_and_the_order_holds():
    locks = doc_locks(DOC.read_text())
    in_src = source_locks(SRC)
    assert {(f, lock) for lock, (f, _) in locks.items()} == in_src, (
        f"docs/architecture.md's lock table: {sorted(locks)}; src/ has {sorted(in_src)}")
    allowed = {(_short(a), _short(b)) for a, (_, may) in locks.items() for b in may}
    order = {a: {b for b in may} for a, (_, may) in locks.items()}
    assert find_cycle(order) is None, f"the lock table's order has a loop: {find_cycle(order)}"
    nested = lock_nestings(source_functions(SRC))
    bad = [why for pair, why in sorted(nested.items()) if pair not in allowed]
    assert not bad, "locks taken out of the documented order:\n" + "\n".join(bad)
    # The GIL comes before every lock: the core never takes it of its own accord.
    takers = [f.name for f in SRC.glob("*.[ch]") if "PyGILState_Ensure" in _strip_comments(f.read_text())]
    assert not takers, f"C files that take the GIL themselves: {takers}"


@needs_cc
def test_the_checks_see_an_arrow_up_a_bad_name_and_a_lock_out_of_order(tmp_path):
    """The checks can fail: a lower file that calls a higher one, a name
    without its file's prefix, and a lock taken inside another."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "low.h").write_text('#include "high.h"\n')
    (src / "high.h").write_text("int mvz_high_fn(void);\n")
    (src / "low.c").write_text('#include "low.h"\nint mvz_high_fn(void);\nint mvz_low_fn(void) { return mvz_high_fn(); }\n')
    (src / "high.c").write_text(
        "#include <pthread.h>\nint mvz_low_fn(void);\nstatic pthread_mutex_t a_lock;\nstatic pthread_mutex_t b_lock;\n"
        "static void inner(void)\n{\n    pthread_mutex_lock(&b_lock);\n    pthread_mutex_unlock(&b_lock);\n}\n"
        "int mvz_high_fn(void)\n{\n    pthread_mutex_lock(&a_lock);\n    inner();\n"
        "    pthread_mutex_unlock(&a_lock);\n    return 0;\n}\n"
        "int high_stray(void) { return mvz_low_fn(); }\n")
    doc = ("## The C core\n\n| layer | files | concern |\n| --- | --- | --- |\n"
           "| 0 | `low.c` | low |\n| 1 | `high.c` | high |\n")
    layers = doc_layers(doc)
    assert layers == {"low.c": 0, "low.h": 0, "high.c": 1, "high.h": 1}
    graph = dependency_graph(src, tmp_path)
    missing, bad = layer_violations(layers, graph, include_graph(src))
    assert not missing
    assert any("low.c (layer 0) calls high.c" in b for b in bad)
    assert any("low.h (layer 0) includes high.h" in b for b in bad)
    assert prefix_violations(object_symbols(src, tmp_path), {}) == ["high.c: high_stray"]
    assert source_locks(src) == {("high.c", "a_lock"), ("high.c", "b_lock")}
    nested = lock_nestings(source_functions(src))
    assert set(nested) == {("a_lock", "b_lock")}, nested



@needs_cc
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


@needs_cc
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
