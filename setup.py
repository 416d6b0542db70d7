"""Build of memviz._core: plain C11, no CUDA headers or libraries needed."""
import sys

from setuptools import Extension, setup

# -fexceptions: PyTorch may throw (out of memory) through the allocator
# route's wrappers (src/allocator.c), which must be unwindable.
extra = ["-std=c11", "-Wall", "-Wextra", "-O2", "-fvisibility=hidden", "-fexceptions"]
if "--memviz-sanitize" in sys.argv:  # developer builds: ASan + UBSan
    sys.argv.remove("--memviz-sanitize")
    extra += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"]
if "--memviz-sanitize-thread" in sys.argv:  # developer builds: ThreadSanitizer
    sys.argv.remove("--memviz-sanitize-thread")
    extra += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread", "-Wno-tsan"]

core = Extension(
    "memviz._core",
    sources=[
        "src/module.c",
        "src/capture.c",
        "src/hot.c",
        "src/seqmap.c",
        "src/nodes.c",
        "src/interpose.c",
        "src/allocator.c",
        "src/cupti.c",
        "src/frames.c",
        "src/store.c",
        "src/trace_ring.c",
        "src/capq.c",
        "src/clock.c",
        "src/trace_writer.c",
        "src/window.c",
        "src/region.c",
        "src/labels.c",
        "src/libfind.c",
        "src/accounting.c",
        "src/stacks.c",
        "src/livetab.c",
        "src/peakset.c",
        "src/blocks.c",
        "src/replay.c",
        "src/replay_categories.c",
        "src/whatif.c",
        "src/whatif_pass.c",
        "src/whatif_pool.c",
        "src/whatif_va.c",
        "src/module_store.c",
        "src/module_seed.c",
        "src/module_heap.c",
        "src/module_replay.c",
        "src/module_whatif.c",
        "src/module_trace.c",
        "src/rows.c",
        "src/codeobj.c",
    ],
    depends=[
        "src/types.h",
        "src/record.h",
        "src/blocks.h",
        "src/whatif.h",
        "src/whatif_pass.h",
        "src/whatif_pool.h",
        "src/whatif_va.h",
        "src/capture.h",
        "src/seqmap.h",
        "src/nodes.h",
        "src/interpose.h",
        "src/allocator.h",
        "src/cupti.h",
        "src/cupti_abi.h",
        "src/frames.h",
        "src/region.h",
        "src/store.h",
        "src/store_types.h",
        "src/trace_ring.h",
        "src/capq.h",
        "src/window.h",
        "src/clock.h",
        "src/labels.h",
        "src/libfind.h",
        "src/accounting.h",
        "src/stacks.h",
        "src/livetab.h",
        "src/peakset.h",
        "src/replay.h",
        "src/replay_categories.h",
        "src/hash.h",
        "src/bind.h",
        "src/rows.h",
        "src/codeobj.h",
    ],
    extra_compile_args=extra,
    libraries=["dl", "pthread"],
)

setup(ext_modules=[core])
