"""Process groups created every way a job creates them, for the recorder's coverage tests.

``--setup``: ``mesh`` (``init_device_mesh`` alone, no ``init_process_group`` call), ``by-name``
(``init_process_group`` imported by name), ``store`` (an explicit ``TCPStore``, then ``new_subgroups``
and ``new_group``), ``subgroups`` (the same without the store), ``split`` (``split_group`` where the
backend has it, else ``new_group``). Each rank then runs a few collectives on every group; with ``--desync`` rank 1 skips
one all_reduce on the last group at step 2, so the job hangs until the group timeout.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import init_process_group  # imported by name, as many scripts do

TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "30")))


def setup(kind: str, backend: str) -> list:
    world = int(os.environ["WORLD_SIZE"])
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,), mesh_dim_names=("dp",))
        return [mesh.get_group("dp")]
    if kind == "store":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world,
                              int(os.environ["RANK"]) == 0, timeout=TIMEOUT)
        init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=TIMEOUT)
    else:
        init_process_group(backend, timeout=TIMEOUT)
    if kind in ("store", "subgroups"):
        mine, _ = dist.new_subgroups(group_size=world)
        return [dist.group.WORLD, mine, dist.new_group(list(range(world)))]
    if kind == "split":
        split = getattr(dist, "split_group", None)
        try:
            group = split(split_ranks=[list(range(world))]) if split else None
        except Exception:  # the backend cannot split (Gloo): an ordinary subgroup instead
            group = None
        return [dist.group.WORLD, group or dist.new_group(list(range(world)))]
    return [dist.group.WORLD]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", default="by-name")
    parser.add_argument("--desync", action="store_true")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = parser.parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    groups = setup(args.setup, args.backend)
    rank = dist.get_rank()
    t = torch.ones(4, device="cuda" if args.backend == "nccl" else "cpu")
    for step in range(4):
        for i, group in enumerate(groups):
            if args.desync and rank == 1 and step == 2 and i == len(groups) - 1:
                continue
            dist.all_reduce(t, group=group)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
