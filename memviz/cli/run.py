"""``memviz run``: run a Python script or module under memviz, then print a report.

``python -m memviz run [options] script.py [args...]`` behaves like
``python script.py [args...]`` (``sys.argv``, ``__name__ == "__main__"``,
``sys.path[0]`` = the script's directory), and ``-m module`` like
``python -m module``. The report goes to stderr exactly once, when the script
returns, raises (traceback first, exit status 1), calls ``sys.exit()`` (its
status is kept) or is interrupted with Ctrl-C (exit status 130). Like Python,
memviz runs threading's shutdown calls (an executor left open stops its
workers) and waits for the script's non-daemon threads before reporting, then
lets go of the script's objects. ``sys.argv[0]`` is the script's absolute
path, like its ``__file__``. Output paths (``-o``, ``--report-file``,
``--flight-dir``) are taken in the folder memviz starts in, whatever folder
the script moves to.

With ``-o run.memviz`` the run is also streamed to a trace file (flushed
every 0.5 s, so it survives a kill up to the last flush); read it later with
``memviz report run.memviz`` or ``memviz.load()``. Under a launcher
(``torchrun ... -m memviz run -o run.memviz train.py``: RANK set) each rank
writes its own, ``run.rank0.memviz``, ``run.rank1.memviz`` ... (``{rank}`` in
the path says where the rank goes; memviz.capture.rank_files.rank_path), and so
does ``--report-file``; ``memviz report run.rank*.memviz`` merges them.

Where GPU capture is off (no GPU, no driver, no CUPTI; not with --no-gpu), a
script that sets ``MEMVIZ_SAMPLE_WITHOUT_GPU = True`` in its globals (memviz's
demo, examples/basic.py, does) is followed, after its own report, by the
report of the sample trace shipped in memviz/data (sample.memviz, recorded on
a GPU from that demo), headed by the machine, date and script it was
recorded on (sample.json), and marked as a recording, not this machine's data
(memviz.cli.sample).

No report comes out when the process ends without unwinding the Python stack:
``os._exit()``, a fatal signal (SIGKILL, SIGTERM without a handler, a crash),
or a fork()ed child (only the parent reports).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import shlex
import sys
import threading
import traceback
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import memviz._core as _core
from memviz._args import whole_option
from memviz._errors import CaptureConflict, CaptureUnavailable, MemvizError, OutputError
from memviz._output_files import same_file, write_output
from memviz._package import PACKAGE_DIR
from memviz.capture import callsite as _callsite
from memviz.capture import events as _events, session as _session
from memviz.capture.rank_files import rank_glob, rank_of, rank_path
from memviz.cli.common import EXIT_USAGE, parse, positive, say
from memviz.cli.sample import SAMPLE_OPT_IN, show_sample
from memviz.report.text import text_report
from memviz.trace.format import TraceWarning
from memviz.tracker import CaptureWarning, Tracker

__all__ = ["main", "build_parser"]

EXIT_INTERRUPTED = 130
EXIT_OUTPUT = 2  # the script succeeded but a report file or the trace could not be written
_VALUE_OPTIONS = ("--depth", "--top", "--report-file", "-o", "--output", "--flight-recorder", "--flight-dir")
_MEMVIZ_DIR = PACKAGE_DIR
_RUNPY_FILES = {"<frozen runpy>", os.path.abspath(runpy.__file__)}


class UsageError(Exception):
    """A mistake in the command line: one line, no traceback, exit status 2."""


def build_parser(prog: str = "memviz run") -> argparse.ArgumentParser:
    """The parser of memviz's own options (everything before the script).

    Its usage line is argparse's own, from the arguments below: the script,
    -m and the script's arguments are in it for that, but main() splits them
    off first (_split) and parses only memviz's options."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a Python script (or -m module) with every CUDA allocation tracked, "
                    "then print a memory report to stderr.",
        epilog="Everything after the script name (or -m module) is passed to the script.",
        allow_abbrev=False,
    )
    parser.add_argument("--precise", action="store_true",
                        help="PyTorch on the driver's stream-ordered pool (backend:cudaMallocAsync): "
                             "every tensor is seen; labels backward allocations with their autograd node")
    parser.add_argument("--autograd", action="store_true",
                        help="label backward allocations with their autograd node and forward line, "
                             "and record what autograd graphs keep (saved-tensor hooks)")
    parser.add_argument("--depth", type=whole_option(1, _core.MAX_DEPTH), default=32, metavar="N",
                        help=f"Python frames kept per allocation (1-{_core.MAX_DEPTH}, default 32)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="do not capture GPU allocations (run and report only)")
    parser.add_argument("--no-cupti", action="store_true",
                        help="use no CUPTI (for other tools alongside: torch.profiler, Nsight): "
                             "PyTorch's memory through its allocator, the rest as NVML's total")
    parser.add_argument("--top", type=positive, default=10, metavar="N",
                        help="lines listed per device at its peak (default 10)")
    parser.add_argument("--report-file", metavar="PATH",
                        help="also write the report to this file (one per rank under torchrun, "
                             "as for -o)")
    parser.add_argument("-o", "--output", metavar="TRACE",
                        help="also stream a .memviz trace file here (read it with "
                             "`memviz report TRACE` or memviz.load()); under torchrun each rank "
                             "writes its own, run.memviz -> run.rank0.memviz ({rank} in the path "
                             "says where the rank goes)")
    parser.add_argument("-f", "--force", action="store_true",
                        help="overwrite -o's trace and --report-file when they exist (without it "
                             "memviz refuses before the script runs)")
    parser.add_argument("--flight-recorder", metavar="SIZE", type=_budget,
                        help="keep the latest events in SIZE of memory (e.g. 256MiB) and write "
                             "them as a trace only when an allocation fails, the script raises, "
                             "or on SIGUSR1 (kill -USR1 PID)")
    parser.add_argument("--flight-dir", metavar="DIR",
                        help="where the flight recorder's dumps go (default: this folder; made if "
                             "missing)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("-m", dest="module", metavar="module",
                        help="run a module like python -m (the rest are its arguments)")
    target.add_argument("script", nargs="?", metavar="script.py",
                        help="the Python script to run (the rest are its arguments)")
    parser.add_argument("args", nargs="*", metavar="args",
                        help="the script's (or module's) arguments, passed on unchanged")
    return parser


def _budget(text: str) -> int:
    from memviz.trace.flight import parse_budget
    try:
        return parse_budget(text, "--flight-recorder")
    except MemvizError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _split(argv: List[str]) -> Tuple[List[str], Optional[str], Optional[str], List[str]]:
    """(memviz options, script, module, script args): the first token that is
    not an option, or ``-m NAME``, ends memviz's own options."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            if i + 1 >= len(argv):
                return argv[:i], None, None, []
            return argv[:i], argv[i + 1], None, argv[i + 2:]
        if tok == "-m":
            if i + 1 >= len(argv):
                raise UsageError("-m needs a module name, e.g. `memviz run -m mypkg.train`")
            return argv[:i], None, argv[i + 1], argv[i + 2:]
        if tok.startswith("-m") and not tok.startswith("--"):
            return argv[:i], None, tok[2:], argv[i + 1:]
        if tok in _VALUE_OPTIONS:
            i += 2
            continue
        if tok.startswith("-") and tok != "-":
            i += 1
            continue
        return argv[:i], tok, None, argv[i + 1:]
    return argv, None, None, []


def _check_script(script: str) -> None:
    if not os.path.exists(script):
        raise UsageError(f"cannot run {script!r}: no such file. Give the path of a Python "
                         "script, or -m module.name to run a module.")
    if os.path.isdir(script):
        raise UsageError(f"cannot run {script!r}: it is a directory. Give the path of a .py "
                         "file, or -m module.name to run a package.")
    if not script.endswith((".py", ".pyw")):
        raise UsageError(f"cannot run {script!r}: not a .py file. Give a Python script "
                         "(ending in .py), or -m module.name to run a module.")


def _check_module(module: str) -> List[str]:
    """The top-level package must exist (looked up without running any code).
    Returns the files that may be the module's code (what -o must not overwrite)."""
    top = module.split(".")[0]
    saved = sys.path[:1]
    sys.path[0:1] = [os.getcwd()]  # where python -m looks first, as _execute sets it
    try:
        spec = importlib.util.find_spec(top) if top else None
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[0:1] = saved
    if spec is None:
        raise UsageError(f"cannot run module {module!r}: no module named {top!r}. Check the "
                         "name, and that it is importable from this folder.")
    files = [spec.origin] if spec.origin and os.path.isfile(spec.origin) else []
    rest = module.split(".")[1:]
    for folder in spec.submodule_search_locations or ():
        base = os.path.join(folder, *rest)
        files += [f for f in (base + ".py", os.path.join(base, "__init__.py"),
                              os.path.join(base, "__main__.py")) if os.path.isfile(f)]
    return files


def _check_report_file(path: Optional[str], what: str = "the report",
                       option: str = "--report-file",
                       inputs: Sequence[Tuple[str, Optional[str]]] = (), force: bool = False) -> None:
    """Refuse, before the script runs, an output that cannot be written, that
    is one of ``inputs`` ((name, path) pairs: the script, -o's trace), or
    that exists (without ``force``)."""
    if path is None:
        return
    if not path or "\0" in path:
        raise UsageError(f"cannot write {what} to {path!r}: not a file name. Give a path with {option}.")
    for name, file in inputs:
        if file is not None and same_file(path, file):
            raise UsageError(f"cannot write {what} to {path!r}: it is {name}, which writing "
                             f"there would destroy. Choose another {option} path.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {what} to {path!r}: the folder {folder!r} does "
                         f"not exist. Create it or choose another {option}.")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {what} to {path!r}: it is a directory. Give a file "
                         f"name with {option}.")
    exists = os.path.exists(path)
    if exists and not os.access(path, os.W_OK):
        raise UsageError(f"cannot write {what} to {path!r}: permission denied (the file is "
                         f"read-only). Make it writable or choose another {option}.")
    if exists and not force and os.path.isfile(path):  # a device or a FIFO is no file to keep
        from memviz.cli.common import exists_message
        raise UsageError(exists_message(path, what, option))
    if not exists and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {what} to {path!r}: permission denied in the folder "
                         f"{folder!r}. Choose another {option} in a folder you may write to.")


