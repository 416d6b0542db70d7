"""Synthetic traces of a distributed run's ranks, made through the real
writer with the libcupti test double: each rank's "run" is recorded in this
process, one after the other, with the launcher's variables (RANK,
WORLD_SIZE, ...) set as torchrun sets them, so each trace is named and
tagged as a rank's (tests/integration/test_ranks_scale.py, benchmarks/bench_ranks_scale.py).

Each rank allocates a buffer (BIG_LINE) of a size that depends on its rank,
and in each step a temporary (TEMP_LINE) freed in the step, plus ``bulk``
alloc/free pairs fired from C (the test double's loop: many events, cheap).
The ``leak`` ranks also keep 2 MiB per step (LEAK_LINE): their memory grows
while the others' does not.
"""

import os
from contextlib import contextmanager
from typing import Iterable, List

import memviz
from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

MiB = 1 << 20
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")


@contextmanager
def launcher(rank: int, world: int, run_id: str, per_host: int = 8):
    old = {k: os.environ.get(k) for k in LAUNCH_ENV}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_host), WORLD_SIZE=str(world),
                      TORCHELASTIC_RUN_ID=run_id)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def big_size(rank: int) -> int:
    """The rank's buffer: 32 MiB plus 1 MiB per rank modulo 16 (rank 15, 31, ... the highest)."""
    return (32 + rank % 16) * MiB


def record_rank(fake, folder: str, rank: int, world: int, steps: int = 6, bulk: int = 0,
                leak: bool = False, run_id: str = "scale-run") -> str:
    """One rank's trace in ``folder`` (run.rankN.memviz); returns its path."""
    with launcher(rank, world, run_id):
        fake.set_device(rank % 8)
        try:
            with memviz.track(trace=os.path.join(folder, "run.memviz"), torch=False) as t:
                alloc, free = fake.lib.fake_alloc, fake.lib.fake_free
                alloc(CBID_cuMemAlloc_v2, big_size(rank), 0, 0)  # BIG_LINE
                per_step = bulk // max(steps, 1)
                for step in range(steps):
                    if leak:
                        alloc(CBID_cuMemAlloc_v2, 2 * MiB, 0, 0)  # LEAK_LINE
                    free(CBID_cuMemFree_v2, alloc(CBID_cuMemAlloc_v2, 8 * MiB, 0, 0), 0, 0)  # TEMP_LINE
                    if per_step:
                        fake.alloc_free_loop(per_step // 2, 4096)
                    t.step()
        finally:
            fake.set_device(0)
    return t.trace_path


def record_ranks(fake, folder: str, n: int, steps: int = 6, bulk: int = 0, leak: Iterable[int] = (),
                 run_id: str = "scale-run") -> List[str]:
    leak = set(leak)
    return [record_rank(fake, folder, r, n, steps, bulk, r in leak, run_id) for r in range(n)]
