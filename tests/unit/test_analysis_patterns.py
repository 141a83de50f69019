"""Every pattern of the registry on factory-built events: the right pattern, culprits and verdict,
and the registry's own contract (one module each, with a docstring that states mechanism, evidence,
risk and fix)."""

from __future__ import annotations

import importlib

import pytest
from analysis_scenarios import SCENARIOS, collective_order_inversion, healthy

from moedoctor.analysis import analyze
from moedoctor.analysis import diagnosis
from moedoctor.analysis.model import DivergenceKind, Verdict
from moedoctor.analysis.patterns import MODULES, registry
from moedoctor.analysis.patterns.base import Finding


@pytest.mark.parametrize("pattern", sorted(SCENARIOS))
def test_each_pattern_is_named_with_its_culprits(pattern):
    build, culprits, verdict = SCENARIOS[pattern]
    report = analyze(build())
    assert report.pattern == pattern, (report.summary, [(c.pattern, c.score) for c in report.candidates])
    if culprits is not None:
        assert report.culprit_ranks == culprits, report.culprit_reasoning
    assert report.verdict.value == verdict
    assert report.evidence, "a pattern is named with the evidence it used"
    assert report.summary and "\n" not in report.summary


def test_fixes_and_verify_command_for_the_seed_patterns():
    expected = {"skipped-optimizer-step": "skip-step-collectively",
                "inflight-metric-allreduce": "metrics-after-microbatches",
                "uneven-dtensor-allgather": "key-manifest-checkpoint", "inactive-experts": "expert-dense"}
    for pattern, fix in expected.items():
        report = analyze(SCENARIOS[pattern][0]())
        assert report.fixes[0] == fix
        assert report.verify_command == f"moedoctor verify --fix {fix} --run /runs/test"
        assert report.suggestion is not None and report.suggestion.call_site


def test_not_a_desync_points_at_hardware_not_code():
    report = analyze(SCENARIOS["not-a-desync"][0]())
    assert report.divergence.kind == DivergenceKind.STALLED and report.fixes == [] and report.verify_command is None
    text = " ".join(report.evidence)
    assert "NVML" in text and "snapshot request" in text
    assert "completion is observed on every member" in text and "every rank's stack is inside all_reduce" in text
    assert report.candidates[0].score == 0.9


def test_straggler_names_the_function_it_is_stuck_in():
    report = analyze(SCENARIOS["straggler"][0]())
    assert "ShardReader._read_shard" in report.summary
    assert report.suggestion.call_site == "/job/train.py:43"
    assert report.wait_for and report.wait_for[0].waits_for == (1,)


@pytest.mark.parametrize("host_blocks", [True, False], ids=["gloo-blocking", "nccl-enqueued"])
def test_order_inversion_is_a_wait_for_cycle(host_blocks):
    """Per-group matching sees nothing wrong (with NCCL every op of both groups was issued on every
    rank); the cycle across the two groups is what names it."""
    report = analyze(collective_order_inversion(host_blocks=host_blocks))
    assert report.pattern == "collective-order-inversion"
    assert report.cycle and {e.group for e in report.cycle} == {"1", "2"}
    assert {e.rank for e in report.cycle} == {0, 1}
    assert report.culprit_ranks == [1]  # it changed the order its own earlier steps used
    assert any("rank 1 issued" in e and "it changed its order" in e for e in report.evidence), report.evidence
    if not host_blocks:
        assert not [d for d in report.groups if d.kind != DivergenceKind.STALLED]


def test_healthy_run():
    report = analyze(healthy())
    assert report.verdict == Verdict.HEALTHY and report.pattern is None and report.culprit_ranks == []
    assert not report.problem_found


def test_a_tie_is_unknown_desync_listing_every_candidate(monkeypatch):
    from moedoctor.analysis.patterns import by_id

    tied = [(by_id("shape-mismatch"), Finding(0.6, ("shape evidence",))),
            (by_id("rank-conditional-collective"), Finding(0.6, ("branch evidence",))),
            (by_id("unknown-desync"), Finding(0.2, ("diverges",)))]
    monkeypatch.setattr(diagnosis, "classify_all", lambda ctx: tied)
    report = analyze(SCENARIOS["shape-mismatch"][0]())
    assert report.pattern == "unknown-desync"
    assert {c.pattern for c in report.candidates} == {"shape-mismatch", "rank-conditional-collective", "unknown-desync"}
    assert any("candidate shape-mismatch" in e for e in report.evidence)
    assert any("candidate rank-conditional-collective" in e for e in report.evidence)


