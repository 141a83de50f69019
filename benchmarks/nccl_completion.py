"""How many collectives the recorder sees complete, and through which source, on a realistic mix.

FSDP2 (``fully_shard``) training steps with ``clip_grad_norm_`` (DTensor: functional all_reduce),
then plain ``dist.all_reduce`` (no ``async_op``: on NCCL, torch >= 2.8, such ops hand the
dispatcher no Work), async ones, functional collectives, a second process group, and p2p
(``batch_isend_irecv`` around the ring, with 2 ranks or more). Run it under
moedoctor, so the recorder is in every rank:

    moedoctor run --run-dir moedoctor-runs/nccl-completion --force -- \\
        torchrun --standalone --nproc_per_node 2 benchmarks/nccl_completion.py --backend nccl

Each rank prints, from its own trace once its process group is destroyed (the trace is closed
then), "completion observed for X of Y collectives (source: ...)", and the same split by kind of
collective (c10d sync, c10d async, functional, p2p); rank 0 then prints the whole job's. The same
from the run directory afterwards, or for any run directory:

    python benchmarks/nccl_completion.py --report moedoctor-runs/nccl-completion

Y counts the collectives something proves finished: here every one, since each rank ends cleanly.
Sources: ``work`` (the recorder watched the collective's Work, or a later one of its group),
``flight-recorder`` (the recorder's progress thread read PyTorch's Flight Recorder). Works on Gloo
too (``--backend gloo``, CPU), where c10d collectives report through their Work and only the
functional ones need Flight Recorder.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def kind_of(event) -> str:
    if event.is_p2p:
        return "p2p"
    if event.raw_op.startswith("_c10d_functional"):
        return "functional"
    return "c10d async" if event.async_op else "c10d sync"


def report(traces, title: str) -> None:
    from moedoctor.analysis.loading.completion import completion_stats, source_of

    stats = completion_stats(traces)
    frac = stats.fraction()
    print(f"{title}: {stats.sentence()}; {'n/a' if frac is None else f'{100 * frac:.1f}%'} "
          f"(events {stats.events}, Flight Recorder pending {stats.pending}, unknown {stats.unknown})", flush=True)
    rows: dict[str, dict[str, int]] = {}
    for t in traces:
        for e in t.events:
            row = rows.setdefault(kind_of(e), {"events": 0})
            row["events"] += 1
            source = source_of(t, e) or "not observed"
            row[source] = row.get(source, 0) + 1
    for kind in sorted(rows):
        row = rows[kind]
        parts = ", ".join(f"{k} {v}" for k, v in sorted(row.items()) if k != "events")
        print(f"  {kind:<11} {row['events']:>5} events: {parts}", flush=True)


def read_traces(run_dir: Path, ranks=None):
    from moedoctor.analysis.loading.load import read_rank_trace
    from moedoctor.trace.reader import trace_paths

    notes: list[str] = []
    traces = [read_rank_trace(p, notes) for p in trace_paths(run_dir / "traces")]
    traces = [t for t in traces if t is not None and (ranks is None or t.rank in ranks)]
    return sorted(traces, key=lambda t: t.rank)


def closed(trace) -> bool:
    return any(c.reason in ("destroy", "exit") for c in trace.coverage)


def workload(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, sync = torch.device("cuda"), torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mesh = init_device_mesh(device.type, (world,))
    dim = args.dim
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim),
                                                      torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
                                  for _ in range(args.layers)]).to(device)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.backend == "nccl"
          else MixedPrecisionPolicy())
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens, dim, device=device)
    for _ in range(args.steps):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor: a functional all_reduce
        optimizer.step()
        optimizer.zero_grad()
    pair = dist.new_group(list(range(world)))
    t = torch.ones(1024, device=device)
    for _ in range(args.plain):
        dist.all_reduce(t)                                     # c10d, no async_op
        dist.all_reduce(t, group=pair)
    works = [dist.all_reduce(t, async_op=True) for _ in range(args.plain)]
    for w in works:
        w.wait()
    for _ in range(args.plain):
        funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
        funcol.wait_tensor(funcol.all_gather_tensor(t, 0, dist.group.WORLD))
    if world > 1:  # p2p around the ring: their Work reports them
        received = torch.empty_like(t)
        for _ in range(max(1, args.plain // 4)):
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % world),
                                               dist.P2POp(dist.irecv, received, (rank - 1) % world)]):
                req.wait()
    dist.broadcast(t, src=0)
    dist.all_reduce(t)   # the last collective of the main thread
    sync()
    time.sleep(args.settle)  # let the recorder's progress thread read Flight Recorder once more
    from moedoctor.recorder.install import installed_recorder

    recorder = installed_recorder()
    poller = getattr(recorder, "_fr_poller", None) if recorder is not None else None
    dist.destroy_process_group()  # closes this rank's trace (after a last Flight Recorder poll)
    if poller:
        print(f"[rank {rank}] Flight Recorder poller: {poller.polls} polls, {poller.claimed} collectives proven "
              f"complete, {1e3 * poller.total_cost / max(1, poller.polls):.2f} ms per poll on average"
              + (f", groups left out: {poller.tracker.misaligned}" if poller.tracker.misaligned else ""), flush=True)
    run_dir = os.environ.get("MOEDOCTOR_RUN_DIR")
    if not run_dir:
        print("not under moedoctor run (MOEDOCTOR_RUN_DIR unset): no trace to read", flush=True)
        return
    run_dir = Path(run_dir)
    report(read_traces(run_dir, {rank}), f"[rank {rank}]")
    if rank == 0:  # every rank's trace, once all are closed (ranks of other nodes: when they are)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            traces = read_traces(run_dir)
            if len(traces) >= world and all(closed(t) for t in traces):
                break
            time.sleep(0.5)
        report(traces, f"job ({len(traces)} ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--steps", type=int, default=10, help="FSDP2 training steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--plain", type=int, default=20, help="collectives of each plain kind")
    parser.add_argument("--settle", type=float, default=2.5, help="seconds to wait before destroying the groups")
    parser.add_argument("--report", type=Path, metavar="RUN_DIR", help="only print the numbers of a finished run")
    args = parser.parse_args()
    if args.report is not None:
        traces = read_traces(args.report)
        if not traces:
            sys.exit(f"{args.report}: no traces")
        for t in traces:
            report([t], f"[rank {t.rank}]")
        report(traces, f"job ({len(traces)} ranks)")
        return
    workload(args)


if __name__ == "__main__":
    main()
