"""Scale benchmark of ``moedoctor analyze``: synthetic traces of 256 ranks x 100,000 collectives.

    python benchmarks/analyze_scale.py                       # generate into a temp dir, analyze, clean up
    python benchmarks/analyze_scale.py --ranks 64 --collectives 20000 --keep /tmp/scale

The job: a 2-D mesh (tensor-parallel groups of 8, data-parallel groups of ranks % 8, and the world),
about 100 collectives per step (tp all-reduces, FSDP all-gathers / reduce-scatters on dp, a dp
optimizer all-reduce), completions, annotations and evidence records as the recorder writes them.
Ten steps before the end, rank 13 gets a non-finite grad norm and skips its optimizer step: its dp
group waits in the optimizer all-reduce while rank 13 is in the next forward, and the rest of the
mesh stops behind them. The analysis must name ``skipped-optimizer-step``, culprit 13, and the dp
group of ranks 5, 13, 21, ...

The analysis runs in a child process (``--analyze-only``) so its peak RSS (and its workers') is
measured apart from the generator's. Prints seconds and peak RSS; exits 1 when the diagnosis is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TP = 8
FAULT_RANK = 13
BASE = 1_700_000_000
SITES = [("/job/train.py", 120, "train_step"), ("/job/model.py", 88, "forward"), ("/job/train.py", 131, "train_step"),
         ("/job/optim.py", 45, "_global_grad_norm"), ("/job/train.py", 140, "train_step")]


def groups_of(rank: int, world: int) -> list[tuple[int, str, str, list[int]]]:
    """(interned id, name, desc, ranks) of the world, tp and dp groups of ``rank``."""
    tp = rank // TP
    dp = rank % TP
    return [(0, "0", "default_pg", list(range(world))),
            (1, str(1 + tp), "tp", list(range(tp * TP, tp * TP + TP))),
            (2, str(1 + world // TP + dp), "dp", list(range(dp, world, TP)))]


class Writer:
    """Formats one rank's records in the recorder's layout; ``RRR`` marks the per-rank digits of times."""

    def __init__(self):
        self.out: list[str] = []
        self.event = 0
        self.seq = [0, 0, 0]
        self.ms = 0
        self.pending: list[int] = []

    def t(self) -> str:
        self.ms += 1
        return f"{BASE + self.ms // 1000}.{self.ms % 1000:03d}RRR"

    def coll(self, gid: int, op: str, shape: int, phase: str, step: int, site: int, module: str | None = None,
             done: bool = True, red: str | None = None) -> None:
        self.seq[gid] += 1
        raw = {"all_reduce": "c10d::allreduce_", "all_gather": "c10d::_allgather_base_",
               "reduce_scatter": "c10d::_reduce_scatter_base_"}[op]
        out = shape * TP if op == "all_gather" else (shape // TP if op == "reduce_scatter" else shape)
        mod = f',"mod":"{module}"' if module else ""
        self.out.append(f'{{"k":"c","i":{self.event},"g":{gid},"seq":{self.seq[gid]},"s":{site},"t":{self.t()},'
                        f'"op":"{op}","raw":"{raw}","in":[[{shape}]],"out":[[{out}]],"dt":["bfloat16"],'
                        f'"async":false,"th":"MainThread","ph":"{phase}","step":{step}{mod}}}\n')
        if red:
            self.out.append(f'{{"k":"a","i":{self.event},"red":"{red}"}}\n')
        if done:
            self.pending.append(self.event)
            if len(self.pending) >= 10:
                self.flush()
        self.event += 1

    def flush(self) -> None:
        if self.pending:
            self.out.append(f'{{"k":"d","t":{self.t()},"i":[{",".join(map(str, self.pending))}]}}\n')
            self.pending = []

    def ev(self, kind: str, step: int, data: dict | None = None) -> None:
        body = f',"data":{json.dumps(data, separators=(",", ":"))}' if data else ""
        self.out.append(f'{{"k":"e","t":{self.t()},"kind":"{kind}","step":{step}{body}}}\n')

    def forward(self, step: int, done: bool = True, upto: int | None = None) -> None:
        for layer in range(20):
            if upto is not None and layer >= upto:
                return
            self.coll(2, "all_gather", 4096, "forward", step, 1, module=f"layers.{layer}", done=done)
            self.coll(1, "all_reduce", 8192, "forward", step, 1, done=done, red=None)

    def step(self, step: int) -> None:
        self.forward(step)
        self.ev("backward_begin", step)
        for layer in reversed(range(20)):
            self.coll(1, "all_reduce", 8192, "backward", step, 2, done=True)
            if layer % 2 == 0:
                self.coll(2, "all_gather", 4096, "backward", step, 2, module=f"layers.{layer}")
            self.coll(2, "reduce_scatter", 32768, "backward", step, 2, module=f"layers.{layer}", red="avg")
        self.ev("backward_end", step)
        self.coll(0, "all_reduce", 1, "other", step, 4, red="sum")
        self.grad_norm_and_optimizer(step)

    def grad_norm_and_optimizer(self, step: int, finite: bool = True, done: bool = True) -> None:
        self.ev("grad_norm", step, {"norm": 1.25 if finite else "inf", "finite": finite, "site": "/job/optim.py:82"})
        if not finite:
            return
        self.ev("optimizer_step_begin", step, {"optimizer": "ShardedAdamW"})
        self.coll(2, "all_reduce", 1, "optimizer", step, 3, done=done, red="sum")
        if done:
            self.ev("optimizer_step_end", step + 1, {"optimizer": "ShardedAdamW"})


def generate(folder: Path, world: int, collectives: int) -> tuple[int, float]:
    per_step = 92
    steps = max(12, collectives // per_step)
    fault_step = steps - 10
    prefix = Writer()
    for step in range(fault_step):
        prefix.step(step)
    prefix.forward(fault_step)
    prefix.ev("backward_begin", fault_step)
    for layer in reversed(range(20)):
        prefix.coll(1, "all_reduce", 8192, "backward", fault_step, 2)
        if layer % 2 == 0:
            prefix.coll(2, "all_gather", 4096, "backward", fault_step, 2, module=f"layers.{layer}")
        prefix.coll(2, "reduce_scatter", 32768, "backward", fault_step, 2, module=f"layers.{layer}", red="avg")
    prefix.ev("backward_end", fault_step)
    prefix.coll(0, "all_reduce", 1, "other", fault_step, 4, red="sum")
    prefix.flush()
    body = "".join(prefix.out).encode()
    sites = "".join(json.dumps({"k": "s", "id": i, "file": f, "line": ln, "fn": fn, "stack": [f"{f}:{ln} {fn}"]},
                               separators=(",", ":")) + "\n" for i, (f, ln, fn) in enumerate(SITES))
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for rank in range(world):
        header = {"format": "moedoctor-trace", "version": 1, "rank": rank, "local_rank": rank % 8, "world_size": world,
                  "host": f"node{rank // 8}", "pid": 1000 + rank, "torch": "2.13.0", "moedoctor": "0.1.0",
                  "start_time": float(BASE)}
        defs = "".join(json.dumps({"k": "g", "id": gid, "name": name, "desc": desc, "ranks": ranks},
                                  separators=(",", ":")) + "\n" for gid, name, desc, ranks in groups_of(rank, world))
        tail = Writer()
        tail.event, tail.seq, tail.ms = prefix.event, list(prefix.seq), prefix.ms
        dp_of_fault = rank % TP == FAULT_RANK % TP
        if rank == FAULT_RANK:                       # skips the optimizer step, goes on to the next forward
            tail.grad_norm_and_optimizer(fault_step, finite=False)
            tail.coll(2, "all_gather", 4096, "forward", fault_step, 1, module="layers.0", done=False)
        elif dp_of_fault:                            # its dp group waits in the optimizer all-reduce
            tail.grad_norm_and_optimizer(fault_step, done=False)
        elif rank // TP == FAULT_RANK // TP:         # its tp peers wait for it in the next forward
            tail.grad_norm_and_optimizer(fault_step)
            tail.coll(2, "all_gather", 4096, "forward", fault_step + 1, 1, module="layers.0")
            tail.coll(1, "all_reduce", 8192, "forward", fault_step + 1, 1, done=False)
        else:                                        # the rest stop behind them, in the next forward
            tail.grad_norm_and_optimizer(fault_step)
            tail.coll(1, "all_reduce", 8192, "forward", fault_step + 1, 1, done=False)
        tail.flush()
        tail.out.append(json.dumps({"k": "v", "t": BASE + tail.ms / 1000 + 5, "reason": "snapshot",
                                    "groups": [[g[1], tail.seq[g[0]], tail.seq[g[0]]] for g in groups_of(rank, world)],
                                    "dropped": 0}, separators=(",", ":")) + "\n")
        digits = "%03d" % (rank % 1000)
        data = (json.dumps(header, separators=(",", ":")) + "\n" + defs + sites).encode() + \
            body.replace(b"RRR", digits.encode()) + "".join(tail.out).replace("RRR", digits).encode()
        (folder / f"rank-{rank:05d}.jsonl").write_bytes(data)
        total += len(data)
    return prefix.seq[0] + prefix.seq[1] + prefix.seq[2], total


def analyze_only(folder: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from moedoctor.analysis import analyze, load_run

    load = os.getloadavg()[0]
    cpu0 = os.times()
    start = time.perf_counter()
    report = analyze(load_run(folder))
    seconds = time.perf_counter() - start
    cpu1 = os.times()
    cpu = sum(getattr(cpu1, k) - getattr(cpu0, k) for k in ("user", "system", "children_user", "children_system"))
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    div = report.divergence
    print(json.dumps({
        "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 1), "load_average_before": round(load, 2),
        "peak_rss_mib": round(self_rss, 1), "worker_peak_rss_mib": round(child_rss, 1),
        "verdict": report.verdict.value, "pattern": report.pattern, "culprit_ranks": report.culprit_ranks,
        "group": None if div is None else div.group.name,
        "group_ranks": None if div is None else list(div.group.ranks)[:6],
        "seq": None if div is None else div.seq, "collectives": report.collectives,
        "torch_imported": "torch" in sys.modules,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--collectives", type=int, default=100_000, help="per rank")
    parser.add_argument("--keep", type=Path, default=None, help="generate into this folder and keep it")
    parser.add_argument("--analyze-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.analyze_only:
        analyze_only(args.analyze_only)
        return
    assert args.ranks % TP == 0 and args.ranks > FAULT_RANK, "ranks must be a multiple of 8, above 13"
    folder = args.keep or Path(tempfile.mkdtemp(prefix="moedoctor-scale-"))
    try:
        start = time.perf_counter()
        per_rank, size = generate(folder, args.ranks, args.collectives)
        print(f"generated {args.ranks} ranks x {per_rank} collectives ({size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - start:.1f}s into {folder}", flush=True)
        done = subprocess.run([sys.executable, __file__, "--analyze-only", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout, done.stderr)
            sys.exit(2)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"analyzed in {result['seconds']:.2f}s on {len(os.sched_getaffinity(0))} cores "
              f"({result['cpu_seconds']:.1f} CPU-seconds, load average {result['load_average_before']:.2f} before); "
              f"peak RSS {result['peak_rss_mib']:.0f} MiB "
              f"(main), {result['worker_peak_rss_mib']:.0f} MiB (largest worker)")
        print(json.dumps(result))
        dp_group = [FAULT_RANK % TP + TP * i for i in range(min(6, args.ranks // TP))]
        ok = (result["pattern"] == "skipped-optimizer-step" and result["culprit_ranks"] == [FAULT_RANK]
              and result["group_ranks"] == dp_group and not result["torch_imported"])
        print("diagnosis: " + ("correct" if ok else "WRONG"))
        sys.exit(0 if ok else 1)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
