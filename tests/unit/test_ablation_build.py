"""The ablation build (src/store.h, CFLAGS=-DMVZ_ABLATE): pieces of the
capture path left out at runtime (``_core._prefetch`` bits 128, no autograd
node read, and 256, no clock read), so that benchmarks/bench_toggle.py on
the GPU machine can say what each piece costs inside a real step. Built here
from this tree into a folder of its own and driven through the stand-in
allocator on the real wrappers; a plain build refuses the bits."""

import json
import platform
import subprocess
import sys

import pytest

from conftest import ROOT, build_variant
from memviz import _core

pytestmark = pytest.mark.skipif(
    not (platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"),
    reason="the allocator route patches a C++ vtable on x86-64 glibc only")

DRIVE = """
import json, os, sys, tempfile, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
from fake_cupti import FakeCupti, build
path = build()
os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
import torch  # noqa: F401  (the stand-in route attaches with torch imported)
import memviz
import stand_in_allocator as sa
fake = FakeCupti(path)
fake.reset()
ans = sa.StandInAnswers(sa.build(Path(tempfile.mkdtemp()) / "abl"), fake.lib.fake_alloc)
c = memviz._core
with memviz.track(depth=32) as t:
    r = t.torch.use_answers(ans)
    assert r.route == "allocator", r.reason
    was = c._prefetch(2)
    a = ans.alloc(4096)
    time.sleep(0.02)
    c._prefetch(2 | 256)   # no clock read
    b = ans.alloc(8192)
    time.sleep(0.02)
    c._prefetch(2 | 128)   # no autograd node read; the clock again
    d = ans.alloc(12288)
    c._prefetch(was)
    rows = {{x.address: x for x in c.live()}}
    out = {{"core": c.__file__, "ts": [rows[p].timestamp_ns for _, p in (a, b, d)],
           "stacks": [rows[p].stack_id for _, p in (a, b, d)]}}
print(json.dumps(out))
"""


def test_a_plain_build_refuses_the_ablation_bits():
    for bits in (128, 256, 2 | 128):
        with pytest.raises(ValueError, match="from 0 to 127"):
            _core._prefetch(bits)


def test_an_ablation_build_leaves_the_clock_out_while_asked_and_only_then(tmp_path):
    pytest.importorskip("torch")  # the stand-in route attaches with torch imported
    tree = build_variant(tmp_path / "ablate", "-DMVZ_ABLATE")
    code = DRIVE.format(root=str(tree), tests=str(ROOT / "tests"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["core"].startswith(str(tree)), out["core"]
    ta, tb, td = out["ts"]
    # 20 ms apart, but b's tick was never read: the store, whose timestamps
    # strictly increase, puts it right after a; d reads the clock again.
    assert 0 < tb - ta < 1_000_000, out
    assert td - tb >= 15_000_000, out
    # Only the named piece is left out: every allocation keeps its stack.
    assert all(s > 0 for s in out["stacks"]), out
