"""Branch fixes: which ``if`` the analysis names, and how the fix rewrites it (no torch)."""

from __future__ import annotations

import builtins
import textwrap

import pytest

from moedoctor.analysis.evidence.source import decision_branch
from moedoctor.fixes import rewrite
from moedoctor.fixes.base import FixConfigError
from moedoctor.fixes.skip_step_collectively import FIX as SKIP

LOOP = textwrap.dedent("""\
    import math

    def train(model, opt, batches, opts):
        for step, batch in enumerate(batches):
            loss = model(batch)
            bad = not math.isfinite(loss)
            if opts.collective:
                bad = agree(bad)
            if bad:
                opt.zero_grad()
                continue
            opt.step()
            if finite_everywhere(loss):
                sync(model)
            else:
                log(loss)
            model(batch)
    """)


def _stack(path, *lines):
    return tuple(f"{path}:{line} {fn}" for line, fn in lines)


def test_the_branch_is_the_one_the_other_ranks_stacks_are_on_the_other_side_of(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(LOOP)
    # the stepping rank in opt.step(); the skipping one already in the next iteration's forward
    branch = decision_branch(_stack(path, (12, "train")), (_stack(path, (5, "train")),))
    assert (branch.line, branch.test, branch.runs_when) == (9, "bad", False)
    # in the body of an `if`, the other rank in its else
    inner = decision_branch(_stack(path, (14, "train")), (_stack(path, (16, "train")),))
    assert (inner.line, inner.runs_when) == (13, True)
    # a rank in the same place on the same side confirms nothing; with no other stack, the nearest
    assert decision_branch(_stack(path, (12, "train")), (_stack(path, (12, "train")),)) is None
    assert decision_branch(_stack(path, (12, "train"))).line == 9
    # `if opts.collective:` tests a setting, never the decision
    assert all(decision_branch(_stack(path, (8, "train")), (o,)) is None for o in (_stack(path, (12, "train")),))


def test_a_branch_setting_is_validated_and_rewritten_in_place(tmp_path):
    with pytest.raises(FixConfigError, match="branch.agree"):
        SKIP.parse_config({"branch": {"file": "train.py", "line": 3, "agree": "most"}})
    with pytest.raises(FixConfigError, match="branch.line"):
        SKIP.parse_config({"branch": {"file": "train.py", "line": "9"}})
    path = tmp_path / "train.py"
    path.write_text("def decide(x):\n    if x > 0:\n        return 'run'\n    return 'skip'\n")
    config = SKIP.parse_config({"branch": {"file": str(path), "line": 2, "agree": "any"}})
    assert config["branch"] == {"file": str(path), "line": 2, "agree": "any"}

    seen = []
    code = rewrite.rewrite(path.read_text(), str(path), {(str(path), 2): "some-fix"})
    assert (str(path), 2) in rewrite.applied
    namespace: dict = {}
    exec(code, namespace)
    setattr(builtins, rewrite.CALL, rewrite._dispatch)
    rewrite.on_branch("some-fix", lambda value, line: seen.append((value, line)) or not value)
    try:
        assert namespace["decide"](1) == "skip" and namespace["decide"](-1) == "run"
    finally:
        rewrite._handlers.pop("some-fix")
    assert seen == [(True, 2), (False, 2)]


def test_the_script_is_launched_through_the_rewriter_only_when_the_branch_is_in_it(tmp_path):
    script = str(tmp_path / "train.py")
    torchrun = ["torchrun", "--nproc_per_node", "2", script, "--steps", "3"]
    assert rewrite.script_command(torchrun, {script}) == [
        "torchrun", "--nproc_per_node", "2", "-m", "moedoctor.fixes.script", script, "--steps", "3"]
    assert rewrite.script_command(torchrun, {str(tmp_path / "lib.py")}) == torchrun
    assert rewrite.script_command(["python", script], {script}) == ["python", "-m", "moedoctor.fixes.script", script]


def test_the_checkpoint_fix_takes_a_branch_too(tmp_path):
    from moedoctor.fixes.key_manifest_checkpoint import FIX as MANIFEST

    config = MANIFEST.parse_config({"branch": {"file": str(tmp_path / "save.py"), "line": 41, "agree": "all"}})
    assert config == {"targets": [], "branch": {"file": str(tmp_path / "save.py"), "line": 41, "agree": "all"}}
    with pytest.raises(FixConfigError, match="branch"):
        MANIFEST.parse_config({"branch": "save.py:41"})


def test_an_inf_nan_check_is_read_through_one_assignment_or_one_call(tmp_path):
    from moedoctor.analysis.evidence.source import Branch, checks_finiteness

    path = tmp_path / "opt.py"
    path.write_text(textwrap.dedent("""\
        import math, torch

        class Opt:
            def _check(self, g):
                return not torch.isfinite(g).all()

            def step(self, g, loss):
                if self._check(g):
                    return
                bad = not math.isfinite(loss)
                if bad:
                    return
                if loss > 10:
                    return
        """))
    assert checks_finiteness(Branch(str(path), 8, "self._check(g)", False))
    assert checks_finiteness(Branch(str(path), 11, "bad", False))
    assert not checks_finiteness(Branch(str(path), 13, "loss > 10", False))


def test_an_inf_nan_flag_converted_in_the_test_is_read_through_its_assignment(tmp_path):
    """``nonfinite = torch.tensor(float(not torch.isfinite(norm)))`` then ``if nonfinite.item() > 0:``
    (corpus 29's DreamerV2 ZeRO-1, read as no check before): ``.item()``, ``float()``, ``bool()``
    keep their operand's value, so the test is made of the flag; a flag assigned from anything else
    still is no check."""
    from moedoctor.analysis.evidence.source import Branch, checks_finiteness

    path = tmp_path / "zero1.py"
    path.write_text(textwrap.dedent("""\
        import torch

        def step(g, loss):
            nonfinite = torch.tensor(float(not torch.isfinite(g.norm())))
            if nonfinite.item() > 0:
                return False
            if bool(nonfinite):
                return False
            big = torch.tensor(float(loss > 10))
            if big.item() > 0:
                return False
        """))
    assert checks_finiteness(Branch(str(path), 5, "nonfinite.item() > 0", False))
    assert checks_finiteness(Branch(str(path), 7, "bool(nonfinite)", False))
    assert not checks_finiteness(Branch(str(path), 10, "big.item() > 0", False))


def test_an_inf_nan_check_is_read_through_an_assignment_that_calls_a_method_of_the_file(tmp_path):
    """``overflow = self.scaler.has_overflow(buf)`` then ``if overflow:`` (a loss scaler of the same
    file, as DeepSpeed-style optimizers written into a script have); a call that checks nothing does
    not count."""
    from moedoctor.analysis.evidence.source import Branch, checks_finiteness

    path = tmp_path / "zero.py"
    path.write_text(textwrap.dedent("""\
        import torch

        class Scaler:
            def has_overflow(self, buf):
                return not bool(torch.isfinite(buf).all())

            def too_large(self, buf):
                return bool(buf.abs().max() > 1e4)

        class Opt:
            def step(self, buf):
                overflow = self.scaler.has_overflow(buf)
                if overflow:
                    return False
                large = self.scaler.too_large(buf)
                if large:
                    return False
        """))
    assert checks_finiteness(Branch(str(path), 13, "overflow", False))
    assert not checks_finiteness(Branch(str(path), 16, "large", False))


def test_a_schedule_on_the_loop_counter_is_not_a_decision(tmp_path):
    """``if (step + 1) % cfg.sync_every == 0:`` is the same on every rank at the same iteration: a rank
    inside it and a rank elsewhere in the loop did not decide differently there. A test on the data
    in the same loop still is a decision."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent("""\
        def main(cfg, batches):
            for step in range(cfg.steps):
                stats = reduce_stats()
                if (step + 1) % cfg.sync_every == 0:
                    outer_sync()
            for i, batch in enumerate(batches):
                if i % cfg.log_every == 0 and batch.size > 0:
                    log()
                if batch.size > 0:
                    log()
        """))
    assert decision_branch(_stack(path, (5, "main")), (_stack(path, (3, "main")),)) is None
    assert decision_branch(_stack(path, (8, "main")), (_stack(path, (10, "main")),)) is None  # `and` is read whole
    assert decision_branch(_stack(path, (10, "main")), (_stack(path, (8, "main")),)).line == 9


def test_which_side_of_an_inf_nan_check_saw_finite_numbers(tmp_path):
    from moedoctor.analysis.evidence.source import Branch, finite_side

    path = tmp_path / "outer.py"
    path.write_text(textwrap.dedent("""\
        import math, torch

        def sync(deltas, norm, scaler, buf, collective):
            finite = all(torch.isfinite(d).all() for d in deltas)
            if collective:
                finite = agree(finite) == 0.0
            bad = not math.isfinite(norm)
            overflow = scaler.has_overflow(buf)
            if not finite:
                return False
            if torch.isfinite(norm):
                step()
            if bad:
                skip()
            if overflow:
                skip()
            if found_inf.item() == 0:
                step()
        """))
    cases = [
        (9, "not finite", False, True),  # past an `if` that leaves when not finite: the finite side
        (11, "torch.isfinite(norm)", True, True),
        (13, "bad", True, False),
        (13, "bad", False, True),
        (15, "overflow", True, False),
        (17, "found_inf.item() == 0", True, None),  # a comparison is not read
    ]
    for line, test, runs_when, want in cases:
        assert finite_side(Branch(str(path), line, test, runs_when)) is want, test


def test_a_decision_in_a_loop_at_the_script_top_level_is_read(tmp_path):
    """A training loop written at module level (no function around it): `if not ok: continue` before
    the call is the decision, confirmed by the other rank's stack at the loop's first line (corpus
    30's MAML script); an `if` inside a function defined in the module is not part of that scope."""
    from moedoctor.analysis.evidence.source import decision_branch

    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent("""\
        import torch

        def helper(x):
            if x is None:
                return 0
            return 1

        for step in range(5):
            broadcast(step)
            ok = bool(torch.isfinite(loss))
            if not ok:
                continue
            opt.step()
        """))
    mine = (f"{path}:13 <module>",)
    theirs = ((f"{path}:9 <module>",),)
    branch = decision_branch(mine, theirs, confirmed=True)
    assert branch is not None and branch.line == 11 and branch.test == "not ok", branch
