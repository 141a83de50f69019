"""``triage.loop_exit``: the ranks past a loop the others wait inside, from stacks and the job's source."""

from __future__ import annotations

import textwrap

import pytest

from moedoctor.analysis.from_stacks import report_from_stacks
from moedoctor.runner.stacks import Frame, StackDump
from moedoctor.triage.loop_exit import left_loop, name_culprit

TORCH = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{TORCH}/distributed/distributed_c10d.py"

SOURCE = textwrap.dedent(
    """\
    def train(model, steps, batches):
        for step in range(steps):
            for xb in batches:
                loss = model(xb)
                if not loss.isfinite():
                    continue
                loss.backward()
            clip(model)
            metric = model.metric()
            reduce(metric)
        barrier()
    """
)
BACKWARD, CLIP, METRIC, REDUCE, BARRIER = 7, 8, 9, 10, 11


@pytest.fixture
def train(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    return str(path)


def waits(rank: int, op: str, file: str, line: int) -> StackDump:
    frames = (Frame(op, C10D, 3000 + line), Frame("train", file, line), Frame("<module>", file, 40))
    return StackDump(rank=rank, pid=1000 + rank, main_thread=frames)


def report(stacks):
    return name_culprit(report_from_stacks(stacks, source="x", world_size=len(stacks)), stacks)


def test_the_rank_past_the_micro_batch_loop_is_the_culprit(train):
    stacks = {0: waits(0, "all_gather_into_tensor", train, BACKWARD), 1: waits(1, "all_reduce", train, CLIP)}
    rep = report(stacks)
    assert rep.pattern == "unknown-desync" and rep.culprit_ranks == [1]
    assert "rank 1 is past the loop of train.py:3 (`for xb in batches`)" in rep.culprit_reasoning
    assert "rank 0 is still inside it, at line 7" in rep.culprit_reasoning
    assert any("encloses line 7 (rank 0), not line 8 (rank 1)" in e for e in rep.evidence)


def test_whichever_rank_it_is(train):
    stacks = {0: waits(0, "all_reduce", train, CLIP), 1: waits(1, "all_gather_into_tensor", train, BACKWARD)}
    assert report(stacks).culprit_ranks == [0]


def test_an_outer_loop_left_names_the_ranks_past_it(train):
    stacks = {0: waits(0, "all_reduce", train, REDUCE), 1: waits(1, "barrier", train, BARRIER)}
    found = left_loop(stacks)
    assert found is not None and found.left == (1,) and found.loop.line == 2


@pytest.mark.parametrize(
    "lines",
    [
        (CLIP, REDUCE),  # both in the same pass of the step loop: nothing was left
        (BACKWARD, BACKWARD + 100),  # a line beyond the file: no loop known
    ],
)
def test_no_loop_left_names_no_culprit(train, lines):
    stacks = {0: waits(0, "all_reduce", train, lines[0]), 1: waits(1, "broadcast", train, lines[1])}
    rep = report(stacks)
    assert rep.pattern == "unknown-desync" and rep.culprit_ranks == []


def test_unreadable_source_names_no_culprit(tmp_path):
    gone = str(tmp_path / "gone.py")
    stacks = {0: waits(0, "all_gather_into_tensor", gone, BACKWARD), 1: waits(1, "all_reduce", gone, CLIP)}
    assert report(stacks).culprit_ranks == []


def test_different_functions_name_no_culprit(train):
    other = StackDump(rank=1, pid=1001, main_thread=(Frame("all_reduce", C10D, 1), Frame("evaluate", train, CLIP)))
    stacks = {0: waits(0, "all_gather_into_tensor", train, BACKWARD), 1: other}
    assert left_loop(stacks) is None


def test_a_majority_culprit_is_kept(train):
    stacks = {r: waits(r, "all_reduce", train, CLIP) for r in (0, 1, 2)}
    stacks[3] = waits(3, "all_gather_into_tensor", train, BACKWARD)
    rep = report(stacks)
    assert rep.culprit_ranks == [3] and "odd ones out" in rep.culprit_reasoning
