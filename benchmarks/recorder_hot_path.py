"""The recorder's own CPU cost per collective, without communication noise.

Runs in one process on PyTorch's in-process ``fake`` backend, whose collectives complete at once, so
what is measured is moedoctor's cost: the Python kernel at the dispatcher, the record, the progress
thread. Fake works never report completion, so the harness counts them complete as real backends'
are. Prints microseconds per collective (median of rounds) for each layer of the recorder.

  python benchmarks/recorder_hot_path.py [--iters 20000] [--rounds 5] [--profile]

The ``native recorder`` row (the C++ kernel of ``moedoctor/recorder/native``) appears where the
extension builds; ``--profile`` profiles whichever recorder ran last.
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
from recorder_overhead import floor_kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the recorded loop")
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from moedoctor.recorder import install

    recorder = install(Path(tempfile.mkdtemp(prefix="moedoctor-hot-")))
    recorder._progress.completed = lambda work: True  # fake works never say so; real ones do
    recorder.unregister_kernels()
    tensor = torch.ones(8)

    def bench() -> float:
        for _ in range(500):
            dist.all_reduce(tensor)
        runs = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(tensor)
            runs.append((time.perf_counter() - start) / args.iters * 1e6)
        return statistics.median(runs)

    results = {"no kernel": bench()}
    libs = floor_kernels()
    results["pass-through kernel (floor)"] = bench()
    for lib in libs:
        lib._destroy()
    recorder.register_kernels()
    results["recorder"] = bench()
    try:
        from moedoctor.recorder import native
    except ImportError:  # a checkout without the native kernel
        native = None
    if native is not None and native.available():  # the C++ kernel (MOEDOCTOR_NATIVE=1), same recorder
        recorder.unregister_kernels()
        os.environ[native.ENV_NATIVE] = "1"
        recorder.register_kernels()
        recorder._native.assume_completed()  # as _completed above
        results["native recorder"] = bench()
    elif native is not None:
        print(f"native recorder: unavailable: {native.reason[-500:]}")
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.iters):
            dist.all_reduce(tensor)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    recorder.close("benchmark")
    from moedoctor.trace.reader import read_trace

    trace = read_trace(recorder.run_dir / "traces" / "rank-00000.jsonl")
    errors = [e.data for e in trace.evidence if e.kind == "recorder_error"]
    print(f"recorded {len(trace.events)} collectives, recorder errors: {errors or 'none'}")
    base = results["no kernel"]
    print(f"torch={torch.__version__} iters={args.iters} rounds={args.rounds}")
    for name, us in results.items():
        print(f"{name:<30}{us:>8.2f} us/collective  (+{us - base:.2f})")


if __name__ == "__main__":
    main()
