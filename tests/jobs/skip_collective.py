"""A hanging job: rank 1 skips the third all_reduce and gets stuck elsewhere, so rank 0 waits in it.

The process-group timeout (60 s) is far longer than the watchdog's ``--hang-timeout`` in the tests,
so moedoctor must detect the hang before Gloo gives up. ``--before-init`` makes rank 1 stall before
``init_process_group`` instead, so no rank ever writes a trace.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def stuck_elsewhere() -> None:
    time.sleep(3600)  # stands in for a data loader or a host-side wait that never returns


def main() -> None:
    before_init = "--before-init" in sys.argv
    rank_env = int(__import__("os").environ["RANK"])
    if before_init and rank_env == 1:
        stuck_elsewhere()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(5):
        if step == 2 and rank == 1:
            print(f"[rank {rank}] skipping all_reduce at step {step}", flush=True)
            stuck_elsewhere()
        dist.all_reduce(x)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
