"""A Gloo job that leaves PyTorch Flight Recorder dumps of a hang.

Both ranks run the same collectives (default group and a second group, several ops, shapes and
dtypes), then three training steps; in the last one rank 1 skips the metric all_reduce. Rank 1
writes its dumps at once; rank 0 writes its own from a timer thread while it is still blocked in
that all_reduce (as a dump taken during a hang would), then hits the process-group timeout.

    torchrun --nproc_per_node=2 tests/jobs/fr_dump.py OUT_DIR [--timeout SECONDS] [--backend nccl]

writes ``OUT_DIR/pickle/fr_rank_<rank>`` (``_dump_fr_trace``, with Python frames) and
``OUT_DIR/json/fr_rank_<rank>`` (``_dump_fr_trace_json``, without frames). Flight Recorder is
on by default in torch >= 2.10 (``TORCH_FR_BUFFER_SIZE`` defaults to 2000 entries).
``--backend nccl`` (one GPU per rank) is written for GPU sessions and not exercised by the tests.
"""

import argparse
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def write_dumps(out: Path, rank: int) -> None:
    c10d = torch._C._distributed_c10d
    for kind, data in (("pickle", c10d._dump_fr_trace()), ("json", c10d._dump_fr_trace_json())):
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".fr_rank_{rank}.tmp"
        tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
        tmp.rename(folder / f"fr_rank_{rank}")
    print(f"[rank {rank}] wrote Flight Recorder dumps", flush=True)


def warm_up(rank: int, pair: dist.ProcessGroup, device: torch.device) -> None:
    x = torch.ones(4, device=device)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    dist.all_gather([torch.zeros(4, device=device) for _ in range(dist.get_world_size())], x)
    dist.reduce_scatter_tensor(torch.zeros(2, device=device), torch.ones(2 * dist.get_world_size(), device=device))
    dist.barrier()
    dist.all_reduce(torch.ones(2, 3, dtype=torch.float16, device=device), group=pair)
    if rank == 0:
        dist.send(torch.ones(3, device=device), dst=1)
    elif rank == 1:
        dist.recv(torch.zeros(3, device=device), src=0)


def train_step(step: int, rank: int, grads: torch.Tensor, before_stuck=None) -> None:
    dist.all_reduce(grads)
    if step == 2 and rank == 1:
        return  # the bug: rank 1 skips the metric all_reduce of the last step
    if step == 2 and before_stuck is not None:
        before_stuck()
    dist.all_reduce(torch.tensor([float(step)], dtype=torch.float64, device=grads.device))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    pair = dist.new_group(list(range(dist.get_world_size())))
    warm_up(rank, pair, device)
    before_stuck = None
    if rank == 0:
        # Rank 0 will block in the skipped all_reduce: dump from another thread while it waits,
        # well before the timeout (timed from the moment it blocks, not from start-up, so a slow
        # machine cannot push the dump past the timeout).
        def before_stuck():
            threading.Timer(min(0.5, args.timeout / 4), write_dumps, (args.out, rank)).start()
    grads = torch.ones(8, device=device)
    for step in range(3):
        try:
            train_step(step, rank, grads, before_stuck)
        except RuntimeError as e:
            print(f"[rank {rank}] step {step}: {str(e).splitlines()[0][:120]}", flush=True)
            break
    if rank != 0:
        time.sleep(0.5)  # Gloo marks a work completed just after the caller resumes: let it, as a hang would
        write_dumps(args.out, rank)
        time.sleep(args.timeout + 1)  # stay up until rank 0 has dumped and timed out
    elif args.backend == "nccl":
        time.sleep(args.timeout + 1)  # NCCL returns at once: wait here for the timer's dump and the watchdog
    print(f"[rank {rank}] exiting", flush=True)
    # No interpreter teardown: after a timed-out collective, torch's C++ threads can abort the exit
    # ("terminate called without an active exception", seen under CI load), failing a finished job.
    os._exit(0)


if __name__ == "__main__":
    main()
