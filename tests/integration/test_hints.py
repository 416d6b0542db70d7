"""Every hint works: memviz's subpackages are reachable after ``import memviz``,
every code snippet that an error, warning, HTML page or notebook view shows
runs as written (or names something that exists) in a fresh interpreter, and
warnings point at the user's line and name the option of the entry point used.
"""

import ast
import html as html_mod
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import memviz
from memviz.capture import cupti as _capture
from memviz import tracker as _tracker
from memviz.capture import availability as _hints, labels as _labels
from conftest import here

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memviz"


def fresh(code, cwd=None, timeout=120):
    """Run ``code`` in a fresh interpreter (no GPU capture: no test double)."""
    env = dict(os.environ)
    env.pop(_capture.ENV_LIBRARY, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


# ---- memviz.torch and the other subpackages ----------------------------------------------


def test_subpackages_are_reachable_after_import_memviz_without_importing_torch():
    p = fresh(textwrap.dedent("""
        import sys, memviz
        assert "torch" not in sys.modules
        paths = [memviz.torch.precise.enable, memviz.torch.PreciseModeTooLate, memviz.report.write,
                 memviz.report.render, memviz.export.perfetto.write, memviz.export.torch_snapshot.write,
                 memviz.integrations.StepCallbackCore]
        assert "torch" not in sys.modules, "reaching memviz.torch imported torch"
        assert {"torch", "report", "export", "integrations"} <= set(dir(memviz))
        try:
            memviz.no_such_thing
        except AttributeError as e:
            assert "no_such_thing" in str(e)
        print("ok")
    """))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# ---- the snippets memviz shows ------------------------------------------------------------

_HOLE = "\x00"  # where an f-string puts a value


def _message_strings():
    """(text, where) of every string in memviz's code that is not a docstring
    (f-strings with their values as holes), plus the %%memviz magic's help."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    docs.add(id(body[0].value))
        parts_of_fstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else _HOLE for v in node.values)
                parts_of_fstrings.update(id(v) for v in node.values)
                out.append((text, f"{path.relative_to(ROOT)}:{node.lineno}"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and id(node) not in parts_of_fstrings):
                out.append((node.value, f"{path.relative_to(ROOT)}:{node.lineno}"))
    from memviz.integrations import ipython as _ipython
    out.append((_ipython.__doc__, "memviz/integrations/ipython.py (the magic's help)"))
    return out


_PATH = re.compile(r"(?<![\w.<])(memviz(?:\.[A-Za-z_]\w*)+)(\()?")
_METHOD = re.compile(r"(?<![\w.<])(?:t|tracker|_memviz|Tracker)\.([A-Za-z_]\w*)\(")


def _snippets():
    """Backticked code (to run, or CLI lines to parse), dotted memviz paths
    (to resolve) and tracker methods (to exist), from every message."""
    code, cli, paths, methods = {}, {}, {}, {}
    for text, where in _message_strings():
        if text.lstrip().startswith("<memviz."):  # a repr, not a hint
            continue
        for snippet in re.findall(r"``?([^`]+)``?", text):
            s = snippet.strip()
            if re.match(r"(python -m )?memviz (run|report|diff)\b", s):
                cli.setdefault(s, where)
            elif _HOLE not in s and re.match(r"(with |import |memviz\.|warnings\.)", s):
                code.setdefault(s, where)
        for m in _PATH.finditer(text):
            paths.setdefault((m.group(1), bool(m.group(2))), where)
        for m in _METHOD.finditer(text):
            methods.setdefault(m.group(1), where)
    return code, cli, paths, methods


def test_the_snippet_finder_finds_the_known_hints():
    code, cli, paths, methods = _snippets()
    assert ("memviz.torch.precise.enable", True) in paths  # PreciseModeTooLate
    assert "with memviz.track() as t:" in code
    assert any(s.startswith("python -m memviz run --precise") for s in cli)
    assert "save" in methods and "step" in methods
    assert "to_html" in methods  # the notebook view's


def _runnable(snippet):
    """A backticked snippet as a program: a `with ...:` line gets a body."""
    return snippet + "\n    pass" if snippet.rstrip().endswith(":") else snippet


def _imports_missing(snippet):
    """The modules other than memviz that ``snippet`` imports and this
    environment lacks (``import torch`` is a fine hint where torch is absent)."""
    try:
        tree = ast.parse(_runnable(snippet))
    except SyntaxError:
        return []  # the run below reports it
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    tops = {name.split(".")[0] for name in names} - {"memviz"}
    return sorted(t for t in tops if importlib.util.find_spec(t) is None)


def test_a_snippet_importing_what_is_not_installed_is_told_apart():
    assert _imports_missing("import memviz_no_such_module_here") == ["memviz_no_such_module_here"]
    assert _imports_missing("from no_such_module_here.sub import x") == ["no_such_module_here"]
    assert _imports_missing("import memviz.no_such_part") == []  # memviz's own: must run
    assert _imports_missing("with memviz.track() as t:") == []


def test_every_backticked_snippet_runs_in_a_fresh_interpreter(tmp_path):
    code, _, _, _ = _snippets()
    code = {s: w for s, w in code.items() if not _imports_missing(s)}
    assert code
    program = ["import json, sys, warnings, traceback", "import memviz", "failed = {}"]
    for snippet, where in sorted(code.items()):
        # each in its own interpreter would cost seconds; each in its own namespace is the same test
        # of what it names, since none of them imports anything the others need
        program.append(f"try:\n    exec(compile({_runnable(snippet)!r}, {where!r}, 'exec'), {{'memviz': memviz, "
                       f"'warnings': warnings}})\nexcept BaseException as e:\n"
                       f"    failed[{snippet!r}] = {where!r} + ': ' + repr(e)")
    program.append("print(json.dumps(failed))")
    p = fresh("\n".join(program), cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {}


def _resolve_program(path, call):
    return textwrap.dedent(f"""
        import importlib, memviz
        obj, parts = memviz, {path!r}.split(".")[1:]
        for i, part in enumerate(parts):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                # a module not imported yet: it must exist; one that needs what is not
                # installed here ("memviz.integrations.huggingface needs transformers") is
                # checked as far as that, in prose and in calls alike
                import importlib.util
                name = ".".join(["memviz"] + parts[:i + 1])
                if importlib.util.find_spec(name) is None:
                    raise
                try:
                    obj = importlib.import_module(name)
                except ImportError:
                    break
                if not {call!r} and i + 1 < len(parts) and not hasattr(obj, parts[i + 1]):
                    break  # prose names the module; what follows may be a word
        print("ok")
    """)


def test_every_memviz_path_named_in_a_message_resolves_in_a_fresh_interpreter():
    _, _, paths, _ = _snippets()
    lazy = {"torch", "report", "export", "integrations"} | set(memviz._LAZY)
    groups = {}
    for (path, call), where in paths.items():
        first = path.split(".")[1]
        # paths that start the same way are resolved together: only their first step imports
        groups.setdefault(first if first in lazy else "", []).append((path, call, where))
    failures = []
    for first, items in sorted(groups.items()):
        program = "\n".join(
            f"try:\n    exec({_resolve_program(path, call)!r})\nexcept Exception as e:\n"
            f"    print('FAIL', {path!r}, {where!r}, repr(e))" for path, call, where in items)
        p = fresh(program)
        assert p.returncode == 0, p.stderr
        failures += [line for line in p.stdout.splitlines() if line.startswith("FAIL")]
    assert failures == []


def test_every_tracker_method_named_in_a_message_exists():
    _, _, _, methods = _snippets()
    assert methods
    missing = {m: w for m, w in methods.items() if not callable(getattr(memviz.Tracker, m, None))}
    assert missing == {}


def test_every_command_line_named_in_a_message_has_those_options():
    from memviz.cli import diff as _cli_diff, report as _cli_report, run as _cli_run

    _, cli, _, _ = _snippets()
    parsers = {"run": _cli_run.build_parser(), "report": _cli_report.report_parser(),
               "diff": _cli_diff.diff_parser()}
    bad = {}
    for line, where in cli.items():
        words = line.replace(_HOLE, "PATH").split()
        words = words[2:] if words[0] == "python" else words
        command, rest = words[1], words[2:]
        if command == "run":  # memviz's own options end at the script (the rest is the script's)
            rest = _cli_run._split(rest)[0]
        options = [w for w in rest if w.startswith("-")]
        known = {o for a in parsers[command]._actions for o in a.option_strings}
        unknown = [o for o in options if o not in known]
        if unknown:
            bad[line] = (where, unknown)
    assert bad == {}


# ---- notebook views -----------------------------------------------------------------------


def _code_elements(page):
    return [html_mod.unescape(c) for c in re.findall(r"<code>(.*?)</code>", page)]


def test_the_tracker_views_code_runs_in_a_fresh_interpreter(tmp_path):
    from memviz.report.notebook import tracker_repr_html

    with memviz.track(gpu=False) as t:
        pass
    snippets = _code_elements(tracker_repr_html(t)) + _code_elements(tracker_repr_html(memviz.Tracker()))
    assert any(".to_html(" in s for s in snippets)
    for s in snippets:
        p = fresh("import memviz\nwith memviz.track(gpu=False) as t:\n    pass\n" + _runnable(s),
                  cwd=str(tmp_path))
        assert p.returncode == 0, (s, p.stderr)
    assert (tmp_path / "report.html").exists()


def test_the_magics_view_names_its_tracker(tmp_path, monkeypatch):
    pytest.importorskip("IPython", reason="the cell magic needs IPython (pip install ipython)")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    monkeypatch.chdir(tmp_path)
    sh = InteractiveShell.instance()
    try:
        memviz.load_ipython_extension(sh)
        with capture_output() as out:
            sh.run_cell("%%memviz --no-gpu\nx = 1\n")
        page, = [o.data["text/html"] for o in out.outputs if "text/html" in o.data]
        snippets = [s for s in _code_elements(page) if "report.html" in s]
        assert snippets and all("_memviz" in s for s in snippets), snippets
        for s in snippets:
            result = sh.run_cell(s, store_history=False)  # in the notebook, as the user would
            assert result.success, (s, result.error_in_exec)
        assert (tmp_path / "report.html").exists()
    finally:
        InteractiveShell.clear_instance()


# ---- warnings -----------------------------------------------------------------------------


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without a GPU, on which memviz has not warned yet."""
    monkeypatch.delenv(_capture.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(_capture, "gpu_present", lambda: (False, "no NVIDIA driver or GPU found (test)"))
    monkeypatch.setattr(_hints, "_warned_gpu_off", False)


def test_capture_warning_points_at_the_users_with_line(no_gpu):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with memviz.track(): line = here()  # noqa: E701  (the warning's line: the with statement's)
    (cw,) = [x for x in w if issubclass(x.category, memviz.CaptureWarning)]
    assert (cw.filename, cw.lineno) == (__file__, line)
    assert "memviz.track(gpu=False)" in str(cw.message)


def test_capture_warning_of_start_points_at_the_users_line(no_gpu):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = memviz.start(); line = here()  # noqa: E702
        t.stop()
    (cw,) = [x for x in w if issubclass(x.category, memviz.CaptureWarning)]
    assert (cw.filename, cw.lineno) == (__file__, line)


def test_the_magics_capture_warning_says_no_gpu(no_gpu):
    pytest.importorskip("IPython", reason="the cell magic needs IPython (pip install ipython)")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    sh = InteractiveShell.instance()
    try:
        memviz.load_ipython_extension(sh)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with capture_output():
                sh.run_cell("%%memviz\nx = 1\n")
    finally:
        InteractiveShell.clear_instance()
    (cw,) = [x for x in w if issubclass(x.category, memviz.CaptureWarning)]
    msg = str(cw.message)
    assert "--no-gpu" in msg and "gpu=False" not in msg
    assert not cw.filename.startswith(str(PACKAGE))


def test_the_callbacks_capture_warning_does_not_offer_an_option_they_lack(no_gpu):
    from memviz.integrations.callbacks import StepCallbackCore

    core = StepCallbackCore()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        core.begin(); line = here()  # noqa: E702
        core.end()
    (cw,) = [x for x in w if issubclass(x.category, memviz.CaptureWarning)]
    msg = str(cw.message)
    assert "pass gpu=False" not in msg
    assert "with memviz.track(gpu=False):" in msg and "warnings.filterwarnings(" in msg
    assert (cw.filename, cw.lineno) == (__file__, line)


def test_label_overflow_warning_points_at_the_users_line(monkeypatch):
    monkeypatch.setattr(_labels, "_label_overflow_warned", False)
    monkeypatch.setattr(_tracker._core, "label_intern", lambda name: 7)
    monkeypatch.setattr(_tracker._core, "label_name", lambda lid: _tracker._core.LABEL_OVERFLOW)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        memviz.label("one more"); line = here()  # noqa: E702
    (cw,) = [x for x in w if issubclass(x.category, memviz.CaptureWarning)]
    assert (cw.filename, cw.lineno) == (__file__, line)


def test_incomplete_trace_warning_points_at_the_users_load(tmp_path, fake):
    from fake_cupti import CBID_cuMemAlloc_v2

    path = tmp_path / "t.memviz"
    with memviz.track(trace=str(path)):
        fake.alloc(CBID_cuMemAlloc_v2, 1 << 20)
    data = path.read_bytes()
    cut = tmp_path / "cut.memviz"
    cut.write_bytes(data[: len(data) - 8])  # no end record
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        memviz.load(str(cut)); line = here()  # noqa: E702
    (tw,) = [x for x in w if "incomplete" in str(x.message)]
    assert (tw.filename, tw.lineno) == (__file__, line)


def test_diagnose_rule_failure_warning_points_at_the_users_call(fake, monkeypatch):
    from memviz.analysis import rules as _diagnose_rules

    def broken(*args):
        raise ValueError("test")

    monkeypatch.setattr(_diagnose_rules, "spike", broken)
    with memviz.track() as t:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t.diagnose(); line = here()  # noqa: E702
    (rw,) = [x for x in w if "rule failed" in str(x.message)]
    assert (rw.filename, rw.lineno) == (__file__, line)


def test_watch_warning_points_at_the_users_optimizer_step():
    torch = pytest.importorskip("torch", reason="watch() wraps a torch optimizer")
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(2)
    with memviz.watch(opt):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step(); line = here()  # noqa: E702
    (rw,) = [x for x in w if "no memviz tracker is running" in str(x.message)]
    assert (rw.filename, rw.lineno) == (__file__, line)


def test_the_tracker_view_takes_a_variable_name():
    from memviz.report.notebook import tracker_repr_html

    with memviz.track(gpu=False) as t:
        pass
    assert "<code>run_3.to_html(" in tracker_repr_html(t, name="run_3")
    with pytest.raises(memviz.InvalidArgument, match="variable name"):
        tracker_repr_html(t, name="not a name")
