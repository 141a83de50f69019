"""The command line without a job: help, version, and what ``moedoctor run`` and ``verify`` refuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

import moedoctor
from moedoctor.cli.main import app, main
from moedoctor.errors import EXIT_USAGE

runner = CliRunner()


def test_help_lists_run():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "run" in result.output


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "Usage" in result.output and "run" in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and moedoctor.__version__ in result.output


@pytest.mark.parametrize("argv", [["-h"], ["analyze", "-h"], ["run", "-h"], ["verify", "-h"], ["triage", "-h"]])
def test_short_help_is_accepted_everywhere(argv):
    result = runner.invoke(app, argv)
    assert result.exit_code == 0 and "Usage" in result.output, result.output


def test_short_version():
    result = runner.invoke(app, ["-V"])
    assert result.exit_code == 0 and moedoctor.__version__ in result.output


def test_run_help_explains_every_option_with_an_example():
    result = runner.invoke(app, ["run", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for option in ("--run-dir", "--hang-timeout", "--keep-alive", "--no-stacks", "--native", "--max-events",
                   "--force", "Example: moedoctor run"):
        assert option in result.output


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_run_help_says_any_command_works():
    result = runner.invoke(app, ["run", "--help"], terminal_width=200)
    # The help's width is the screen's (render/width.py, set once per process by main()): read the text
    # whatever the line breaks.
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 0 and "Any command works" in text and "accelerate launch" in text, text


def test_verify_refuses_a_command_that_is_not_torchrun(tmp_path, capsys):
    code, err = run_main(["verify", "--fix", "metrics-after-microbatches", "--", "python", "train.py"], capsys)
    assert code == EXIT_USAGE and "torchrun" in err


def test_refuses_no_command(capsys):
    code, err = run_main(["run"], capsys)
    assert code == EXIT_USAGE and "no command" in err


def test_refuses_a_non_empty_run_dir_without_force(tmp_path, capsys, monkeypatch):
    (tmp_path / "old.txt").write_text("a previous run")
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["run", "--run-dir", str(tmp_path), "--", "torchrun", "t.py"], capsys)
    assert code == EXIT_USAGE and "--force" in err and "not empty" in err


def test_options_after_the_launcher_belong_to_it(tmp_path, capsys):
    # No '--': the command's own options must not be parsed as moedoctor's (``false`` ignores them, exits 1).
    code, err = run_main(["run", "--run-dir", str(tmp_path / "r"), "false", "--nproc_per_node=2", "x.py"], capsys)
    assert code == 1 and "No such option" not in err and "exited with status 1" in err


def test_python_dash_m_moedoctor_help():
    done = subprocess.run([sys.executable, "-m", "moedoctor", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "run" in done.stdout
    done = subprocess.run([sys.executable, "-m", "moedoctor", "run", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--hang-timeout" in done.stdout


@pytest.mark.parametrize("command", ["run", "verify", "analyze", "triage", "fixes"])
def test_flags_show_no_type_placeholder(command):
    result = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    flag_lines = [line for line in result.output.splitlines()
                  if any(f in line for f in ("--force", "--keep-alive", "--json", "--native", "--verbose", "--help"))]
    assert flag_lines and not any("<bool>" in line for line in flag_lines), flag_lines


def test_usage_names_the_required_argument_plainly():
    result = runner.invoke(app, ["analyze", "--help"], terminal_width=200)
    assert "Usage: moedoctor analyze [OPTIONS] PATH" in result.output, result.output


@pytest.mark.parametrize(
    "command",
    [
        ["torchrun", "--standalone", "--nproc_per_node", "2", "nosuch/train.py", "--steps", "3"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "nosuch/train.py"],
        [sys.executable, "nosuch/train.py"],
    ],
)
def test_a_missing_script_is_one_line_and_leaves_no_run_folder(command, tmp_path, monkeypatch, capsys):
    """Issue 32, point 4: not torchrun's 40-line traceback then "the job never started" and a useless
    next step, but the file, and no run directory for a command that never started."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["run", "--run-dir", str(tmp_path / "run"), "--", *command], capsys)
    assert code == EXIT_USAGE, err
    assert err.strip() == "moedoctor: nosuch/train.py: no such file (nothing was started)", err
    assert not (tmp_path / "run").exists() and not (tmp_path / "moedoctor-runs").exists()
