"""A training loop whose skip decision is rank-local, for ``skip-step-collectively`` named through
``--config`` (a ``__main__`` target). ``--wrong-skip`` "skips" the way seed 001's review warns
against: zero the gradients and step anyway, which AdamW's weight decay turns into a real update.
``--reset-skip`` handles a skip as DiLoCo does: the weights go back to a saved copy, no step."""

import argparse
import datetime

import torch
import torch.distributed as dist


def should_skip(step: int, rank: int) -> bool:
    return step == 1 and rank == 1  # rank-local: only rank 1 sees its "overflow"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrong-skip", action="store_true")
    parser.add_argument("--reset-skip", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    saved = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if should_skip(step, rank):
            optimizer.zero_grad(set_to_none=False)
            if args.wrong_skip:
                optimizer.step()
            if args.reset_skip:
                with torch.no_grad():
                    for p, keep in zip(model.parameters(), saved):
                        p.copy_(keep)
            continue
        optimizer.step()
        optimizer.zero_grad()
        print(f"[rank {rank}] step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
