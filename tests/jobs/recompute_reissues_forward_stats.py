"""Two blocks all-reduce their batch statistics in forward ([2, 8], then [2, 16]), then the gradients
are all-reduced flat. At step 2 rank 1's input is long and it checkpoints the blocks: in backward the
recompute all-reduces the second block's statistics again while rank 0 all-reduces the gradients.
The re-issued [2, 16] looks like the next step's second collective only by op, call site and size;
the history issues that one in forward, this one is in backward: rank 1 issued an extra collective
(corpus 31's Demucs read as rank 1 having left out two collectives).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.proj = torch.nn.Linear(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        stats = torch.stack([h.mean(0), h.pow(2).mean(0)]).detach()
        dist.all_reduce(stats)
        return (h - stats[0]) / (stats[1] + 1e-5).sqrt()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(4, 8), Block(8, 16)])
    head = torch.nn.Linear(16, 1)
    params = [*blocks.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    for step in range(4):
        long_input = step == 2 and rank == 1
        x = torch.randn(16 if long_input else 8, 4, requires_grad=True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if long_input else block(x)
        loss = head(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        opt.step()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