def _is_ours(filename: str) -> bool:
    return (filename in _RUNPY_FILES or filename.startswith("<frozen importlib")
            or filename.startswith(_MEMVIZ_DIR + os.sep))


def _user_traceback(tb):
    """The traceback without memviz's and runpy's frames at its start (None if
    nothing is left, as for a SyntaxError in the script)."""
    while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _print_exception(exc: BaseException) -> None:
    """Print like Python does for an uncaught exception (through sys.excepthook)."""
    sys.stdout.flush() if sys.stdout else None
    tb = _user_traceback(exc.__traceback__)
    exc.__traceback__ = tb  # the default hook prints the exception's own traceback
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # noqa: BLE001 - a broken hook: fall back like Python does
        traceback.print_exception(type(exc), exc, tb)


def _exit_status(exc: SystemExit) -> int:
    """The status Python exits with for this SystemExit (printing a non-int code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stdout.flush() if sys.stdout else None
    print(code, file=sys.stderr)
    return 1


def _module_not_found(exc: BaseException) -> bool:
    """An ImportError raised by runpy/importlib themselves (no user frame)."""
    return isinstance(exc, ImportError) and _user_traceback(exc.__traceback__) is None


def _wait_for_threads() -> None:
    """What the interpreter does before it exits: first the shutdown calls
    registered with threading (concurrent.futures' executors register one
    that tells their workers to stop), then join the non-daemon threads.
    Joined without those calls, a script that left an executor open hung."""
    calls = getattr(threading, "_threading_atexits", None)
    if isinstance(calls, list):
        ran, calls[:] = list(calls), []  # each once: the interpreter's own pass finds them gone
        for call in reversed(ran):
            try:
                call()
            except Exception:  # noqa: BLE001 - as Python says it, and the report still comes
                print("Exception ignored on threading shutdown:", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t.is_alive() and t is not threading.main_thread():
            t.join()


def _execute(script: Optional[str], module: Optional[str], args: List[str]) -> Dict[str, Any]:
    """Run the target with ``sys.argv``/``sys.path[0]`` set like python does;
    returns its globals when it returned.

    The target runs in a temporary ``__main__`` that is gone when the report
    is written; its globals are handed to memviz.capture.callsite, which names
    calls through the target's module aliases (``F.linear``)."""
    try:
        if module is not None:
            sys.argv = [module] + args  # run_module(alter_sys=True) sets argv[0] to the file
            sys.path[0:1] = [os.getcwd()]
            ns = runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script] + args
            sys.path[0:1] = [os.path.dirname(os.path.realpath(script))]
            ns = runpy.run_path(os.path.abspath(script), run_name="__main__")  # __file__ absolute, as in 3.9+
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_globals.get("__name__") != "__main__":
            tb = tb.tb_next
        if tb is not None:  # the target's own frame: its globals as they were
            _callsite.add_namespace(tb.tb_frame.f_code.co_filename, tb.tb_frame.f_globals)
        raise
    if isinstance(ns.get("__file__"), str):
        _callsite.add_namespace(ns["__file__"], ns)
    return ns


