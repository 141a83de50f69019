"""Each fix's check fails when the fix is broken (docs/fixes.md, "Every check, what it proves").

The checks of expert-dense, expert-zero-term, recompute-cache-collective and the member lists have
theirs beside the fix's other unit tests (``test_fix_expert_dense.py``, ``test_fix_recompute_cache.py``,
``test_fix_member_lists.py``); skip-step-collectively's and metrics-after-microbatches' run real jobs
(``tests/integration/test_verify_config_job.py``, ``test_fix_metrics_checkpoint_jobs.py``). Here: the
checks that compare across ranks, on two Gloo processes, and the checkpoint round trip in one. Each
is fed what a broken fix leaves behind, and what a working one does, and must tell them apart."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_fix_recompute_cache import _Runtime as Runtime


# -- two ranks -------------------------------------------------------------------------------------------


def _coalesce_arrivals(rank: int, broken: bool) -> Runtime:
    """What coalesce-broadcasts' flush leaves in each rank: the source's values everywhere, or (broken:
    the coalesced broadcast never sent) rank 1 still holding its own."""
    from moedoctor.fixes.coalesce_broadcasts import _check_arrivals

    source = [torch.arange(6.0), torch.ones(3, dtype=torch.bfloat16)]
    held = [t.clone() for t in source] if rank == 0 or not broken else [t * 0 + 7 for t in source]
    runtime = Runtime()
    sent = [((None, 0, "cpu"), t) for t in held]
    _check_arrivals(runtime, sent, len(sent), 1, 0, 0.01, torch, dist)
    return runtime


def _gather_upfront_agreement(rank: int, broken: bool) -> Runtime:
    """fsdp-gather-upfront's vote on the units each rank gathers up front: the same set, or (broken:
    a rank-dependent selection) another set on rank 1."""
    from moedoctor.fixes import fsdp_gather_upfront
    from moedoctor.fixes.runtime import TargetState

    runtime = Runtime()
    upfront = fsdp_gather_upfront._Upfront(runtime, TargetState(fsdp_gather_upfront.TARGET, ""))
    world = dist.distributed_c10d._get_default_group()
    fsdp_gather_upfront._param_groups = lambda unit: [types.SimpleNamespace(_all_gather_process_group=world)]
    names = ["layers.0", "layers.1"] + (["layers.2"] if broken and rank == 1 else [])
    upfront._agreed(object(), names)
    return runtime


CASES = {"coalesce": _coalesce_arrivals, "upfront": _gather_upfront_agreement}


def _rank_main(rank: int, store: str, broken: bool, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        checks = {case: run(rank, broken).checks for case, run in CASES.items()}
        Path(out, f"rank-{rank}.json").write_text(json.dumps(checks))
        dist.barrier()  # neither rank tears the group down while the other is still in a check
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{broken: {rank: {case: checks}}}: every case on two Gloo ranks, with the fix working and broken."""
    results = {}
    for broken in (False, True):
        folder = tmp_path_factory.mktemp(f"broken-{broken}")
        try:
            mp.spawn(_rank_main, args=(str(folder / "store"), broken, str(folder)), nprocs=2, join=True)
        except mp.ProcessExitedException as exc:
            # Gloo sometimes aborts a rank in destroy_process_group under load (a PyTorch teardown race);
            # what is tested was written before the teardown, and is used only if every rank wrote it
            if exc.signal_name != "SIGABRT" or not all((folder / f"rank-{r}.json").exists() for r in (0, 1)):
                raise
            print(f"a rank aborted in teardown after writing its checks: {exc}")
        results[broken] = {r: json.loads((folder / f"rank-{r}.json").read_text()) for r in (0, 1)}
    return results


@pytest.mark.parametrize("broken", [False, True])
def test_coalesce_broadcasts_check_fails_when_a_rank_did_not_receive(two_ranks, broken):
    from moedoctor.fixes.coalesce_broadcasts import CHECK

    checks = {rank: by_case["coalesce"] for rank, by_case in two_ranks[broken].items()}
    (name, passed, detail), = checks[1]
    assert name == CHECK
    if broken:
        assert passed is False and detail.startswith("2 of 2 tensors differ from the source rank's"), detail
    else:
        assert passed is True and detail.startswith("all 2 identical to the source rank's"), detail
    assert checks[0][0][1] is True  # the source itself holds what it sent


@pytest.mark.parametrize("broken", [False, True])
def test_gather_upfront_check_fails_when_the_ranks_gather_different_units(two_ranks, broken):
    from moedoctor.fixes.fsdp_gather_upfront import CHECK

    checks = {rank: by_case["upfront"] for rank, by_case in two_ranks[broken].items()}
    for rank in (0, 1):
        (name, passed, detail), = checks[rank]
        assert name == CHECK and passed is (not broken), (rank, detail)
        if broken:
            assert "the ranks' sets of sharded units differ" in detail, detail


# -- one process -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken", [False, True])
def test_checkpoint_round_trip_fails_when_the_fix_saves_other_values(tmp_path, broken):
    """key-manifest-checkpoint's round trip: what was saved loads back bitwise equal, or (broken: the
    save writes other values than the state dict the fix completed) the check names the tensors."""
    import torch.distributed.checkpoint as dcp

    from moedoctor.fixes.key_manifest_checkpoint import CHECK, _RoundTrip

    def save(state_dict, **kwargs):
        if broken:
            state_dict = {k: v + 1 if k == "w" else v for k, v in state_dict.items()}
        return dcp.save(state_dict, **kwargs)

    runtime = Runtime()
    trip = _RoundTrip(runtime)
    state = {"w": torch.arange(4.0), "b": torch.zeros(2)}
    trip.expect(state)
    trip._checking(save)(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (name, passed, detail), = runtime.checks
    assert name == CHECK
    if broken:
        assert passed is False and "1 of 2 tensors load back different: w" in detail, detail
    else:
        assert passed is True and "2 tensors (local shards) load back bitwise equal" in detail, detail
