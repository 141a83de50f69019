"""A tiny healthy job: a few all_reduce / broadcast / barrier calls on Gloo, then a clean exit.

``--fail-rank R`` makes rank R exit with status 3 after its collectives (the others succeed).
"""

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    x = torch.ones(4) * (rank + 1)
    for _ in range(3):
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
    dist.barrier()
    print(f"[rank {rank}] done {x.sum().item():.0f}", flush=True)
    dist.destroy_process_group()
    if rank == args.fail_rank:
        sys.exit(3)


if __name__ == "__main__":
    main()
