"""End to end: a job whose diagnosis must be a mechanism, never a confidently wrong pattern.

A plain per-micro-batch all-reduce loop whose trip count differs across ranks (no checkpoint, no
DTensor) was named ``uneven-dtensor-allgather`` by the loop rule before the patterns declared their
evidence (issue 28). Now the report names the mechanism, ``loop-trip-count`` with each rank's count
and the loop's call site, and the checkpoint pattern is listed as lacking a checkpoint phase.
"""

from __future__ import annotations

import json

from test_run_cli import moedoctor_run

from moedoctor.errors import EXIT_HANG


def test_a_plain_microbatch_loop_is_a_loop_trip_count_not_a_checkpoint_pattern(tmp_path):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "uneven_microbatch_loop.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{report['not_named']}\n{result.tail()}"
    assert report["pattern"] != "uneven-dtensor-allgather", context
    mech = report["mechanism"]
    assert mech["mechanism"] == "loop-trip-count", context
    assert mech["loop_counts"] == {"0": 3, "1": 4}, context
    assert mech["loop_site"].endswith("uneven_microbatch_loop.py:27"), context
    assert mech["ranks"] == [0] and mech["step"] == 2, context
    if report["pattern"] in (None, "unknown-desync"):
        text = report["suggestion"]["text"]
        assert "rank 0 ran 3, rank 1 ran 4 iterations of uneven_microbatch_loop.py:27" in text, context
    if "uneven-dtensor-allgather" in report["not_named"]:
        assert any("checkpoint" in m for m in report["not_named"]["uneven-dtensor-allgather"]), context