def test_crash_of_the_awaited_rank_is_not_named_a_pattern():
    from event_factory import manifest, ranks, run_of

    a, b = ranks(2)
    for step in range(3):
        a.coll("all_reduce", (8,), step=step, done=step < 2)
        if step < 2:
            b.coll("all_reduce", (8,), step=step)
    report = analyze(run_of(a, b, manifest_info=manifest({0: -15, 1: 1}, hang=False)))
    assert report.verdict == Verdict.CRASHED and report.pattern is None and report.culprit_ranks == [1]
    assert "rank 1 exited with status 1" in report.evidence


def test_registry_one_module_per_pattern_with_docstrings():
    patterns = registry()
    assert [p.id for p in patterns] == [m.replace("_", "-") for m in MODULES]
    for module_name, pattern in zip(MODULES, patterns):
        module = importlib.import_module(f"moedoctor.analysis.patterns.{module_name}")
        doc = module.__doc__ or ""
        for word in ("Mechanism", "Evidence", "Risk", "Fix"):
            assert word in doc, f"{module_name}: docstring lacks {word}"
        assert pattern.title and pattern.advice
    assert {p.id: p.fixes for p in patterns if p.fixes} == {
        "skipped-optimizer-step": ("skip-step-collectively",),
        "inflight-metric-allreduce": ("metrics-after-microbatches", "fsdp-gather-upfront"),
        "uneven-dtensor-allgather": ("key-manifest-checkpoint",), "inactive-experts": ("expert-dense", "expert-zero-term"),
        "checkpoint-recompute-mismatch": ("expert-dense",),
        "collective-in-checkpointed-region": ("recompute-cache-collective",)}


def test_a_cycle_closed_by_a_collective_only_one_rank_issues_is_not_named_an_inversion():
    """Rank 1 issues an extra all_reduce on a subgroup (a call site rank 0 never used) while rank 0
    waits in the world's next all_reduce: the waits form a cycle, but nothing was reordered."""
    from analysis_scenarios import DP, TP
    from event_factory import ranks, run_of

    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            r.coll("all_reduce", (8,), group=TP, step=step, line=30)
    b.coll("all_reduce", (1,), group=DP, step=2, line=77, done=False)    # only rank 1, only now: it blocks
    a.coll("all_reduce", (8,), group=TP, step=2, line=30, done=False)    # rank 0 waits in the next TP one
    report = analyze(run_of(a, b, hang=True))
    assert report.cycle
    assert report.pattern != "collective-order-inversion", report.summary
    assert any("never issued a collective from train.py:77" in e for e in report.evidence + [
        x for c in report.candidates for x in c.evidence]), report.evidence


@pytest.mark.parametrize("devices, shared", [(("cuda:0", "cuda:0"), True), (("cuda:0", "cuda:1"), False),
                                             (("cpu", "cpu"), False), ((None, None), False)])
def test_ranks_of_one_host_on_one_gpu_are_said(devices, shared):
    import dataclasses

    run = SCENARIOS["straggler"][0]()
    for trace, device in zip(run.traces, devices, strict=True):
        trace.events[:] = [dataclasses.replace(e, device=device) for e in trace.events]
    report = analyze(run)
    lines = [line for line in report.evidence if "same GPU" in line]
    assert lines == (["ranks 0,1 on host host issued their collectives on the same GPU, cuda:0: each rank needs its "
                      "own (torch.cuda.set_device(local_rank) before init_process_group)"] if shared else [])


_REFILL_LOOP = '''def train(reader, model, data_group):
    for step in range(4):
        if reader.starved():
            reader.exchange_cursor(data_group)
        loss = model(reader.next_batch())
        sync_gradients(model)
'''


