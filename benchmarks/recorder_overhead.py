"""Per-collective cost of moedoctor's recorder: the same process, recorder off and on, alternating.

Three modes per op: ``off`` (no kernel), ``floor`` (a pass-through kernel at the same dispatch key,
recording nothing: the price of a Python kernel at the dispatcher) and ``on`` (the recorder).

Run under torchrun, e.g. ``torchrun --standalone --nproc_per_node 2 benchmarks/recorder_overhead.py``
(add ``--backend nccl`` on GPUs). Prints the median time per collective with and without the
recorder and the difference, for a few ops, on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def time_op(fn, iters: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def floor_kernels() -> list:
    """Pass-through kernels at the recorder's dispatch key, recording nothing."""
    from moedoctor.recorder.ops import all_specs

    after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
    libs: dict = {}
    for spec in all_specs():
        handle = spec.packet._handle
        lib = libs.setdefault(spec.namespace, torch.library.Library(spec.namespace, "IMPL"))
        lib.impl(spec.raw_name, lambda ks, *a, _h=handle, **kw: _h.redispatch_boxed(ks & after, *a, **kw),
                 "BackendSelect", with_keyset=True)
    return list(libs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda")
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    dist.init_process_group(args.backend)
    small = torch.ones(8, device=device)
    world = dist.get_world_size()
    gathered = torch.empty(8 * world, device=device)
    ops = {
        "all_reduce": lambda: dist.all_reduce(small),
        "all_reduce async": lambda: dist.all_reduce(small, async_op=True).wait(),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, small),
        "broadcast": lambda: dist.broadcast(small, 0),
    }
    from moedoctor.recorder import install

    run_dir = Path(tempfile.mkdtemp(prefix="moedoctor-bench-"))
    recorder = install(run_dir)
    recorder.unregister_kernels()
    modes = ("off", "floor", "on")
    results: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in ops}
    for name, fn in ops.items():
        time_op(fn, args.iters, sync)  # warm-up
        for _ in range(args.rounds):
            for mode in modes:
                libs = floor_kernels() if mode == "floor" else []
                if mode == "on":
                    recorder.register_kernels()
                dist.barrier()
                results[name][mode].append(time_op(fn, args.iters, sync))
                recorder.unregister_kernels()
                for lib in libs:
                    lib._destroy()
    if dist.get_rank() == 0:
        print(f"backend={args.backend} world={world} iters={args.iters} rounds={args.rounds} "
              f"torch={torch.__version__}")
        print(f"{'op':<24}{'off us':>9}{'floor us':>10}{'on us':>9}{'floor+':>9}{'added':>9}")
        for name, r in results.items():
            off, floor, on = (statistics.median(r[m]) for m in modes)
            print(f"{name:<24}{off:>9.1f}{floor:>10.1f}{on:>9.1f}{floor - off:>9.1f}{on - off:>9.1f}")
        print("floor+ = cost of a pass-through Python kernel at the dispatcher; added = recorder's total")
        events = sum(1 for _ in open(run_dir / "traces" / "rank-00000.jsonl"))
        print(f"trace lines on rank 0: {events}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
