"""Try memviz without a GPU: real attribution of your own code's lines,
steps and a finding, through the CUPTI test double.

Run it from a source checkout (it builds tests/fake_cupti, which needs a C
compiler):

    python examples/try_without_gpu.py

The test double is a stand-in for NVIDIA's libcupti that the test suite
uses: its fake "driver" hands out addresses and calls memviz's CUPTI
callback exactly as the real driver would, on the calling thread. So what
you see below went through memviz's real capture path: the frames of the
line that asked, the steps, the growth rule. Nothing is allocated on a GPU;
the sizes are what the fake driver was asked for. Replace `gpu_alloc` by a
real framework on a GPU machine, and `memviz.track()` reports the same way.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20


def load_test_double():
    """Build the libcupti test double and point memviz at it (before memviz loads CUPTI)."""
    tests = os.path.join(ROOT, "tests")
    if not os.path.isdir(os.path.join(tests, "fake_cupti")):
        sys.exit("examples/try_without_gpu.py needs memviz's source checkout (tests/fake_cupti): "
                 "run it from a clone of the repository")
    sys.path.insert(0, tests)
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, FakeCupti, build

    import functools

    import memviz

    path = build()  # compiles fake_cupti.c once (cached under tests/fake_cupti/_build)
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    fake = FakeCupti(path)
    fake.reset()
    # the double's own Python wrapper is a library, as a framework's would be: your line is the user's
    memviz.frames.add_library_path(os.path.join(tests, "fake_cupti"))
    return functools.partial(fake.alloc, CBID_cuMemAlloc_v2), functools.partial(fake.free, CBID_cuMemFree_v2)


gpu_alloc, gpu_free = load_test_double()


# ---- "your" code: a small training loop with a leak -------------------------------------

def load_model():
    return [gpu_alloc(64 * MiB) for _ in range(4)]          # the weights: kept


def forward(batch):
    return [gpu_alloc(8 * MiB) for _ in range(batch)]       # activations: freed each step


history = []


def train_step(batch):
    acts = forward(batch)
    loss = gpu_alloc(1 * MiB)
    history.append(loss)                                     # the leak: every step's loss is kept
    for a in acts:
        gpu_free(a)


def main():
    import memviz

    weights = load_model()
    with memviz.track(torch=False) as t:
        for step in range(8):
            train_step(batch=6)
            t.step()
    print(memviz.summary(t, top=5))
    print("The lines still holding memory when tracking stopped:")
    for stat in t.snapshot().statistics("lineno")[:3]:
        print("   ", stat)
    print("\nWhat memviz.diagnose(t) finds:")
    for finding in memviz.diagnose(t):
        print("   ", finding)
    del weights


if __name__ == "__main__":
    main()