def _emit(report: str, report_file: Optional[str],
          inputs: Sequence[Tuple[str, Optional[str]]] = ()) -> bool:
    """Print the report to stderr and write it to ``report_file`` (through a
    temporary file renamed over it). False when the file could not be written
    (said on stderr, after the printed report)."""
    try:
        sys.stdout.flush() if sys.stdout else None
    except Exception:  # noqa: BLE001 - the script may have closed stdout
        pass
    # A script may set sys.stderr to None or to an object of its own: the
    # report is memviz's, and goes to the process's stderr then
    err = sys.stderr if sys.stderr is not None else sys.__stderr__
    try:
        err.write("\n" + report)
        err.flush()
    except Exception:  # noqa: BLE001 - stderr closed, full or broken: the file may still get it
        pass
    if report_file is not None:
        try:
            write_output(report_file, report, "the report", inputs=inputs)
        except OutputError as e:
            say(str(e))  # "memviz cannot write the report to ...: why. What to do: ..."
            return False
    return True


def _trace_note(tracker: Tracker, path: str, given: Optional[str] = None) -> bool:
    """One line saying where the trace went (``path``, this rank's file of
    the ``given`` -o path) and how to read it; False (and what went wrong,
    what to do) when writing it stopped early."""
    from memviz._units import format_size

    writer = next((p for p in tracker.subscribers if getattr(p, "path", None) == path), None)
    events = f"{writer.events_written:,} events, " if writer is not None else ""
    try:
        size = format_size(os.path.getsize(path))
    except OSError:
        size = "?"
    if given is not None:  # said as given while that still names it (the script left the folder as it was)
        as_given = rank_path(given)
        if os.path.abspath(as_given) == path:
            path = as_given
    read = f"read it with `python -m memviz report {shlex.quote(path)}`"
    if rank_of() is not None and given is not None:  # torchrun: every rank's file, merged
        read += f", all ranks with `python -m memviz report {shlex.quote(rank_glob(given))}`"
    if writer is not None and writer.error is not None:
        say(f"memviz: the trace {path} is incomplete ({events}{size}): {writer.error} "
             f"What to do: free some disk space or choose another -o path next time; {read} "
             "(it loads up to the last complete flush).")
        return False
    say(f"memviz: trace written to {path} ({events}{size}); {read}")
    return True


