"""README's quick start is two commands, and ``.ci/run`` runs the second, README's test command, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_readmes_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert len(blocks) == 2 and all("\n" not in b for b in blocks), blocks
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == blocks[1]
    assert "apt-get install -y chromium" in ci and "python ci/make_venv.py .venv-tf4" in ci
