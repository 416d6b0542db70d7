"""How far memviz's own trace chunks inflate, by chunk kind (the reader's caps
in memviz/trace/parse.py must leave room for them).

    python benchmarks/trace_ratios.py

Records, through the libcupti test double (tests/fake_cupti): (a) the
training-like run of bench_trace.py (300 steps), (b) 3,000 steps with
allocations of 17 sizes, (c) the most regular stream there is, one
alloc/free pair repeated 500,000 times, and 20,000 empty steps. Prints, per
file and chunk kind: compressed bytes, inflated bytes, and the largest
ratio of one chunk.
"""

import collections
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE, os.path.join(HERE, "..", "tests")]


def ratios(path):
    import zlib

    import memviz.trace.format as F

    data = open(path, "rb").read()
    pos, per = F.HEADER.size, collections.defaultdict(lambda: [0, 0, 0.0])
    while pos < len(data):
        ctype, length = F.CHUNK_HEAD.unpack_from(data, pos)
        payload = data[pos + F.CHUNK_HEAD.size:pos + F.CHUNK_HEAD.size + length]
        if ctype & F.COMPRESSED:
            out = zlib.decompress(payload)
            s = per[F.CHUNK_NAMES.get(ctype & F.KIND_MASK)]
            s[0], s[1], s[2] = s[0] + len(payload), s[1] + len(out), max(s[2], len(out) / len(payload))
        pos += F.CHUNK_HEAD.size + length + F.CRC.size
    return {"file_bytes": len(data),
            "chunks": {k: {"compressed": v[0], "inflated": v[1], "max_ratio": round(v[2], 1)}
                       for k, v in per.items()}}


def main():
    import bench_trace

    tmp = tempfile.mkdtemp()
    out = {}
    a = os.path.join(tmp, "a.memviz")
    bench_trace.record(a, 300)  # sets MEMVIZ_CUPTI_LIBRARY to the test double
    out["training_like"] = ratios(a)
    import memviz
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, FakeCupti

    fake = FakeCupti(os.environ["MEMVIZ_CUPTI_LIBRARY"])
    b = os.path.join(tmp, "b.memviz")
    with memviz.track(trace=b, torch=False) as t:
        keep = []
        for i in range(3000):
            keep.append(fake.alloc(CBID_cuMemAlloc_v2, (i % 17 + 1) << 20))
            if i % 3 == 0:
                fake.free(CBID_cuMemFree_v2, keep.pop(0))
            t.step(loss=1.0 / (i + 1))
    out["steps_17_sizes"] = ratios(b)
    c = os.path.join(tmp, "c.memviz")
    with memviz.track(trace=c, torch=False) as t:
        fake.lib.fake_alloc_free_loop(CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, 500_000, 1 << 20)
        for _ in range(20_000):
            t.step()
    out["one_pair_repeated_and_empty_steps"] = ratios(c)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
