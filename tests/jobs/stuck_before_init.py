"""A rank that hangs before any process group exists: rank 1 never returns from reading its dataset
index, so rank 0 waits in ``init_process_group``'s rendezvous and no rank ever records a trace."""

import datetime
import os
import time

import torch
import torch.distributed as dist


def load_dataset_index() -> None:
    while True:  # a hung storage mount, before the process group exists; dies with the job
        time.sleep(1)


if int(os.environ["RANK"]) == 1:
    load_dataset_index()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
