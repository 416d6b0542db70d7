"""Fuzz the trace reader for a bounded time (see tests/fuzz_trace.py).

``MEMVIZ_FUZZ_SECONDS`` (default 20) is the budget. The dependency-free
mutation fuzzer always runs; when atheris is installed, half of the budget
goes to a coverage-guided atheris run in a subprocess. Any exception other
than memviz.TraceError fails the test; the failing input is kept in the
test's tmp_path (its name is printed).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import fuzz_trace

ROOT = Path(__file__).resolve().parents[1]
SECONDS = float(os.environ.get("MEMVIZ_FUZZ_SECONDS", "20"))
HAS_ATHERIS = importlib.util.find_spec("atheris") is not None


def test_seed_traces_load():
    for data in fuzz_trace.seeds():
        t = fuzz_trace.check(data)
        assert t is not None and not t.truncated


def test_crc_repair_reaches_the_chunk_parsers():
    data = fuzz_trace.seeds()[1]  # uncompressed chunks
    assert fuzz_trace.fix_crcs(data) == data
    head, chunks, tail = fuzz_trace.split(data)
    assert len(chunks) >= 9 and tail == b""


def test_mutation_fuzzer(tmp_path):
    budget = SECONDS / 2 if HAS_ATHERIS else SECONDS
    runs = fuzz_trace.fuzz(budget, rng_seed=int(os.environ.get("MEMVIZ_FUZZ_SEED", "0")),
                           save_dir=str(tmp_path))
    assert runs > 0


def test_atheris_harness(tmp_path):
    if not HAS_ATHERIS:
        import pytest
        pytest.skip("atheris is not installed (pip install atheris); the mutation fuzzer ran")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fuzz_trace.py"),
         f"-max_total_time={max(1, int(SECONDS / 2))}", "-timeout=30",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, env=env, timeout=SECONDS * 3 + 120)
    assert p.returncode == 0, p.stderr[-4000:]