def test_an_fsdp_unit_left_out_in_the_middle_of_a_per_unit_loop_is_a_skipped_collective(tmp_path):
    """One call site all-gathers one FSDP unit per iteration; rank 1 leaves out expert 1 and goes on
    with expert 2. "The same collective" includes the FSDP unit, so rank 1 skipped expert 1's
    all-gather at the position where the units first differ (issue 28, corpus 28's per-expert
    units), not a loop that ran fewer iterations."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "fsdp2_unit_skipped_mid_loop.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode != 0, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    mech = report["mechanism"]
    assert mech["mechanism"] == "skipped-collective", context
    assert mech["ranks"] == [1] and mech["step"] == 2 and mech["phase"] == "forward", context
    assert "experts.1" in mech["detail"] and "experts.2" in mech["detail"], context
    assert report["pattern"] in ("inactive-experts", "unknown-desync", None), context


def test_a_rank_that_begins_the_next_pass_over_the_parameters_skipped_what_follows_the_loop(tmp_path):
    """Gradients all-reduced one parameter at a time, then broadcasts (a hand-rolled ZeRO-1, no torch
    optimizer, so no step counter). Every earlier pass issued the same 4 items and then a broadcast;
    rank 1 skips its step and all-reduces the first parameter again while rank 0 broadcasts: rank 1
    skipped the broadcasts (issue 28, corpus 28's AlphaZero learner), not a loop of 5 iterations."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "param_loop_skipped_broadcasts.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    mech = report["mechanism"]
    assert mech["mechanism"] == "skipped-collective", context
    assert mech["ranks"] == [1] and report["culprit_ranks"] == [1], context
    assert "the same 4 items and then broadcast" in mech["detail"], context


def test_two_paths_at_one_item_of_a_walk_are_a_different_op_not_a_loop_exit(tmp_path):
    """Each item of a walk issues an all-gather or an all-reduce, chosen on the rank's own chunk;
    both were issued by every rank earlier in the walk. At the item chunked 3 + 2 rank 0 takes the
    all-reduce path and rank 1 the all-gather path: a different op at one item (issue 28, corpus
    28's DiT offload manifest), not a run of all-gathers that rank 0 left after fewer."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "walk_two_paths_per_item.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode != 0, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    mech = report["mechanism"]
    assert mech["mechanism"] == "different-op", context
    assert mech["call_sites"]["0"].endswith("walk_two_paths_per_item.py:25"), context
    assert mech["call_sites"]["1"].endswith("walk_two_paths_per_item.py:29"), context


def test_a_per_parameter_loop_left_early_where_task_heads_got_no_gradient_is_inactive_experts(tmp_path):
    """Gradients all-reduced one parameter at a time, skipping those without a gradient; rank 1's
    batch has no sample of one task, so that head (a module-list member) gets none and rank 1 leaves
    the loop early for the per-task count. The required evidence of inactive experts is in the trace
    (parameters without a gradient naming a heads member on rank 1 only; corpus 28's Decision
    Transformer task heads), so the pattern is named, rank 1 the culprit (was `unknown-desync`)."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "task_heads_grad_none_loop.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode != 0, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    assert report["mechanism"]["mechanism"] == "loop-trip-count", context
    assert report["pattern"] == "inactive-experts" and report["culprit_ranks"] == [1], context
    assert any("heads.1" in line for line in report["evidence"]), context


def test_a_sharded_step_gather_skipped_after_the_gradient_loop_is_not_a_checkpoint_walk(tmp_path):
    """Gradients all-reduced one parameter at a time, then the sharded step's all-gather; rank 1
    skips its step and all-reduces the first parameter again while rank 0 gathers. The gather at the
    divergence follows a loop whose passes all walked the same items: not ranks walking different key
    sets in a save (corpus 29's RWKV loss-spike guard was named `uneven-dtensor-allgather`, culprit
    rank 0). The mechanism's skipping rank is the culprit when no pattern is named."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "sharded_step_skipped_gather.py", "--hang-timeout", "10", timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    mech = report["mechanism"]
    assert mech["mechanism"] == "skipped-collective" and mech["ranks"] == [1], context
    assert report["pattern"] != "uneven-dtensor-allgather", context
    assert report["culprit_ranks"] == [1], context


def test_an_order_written_in_both_arms_of_an_if_is_a_reordering(tmp_path):
    """Two groups over the same ranks; the order of their all-reduces is written twice, in both arms of
    an `if` on the rank's own queue. Rank 1 takes the other arm at step 2 and waits in a collective
    from a line rank 0 never ran, but that line's call is the one rank 0 issues from the other arm,
    same op and sizes: a reordering (corpus 29's MuZero reanalyse learner was `unknown-desync`, read as
    a collective that appeared on some ranks)."""
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, "two_groups_order_written_twice.py", "--hang-timeout", "8", timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{result.tail()}"
    assert report["mechanism"]["mechanism"] == "wait-cycle", context
    assert report["pattern"] == "collective-order-inversion", context


def _run(tmp_path, job: str):
    run_dir = tmp_path / "run"
    result = moedoctor_run(run_dir, job, "--hang-timeout", "8", timeout=150)
    assert result.returncode == EXIT_HANG, result.tail()
    report = json.loads((run_dir / "report.json").read_text())
    context = f"{report['summary']}\n{json.dumps(report['mechanism'], indent=1)}\n{report['candidates']}\n{result.tail()}"
    return report, context


def test_a_skipped_outer_step_in_a_top_level_loop_is_no_microbatch_mismatch(tmp_path):
    """A top-level training loop, one backward pass a step; rank 1's loss is NaN and `if not ok:
    continue` skips the wrapper's all-reduce and the optimizer step. Its step counter does not move,
    which once read as another micro-batch (corpus 30's MAML: `microbatch-count-mismatch`, culprit
    rank 0); the decision at the top level is read, and a restart without any step of two backward
    passes is no evidence of micro-batches."""
    report, context = _run(tmp_path, "module_loop_skipped_outer_step.py")
    assert report["mechanism"]["mechanism"] == "skipped-collective", context
    assert report["pattern"] == "skipped-optimizer-step" and report["culprit_ranks"] == [1], context


def test_a_step_closed_early_is_not_a_metric_among_reductions(tmp_path):
    """FSDP2 with packed micro-batches: rank 1 steps after 2 and all-reduces the next step's token
    count while rank 0 all-gathers for a third. The small all-reduce meets an FSDP all-gather in
    another step (corpus 30's DeepSeek-V3 packing was named `inflight-metric-allreduce`)."""
    report, context = _run(tmp_path, "fsdp2_microbatches_step_closed_early.py")
    assert report["pattern"] != "inflight-metric-allreduce", context


def test_a_count_left_out_before_backward_is_not_a_metric_among_reductions(tmp_path):
    """DDP; the loss all-reduces the mask count once a step, before backward; rank 1's criterion
    returns early at step 2 and its bucket all-reduce meets rank 0's count (corpus 30's Mask2Former
    was named `inflight-metric-allreduce`, culprit rank 0)."""
    report, context = _run(tmp_path, "mask_count_skipped_before_backward.py")
    assert report["pattern"] != "inflight-metric-allreduce", context


def test_a_loss_after_a_loop_of_optimizer_steps_is_no_metric_among_reductions(tmp_path):
    """DDP, each mini-batch a whole optimizer step, the loss all-reduced once after the loop; rank 1
    runs 3 mini-batches against 2 and its third bucket all-reduce meets rank 0's loss (corpus 31's
    cluster-GCN was named `inflight-metric-allreduce`). The loss is where every earlier outer
    iteration put it, before the next step's backward: a loop of one call site that ran more times on
    rank 1 (rank 0 left it after 2), with rank 0 the rank that ran fewer."""
    report, context = _run(tmp_path, "ddp_inner_steps_then_metric.py")
    assert report["pattern"] != "inflight-metric-allreduce", context
    mech = report["mechanism"]
    assert mech["mechanism"] == "loop-trip-count" and mech["ranks"] == [0], context
    assert mech["loop_counts"] == {"0": 2, "1": 3}, context
    assert report["culprit_ranks"] == [0], context


def test_a_forward_collective_issued_again_by_a_recompute_is_an_extra_collective(tmp_path):
    """Rank 1 checkpoints its blocks at step 2; the recompute in backward all-reduces a block's
    statistics again. Its size and call site are those of the next step's second collective, but
    the history issues that one in forward (corpus 31's Demucs read as two collectives left out)."""
    report, context = _run(tmp_path, "recompute_reissues_forward_stats.py")
    mech = report["mechanism"]
    assert mech["mechanism"] == "extra-collective" and mech["ranks"] == [1], context
    assert report["pattern"] == "collective-in-checkpointed-region" and report["culprit_ranks"] == [1], context


def test_a_metric_past_bucket_reductions_held_back_in_a_fixed_microbatch_loop_is_named(tmp_path):
    """A hand-written bucket reducer syncs in the last of `range(N_MICRO)` micro-batches; an expert
    without a gradient holds rank 1's buckets back past its per-micro-batch loss all-reduce. Both
    ranks ran 2 passes and the loop's count is a literal: no disagreement on the last micro-batch
    (corpus 31's OpenVLA was left `unknown-desync`)."""
    report, context = _run(tmp_path, "bucket_hooks_held_back_metric.py")
    assert report["pattern"] == "inflight-metric-allreduce" and report["culprit_ranks"] == [1], context


def test_a_shape_changed_on_one_rank_after_setup_collectives_names_that_rank(tmp_path):
    """Parameter broadcasts fill step 0, so the steps do not line up position by position; rank 1's
    statistics all-reduce changed size while rank 0's is the size both always issued from that call
    site (corpus 31's TabPFN had no culprit)."""
    report, context = _run(tmp_path, "setup_broadcasts_then_shape_change.py")
    assert report["pattern"] == "shape-mismatch" and report["culprit_ranks"] == [1], context


def test_a_third_packed_microbatch_after_the_others_stepped_is_a_microbatch_count_mismatch(tmp_path):
    """Every step opens with a token-count all-reduce; rank 0 packs 3 micro-batches at step 2, and its
    third forward all-gather meets rank 1's next token count. Rank 0 did not issue the step's opening
    collective since its last backward pass, so it is in another pass of its step, not in the next
    iteration of a skipped step (corpus 30's DeepSeek-V3 packing: `unknown-desync`, culprit rank 0)."""
    report, context = _run(tmp_path, "packed_microbatches_third_pass.py")
    assert report["mechanism"]["mechanism"] == "loop-trip-count", context
    assert report["pattern"] == "microbatch-count-mismatch" and report["culprit_ranks"] == [1], context
