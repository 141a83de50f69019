"""What the recorder adds to one collective on a real backend, timed over many iterations.

Run under ``moedoctor run`` (the recorder installed at start-up, as users run it), on 2 GPUs:

  moedoctor run -- torchrun --standalone --nproc_per_node 2 benchmarks/collective_cost.py --backend nccl

In one process it alternates rounds with the whole recorder on and paused (``Recorder.pause``: no
kernel on the dispatcher, evidence hooks passing through); each round issues ``--iters`` 1-float
all-reduces back to back and synchronises once at the end, so the time per collective is the host's
issue cost plus NCCL's, with no per-op synchronisation. Prints the median per collective of each mode
and their difference: the recorder's cost per collective. Without moedoctor it installs a recorder
itself (Python kernels unless ``MOEDOCTOR_NATIVE=1``).
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
from _timing import kernel_split, paired_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode, interleaved")
    parser.add_argument("--kernel-clock", action="store_true",
                        help="the native kernel times itself by part and the split is printed (the clock's "
                        "own reads add to the cost measured)")
    parser.add_argument("--depth", type=int, default=0,
                        help="issue each round's collectives from this many nested Python frames (FSDP2's "
                        "hooks run 40-60 deep): the stack walk's cost grows with the depth")
    args = parser.parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, sync = torch.device("cuda"), torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    dist.init_process_group(args.backend)
    from moedoctor.recorder.install import install, installed_recorder

    recorder = installed_recorder() or install(Path(tempfile.mkdtemp(prefix="moedoctor-cost-")))
    native = getattr(recorder, "_native", None)
    if native is not None and args.kernel_clock:
        native.set_clock(True)
    x = torch.ones(1, device=device)
    for _ in range(50):  # warm-up: communicators, caches
        dist.all_reduce(x)
    sync()
    per_op: dict[bool, list[float]] = {True: [], False: []}
    for r in range(2 * args.rounds):
        on = r % 2 == 0
        recorder.resume() if on else recorder.pause()
        dist.barrier()
        sync()
        per_op[on].append(_nested(args.depth, lambda: _round(x, args.iters, sync)))
    recorder.resume()
    if dist.get_rank() == 0:
        on, off = statistics.median(per_op[True]), statistics.median(per_op[False])
        kind = "native" if native is not None else "python"
        split = kernel_split(native) if native is not None else None
        if split:
            print(split, flush=True)
        print(f"collective cost ({args.backend}, {kind} kernels, 1-float all_reduce, {args.iters} per round, "
              f"{args.rounds}+{args.rounds} rounds): recorder paused {off:.2f} us, on {on:.2f} us, "
              f"added {on - off:+.2f} us per collective (spread on {min(per_op[True]):.2f}-{max(per_op[True]):.2f},"
              f" paused {min(per_op[False]):.2f}-{max(per_op[False]):.2f}); "
              f"{paired_text(per_op[True], per_op[False], ' us', relative=False)}", flush=True)
    dist.destroy_process_group()


def _round(x, iters: int, sync) -> float:
    """One round: ``iters`` all-reduces back to back, one synchronisation; us per collective."""
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def _nested(depth: int, fn):
    return fn() if depth <= 0 else _nested(depth - 1, fn)


if __name__ == "__main__":
    main()
