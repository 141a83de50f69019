"""A healthy job that issues collectives through every path the recorder must see.

FSDP2 (``fully_shard`` on a cpu mesh) with DTensor ``clip_grad_norm_``, DDP, ``all_gather_object``,
async ops, p2p, a collective from a background thread, a subgroup per pair of ranks, a functional
collective, and a ``torch.distributed.checkpoint`` save. Prints each step's loss and, at the end, a
digest of the final parameters, so tests can compare runs with and without the recorder bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write, so the ranks' lines do not interleave
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    mesh = init_device_mesh("cpu", (world,))
    fsdp_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (fsdp_model[0], fsdp_model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-2)

    ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-2)
    pair = [r - r % 2 for r in range(world)]
    subgroups = [dist.new_group([r, r + 1]) for r in range(0, world - world % 2, 2)]
    my_subgroup = subgroups[rank // 2] if rank // 2 < len(subgroups) else None

    generator = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(4, 8, generator=generator)
        loss = fsdp_model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(fsdp_model.parameters(), 1.0)
        fsdp_opt.step()
        fsdp_opt.zero_grad()

        ddp_loss = ddp_model(torch.randn(3, 4, generator=generator)).sum()
        ddp_loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

        metric = loss.detach().clone()
        work = dist.all_reduce(metric, async_op=True)
        work.wait()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "loss": float(loss)})
        if my_subgroup is not None:
            dist.all_reduce(torch.ones(2), group=my_subgroup)
        if world >= 2 and rank in (0, 1):
            buf = torch.full((3,), float(step))
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
        background = threading.Thread(target=lambda: dist.broadcast(torch.zeros(5), src=0), name="metrics-thread")
        background.start()
        background.join()
        functional_all_reduce(torch.ones(3), "sum", dist.group.WORLD).wait()
        say(f"[rank {rank}] step {step} loss {loss.item():.8f} metric {metric.item():.8f}")

    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="mixed-ckpt-")
    objs = [checkpoint_dir]
    dist.broadcast_object_list(objs, src=0)
    dcp.save({"model": fsdp_model.state_dict()}, checkpoint_id=os.path.join(objs[0], "ckpt"))
    dist.barrier()

    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in fsdp_model.parameters()]
    params += list(ddp_model.parameters())
    say(f"[rank {rank}] final digest {digest(params)} pairs {pair[rank]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
