"""GPU stress run (H200): 8 Python threads training, DataLoader workers with
pinned memory feeding the main thread, backward on the engine threads, and a
thread taking snapshots, all under memviz.track() on the allocator route.

    python benchmarks/gpu_stress.py [--iters 1000] [--threads 8] [--timeout 480]

Prints one JSON line: iterations done per thread, snapshots taken, whether
memviz's block bytes equal torch.cuda.memory_allocated() at the end, the
route, and the wall time. A deadlock is reported by faulthandler's dump
after --timeout seconds (and a non-zero exit).
"""

import argparse
import faulthandler
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class Squares:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        return torch.full((64, 256), float(i % 7))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=480)
    ap.add_argument("--no-snapshots", action="store_true", help="no thread taking snapshots")
    ap.add_argument("--no-loader", action="store_true", help="no DataLoader feeding the main thread")
    a = ap.parse_args()
    faulthandler.enable()
    faulthandler.dump_traceback_later(a.timeout, exit=True)

    import torch
    import memviz

    torch.cuda.init()
    models = [torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
              for _ in range(a.threads + 1)]
    done = [0] * a.threads
    errors = []
    snaps = [0]
    stop = threading.Event()
    t0 = time.perf_counter()
    with memviz.track() as t:
        route = memviz.capture_info()["pytorch"]

        def train(k):
            try:
                m = models[k]
                opt = torch.optim.SGD(m.parameters(), lr=1e-3)
                s = torch.cuda.Stream()
                for i in range(a.iters):
                    with torch.cuda.stream(s):
                        x = torch.randn(64, 256, device="cuda")
                        m(x).square().mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    done[k] = i + 1
                s.synchronize()
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        def snapshotter():
            while not stop.is_set():
                t.snapshot()
                snaps[0] += 1
                time.sleep(0.05)

        workers = [threading.Thread(target=train, args=(k,), name=f"train{k}") for k in range(a.threads)]
        shot = threading.Thread(target=snapshotter, name="snapshots")
        for w in workers:
            w.start()
        if not a.no_snapshots:
            shot.start()
        loader = torch.utils.data.DataLoader(Squares(0 if a.no_loader else a.iters * 8), batch_size=8,
                                             num_workers=2, pin_memory=True)
        main_model = models[-1]
        loaded = 0
        for batch in loader:
            x = batch.cuda(non_blocking=True).view(-1, 256)
            main_model(x).sum().backward()
            loaded += 1
        for w in workers:
            w.join()
        stop.set()
        if not a.no_snapshots:
            shot.join()
        torch.cuda.synchronize()
        snap = t.snapshot()
        blocks = sum(x.size for x in snap.allocations if x.kind == "block")
        allocated = torch.cuda.memory_allocated()
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps({"iterations_per_thread": done, "loader_batches": loaded, "snapshots": snaps[0],
                      "errors": errors, "route": route, "blocks_equal_allocated": blocks == allocated,
                      "blocks": blocks, "allocated": allocated, "wall_s": round(time.perf_counter() - t0, 1),
                      "block_events": t.capture_info()["store"]["calls"].get("block_alloc")}))
    sys.exit(1 if errors or min(done) < a.iters else 0)


if __name__ == "__main__":
    main()
