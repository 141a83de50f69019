"""``coalesce-broadcasts`` flushes before an operation touches a deferred tensor: the range index
alone, then the installed fix in a real process (the fake backend, rank 1 of 2, its flushes counted
at ``dist._broadcast_coalesced``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moedoctor.fixes.coalesce_broadcasts import Ranges

REPO = Path(__file__).resolve().parents[2]


def test_ranges_answer_overlap_with_one_bisection():
    r = Ranges()
    assert not r and not r.overlaps(0, 100)
    for start in (300, 100, 500):  # added out of order
        r.add(start, start + 50)
    assert r
    assert r.overlaps(120, 130) and r.overlaps(90, 101) and r.overlaps(349, 400) and r.overlaps(0, 1000)
    assert not r.overlaps(150, 300) and not r.overlaps(0, 100) and not r.overlaps(550, 600)
    r.clear()
    assert not r and not r.overlaps(100, 150)


JOB = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
events = []
real = dist._broadcast_coalesced
def counted(pg, tensors, *args):
    events.append(("flush", len(tensors)))
    return real(pg, tensors, *args)
dist._broadcast_coalesced = counted
from moedoctor.fixes.coalesce_broadcasts import FIX
from moedoctor.fixes.runtime import FixRuntime
runtime = FixRuntime(FIX, FIX.parse_config({"targets": ["loader:load", "loader:load_each"]}), None, False)
FIX.install(runtime)
import loader
loader.load(events)
events.append("---")
loader.load_each(events)
print(json.dumps(events))
"""

LOADER = '''
import torch, torch.distributed as dist

def load(events):
    flat = torch.zeros(40)
    params = [flat[i * 10:(i + 1) * 10] for i in range(4)]  # views of one buffer, as a flat param buffer
    other = torch.ones(3)
    for p in params:
        dist.broadcast(p, src=0)
    events.append(("untouched", float(other.sum())))  # not a deferred tensor: nothing flushed
    events.append(("after loop", len(events)))
    model = torch.nn.Linear(10, 1, bias=False)
    model.load_state_dict({"weight": params[2].view(1, 10)})  # reads a deferred view: flush first
    events.append("read")
    dist.broadcast(other, src=0)
    return model

def load_each(events):
    for _ in range(3):
        t = torch.zeros(5)
        dist.broadcast(t, src=0)
        events.append(("read", float(t.sum())))  # read at once: one flush per broadcast
'''


def test_an_operation_on_a_deferred_tensor_flushes_first_and_others_do_not(tmp_path):
    (tmp_path / "loader.py").write_text(LOADER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], capture_output=True, text=True,
                            timeout=180, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    events = json.loads(result.stdout.strip().splitlines()[-1])
    # Four broadcasts deferred; the sum of an unrelated tensor and the loop's end flush nothing; the
    # load_state_dict of a deferred view flushes all four in one coalesced broadcast before it reads;
    # the broadcast after it is flushed when the target returns.
    assert events[:6] == [["untouched", 3.0], ["after loop", 1], ["flush", 4], "read", ["flush", 1], "---"], events
    # Read right after each broadcast: every broadcast is flushed alone (nothing coalesced).
    assert events[6:] == [["flush", 1], ["read", 0.0]] * 3, events