def _flight_dump(tracker: Tracker, exc: BaseException) -> None:
    """The flight recorder's dump when the script raised (before the traceback)."""
    if tracker.running:  # through the capture session, as every flight-recorder trigger
        _session.current().failure(tracker, _events.Trigger(
            _events.EXCEPTION, f"{type(exc).__name__} raised by the script"))


def _start(opts: argparse.Namespace) -> Tracker:
    tracker = Tracker(gpu=not opts.no_gpu, depth=opts.depth, trace=opts.output,
                      precise=opts.precise, autograd=True if opts.autograd else None,
                      flight_recorder=opts.flight_recorder, flight_dir=opts.flight_dir,
                      cupti=False if opts.no_cupti else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)  # said below, and in the report
        tracker.start()
    if not tracker.gpu_enabled and not opts.no_gpu:
        reason = (tracker.gpu_off_reason or "unknown reason").rstrip(".")
        print(f"memviz: GPU capture is off: {reason}. The script runs, but no GPU allocation "
              "will be recorded.", file=sys.stderr)
    elif tracker.gpu_enabled and not tracker.cupti_enabled and not opts.no_cupti:
        reason = (tracker.cupti_off_reason or "unknown reason").rstrip(".")
        print(f"memviz: tracking without CUPTI: {reason}. PyTorch's memory is still seen through its "
              "allocator; other libraries' allocations only as NVML's total. Pass --no-cupti to say "
              "this is meant.", file=sys.stderr)
    return tracker


