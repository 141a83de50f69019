"""``moedoctor.launchers.ray_runtime_env``: the variables an existing Ray cluster's workers need to
record, forwarded through Ray's ``runtime_env``; nothing outside ``moedoctor run``."""

from __future__ import annotations

import os

from moedoctor.launchers import moedoctor_env, ray_runtime_env


def test_outside_moedoctor_run_nothing_is_added(monkeypatch):
    monkeypatch.delenv("MOEDOCTOR_RUN_DIR", raising=False)
    assert moedoctor_env() == {}
    assert ray_runtime_env({"pip": ["x"]}) == {"pip": ["x"]}


def test_under_moedoctor_run_the_bootstrap_run_dir_and_marker_are_forwarded(monkeypatch):
    monkeypatch.setenv("MOEDOCTOR_RUN_DIR", "/runs/a")
    monkeypatch.setenv("MOEDOCTOR_LAUNCH_ID", "abc")
    monkeypatch.setenv("PYTHONPATH", "/pkg/moedoctor/_bootstrap:/pkg")
    monkeypatch.setenv("HOME", "/root")
    env = ray_runtime_env({"env_vars": {"PYTHONPATH": "/job/src", "X": "1"}, "working_dir": "."})
    assert env["working_dir"] == "."
    assert env["env_vars"]["MOEDOCTOR_RUN_DIR"] == "/runs/a" and env["env_vars"]["MOEDOCTOR_LAUNCH_ID"] == "abc"
    assert env["env_vars"]["PYTHONPATH"] == os.pathsep.join(["/pkg/moedoctor/_bootstrap:/pkg", "/job/src"])
    assert env["env_vars"]["X"] == "1" and "HOME" not in env["env_vars"]
