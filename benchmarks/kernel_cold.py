"""The native recording kernel's cost per collective with cold caches, one setting against another (issue 31).

In the FSDP2 loop the kernel's stack walk costs 2.4-4.7 us per collective, in a tight loop of
collectives 0.1-0.4 us: between two collectives a training step touches enough memory that the
interpreter's frames, the tensors and the kernel's own tables are no longer in the caches. This script
reproduces that without a model, in one process on PyTorch's in-process ``fake`` backend (collectives
complete at once): before each collective it writes ``--evict-kib`` of memory, then issues the
collective from a Python stack ``--depth`` frames deep (distinct functions, as a module stack is), in
FSDP2's mix (all-gather, reduce-scatter, all-reduce, from three call sites). Only the collectives are
timed.

Rounds alternate two settings of the kernel (``--versus``), the order rotating, so drift slower than a
round cancels. Per setting it prints the kernel's own clock by part (microseconds per collective,
median over rounds) and the collective call's median time; then the paired difference of the call's
time (setting on minus off, per round, median and bootstrap 95% interval).

  python benchmarks/kernel_cold.py [--versus nogil|cache|none] [--depth 40] [--evict-kib 4096]
                                   [--iters 1000] [--rounds 21]

``--versus nogil``: the call-site cache's hits recorded without taking the GIL (on) or with it (off).
``--versus cache``: the call-site cache on or off. ``--versus none``: the same setting twice (the
harness's own noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_parts, paired  # noqa: E402

PARTS = ("kernel", "arguments", "GIL", "walk", "record", "leaving", "write")


def deep_caller(depth: int, leaf):
    """A function that calls ``leaf(k)`` from ``depth`` distinct Python frames."""
    namespace = {"leaf": leaf}
    source = [f"def f{depth}(k):\n    return leaf(k)\n"]
    for i in range(depth - 1, -1, -1):
        source.append(f"def f{i}(k):\n    x = k + {i}\n    return f{i + 1}(k)\n")
    exec("".join(source), namespace)
    return namespace["f0"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versus", choices=("nogil", "cache", "none"), default="nogil")
    parser.add_argument("--depth", type=int, default=40, help="Python frames above each collective")
    parser.add_argument("--evict-kib", type=int, default=4096, help="memory written before each collective")
    parser.add_argument("--iters", type=int, default=1000, help="collectives per round and setting")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    os.environ["MOEDOCTOR_NATIVE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from moedoctor.recorder import install

    recorder = install(Path(tempfile.mkdtemp(prefix="moedoctor-kernel-cold-")))
    native = recorder._native
    if native is None:
        raise SystemExit("kernel_cold: the native kernel did not load (a C++ compiler and ninja are needed)")
    if not native.fast_walk:
        raise SystemExit("kernel_cold: this Python has no fast walk (3.11 and 3.12 only): nothing to compare")
    recorder._progress.completed = lambda work: True  # fake works never say so; real ones do
    native.set_clock(True)

    def setting(on: bool) -> None:
        if args.versus == "nogil":
            native.set_gil_free(on)
        elif args.versus == "cache":
            native._m.set_site_cache(on)

    shard = torch.ones(1024)
    full = torch.empty(2048)
    evict = torch.zeros(args.evict_kib * 256)  # float32: 4 bytes each
    timings: list[int] = []
    # torch 2.13 names them *_single; 2.11 (the GPU host's) has only the older names.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def leaf(k: int) -> None:
        evict.add_(1.0)
        start = time.perf_counter_ns()
        if k % 3 == 0:
            gather(full, shard)
        elif k % 3 == 1:
            scatter(shard, full)
        else:
            dist.all_reduce(shard)
        timings.append(time.perf_counter_ns() - start)

    top = deep_caller(args.depth, leaf)
    for k in range(300):  # warm: every call site walked and interned, every group known
        top(k)

    parts: dict[bool, dict[str, list[float]]] = {on: {p: [] for p in PARTS} for on in (True, False)}
    calls: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            if args.versus != "none":
                setting(on)
            timings.clear()
            before = native.kernel_time()
            for k in range(args.iters):
                top(k)
            delta = tuple(b - a for a, b in zip(before, native.kernel_time()))
            for name, value in kernel_parts(delta).items():
                parts[on][name].append(value)
            calls[on].append(statistics.median(timings) / 1e3)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    setting(True)
    labels = {"nogil": ("GIL-free hits", "GIL taken"), "cache": ("cache on", "cache off"), "none": ("A", "B")}
    for on in (True, False):
        figures = ", ".join(f"{p} {statistics.median(parts[on][p]):.2f}" for p in PARTS)
        print(f"{labels[args.versus][not on]:>14}: call {statistics.median(calls[on]):.2f} us; kernel clock: {figures}")
    hits, misses = native.site_cache_counts()
    mid, lo, hi, n = paired(calls[True], calls[False], relative=False)
    print(
        f"kernel-cold: depth {args.depth}, {args.evict_kib} KiB evicted, {args.iters} x {args.rounds} rounds; "
        f"{labels[args.versus][0]} minus {labels[args.versus][1]}: call {mid:+.2f} us (CI {lo:+.2f}..{hi:+.2f}, "
        f"{n} rounds); cache answered {hits} of {hits + misses} walks"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
