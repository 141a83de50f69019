"""Each step opens with a token-count all-reduce, then runs the rank's packed micro-batches (forward
all-gathers a shard of the embedding, backward all-reduces its gradient from a hook, as a sharded
layer does), then steps. At step 2 rank 0
packs 3 micro-batches against rank 1's 2: its third forward all-gather meets rank 1's next token count.
Every earlier step opened with the token count and rank 0 has not issued it since its last backward
pass: it is in another pass of its step, not in the next iteration of a skipped step (corpus 30's
DeepSeek-V3 packing was left `unknown-desync`, culprit rank 0): rank 1 ran fewer micro-batches.
"""

from datetime import timedelta

import torch
import torch.distributed as dist


class ShardedEmbedding(torch.nn.Module):
    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.shard = torch.nn.Parameter(torch.randn(8, 16))
        self.shard.register_hook(self._reduce)

    @staticmethod
    def _reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(self.shard) for _ in range(self.world)]
        dist.all_gather(parts, self.shard.detach())
        full = torch.cat(parts) + self.shard.repeat(self.world, 1) - self.shard.detach().repeat(self.world, 1)
        return x @ full


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(ShardedEmbedding(world), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        packs = 3 if (step == 2 and rank == 0) else 2  # a batch of short documents packs into more
        tokens = torch.tensor([float(packs * 4)])
        dist.all_reduce(tokens)
        for _ in range(packs):
            loss = model(torch.randn(4, 8 * world)).pow(2).sum() / tokens
            loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