def main(argv: Optional[List[str]] = None, prog: str = "memviz run") -> int:
    """Entry point of ``memviz run``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    try:
        own, script, module, args = _split(argv)
        opts = parse(parser, own)
        if isinstance(opts, int):  # --help, or argparse's own usage error
            return opts
        if opts.module is not None:  # "-m" given as the last memviz option, e.g. -m=x
            module = opts.module
        if script is None and not module:
            raise UsageError("give a script to run, e.g. `memviz run train.py --epochs 1`, or "
                             "-m module.name")
        if script is not None:
            _check_script(script)
            inputs = [("the script to run", script)]
        else:
            inputs = [("a file of the module to run", f) for f in _check_module(module)]
        trace = rank_path(opts.output) if opts.output is not None else None  # one per rank
        if opts.report_file is not None:
            opts.report_file = rank_path(opts.report_file)
        _check_report_file(trace, "the trace", "-o", inputs, force=opts.force)
        _check_report_file(opts.report_file, inputs=inputs + [("the trace file given with -o",
                                                               trace)], force=opts.force)
        # Checked as given, then absolute: a script that changes its folder must not
        # move them (a report written over a file there that nobody checked)
        if opts.report_file is not None:
            opts.report_file = os.path.abspath(opts.report_file)
        if opts.flight_dir is not None:
            opts.flight_dir = os.path.abspath(opts.flight_dir)
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE

    try:
        tracker = _start(opts)
    except CaptureUnavailable as e:
        print(f"{prog}: cannot capture GPU allocations: {e.reason.rstrip('.')}. What to do: "
              f"{e.hint} Or pass --no-gpu to run the script without GPU capture.", file=sys.stderr)
        return EXIT_USAGE
    except (CaptureConflict, MemvizError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE

    command = shlex.join((["-m", module] if module is not None else [script]) + args)
    saved_argv, saved_path0 = sys.argv, sys.path[:1]
    pid = os.getpid()
    status = 0
    ns: Dict[str, Any] = {}
    try:
        try:
            ns = _execute(script, module, args)
        except SystemExit as e:
            status = _exit_status(e)
        except KeyboardInterrupt as e:
            _flight_dump(tracker, e)
            _print_exception(e)
            status = EXIT_INTERRUPTED
        except BaseException as e:  # noqa: BLE001 - report any failure of the script
            if module is not None and _module_not_found(e):
                print(f"{prog}: cannot run module {module!r}: {e}. Check the name, and that "
                      "it is importable from this folder.", file=sys.stderr)
                return EXIT_USAGE
            _flight_dump(tracker, e)
            _print_exception(e)
            status = 1
        try:
            _wait_for_threads()
        except KeyboardInterrupt:
            status = EXIT_INTERRUPTED
    except KeyboardInterrupt:  # a second Ctrl-C while the first was handled (its dump, its traceback)
        status = EXIT_INTERRUPTED
    finally:
        try:
            if tracker.running:  # the script may have stopped it through memviz.stop()
                with warnings.catch_warnings():  # an incomplete trace: said by _trace_note
                    warnings.simplefilter("ignore", TraceWarning)
                    tracker.stop()
        except KeyboardInterrupt:  # a Ctrl-C while it stopped: it stopped, the trace is closed
            status = EXIT_INTERRUPTED
        finally:
            sys.argv, sys.path[:1] = saved_argv, saved_path0

    if os.getpid() != pid:  # a fork()ed child of the script's, ending here: the parent reports
        _callsite.forget_namespaces()
        return status
    written = True
    try:
        written = _emit(text_report(tracker, top=opts.top, command=command), opts.report_file,
                        inputs)
        if tracker.trace_path is not None:
            written = _trace_note(tracker, tracker.trace_path, opts.output) and written
        if not opts.no_gpu and not tracker.gpu_enabled and ns.get(SAMPLE_OPT_IN) is True:
            show_sample(opts.top)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - keep the script's status; show what broke
        print("memviz: internal error while writing the report (please report it):\n"
              + traceback.format_exc(), file=sys.stderr if sys.stderr is not None else sys.__stderr__)
    finally:
        # The script's objects go now, while the interpreter is whole: kept to
        # its end (to name calls), their __del__ ran with modules half gone
        del ns
        _callsite.forget_namespaces()
    # An output that could not be written fails the command, keeping the script's own failure.
    return status if status or written else EXIT_OUTPUT
