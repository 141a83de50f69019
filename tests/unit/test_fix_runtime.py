"""The worker side of the fixes, in-process: patching by import path, call counts, status files, the
loud 'did nothing', checks aggregated per name; and ``--config`` loading."""

from __future__ import annotations

import json
import sys
import types

import pytest

from moedoctor.errors import MoedoctorError
from moedoctor.fixes import FIXES, Fix, Target, get_fix
from moedoctor.fixes.config import load_fix_config
from moedoctor.fixes.runtime import FixRuntime
from moedoctor.fixes.status import read_fix_status


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("moedoctor_test_user_code")
    module.decide = lambda x: x > 1
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setenv("RANK", "3")
    return module


def make_runtime(tmp_path, targets, install=lambda rt: None, checks=True) -> FixRuntime:
    fix = Fix(name="test-fix", patterns=("p",), summary="s", mechanism="m", risk="r", cost="c", check="k",
              targets=tuple(targets), install=install)
    return FixRuntime(fix, {}, tmp_path / "fixes", checks)


def test_patch_counts_calls_and_writes_status(tmp_path, user_module):
    runtime = make_runtime(tmp_path, [Target("moedoctor_test_user_code:decide")])
    runtime.patch(Target("moedoctor_test_user_code:decide"), lambda original, owner: lambda x: not original(x))
    assert user_module.decide(5) is False and user_module.decide(0) is True
    runtime.check("holds", True, "fine", worst=0.5)
    runtime.check("holds", True, "fine", worst=0.25)
    runtime.finish()
    status = read_fix_status(tmp_path, "test-fix")
    rank = status.ranks[3]
    assert rank.applied and status.applied_ranks() == [3]
    assert status.calls() == {"moedoctor_test_user_code:decide": 2}
    (check,) = rank.checks
    assert (check.passed, check.runs, check.worst) == (True, 2, 0.5)
    assert rank.notes == ()


def test_a_failure_sticks_and_an_unrunnable_check_is_not_a_pass(tmp_path, user_module):
    runtime = make_runtime(tmp_path, [])
    runtime.check("a", True, "ok")
    runtime.check("a", False, "moved the weights")
    runtime.check("a", True, "ok")
    runtime.check("b", None, "experts are FSDP units")
    checks = {c.name: c for c in runtime.checks.values()}
    assert (checks["a"].passed, checks["a"].failures, checks["a"].detail) == (False, 1, "moved the weights")
    assert checks["b"].passed is None


def test_missing_target_says_so_loudly(tmp_path, user_module, capsys):
    runtime = make_runtime(tmp_path, [])
    runtime.patch(Target("moedoctor_test_user_code:no_such_function"), lambda original, owner: original)
    runtime.finish()
    assert "did NOTHING" in capsys.readouterr().err
    status = read_fix_status(tmp_path, "test-fix").ranks[3]
    assert not status.applied
    assert "has no no_such_function" in status.targets[0].error
    assert any("did NOTHING" in n for n in status.notes)


def test_a_target_the_fix_refuses_is_left_alone(tmp_path, user_module):
    original = user_module.decide
    runtime = make_runtime(tmp_path, [])

    def refuse(original, owner):
        raise TypeError("structure differs")

    runtime.patch(Target("moedoctor_test_user_code:decide"), refuse)
    assert user_module.decide is original
    assert "structure differs" in runtime.targets["moedoctor_test_user_code:decide"].error


def test_not_a_rank_writes_nothing(tmp_path, user_module, monkeypatch):
    monkeypatch.delenv("RANK")
    runtime = make_runtime(tmp_path, [])
    runtime.finish()  # torchrun's agent imports torch too: it must not report as rank 0
    assert not (tmp_path / "fixes").exists()


@pytest.mark.parametrize("text, message", [
    ("not: [valid", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping of fix names"),
    ("no-such-fix: {}\n", "unknown fix 'no-such-fix'"),
    ("skip-step-collectively:\n  decision: not a path\n", "skip-step-collectively: decision[0]"),
    ("skip-step-collectively:\n  returns: maybe\n", "returns: expected 'flag'"),
    ("skip-step-collectively:\n  typo: 1\n", "unknown key(s) ['typo']"),
])
def test_config_errors_name_the_file_fix_and_key(tmp_path, text, message):
    path = tmp_path / "fixes.yaml"
    path.write_text(text)
    with pytest.raises(MoedoctorError) as e:
        load_fix_config(path, FIXES.values())
    assert message in e.value.message and str(path) in e.value.message


def test_config_is_normalized(tmp_path):
    path = tmp_path / "fixes.yaml"
    path.write_text("skip-step-collectively:\n  decision: mypkg.train:should_skip\n  returns: norm\n")
    config = load_fix_config(path, FIXES.values())
    assert config == {"skip-step-collectively": {"targets": ["mypkg.train:should_skip"], "returns": "norm"}}
    json.dumps(config)  # what the workers read
    targets = get_fix("skip-step-collectively").all_targets(config["skip-step-collectively"])
    assert Target("mypkg.train:should_skip", "from --config") in targets


def test_unknown_fix_lists_the_known_ones():
    with pytest.raises(MoedoctorError, match="known fixes: expert-dense"):
        get_fix("expert-sparse")
