"""A healthy job that keeps issuing collectives and printing its progress (Gloo): ``--steps`` small
all_reduces, ``--sleep`` seconds apart, a progress line about every second, then a barrier and a
clean exit. Under ``moedoctor run`` on a tiny file system it fills the disk early and runs on."""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--sleep", type=float, default=0.01)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(4)
    printed = 0.0
    for step in range(args.steps):
        dist.all_reduce(t)
        time.sleep(args.sleep)
        if time.monotonic() - printed >= 1.0:
            printed = time.monotonic()
            print(f"[rank {rank}] progress {step}", flush=True)
    dist.barrier()
    print(f"[rank {rank}] done {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
