"""A walk over a state's items where each item issues one of two collectives: an all-gather of its
chunk's metadata, or, for a chunk above a size, an all-reduce of its element count (an offloaded
entry). The size is read on the rank's own chunk: an item of 5 rows is chunked 3 + 2, so rank 0
takes the all-reduce path and rank 1 the all-gather path at that one item. Both collectives were
issued by every rank earlier in the walk: the ranks took different paths at one item (a different
op), not a loop of all-gathers that rank 0 left early.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

ROWS = [4, 4, 6, 4, 4, 4, 5, 4, 4]  # rows of each item; 2 columns


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = []
    for rows in ROWS:
        local = torch.ones(rows, 2).chunk(world)[rank]
        if local.numel() > 4:  # an offloaded entry: only its element count is agreed
            n = torch.tensor([local.numel()])
            dist.all_reduce(n)
            manifest.append(int(n))
        else:
            meta = [torch.zeros(2, dtype=torch.long) for _ in range(world)]
            dist.all_gather(meta, torch.tensor(local.shape))
            manifest.append([m.tolist() for m in meta])
    print(f"[rank {rank}] {len(manifest)} entries", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
