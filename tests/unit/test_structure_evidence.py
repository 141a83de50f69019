"""Structural evidence the classifiers use: the code around a call site (``analysis/evidence/source.py``),
where a rank is in its step and loops run a different number of times (``analysis/evidence/steps.py``), and
steps whose gradients were thrown away (``RunView.discarded_steps``)."""

from __future__ import annotations

import textwrap

from event_factory import ranks, run_of

from moedoctor.analysis import analyze
from moedoctor.analysis.evidence.source import enclosing, rank_guard, shared_loop
from moedoctor.analysis.evidence.steps import CLOSING, RESTART, loop_exit, position
from moedoctor.analysis.evidence.view import RunView
from moedoctor.events import Phase

TRAIN = textwrap.dedent("""\
    import torch.distributed as dist

    def log(x):
        dist.all_reduce(x)

    def train(model, opt, batches):
        rank = dist.get_rank()
        for step, micro in enumerate(batches):
            for mb in micro:
                loss = model(mb)
                loss.backward()
                log(loss)
            should_log = rank == 0 and step % 10 == 0
            if should_log:
                log(loss)
            if step > 3:
                log(loss)
            opt.step()
    """)


def _stack(path, *lines: tuple[int, str]) -> tuple[str, ...]:
    return tuple(f"{path}:{line} {fn}" for line, fn in lines)


