"""Many collective paths in one process on PyTorch's in-process ``fake`` backend (rank 0 of 2), with
the recorder installed directly: for comparing the Python and the native recording kernels.

  python tests/jobs/fake_ops.py RUN_DIR [--kernels python|native|switch] [--max-events N]

``switch`` starts on the Python kernels, switches to the native ones half-way and back at the end.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.testing._internal.distributed.fake_pg import FakeStore

from moedoctor.events import Phase


def save_checkpoint(tensor):  # a user function named like a checkpoint save
    dist.all_reduce(tensor)


def phase_one(recorder, big):
    tensor = torch.ones(8)
    dist.all_reduce(tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True).wait()
    dist.broadcast(torch.zeros(3, 2, dtype=torch.bfloat16), src=1)
    dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
    dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), op=dist.ReduceOp.AVG)
    dist.all_to_all_single(torch.empty(4), torch.ones(4))
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    dist.all_gather(big, torch.ones(1))  # more than 64 tensors: "n" gives the counts
    functional_all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()
    dist.barrier()


def phase_two(recorder, subgroup):
    torch.manual_seed(0)  # the recorded losses must be the same in every run
    model = torch.nn.Linear(2, 2)

    class Collective(torch.nn.Module):
        def forward(self, x):
            dist.all_reduce(x)  # inside Module.__call__: forward
            return x

    Collective()(torch.ones(2))
    recorder.step = 3
    recorder.optimizer_depth = 1
    dist.all_reduce(torch.ones(2))  # optimizer
    recorder.optimizer_depth = 0
    recorder.checkpoint = Phase.CHECKPOINT_LOAD
    dist.all_reduce(torch.ones(2))  # checkpoint_load
    recorder.checkpoint = None
    save_checkpoint(torch.ones(2))  # checkpoint_save from the function's name

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(grad)  # in an autograd graph task: backward
            return grad

    Backward.apply(model(torch.ones(2)).sum().reshape(1).requires_grad_()).sum().backward()
    worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)), name="worker-thread")
    worker.start()
    worker.join()
    dist.send(torch.ones(2), 1)
    dist.recv(torch.ones(2), 1)
    dist.send(torch.ones(2), 1, group=subgroup)
    dist.all_reduce(torch.ones(5), group=subgroup)
    fsdp_unit()


def fsdp_unit():
    """One FSDP2 unit's forward: its all-gather carries the unit's name ("mod")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kernels", choices=["python", "native", "switch"], default="python")
    parser.add_argument("--max-events", type=int, default=None)
    args = parser.parse_args()
    os.environ["MOEDOCTOR_NATIVE"] = "1" if args.kernels == "native" else "0"
    from moedoctor.recorder import install

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    recorder = install(args.run_dir, args.max_events)
    # Completions polled only at close (the fake backend's collectives complete at once): the kernels'
    # completion records then fall at the same place in both traces, whatever the host's timing.
    recorder._progress.idle = True
    print(f"native={recorder._native is not None and recorder._native.registered}", flush=True)
    print(f"fast_walk={getattr(recorder._native, 'fast_walk', None)}", flush=True)
    subgroup = dist.new_group([1, 0])
    big = [torch.empty(1) for _ in range(70)]
    phase_one(recorder, big)
    if args.kernels == "switch":
        recorder.unregister_kernels()
        os.environ["MOEDOCTOR_NATIVE"] = "1"
        recorder.register_kernels()
        print(f"switched native={recorder._native.registered}", flush=True)
    phase_two(recorder, subgroup)
    if args.kernels == "switch":
        recorder.unregister_kernels()
        os.environ["MOEDOCTOR_NATIVE"] = "0"
        recorder.register_kernels()
        dist.all_reduce(torch.ones(2))
        dist.send(torch.ones(2), 1, group=subgroup)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
