"""A healthy job that loops over two collectives per step (Gloo): an ``all_gather`` then an
``all_reduce``, ``--sleep`` seconds apart, a progress line about every second, then a barrier and a
clean exit. The fault tests stop or kill its processes from outside while it runs; with
``--stop-rank R --stop-step N`` rank R stops itself (SIGSTOP) right after its all_gather of step N
returns, before the all_reduce: the other ranks then wait in that all_reduce."""

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--sleep", type=float, default=0.005)
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    parts = [torch.empty(4) for _ in range(world)]
    printed = 0.0
    for step in range(args.steps):
        dist.all_gather(parts, t)
        if rank == args.stop_rank and step == args.stop_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.sleep)
        dist.all_reduce(t)
        t /= world
        time.sleep(args.sleep)
        if time.monotonic() - printed >= 1.0:
            printed = time.monotonic()
            print(f"[rank {rank}] progress {step}", flush=True)
    dist.barrier()
    print(f"[rank {rank}] done {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
