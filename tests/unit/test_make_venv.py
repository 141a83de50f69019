"""``ci/make_venv.py`` (README's ``.venv-tf4``, ``tests/unit/test_native_build.py``'s venvs) from
inside a venv: the new venv sees the packages of the venv it was made from, not only the base
interpreter's (``python -m venv --system-site-packages`` alone), and its own installs shadow them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _venv(path: Path, *args: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *args, str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def test_a_venv_made_inside_a_venv_sees_the_outer_venvs_packages(tmp_path):
    # the outer venv: a package only it holds (as a user's venv holds torch), the base's packages not seen
    outer = _venv(tmp_path / "outer")
    (_purelib(outer) / "only_in_outer.py").write_text("WHERE = 'outer'\n")
    (_purelib(outer) / "shadowed.py").write_text("WHERE = 'outer'\n")
    inner = tmp_path / "inner"
    done = subprocess.run([str(outer), str(REPO / "ci" / "make_venv.py"), str(inner)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    python = inner / "bin" / "python"
    (_purelib(python) / "shadowed.py").write_text("WHERE = 'inner'\n")  # installed into the inner venv
    code = "import only_in_outer, shadowed, sys; print(only_in_outer.WHERE, shadowed.WHERE, sys.prefix)"
    seen = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["outer", "inner", str(inner)]
    # what plain --system-site-packages gives from inside the outer venv: the base only
    plain = tmp_path / "plain"
    subprocess.run([str(outer), "-m", "venv", "--system-site-packages", "--without-pip", str(plain)], check=True)
    assert subprocess.run([str(plain / "bin" / "python"), "-c", "import only_in_outer"],
                          capture_output=True).returncode != 0
