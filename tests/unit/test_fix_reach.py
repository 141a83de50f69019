"""``moedoctor.fixes.reach``: a verify command is offered only for a fix that can reach code the job ran."""

from __future__ import annotations

from analysis_scenarios import SCENARIOS

from moedoctor.analysis import analyze
from moedoctor.fixes.reach import reached, script_of, with_fix_reach
from moedoctor.render.json_report import report_to_dict


def test_a_fix_whose_targets_the_job_never_ran_gives_a_note_instead_of_a_verify_command():
    build, _, _ = SCENARIOS["skipped-optimizer-step"]
    run = build()  # frames of /job/train.py only: no _lib.sharded_optim
    report = analyze(run)
    assert report.fixes == ["skip-step-collectively"] and report.verify_command
    reached_report = with_fix_reach(report, run, ["torchrun", "/job/train.py"])
    assert reached_report.verify_command is None
    assert "No automatic fix for this code: skip-step-collectively patches _lib.sharded_optim:" in reached_report.fix_note
    assert "--config FILE" in reached_report.fix_note
    assert report_to_dict(reached_report)["fix_note"] == reached_report.fix_note


def test_targets_are_matched_on_module_file_and_function():
    frames = {("/repo/fixtures/_lib/sharded_optim.py", "step"), ("/repo/train.py", "all_reduce_metrics")}
    script = script_of(["python", "-m", "torch.distributed.run", "/repo/train.py", "--x"])
    assert script == "/repo/train.py"
    # a helper that issues no collective itself counts as reached when its module was seen
    assert reached(["_lib.sharded_optim:grad_norm_is_nonfinite"], frames, script) == [
        "_lib.sharded_optim:grad_norm_is_nonfinite"]
    assert reached(["__main__:all_reduce_metrics", "__main__:train_step"], frames, script) == [
        "__main__:all_reduce_metrics"]
    assert reached(["transformers.models.mixtral.modeling_mixtral:MixtralSparseMoeBlock.forward"], frames, script) == []
    # a script given relative to the job's directory matches wherever `analyze` runs
    relative = script_of(["torchrun", "--nproc_per_node=2", "./train.py"])
    assert relative == "train.py" and reached(["__main__:all_reduce_metrics"], frames, relative)


def test_a_reached_fix_keeps_its_verify_command(monkeypatch):
    build, _, _ = SCENARIOS["skipped-optimizer-step"]
    run = build()
    report = analyze(run)
    monkeypatch.setattr("moedoctor.fixes.reach.run_frames",
                        lambda _run: {("/repo/fixtures/_lib/sharded_optim.py", "step")})
    kept = with_fix_reach(report, run, None)
    assert kept.verify_command == report.verify_command and kept.fix_note is None


def test_a_method_target_needs_its_class_in_the_module(tmp_path):
    """transformers 4.x's qwen2_moe module holds Qwen2MoeSparseMoeBlock.forward; the 5.x target
    Qwen2MoeExperts.forward names the same module but a class that 4.x does not have."""
    pkg = tmp_path / "transformers" / "models" / "qwen2_moe"
    pkg.mkdir(parents=True)
    (pkg / "modeling_qwen2_moe.py").write_text(
        "class Qwen2MoeSparseMoeBlock:\n    def forward(self, x):\n        return x\n")
    frames = {(str(pkg / "modeling_qwen2_moe.py"), "forward")}
    module = "transformers.models.qwen2_moe.modeling_qwen2_moe"
    assert reached([f"{module}:Qwen2MoeExperts.forward"], frames, None) == []
    assert reached([f"{module}:Qwen2MoeSparseMoeBlock.forward"], frames, None) == [
        f"{module}:Qwen2MoeSparseMoeBlock.forward"]


def test_a_job_that_replaces_the_target_method_itself_is_not_reached(tmp_path):
    from moedoctor.fixes.reach import _replaced_by_job

    job = tmp_path / "train.py"
    job.write_text("from lib import modeling\n\ndef apply_kernels():\n"
                   "    modeling.MoeBlock.forward = fast_forward\n\ndef main(args):\n"
                   "    if args.apply_fix:\n        modeling.OtherBlock.forward = dense_forward\n")
    seen = {(str(job), "main")}
    assert _replaced_by_job("lib.modeling:MoeBlock.forward", seen)          # unconditional: always replaced
    assert not _replaced_by_job("lib.modeling:OtherBlock.forward", seen)    # under an `if`: may not have run
    assert not _replaced_by_job("lib.modeling:grad_norm", seen)             # a function target: not a method


def test_a_job_subclass_that_overrides_the_target_method_without_calling_it_is_not_reached(tmp_path):
    from moedoctor.fixes.reach import _replaced_by_job

    job = tmp_path / "train.py"
    job.write_text("from lib.modeling import MoeBlock, OtherBlock\n\n"
                   "class Budgeted(MoeBlock):\n    def forward(self, x):\n        return x\n\n"
                   "class Logged(OtherBlock):\n    def forward(self, x):\n        return super().forward(x)\n")
    seen = {(str(job), "main")}
    assert _replaced_by_job("lib.modeling:MoeBlock.forward", seen)        # its own forward: the patch never runs
    assert not _replaced_by_job("lib.modeling:OtherBlock.forward", seen)  # calls the base's: the patch runs


def test_the_checkpointed_function_of_an_exception_counts_as_code_the_job_ran():
    """A recompute mismatch raises in backward; the MoE block issued no collective, but the function
    torch.utils.checkpoint was recomputing names its module."""
    import dataclasses

    from moedoctor.events import CheckpointedFunction
    from moedoctor.fixes.reach import run_frames

    from event_factory import ranks, run_of

    a, b = ranks(2)
    for r in (a, b):
        r.coll("all_reduce", (8,), line=30)
    where = CheckpointedFunction("Qwen2MoeDecoderLayer.forward", "/site-packages/modeling_qwen2_moe.py", 660)
    b.exc("torch.utils.checkpoint.CheckpointError", "different metadata", (("/job/train.py", 40, "main"),))
    b.exceptions[0] = dataclasses.replace(b.exceptions[0], checkpointed=where)
    seen = run_frames(run_of(a, b, hang=True))
    assert ("/site-packages/modeling_qwen2_moe.py", "forward") in seen and ("/job/train.py", "main") in seen


def test_metrics_in_code_of_no_known_function_get_the_up_front_gather_where_a_unit_was_gathered_lazily():
    """The other rank's collective is the forward all-gather of a unit the metric rank had not gathered
    yet this step: the report points `fsdp-gather-upfront` at the job by structure, and offers it when
    the metrics fix's own functions are not in the job (here the script is another file)."""
    build, _, _ = SCENARIOS["inflight-metric-allreduce"]
    run = build()
    report = analyze(run)
    assert report.fix_config == {"fsdp-gather-upfront": {"units": "kept"}}
    offered = with_fix_reach(report, run, ["torchrun", "/elsewhere/pretrain.py"])
    assert offered.fixes[0] == "fsdp-gather-upfront"
    assert offered.verify_command == "moedoctor verify --fix fsdp-gather-upfront --run /runs/test"
    reached_report = with_fix_reach(report, run, ["torchrun", "/job/train.py"])  # all_reduce_metrics ran there
    assert reached_report.fixes[0] == "metrics-after-microbatches"
    assert reached_report.verify_command == "moedoctor verify --fix metrics-after-microbatches --run /runs/test"
