"""``moedoctor verify`` and ``moedoctor fixes`` without a job: the listing, and what verify refuses."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moedoctor.cli.main import app, main
from moedoctor.errors import EXIT_USAGE
from moedoctor.fixes import FIXES

runner = CliRunner()


def test_fixes_lists_every_fix_with_its_patterns_and_targets():
    result = runner.invoke(app, ["fixes", "--verbose"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for fix in FIXES.values():
        assert fix.name in result.output
        for pattern in fix.patterns:
            assert pattern in result.output
        for target in fix.targets[:1]:
            assert target.path in result.output
    assert "mechanism:" in result.output and "risk:" in result.output


def test_fixes_piped_keeps_every_name_whole():
    result = runner.invoke(app, ["fixes"])  # CliRunner's output is no terminal: like `moedoctor fixes | less`
    assert result.exit_code == 0, result.output
    for fix in FIXES.values():
        assert any(line.startswith(f"{fix.name}  (fixes ") for line in result.output.splitlines())
        for target in fix.targets[:4]:
            assert target.path in result.output or "classes (" in result.output


def test_verify_help_explains():
    result = runner.invoke(app, ["verify", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for text in ("--fix", "--run", "--config", "--json", "--hang-timeout", "Exit status"):
        assert text in result.output


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == EXIT_USAGE
    return " ".join(capsys.readouterr().err.split())  # rich wraps long lines


def test_unknown_fix(capsys):
    assert "no fix called 'expert-sparse'" in refused(capsys, ["verify", "--fix", "expert-sparse", "--", "torchrun", "x.py"])


def test_nothing_to_rerun(capsys):
    assert "nothing to rerun" in refused(capsys, ["verify", "--fix", "expert-dense"])


def test_not_a_run_directory(capsys, tmp_path):
    assert "not a moedoctor run directory" in refused(capsys, ["verify", "--fix", "expert-dense", "--run", str(tmp_path)])


def test_run_and_command_together(capsys, tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"command": ["torchrun", "train.py"]}))
    err = refused(capsys, ["verify", "--fix", "expert-dense", "--run", str(tmp_path), "--", "torchrun", "x.py"])
    assert "not both" in err


def test_bad_config_is_refused_before_anything_runs(capsys, tmp_path):
    config = tmp_path / "fixes.yaml"
    config.write_text("expert-dense: [1, 2]\n")
    err = refused(capsys, ["verify", "--fix", "expert-dense", "--config", str(config), "--run-dir",
                           str(tmp_path / "rerun"), "--", "torchrun", "x.py"])
    assert str(config) in err and "expert-dense" in err
    assert not (tmp_path / "rerun").exists()


def test_run_refuses_an_unknown_fix_and_a_config_without_a_fix(capsys, tmp_path):
    assert "no fix called 'nope'" in refused(capsys, ["run", "--run-dir", str(tmp_path / "a"), "--fix", "nope", "--",
                                                      "torchrun", "x.py"])
    config = tmp_path / "fixes.yaml"
    config.write_text("skip-step-collectively:\n  decision: mypkg.train:should_skip\n")
    err = refused(capsys, ["run", "--run-dir", str(tmp_path / "b"), "--config", str(config), "--", "torchrun", "x.py"])
    assert "name a fix with --fix" in err
