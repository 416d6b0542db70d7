"""Progress on stderr (memviz/_progress.py): `memviz report`, `memviz diff`
and the exports show it when stderr is a terminal and the work takes over a
second; nothing when stderr is a pipe, nothing for short work.

The terminal is a pseudo-terminal (the pty module) given to a child
process as its stderr; the child lowers the one-second delay
(``_progress.DELAY_S``) so that a small trace is "long" work, or keeps it to
show that short work draws nothing.
"""

import io
import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest

import memviz._progress as progress
from memviz.trace import format as F

from conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty and /proc")


def small_trace(path, chunks=40, per_chunk=2000):
    rows = []
    for k in range(per_chunk // 2):
        a = 0x7F00_0000 + (k % 16) * 4096
        rows.append(F.EVENT.pack(100, F.OP_ALLOC, 0, 0, 0, 0, 0, 0, a, 4096, 0, 0))
        rows.append(F.EVENT.pack(100, F.OP_FREE, 0, 0, 0, 0, 0, 0, a, 4096, 0, 0))
    meta = {"format": "memviz-trace", "format_version": 1, "mode": "stream",
            "start_monotonic_ns": 1000, "tracker": {}, "capture": {}}
    with open(path, "wb") as f:
        f.write(F.header() + F.chunk(F.META, F.json_bytes(meta)))
        for _ in range(chunks):
            f.write(F.chunk(F.EVENTS, F.events_payload(b"".join(rows))))
        f.write(F.chunk(F.END, F.json_bytes({"stopped_monotonic_ns": 10 ** 9})))


def run(code, *args, tty, cwd):
    """(stdout, stderr) of a child running ``code``; its stderr a pseudo-terminal or a pipe."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    if not tty:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    err = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        err += data
    out = p.stdout.read().decode()
    assert p.wait(timeout=60) == 0, err
    os.close(master)
    return out, err.decode(errors="replace")


FAST = "import memviz._progress as p; p.DELAY_S = 0.0; p.INTERVAL_S = 0.0\n"


def test_report_shows_progress_on_a_terminal_and_clears_it(tmp_path):
    small_trace(tmp_path / "run.memviz")
    code = FAST + ("import sys\nfrom memviz.cli.report import main\n"
                   "sys.exit(main([sys.argv[1], '--format', 'html', '-o', sys.argv[2]]))\n")
    out, err = run(code, tmp_path / "run.memviz", tmp_path / "run.html", tty=True, cwd=tmp_path)
    assert "\rmemviz report: reading run.memviz: " in err and "% of " in err, repr(err)
    # cleared before the command says what it wrote, so that line stands alone
    assert "\r\x1b[Kmemviz report: wrote " in err, repr(err)
    assert (tmp_path / "run.html").exists()


def test_report_text_on_the_terminal_starts_on_a_clear_line(tmp_path):
    small_trace(tmp_path / "run.memviz")
    code = FAST + ("import sys\nfrom memviz.cli.report import main\n"
                   "sys.exit(main([sys.argv[1]]))\n")
    out, err = run(code, tmp_path / "run.memviz", tty=True, cwd=tmp_path)
    assert "reading run.memviz" in err and err.endswith("\r\x1b[K"), repr(err)
    assert "Peak" in out or "peak" in out


def test_nothing_is_drawn_when_stderr_is_a_pipe(tmp_path):
    small_trace(tmp_path / "run.memviz")
    code = FAST + ("import sys\nfrom memviz.cli.report import main\n"
                   "sys.exit(main([sys.argv[1], '--format', 'html', '-o', sys.argv[2]]))\n")
    out, err = run(code, tmp_path / "run.memviz", tmp_path / "run.html", tty=False, cwd=tmp_path)
    assert "\r" not in err and "%" not in err and "\x1b" not in err, repr(err)
    assert err.startswith("memviz report: wrote "), repr(err)


def test_short_work_draws_nothing_on_a_terminal(tmp_path):
    small_trace(tmp_path / "run.memviz", chunks=2)
    code = ("import sys\nfrom memviz.cli.report import main\n"
            "sys.exit(main([sys.argv[1], '--format', 'json']))\n")
    out, err = run(code, tmp_path / "run.memviz", tty=True, cwd=tmp_path)
    assert err == "", repr(err)
    assert '"memviz_report": 1' in out


def test_diff_and_the_exports_show_progress_on_a_terminal(tmp_path):
    small_trace(tmp_path / "a.memviz")
    small_trace(tmp_path / "b.memviz", chunks=30)
    code = FAST + ("import sys\nfrom memviz.cli.diff import main\n"
                   "sys.exit(main([sys.argv[1], sys.argv[2]]))\n")
    out, err = run(code, tmp_path / "a.memviz", tmp_path / "b.memviz", tty=True, cwd=tmp_path)
    assert "\rmemviz diff: reading a.memviz: " in err and "\rmemviz diff: reading b.memviz: " in err
    assert "A  a.memviz" in out and "B  b.memviz" in out
    code = FAST + ("import sys, warnings, memviz\n"
                   "t = memviz.load(sys.argv[1])\n"
                   "t.to_perfetto(sys.argv[2])\n")
    out, err = run(code, tmp_path / "a.memviz", tmp_path / "a.json", tty=True, cwd=tmp_path)
    assert "\rmemviz: to_perfetto: reading again a.memviz: " in err, repr(err)
    assert (tmp_path / "a.json").stat().st_size > 0


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_waits_for_its_delay_and_clears_before_other_output(monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    term = Terminal()
    with progress.shown("memviz x", stream=term, delay=3600):
        progress.update(5, 10, "reading t")
    assert term.getvalue() == ""  # shorter than its delay: nothing
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with progress.shown("memviz x", delay=0):
        progress.update(5, 10, "reading t")
        assert term.getvalue() == "\rmemviz x: reading t: 50% of 10 bytes\x1b[K"
        print("an error", file=sys.stderr)  # the line goes first
        progress.update(10, 10, "reading t")
        progress.update(0, None, "rendering")
    assert term.getvalue() == ("\rmemviz x: reading t: 50% of 10 bytes\x1b[K\r\x1b[Kan error\n"
                               "\rmemviz x: reading t: 100% of 10 bytes\x1b[K"
                               "\rmemviz x: rendering...\x1b[K\r\x1b[K")
    assert sys.stderr is term  # put back
    progress.update(1, 2, "after")  # nobody shows it now
    assert term.getvalue().endswith("\r\x1b[K")
    not_a_terminal = io.StringIO()
    with progress.shown("memviz x", stream=not_a_terminal, delay=0):
        progress.update(5, 10, "reading t")
    assert not_a_terminal.getvalue() == ""