@pytest.mark.parametrize("both_branch", [False, True], ids=["one-rank-decided", "both-under-branches"])
def test_an_inversion_at_the_first_collective_names_the_rank_whose_own_branch_put_it_first(tmp_path, both_branch):
    """No earlier step shows a habit, so the order alone names nobody. Rank 0 reached its collective
    through `if reader.starved():`, whose body rank 1 (blocked further down the same function) did not
    enter: rank 0 decided. When both ranks' collectives sit under branches, nobody is singled out."""
    from analysis_scenarios import DP, TP
    from event_factory import ranks, run_of

    source = tmp_path / "train.py"
    text = _REFILL_LOOP
    if both_branch:
        text = text.replace("        sync_gradients(model)", "        if loss.isfinite():\n            sync_gradients(model)")
    source.write_text(text)
    a, b = ranks(2)
    a.coll("all_gather", (1,), group=DP, line=4, file=str(source), function="train", done=False)
    b.coll("all_reduce", (8,), group=TP, line=7 if both_branch else 6, file=str(source), function="train", done=False)
    report = analyze(run_of(a, b, hang=True))
    assert report.pattern == "collective-order-inversion", report.summary
    if both_branch:
        assert report.culprit_ranks == [0, 1]
    else:
        assert report.culprit_ranks == [0]
        assert any("rank 0 reached its collective through `if reader.starved()`" in e for e in report.evidence)


_PREFETCH_LOOP = '''import torch.distributed as dist


def broadcast_data(batch, group):
    dist.broadcast(batch, src=0, group=group)
    return batch


def main(rank, model, batch, data_group):
    is_source = rank == 0
    batch = broadcast_data(batch, data_group)
    for step in range(4):
        prefetched = None
        loss = model(batch)
        if step + 1 < 4 and is_source:
            prefetched = broadcast_data(batch, data_group)
        loss.backward()
        batch = prefetched if prefetched is not None else broadcast_data(batch, data_group)
'''


def test_an_inversion_at_the_first_step_where_the_awaited_rank_is_on_its_way_names_the_rank_branch():
    """Rank 0 (the data source) prefetches the next batch over a data group under a branch on its rank,
    before backward; rank 1 goes on to backward's gradient all_reduce and would receive the batch at the
    top of its next iteration. Rank 0 never issued the gradient all_reduce (the first step), but its
    stack shows it earlier in the same pass of the loop: a reordering, decided by rank 0's branch."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from analysis_scenarios import DP
    from event_factory import WORLD, ranks, run_of

    from moedoctor.events import CallSite

    source = Path(tempfile.mkdtemp()) / "prefetch.py"
    source.write_text(_PREFETCH_LOOP)
    path = str(source)

    def call(line, *outer):
        stack = (f"{path}:{line} broadcast_data",) + tuple(f"{path}:{o} main" for o in outer)
        return CallSite(path, line, "broadcast_data", stack)

    a, b = ranks(2)
    for r in (a, b):
        r.coll("broadcast", (4,), group=DP, file=path, line=5, function="broadcast_data", root=0)
        r.events[-1] = dataclasses.replace(r.events[-1], call_site=call(5, 11))
    a.coll("broadcast", (4,), group=DP, file=path, line=5, function="broadcast_data", root=0, done=False)
    a.events[-1] = dataclasses.replace(a.events[-1], call_site=call(5, 16))
    b.coll("all_reduce", (8,), group=WORLD, file=path, line=17, function="main", done=False)
    report = analyze(run_of(a, b, hang=True))
    assert report.pattern == "collective-order-inversion", [(c.pattern, c.score) for c in report.candidates]
    assert report.culprit_ranks == [0]
    assert any("earlier in the same pass of the loop" in e for e in report.evidence), report.evidence


_SOUP = '''import torch.distributed as dist


def reduce_tensor(t):
    dist.all_reduce(t)
    return t


def main(rank, model, ema, soup):
    for step in range(4):
        model.sync()
        reduce_tensor(ema)
        if rank == 0:
            reduce_tensor(soup)
'''


@pytest.mark.parametrize("guarded", [True, False], ids=["rank-branch", "no-branch"])
def test_a_shared_helper_called_again_under_a_rank_branch_is_a_rank_conditional_collective(tmp_path, guarded):
    """Every rank all-reduces the EMA accuracy through ``reduce_tensor`` (line 5); rank 0 then calls
    it again for the soup under ``if rank == 0:`` while rank 1 goes on to the next step's gradient
    all-reduce. Without the branch on the rank (a second call every rank makes), no name."""
    import dataclasses

    from event_factory import ranks, run_of

    from moedoctor.events import CallSite

    source = tmp_path / "train.py"
    source.write_text(_SOUP if guarded else _SOUP.replace("        if rank == 0:\n    ", ""))
    path = str(source)
    a, b = ranks(2)
    for step in range(3):
        for r in (a, b):
            r.coll("all_reduce", (32, 10), step=step, line=11, file=path)
            r.coll("all_reduce", (32,), step=step, line=11, file=path)
    for r in (a, b):
        r.coll("all_reduce", (), step=3, line=5, file=path, function="reduce_tensor")
    a.coll("all_reduce", (), step=3, line=5, file=path, function="reduce_tensor", done=False)
    b.coll("all_reduce", (32, 10), step=3, line=11, file=path, done=False)
    outer = 14 if guarded else 13
    a.events[-1] = dataclasses.replace(
        a.events[-1], call_site=CallSite(path, 5, "reduce_tensor", (f"{path}:5 reduce_tensor", f"{path}:{outer} main"))
    )
    report = analyze(run_of(a, b, hang=True))
    assert report.mechanism.mechanism.value == "extra-collective" and report.mechanism.ranks == (0,)
    if guarded:
        assert report.pattern == "rank-conditional-collective" and report.culprit_ranks == [0], report.summary
        assert any("a second time in a row" in e for e in report.evidence)
    else:
        assert report.pattern != "rank-conditional-collective", report.summary


_ROLES = """import torch.distributed as dist


