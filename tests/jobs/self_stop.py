"""A rank that stops itself: at step ``--stop-step`` rank ``--stop-rank`` sends itself SIGSTOP from
its own training loop, between two collectives, so the other ranks wait in the next all-reduce for
a process that does not run (state T) and has issued nothing.

Not a desync and not a straggler: the report must name the stopped rank and suggest no code change.
A stopped process ignores SIGTERM until it is continued; the job is killed from outside.
"""

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop-step", type=int, default=3)
    parser.add_argument("--stop-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    x = torch.ones(64)
    for step in range(args.steps):
        y = (x * (rank + 1)).sum()  # a little work
        if step == args.stop_step and rank == args.stop_rank:
            print(f"[rank {rank}] step {step}: stopping myself (SIGSTOP)", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(x)
        x /= dist.get_world_size()
        print(f"[rank {rank}] step {step} done ({float(y):.1f})", flush=True)
        time.sleep(0.05)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