def test_a_branch_on_the_rank_is_found_through_one_assignment(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    guard = rank_guard(_stack(path, (4, "log"), (15, "train")))
    assert guard is not None and guard.kind == "if" and guard.text == "should_log" and guard.line == 14
    assert rank_guard(_stack(path, (4, "log"), (17, "train"))) is None      # `if step > 3`: every rank
    assert rank_guard(_stack(path, (4, "log"), (12, "train"))) is None      # in the micro-batch loop


CHECKED = textwrap.dedent("""\
    import torch.distributed as dist

    def sync(x):
        dist.all_reduce(x)

    def train(rank, scaler, opt, step, accelerator):
        finite = scaler.unscale_and_check(opt, inject_inf=(rank == 1 and step == 3))
        if finite:
            sync(opt)
        main = bool(rank == 0)
        if main:
            sync(opt)
        chief = accelerator.is_main_process()
        if chief:
            sync(opt)
    """)


def test_a_value_a_call_computes_is_data_even_when_a_rank_is_among_its_arguments(tmp_path):
    """``if finite:`` where ``finite`` is what a check returned: a data decision (the fault injection's
    ``rank == 1`` argument only parameterises the check); a conversion of a rank test, or a call whose
    own name reads the rank, is still a branch on the rank."""
    path = tmp_path / "train.py"
    path.write_text(CHECKED)
    assert rank_guard(_stack(path, (4, "sync"), (9, "train"))) is None
    assert rank_guard(_stack(path, (4, "sync"), (12, "train"))).text == "main"
    assert rank_guard(_stack(path, (4, "sync"), (15, "train"))).text == "chief"


def test_the_loop_that_runs_backward_and_whether_it_steps(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    loop = shared_loop(_stack(path, (4, "log"), (12, "train")))
    assert loop is not None and loop.line == 9 and loop.text == "for mb in micro"
    outer = shared_loop(_stack(path, (4, "log"), (17, "train")))
    assert outer is not None and outer.line == 8
    assert [e.kind for e in enclosing(str(path), 12)] == ["def", "for", "for"]


def test_unreadable_source_gives_no_facts(tmp_path):
    assert rank_guard((f"{tmp_path}/gone.py:3 main",)) is None
    (tmp_path / "bad.py").write_text("def (:\n")
    assert shared_loop((f"{tmp_path}/bad.py:1 main",)) is None


def test_restart_and_closing_positions():
    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_gather", (8,), phase=Phase.FORWARD, module="0", line=40)
        r.ev("backward_begin", 0)
        r.coll("all_gather", (8,), phase=Phase.BACKWARD, module="0", line=41)
        r.ev("backward_end", 0)
    a.coll("all_gather", (8,), phase=Phase.FORWARD, module="0", line=40, done=False)      # another micro-batch
    b.coll("reduce_scatter", (16,), phase=Phase.BACKWARD, module="0", line=41, done=False)  # the syncing one
    view = RunView(run_of(a, b, hang=True))
    assert position(view, view.event(0, "0", 3)) == RESTART
    assert position(view, view.event(1, "0", 3)) == CLOSING


def test_a_loop_left_early_is_found_and_a_per_step_collective_is_not_a_loop():
    a, b = ranks(2)
    for r, keys in ((a, 5), (b, 3)):
        for _ in range(keys):
            r.coll("all_gather", (1,), step=3, line=48)
    b.coll("gather", (1,), step=3, line=105, done=False)
    view = RunView(run_of(a, b, hang=True))
    found = loop_exit(view, "0", 4, [0, 1])
    assert found is not None and found.left == (1,) and found.looping == (0,) and found.counts == {0: 4, 1: 3}

    c, d = ranks(2)
    for step in range(3):
        for r in (c, d):
            r.coll("all_reduce", (4,), step=step, line=50)
    c.coll("all_reduce", (4,), step=3, line=50, done=False)
    d.coll("broadcast", (4,), step=3, line=77, done=False)
    assert loop_exit(RunView(run_of(c, d, hang=True)), "0", 4, [0, 1]) is None  # one per step: the step loop


def _step(r, step, *, stepped=True, cleared=True):
    r.coll("all_gather", (8,), phase=Phase.FORWARD, step=step, module="0", line=40)
    r.ev("backward_begin", step)
    r.coll("reduce_scatter", (16,), phase=Phase.BACKWARD, step=step, module="0", line=41)
    r.ev("backward_end", step)
    if stepped:
        r.ev("optimizer_step_begin", step)
    if cleared:
        r.ev("zero_grad", step)


def test_gradients_thrown_away_name_the_skipped_step_and_its_rank():
    a, b = ranks(2)
    for r in (a, b):
        _step(r, 0, cleared=False)
        r.coll("all_reduce", (1,), step=0, line=87)  # the finiteness check, every step
        r.ev("optimizer_step_end", 1)
        r.ev("zero_grad", 1)
    # Step 1: rank 1 clears its gradients without stepping and starts over; rank 0 clips them.
    a.coll("all_gather", (8,), phase=Phase.FORWARD, step=1, module="0", line=40)
    b.coll("all_gather", (8,), phase=Phase.FORWARD, step=1, module="0", line=40)
    for r in (a, b):
        r.ev("backward_begin", 1)
        r.coll("reduce_scatter", (16,), phase=Phase.BACKWARD, step=1, module="0", line=41)
        r.ev("backward_end", 1)
    b.ev("zero_grad", 1)
    a.coll("all_reduce", (1,), phase=Phase.OTHER, step=1, line=87, done=False)
    b.coll("all_gather", (8,), phase=Phase.FORWARD, step=1, module="0", line=40, done=False)
    run = run_of(a, b, hang=True)
    view = RunView(run)
    assert [e.step for e in view.discarded_steps(1)] == [1] and view.discarded_steps(0) == []
    report = analyze(run)
    assert report.pattern == "skipped-optimizer-step", [(c.pattern, c.score) for c in report.candidates]
    assert report.culprit_ranks == [1]
    assert any("cleared its gradients (zero_grad)" in e for e in report.evidence)


HOOKS = textwrap.dedent("""\
    import torch.distributed as dist

    def install_monitor(model):
        def make_hook(name):
            def hook(module, inputs, output):
                dist.all_reduce(output)
            return hook
        model.register_forward_hook(make_hook("x"))

    class ProgressBar:
        def on_batch_end(self, trainer, loss):
            if not trainer.is_global_zero:
                return
            dist.all_reduce(loss)

    def main(model, trainer):
        if dist.get_rank() == 0:
            install_monitor(model)
        for step in range(3):
            model(step)
            ProgressBar().on_batch_end(trainer, step)
    """)


def test_a_hook_registered_under_a_rank_branch_and_an_early_return_on_the_rank(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    # the hook is called by torch (the next frame of the job is `model(step)` in main)
    guard = rank_guard(_stack(path, (6, "hook"), (20, "main")))
    assert guard is not None and guard.line == 17 and "install_monitor at line 18" in guard.text
    early = rank_guard(_stack(path, (14, "on_batch_end"), (21, "main")))
    assert early is not None and early.line == 12 and "early exit" in early.text
    # main itself is on the stack: the branch that references it elsewhere is not a registration
    assert rank_guard(_stack(path, (20, "main"),)) is None


def test_clearing_between_micro_batches_by_design_is_not_a_skipped_step():
    """Code that reduces each micro-batch's gradients itself and clears them before the next does so in
    every step it completes: that habit is no thrown-away step."""
    a, = ranks(1)
    for step in range(2):
        for _ in range(2):
            a.ev("zero_grad", step)
            a.ev("backward_begin", step)
            a.coll("all_reduce", (8,), step=step, line=46)
            a.ev("backward_end", step)
        a.ev("optimizer_step_begin", step)
        a.ev("optimizer_step_end", step + 1)
    a.ev("zero_grad", 2)
    a.ev("backward_begin", 2)
    a.ev("backward_end", 2)
    a.ev("zero_grad", 2)
    assert RunView(run_of(a)).discarded_steps(0) == []


STOP_LOOP = textwrap.dedent("""\
    import torch.distributed as dist

    def save(model):
        dist.barrier()

    def main(model, steps, fixed):
        rank = dist.get_rank()
        for step in range(steps):
            stop = rank == 0 and step == 2
            if fixed:
                stop = bool(agree(stop))
            if stop:
                print("stop requested")
                break
            model(step)
        save(model)
    """)


def test_a_loop_left_on_a_rank_test_guards_what_follows_it(tmp_path):
    path = tmp_path / "stop.py"
    path.write_text(STOP_LOOP)
    # `stop` is reassigned in a branch that did not run; the rank-derived assignment still counts
    guard = rank_guard(_stack(path, (4, "save"), (16, "main")))
    assert guard is not None and guard.line == 12 and "leaves the loop of line 8" in guard.text
    # inside the loop, before the break, nothing is guarded
    assert rank_guard(_stack(path, (15, "main"),)) is None


def test_a_skipped_step_completed_by_the_next_iteration_is_still_thrown_away():
    """A rank that skips keeps its step counter, so the next iteration steps in that same step: the
    clear before it is the skip (NCCL lets the rank run that far before the others stop it), not a
    habit of clearing between micro-batches."""
    a, = ranks(1)
    for step in range(2):
        a.ev("backward_begin", step)
        a.ev("backward_end", step)
        a.ev("optimizer_step_begin", step)
        a.ev("optimizer_step_end", step + 1)
        a.ev("zero_grad", step + 1)
    a.ev("backward_begin", 2)
    a.ev("backward_end", 2)
    a.ev("zero_grad", 2)                 # the skip
    a.ev("backward_begin", 2)
    a.ev("backward_end", 2)
    a.ev("optimizer_step_begin", 2)      # the next iteration steps, counter still 2
    view = RunView(run_of(a))
    assert [e.step for e in view.discarded_steps(0)] == [2] and view.discarded_in(0, 2)


def _sync_per_parameter(builder, params, step=0, seqs_done=True):
    for shape in params:
        builder.coll("all_reduce", shape, step=step, line=30, function="sync_gradients", done=seqs_done)


def test_a_per_parameter_gradient_sync_that_skips_idle_experts_is_inactive_experts_not_a_shape_mismatch():
    """Ranks 0 and 1 routed no token to expert 2 at step 0 (no gradient at the end of backward): their
    hand-written sync skips its two parameters, and their head gradient meets rank 2's expert-2 one."""
    model = [("embed.weight", (6, 5)), ("moe.experts.0.weight", (6, 6)), ("moe.experts.0.bias", (6,)),
             ("moe.experts.1.weight", (6, 6)), ("moe.experts.1.bias", (6,)),
             ("moe.experts.2.weight", (6, 6)), ("moe.experts.2.bias", (6,)), ("head.weight", (2, 6))]
    idle = [n for n, _ in model if n.startswith("moe.experts.2.")]
    bs = ranks(3)
    for b in bs:
        if b.rank < 2:
            b.ev("params_without_grad", 0, names=idle, shapes=[[6, 6], [6]], count=2)
        shapes = [s for n, s in model if b.rank == 2 or n not in idle]
        _sync_per_parameter(b, shapes[:5])
        b.coll("all_reduce", shapes[5], step=0, line=30, function="sync_gradients", done=False)
    report = analyze(run_of(*bs, hang=True))
    assert report.pattern == "inactive-experts" and report.culprit_ranks == [0, 1], report.candidates
    assert report.fix_config == {"expert-zero-term": {"lists": "auto"}}
    assert any("left out" in e for e in report.evidence), report.evidence

    # Without the gradient evidence the same stream is a plain shape mismatch: nothing shows routing.
    bare = ranks(3)
    for b in bare:
        shapes = [s for n, s in model if b.rank == 2 or n not in idle]
        _sync_per_parameter(b, shapes[:5])
        b.coll("all_reduce", shapes[5], step=0, line=30, function="sync_gradients", done=False)
    assert analyze(run_of(*bare, hang=True)).pattern == "shape-mismatch"


def _rank_1_left_a_backward_reduction():
    """Two DDP ranks, two steps of one backward all-reduce; at step 2 rank 0 waits in it alone."""
    a, b = ranks(2)
    for step in range(2):
        for r in (a, b):
            r.coll("all_reduce", (151,), step=step, line=86, phase=Phase.BACKWARD)
    a.coll("all_reduce", (151,), step=2, line=86, phase=Phase.BACKWARD, done=False)
    return a, b


def test_a_reducer_that_never_launched_an_idle_experts_bucket_explains_the_crash_that_follows():
    """DDP with static buckets: at step 2 rank 1 routed no token to expert 2, its bucket is never
    launched, rank 0 waits in it, and rank 1's reducer raises in the next forward (exit 1)."""
    from event_factory import manifest

    def job(with_evidence: bool):
        a, b = _rank_1_left_a_backward_reduction()
        if with_evidence:
            b.ev("params_without_grad", 2, names=["module.0.experts.2.weight", "module.0.experts.2.bias"],
                 shapes=[[4, 4], [4]], count=2)
        return run_of(a, b, manifest_info=manifest({0: -15, 1: 1}))

    report = analyze(job(True))
    assert report.verdict.value == "crashed" and report.pattern == "inactive-experts", report.summary
    assert report.culprit_ranks == [1] and report.fix_config == {"expert-zero-term": {"lists": "auto"}}
    bare = analyze(job(False))
    assert bare.verdict.value == "crashed" and bare.pattern is None and bare.culprit_ranks == [1], bare.summary


def test_gradients_missing_after_a_backward_that_raised_say_nothing_about_routing():
    """Rank 1's backward raised (a recompute's CheckpointError): the parameters autograd had not reached
    have no gradient, idle experts or not. The recorder now marks that backward's end and checks no
    gradients; an older trace still holds the set, and the exception in backward rules it out."""
    from event_factory import manifest

    def job(marked: bool):
        a, b = _rank_1_left_a_backward_reduction()
        b.ev("backward_begin", 2)
        if marked:
            b.ev("backward_end", 2, raised="CheckpointError")
        else:
            b.ev("backward_end", 2)
            b.ev("params_without_grad", 2, names=["module.layers.0.experts.2.weight", "module.layers.0.attn.bias"],
                 shapes=[[4, 4], [4]], count=2)
        b.exc("torch.utils.checkpoint.CheckpointError", "Recomputed values have different metadata",
              (("/job/train.py", 86, "main"),), step=2)
        return run_of(a, b, manifest_info=manifest({0: -15, 1: 1}))

    for marked in (True, False):
        report = analyze(job(marked))
        assert report.pattern != "inactive-experts", report.summary
        assert not any("inactive-experts" == c.pattern for c in report.candidates), report.candidates


EMA = textwrap.dedent("""\
    import torch.distributed as dist

    class Shadow:
        def __init__(self, model, skip_empty):
            self.shadow = {}
            for name, p in model.named_parameters():
                if skip_empty and p.numel() == 0:
                    continue
                self.shadow[name] = p.detach().clone()
            self.ranked = []
            for name, p in model.named_parameters():
                if dist.get_rank() == 0:
                    self.ranked.append(name)

        def state_dict(self):
            for name, s in self.shadow.items():
                dist.all_gather_object([None, None], s.shape)
            for name in self.ranked:
                dist.all_gather_object([None, None], name)

    def export(tensors):
        out = {}
        for key, t in tensors.items():
            if t.numel():
                out[key] = t
        for key in sorted(out):
            dist.all_gather_object([None, None], key)
    """)


def test_the_if_that_filled_the_per_key_collection_is_the_decision(tmp_path):
    from moedoctor.analysis.evidence.source import collection_decision

    path = tmp_path / "ema.py"
    path.write_text(EMA)
    shadow = collection_decision(_stack(path, (17, "state_dict"), (40, "main")))
    assert (shadow.line, shadow.runs_when) == (7, False) and "numel() == 0" in shadow.test
    local = collection_decision(_stack(path, (27, "export")))
    assert (local.line, local.runs_when) == (24, True)
    assert collection_decision(_stack(path, (19, "state_dict"))) is None  # filled under a rank test: a guard


OUTER = textwrap.dedent("""\
    class Outer:
        def _outer_step(self, deltas):
            flat = torch.cat(deltas)
            dist.all_reduce(flat)
            self.opt.step()

        def sync(self, deltas):
            finite = all(torch.isfinite(d).all() for d in deltas)
            if not finite:
                return False
            self._outer_step(deltas)
            return True


    def main(cfg, outer, inner):
        for step in range(cfg.steps):
            inner_step(inner)
            dist.all_reduce(stats)
            if (step + 1) % cfg.inner_steps == 0:
                outer.sync(deltas)
    """)


def test_an_outer_step_skipped_by_a_local_check_is_told_by_the_check_not_by_the_inner_optimizers_count(tmp_path):
    """DiLoCo-style: an inner optimizer steps every iteration (the step counter's), and every second one
    an outer step all-reduces the pseudo-gradients, skipped on a rank-local inf/NaN check. Rank 2
    skips it and runs on into the next iteration's inner step: the hooks show rank 2 starting the
    step the others have not, the reverse of a skip. The ranks that are past the check's finite side
    stepped; rank 2 skipped."""
    import dataclasses

    from moedoctor.events import CallSite

    path = tmp_path / "diloco.py"
    path.write_text(OUTER)
    outer_stack = (f"{path}:4 Outer._outer_step", f"{path}:11 Outer.sync", f"{path}:20 main")
    builders = ranks(3)

    def iteration(r, k, sync, done=True):
        r.ev("optimizer_step_begin", k, optimizer="AdamW")
        r.ev("optimizer_step_end", k, optimizer="AdamW")
        r.coll("all_reduce", (2,), step=k + 1, line=18, file=str(path), done=done or sync)
        if sync:
            r.coll("all_reduce", (1571,), step=k + 1, line=4, file=str(path), function="Outer._outer_step", done=done)
            r.events[-1] = dataclasses.replace(r.events[-1], call_site=CallSite(str(path), 4, "Outer._outer_step",
                                                                                outer_stack))

    for k in range(3):
        for r in builders:
            iteration(r, k, sync=k % 2 == 1)
    for r in builders[:2]:
        iteration(r, 3, sync=True, done=False)  # they wait in the outer all_reduce
    iteration(builders[2], 3, sync=False)      # rank 2 skipped it ...
    iteration(builders[2], 4, sync=False, done=False)  # ... and waits in the next iteration's all_reduce
    report = analyze(run_of(*builders, hang=True))
    assert report.pattern == "skipped-optimizer-step", report.summary
    assert report.culprit_ranks == [2]
    assert any("ranks 0,1 went the way that steps, rank 2 the other" in e for e in report.evidence), report.evidence
    assert report.fix_config == {"skip-step-collectively": {"branch": {
        "file": str(path), "line": 9, "agree": "any", "test": "not finite"}}}


def test_a_checkpoint_walk_of_gathers_at_other_keys_is_no_shape_mismatch():
    """PySlowFast's offload save: one ``full_tensor()`` per state key, rank 0 left a key out, so at the
    same position it gathers the bias ([3]) while rank 1 gathers the weight ([3, 3, 1, 3, 3]), and rank 1
    gathers from that line again. The sizes differ because the ranks walk other keys: shape-mismatch
    yields (its required evidence, a size that differs for no structural reason, is missing) and the
    uneven checkpoint gather is named, with no culprit (which rank skipped is not shown)."""
    bs = ranks(2)
    for step in (0, 1):
        for b in bs:
            b.coll("all_gather", (114,), out_shapes=((228,),), phase=Phase.FORWARD, step=step, line=79)
            b.coll("reduce_scatter", (228,), out_shapes=((114,),), phase=Phase.BACKWARD, step=step, line=80)
    bs[0].coll("all_gather", (3,), out_shapes=(), phase=Phase.CHECKPOINT_SAVE, step=2, line=52, done=False)
    for _ in range(2):
        bs[1].coll("all_gather", (3, 3, 1, 3, 3), out_shapes=(), phase=Phase.CHECKPOINT_SAVE, step=2, line=52)
    report = analyze(run_of(*bs, hang=True))
    assert report.mechanism.mechanism.value == "different-shape"
    assert report.pattern == "uneven-dtensor-allgather" and not report.culprit_ranks
    assert "size" in " ".join(report.not_named["shape-mismatch"])  # held back, the missing evidence said
    # The same resize outside a save, issued once: a shape mismatch still.
    bs = ranks(2)
    bs[0].coll("all_gather", (3,), phase=Phase.OTHER, line=52, done=False)
    bs[1].coll("all_gather", (3, 3, 1, 3, 3), phase=Phase.OTHER, line=52)
    assert analyze(run_of(*bs, hang=True)).pattern == "shape-mismatch"


def test_a_gradient_bucket_issued_again_opens_another_micro_batch_not_a_recompute():
    """minGPT's token-budget micro-batches on DDP: each micro-batch's backward all-reduces the bucket
    (train.py:86), the step's loss all-reduce follows the loop (train.py:89). In step 2 rank 0 packed
    two micro-batches, rank 1 one: rank 0 issues the bucket again while rank 1 closes the step. A call
    site the step issued only in backward, issued again, begins another pass (loop-trip-count, rank 1
    ran fewer); the recompute reading (skipped-collective) needs a call site of the step's forward."""
    bs = ranks(2)

    def micro(b, step, done=True):
        b.ev("backward_begin", step=step)
        b.coll("all_reduce", (24352,), phase=Phase.BACKWARD, step=step, line=86, done=done)
        b.ev("backward_end", step=step)

    def close(b, step, done=True):
        b.coll("all_reduce", (1,), step=step, line=89, done=done)
        b.ev("optimizer_step_begin", step=step)
        b.ev("optimizer_step_end", step=step + 1)

    for step in (0, 1):
        for b in bs:
            micro(b, step)
            micro(b, step)
            close(b, step)
    micro(bs[0], 2)
    micro(bs[0], 2, done=False)
    micro(bs[1], 2)
    close(bs[1], 2, done=False)
    report = analyze(run_of(*bs, hang=True))
    assert report.mechanism.mechanism.value == "loop-trip-count", report.mechanism.detail
    assert report.mechanism.ranks == (1,)


def test_a_small_all_gather_past_held_back_bucket_reductions_is_an_inflight_metric():
    """LLaVA's bucket reducer of corpus 27: each step's backward all-reduces two buckets (train.py:74),
    then the loop all-gathers a 3-element modality count (train.py:127). In step 2 rank 1 holds its
    second bucket back past the pass and gathers while rank 0 reduces: the metric side is an all_gather, the
    structure (reductions held back past a small user collective) that of an in-flight metric."""
    bs = ranks(2)
    for step in (0, 1, 2):
        for b in bs:
            b.ev("backward_begin", step=step)
            b.coll("all_reduce", (1856,), phase=Phase.BACKWARD, step=step, line=74)
            if step < 2 or b.rank == 0:
                b.coll("all_reduce", (1856,), phase=Phase.BACKWARD, step=step, line=74, done=step < 2)
            b.ev("backward_end", step=step)
            if step < 2 or b.rank == 1:
                b.coll("all_gather", (3,), out_shapes=((3,), (3,)), step=step, line=127, done=step < 2)
            if step < 2:
                b.ev("optimizer_step_begin", step=step)
                b.ev("optimizer_step_end", step=step + 1)
    report = analyze(run_of(*bs, hang=True))
    assert report.mechanism.mechanism.value == "different-op", report.mechanism.detail
    assert report.pattern == "inflight-metric-allreduce" and report.culprit_ranks == [1], report.summary
