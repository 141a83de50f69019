"""``Recorder.pause()`` / ``resume()``: the benchmarks' in-process toggle of the whole recorder. While
paused no collective is recorded and no evidence hook writes; after ``resume()`` both record again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from torch.testing._internal.distributed.fake_pg import FakeStore
from moedoctor.recorder import install
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
recorder = install(Path(sys.argv[1]))
model = torch.nn.Linear(2, 1)
def step(tag):
    dist.all_reduce(torch.full((int(tag),), 1.0))
    model(torch.ones(3, 2)).sum().backward()
step(1)
recorder.pause()
step(2)
recorder.resume()
step(3)
dist.destroy_process_group()
"""


def test_a_paused_recorder_records_nothing_and_resumes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], capture_output=True, text=True,
                            timeout=180, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "traces" / "rank-00000.jsonl").read_text().splitlines()[1:]
    records = [json.loads(line) for line in lines]
    sizes = [r["in"] for r in records if r["k"] == "c"]
    assert sizes == [[[1]], [[3]]], sizes   # the paused step's all_reduce of 2 elements is absent
    backward = [r for r in records if r["k"] == "e" and r["kind"] == "backward_begin"]
    assert len(backward) == 2, records