def main(rank, dp, sync, groups, x):
    if rank < 2:
        for step in range(3):
            dist.all_reduce(x, group=dp)
            dist.broadcast(x, rank, group=sync)
    else:
        for step in range(3):
            for g in groups:
                dist.broadcast(x, 0, group=g)
"""


def _rollout_sync(path: str, inverted_at: int | None):
    """Trainers 0 and 1 (under ``if rank < 2``) all-reduce over their data group (line 7), then each
    broadcasts its weights over its own pair group with the rollout engine, rank 2 (line 8); rank 2
    receives on both pair groups from its own code (line 12). At step ``inverted_at`` trainer 1
    pushes before it logs."""
    from event_factory import ranks, run_of

    from moedoctor.events import Group

    dp, g02, g12 = Group("1", "dp", (0, 1)), Group("2", "sync0", (0, 2)), Group("3", "sync1", (1, 2))
    a, b, c = ranks(3)
    kw = dict(file=path)
    for step in range(3):
        stop = step == inverted_at
        if stop:
            b.coll("broadcast", (8,), group=g12, step=step, line=8, done=False, **kw)
        else:
            b.coll("all_reduce", (1,), group=dp, step=step, line=7, **kw)
            b.coll("broadcast", (8,), group=g12, step=step, line=8, **kw)
        a.coll("all_reduce", (1,), group=dp, step=step, line=7, done=not stop, **kw)
        c.coll("broadcast", (8,), group=g02, step=step, line=12, done=not stop, **kw)
        if stop:
            break
        a.coll("broadcast", (8,), group=g02, step=step, line=8, **kw)
        c.coll("broadcast", (8,), group=g12, step=step, line=12, **kw)
    return run_of(a, b, c, hang=True)


def test_an_inversion_between_ranks_of_different_roles_is_named_from_their_paired_call_sites(tmp_path):
    """The rollout engine never issues the trainers' call site: it meets it from its own code, every
    step. That counterpart in the history makes the cycle a reordering of collectives every rank runs,
    though the trainers' collectives sit under a branch on the rank (their role)."""
    source = tmp_path / "train.py"
    source.write_text(_ROLES)
    report = analyze(_rollout_sync(str(source), 2))
    assert report.mechanism.mechanism.value == "wait-cycle"
    assert report.pattern == "collective-order-inversion", report.summary
    assert report.culprit_ranks == [1]
