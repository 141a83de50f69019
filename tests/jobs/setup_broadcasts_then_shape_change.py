"""The parameters are broadcast from rank 0 before the first step (setup collectives in step 0), then
every step all-reduces standardisation statistics of the rank's kept features and the gradients. At
step 1 rank 1 dropped a constant feature: its statistics are [3, 7] where every earlier one of both
ranks was [3, 8]. Step 0 holds the broadcasts too, so the steps cannot be compared position by
position; rank 1's collective differs from every earlier one of its own from that call site, rank 0's
does not: rank 1 changed (corpus 31's TabPFN had no culprit).
"""

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(16, 8)
        if step == 1 and rank == 1:
            x[:, 3] = 1.0  # a constant column on this shard
        keep = x.std(0) > 0
        kept = x[:, keep]
        stats = torch.stack([kept.sum(0), kept.pow(2).sum(0), torch.full_like(kept[0], 16.0)])
        dist.all_reduce(stats)
        x = torch.nn.functional.pad(kept, (0, 8 - kept.shape[1]))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
