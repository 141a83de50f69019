"""Rank 0 takes SECONDS (default 6) before it imports torch (a busy node, a slow file system);
rank 1 imports at once and waits for it in init_process_group. Healthy: a few all_reduces, exit 0."""

import os
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 6.0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
for _ in range(3):
    dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
