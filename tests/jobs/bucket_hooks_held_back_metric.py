"""A hand-written bucket reducer: gradient hooks launch each bucket's async all-reduce in order once
all its parameters have a gradient, in the last of a fixed 2 micro-batches (`range(N_MICRO)`); a
1-element loss all-reduce follows every micro-batch's backward. At step 3 rank 1's second micro-batch
routes no token to expert 1: the bucket holding expert 1 waits for a gradient that never comes, so
rank 1's reductions are held back past its loss all-reduce while rank 0's are issued. Both ranks ran
2 micro-batches (the loop's count is a literal): no count mismatch, a metric among reductions held
back (corpus 31's OpenVLA was left `unknown-desync`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

N_MICRO = 2


class Reducer:
    def __init__(self, params: list, bucket_numel: int = 300):
        self.params, self.buckets, cur = params, [], []
        for p in reversed(params):
            cur.append(p)
            if sum(q.numel() for q in cur) >= bucket_numel:
                self.buckets.append(cur)
                cur = []
        if cur:
            self.buckets.append(cur)
        self.sync, self.works, self.ready, self.next = False, [], set(), 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p) -> None:
        if self.sync:
            self.ready.add(p)
            self._launch()

    def _launch(self) -> None:
        while self.next < len(self.buckets) and all(q in self.ready for q in self.buckets[self.next]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[self.next]])
            self.works.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[self.next]))
            self.next += 1

    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.ready.add(p)
        self._launch()
        for work, flat, bucket in self.works:
            work.wait()
            off = 0
            for q in bucket:
                q.grad.copy_(flat[off : off + q.numel()].view_as(q))
                off += q.numel()
        self.works, self.ready, self.next = [], set(), 0


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            picked = route == e
            if picked.any():
                y[picked] = expert(h[picked])
        return self.out(y)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MoE()
    reducer = Reducer(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        opt.zero_grad(set_to_none=False)
        for mb in range(N_MICRO):
            route = torch.arange(8) % 2
            if step == 3 and rank == 1 and mb == 1:
                route = torch.zeros(8, dtype=torch.long)  # every token to expert 0
            loss = model(torch.randn(8, 8), route).pow(2).mean()
            reducer.sync = mb == N_MICRO - 1
            loss.backward()
            stat = loss.detach().reshape(1)
            dist.all_reduce(stat)
        reducer.finish()
        opt.step()
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
