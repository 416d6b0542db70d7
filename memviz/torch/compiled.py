"""torch.compile and CUDA graphs under the PyTorch integration.

``mode="reduce-overhead"`` runs a model's compiled code through CUDA-graph
trees (``torch._inductor.cudagraph_trees``), which record graphs into a
private pool and check, when they checkpoint the pool, that each live
block's deleter is the allocator's ``raw_deleter()``. Under the allocator
route a block made while tracking carries memviz's deleter and one made
before carries PyTorch's, so trees that recorded graphs *before* tracking
started see some blocks as foreign (README, "Known limits of the
allocator route"). This cannot be repaired from outside PyTorch without
re-recording the user's graphs (resetting the trees would invalidate the
outputs the program still holds), so :func:`warn_if_trees_exist` says so
when tracking attaches the route; started before the first compiled call,
the trees record under memviz and work (measured on the H200).

What compile-time memory and graph pools are called is decided in
memviz.torch.categories (``compile``, ``cuda_graph_pool``); the model
lines of compiled code in memviz.model.compiled.

May import: memviz.capture, memviz.model (floors: docs/architecture.md);
torch only as already imported (sys.modules).
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

from memviz.capture.availability import CaptureWarning

__all__ = ["graph_trees_exist", "warn_if_trees_exist", "TREES_BEFORE"]

#: what memviz says when CUDA-graph trees were recorded before tracking
TREES_BEFORE = (
    "memviz: torch.compile(mode='reduce-overhead') recorded CUDA graphs before tracking started; "
    "their private pools' blocks carry PyTorch's deleter and those made from now on memviz's, "
    "which CUDA-graph trees' checkpointing does not accept as its own, and the graphs' memory "
    "before tracking is attributed to no line. Start tracking before the compiled model's first "
    "call (e.g. `with memviz.track():` around the whole training, or `memviz run`), or call "
    "torch._dynamo.reset() before tracking so the graphs are recorded again."
)


def graph_trees_exist() -> bool:
    """True when ``torch._inductor.cudagraph_trees`` (already imported) holds
    a tree manager on this thread: a ``reduce-overhead`` model ran. Reads
    only what is there (never imports torch, never creates a manager)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    local = getattr(trees, "local", None)
    containers = getattr(local, "tree_manager_containers", None)
    if not isinstance(containers, dict):
        return False
    for container in list(containers.values()):
        if getattr(container, "tree_manager", None) is not None:
            return True
    return False


def warn_if_trees_exist(route: Optional[str], stacklevel: int = 2) -> bool:
    """Warn (CaptureWarning) when the allocator route attaches while
    CUDA-graph trees from before tracking exist; returns whether it warned.
    Nothing to say on the other routes (they do not change deleters)."""
    if route != "allocator" or not graph_trees_exist():
        return False
    warnings.warn(CaptureWarning(TREES_BEFORE), stacklevel=stacklevel)
    return True
