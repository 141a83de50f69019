"""A sparse MoE loop under FSDP2 with each expert its own unit: the loop calls only the experts that
received tokens. At step 2 rank 1's batch has no token for expert 1, so it leaves out that unit's
forward all-gather and goes on with expert 2's, while rank 0 all-gathers expert 1. The all-gathers
come from one call site, one per unit: the trace shows a unit skipped in the middle of the sequence
(a skipped collective), not a loop that ran fewer iterations. Gloo pairs the equal-size expert
all-gathers silently until rank 0's last expert meets rank 1's head; the job aborts or hangs.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

D, E = 16, 4


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (tokens % E == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # an expert without tokens: its unit is never gathered on this rank
            out = out.index_add(0, idx, expert(h[idx]))
        return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.moe, self.head = nn.Embedding(32, D), Sparse(), nn.Linear(D, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.moe(h, tokens))


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model()
    for expert in model.moe.experts:
        fully_shard(expert)
    fully_shard(model.head)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        tokens = torch.arange(16) + 16 * rank
        if step == 2 and rank == 1:
            tokens = tokens[tokens % E != 1]  # a batch with no token routed to expert 1
        loss = model(tokens).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
