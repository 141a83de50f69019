"""What the evidence hooks cost per training step, on the host, without collectives or a GPU.

The recorder's evidence hooks (``moedoctor/recorder/evidence.py``: backward begin/end and the loss,
optimizer step begin/end, ``zero_grad``, the gradient norm of ``clip_grad_norm_``, the
``params_without_grad`` check at the end of each backward and at each step) run on the training
thread once or twice a step, whatever the model. On a GPU their cost hides behind the device when the
step is GPU-bound and adds to the step when it is host-bound, where launch-to-launch and in-process
toggles on the GPU machine did not resolve it (docs/performance.md). This measures it where nothing
else moves: one process, PyTorch's in-process ``fake`` backend (no collective is issued), a model of
``--layers`` tiny blocks (6 parameters each) so that the step's own work is small, and the same step
run with the recorder on and paused (``Recorder.pause()``: every hook passes through) in alternating
blocks. Prints the median step both ways and the paired difference per step in microseconds, then
each hook's own cost timed alone.

  python benchmarks/evidence_cost.py [--layers 48] [--steps 4000] [--block 20] [--idle 0.5]

``--idle F``: the fraction of blocks left out of the forward (so their parameters get no gradient
and ``params_without_grad`` names them, as a sparse MoE's idle experts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import paired_text  # noqa: E402
from fsdp_step_overhead import Block  # noqa: E402  (the step benchmark's block: LayerNorm, up, down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--block", type=int, default=20, help="steps per on/paused block")
    parser.add_argument("--idle", type=float, default=0.0, help="fraction of blocks without a gradient")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from moedoctor.recorder import install

    recorder = install(Path(tempfile.mkdtemp(prefix="moedoctor-evidence-")))
    blocks = torch.nn.ModuleList(Block(args.dim) for _ in range(args.layers))
    used = [b for i, b in enumerate(blocks) if i >= int(args.idle * args.layers)]
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    x = torch.randn(4, args.dim)
    params = sum(1 for _ in blocks.parameters())

    def step() -> None:
        h = x
        for b in used:
            h = b(h)
        loss = h.pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(blocks.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(50):
        step()
    on: list[float] = []
    off: list[float] = []
    for i in range(args.steps // args.block):
        paused = i % 2 == 1
        recorder.pause() if paused else recorder.resume()
        start = time.perf_counter()
        for _ in range(args.block):
            step()
        (off if paused else on).append((time.perf_counter() - start) / args.block * 1e6)
    recorder.resume()
    print(
        f"{args.layers} blocks, {params} parameters ({len(blocks) - len(used)} blocks idle), "
        f"{args.steps} steps in blocks of {args.block}"
    )
    print(
        f"step: on {statistics.median(on):.1f} us, paused {statistics.median(off):.1f} us; hooks per step: "
        + paired_text(on, off, unit=" us", relative=False)
    )

    # Each hook alone, many times: what it adds to a step where it fires once.
    from moedoctor.recorder import evidence

    gradients = evidence._Gradients(recorder)
    gradients.primary = None
    step()
    h = x
    for b in used:
        h = b(h)
    h.pow(2).mean().backward()  # gradients present (idle blocks' absent) for the checks below
    alone = {
        "write_evidence (one record)": lambda: recorder.write_evidence("bench", {"of": "x"}),
        "params_without_grad check, set unchanged": lambda: gradients.note(optimizer),
    }
    for name, fn in alone.items():
        for _ in range(200):
            fn()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            runs.append((time.perf_counter() - start) / 2000 * 1e6)
        print(f"  {name}: {statistics.median(runs):.2f} us")
    norm: dict[bool, list[float]] = {True: [], False: []}
    for i in range(20):
        paused = i % 2 == 1
        recorder.pause() if paused else recorder.resume()
        start = time.perf_counter()
        for _ in range(500):
            torch.nn.utils.clip_grad_norm_(blocks.parameters(), 1e9)
        norm[paused].append((time.perf_counter() - start) / 500 * 1e6)
    recorder.resume()
    on_us, off_us = statistics.median(norm[False]), statistics.median(norm[True])
    print(
        f"  clip_grad_norm_: on {on_us:.1f} us, paused {off_us:.1f} us; "
        + paired_text(norm[False], norm[True], unit=" us", relative=False)
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
