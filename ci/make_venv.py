"""Create a venv that sees this interpreter's packages (torch, moedoctor...), from anywhere.

    python ci/make_venv.py .venv-tf4

``python -m venv --system-site-packages`` alone makes a venv over the *base* interpreter: run from
inside a venv (where torch is installed), the new one would see the base interpreter's packages,
without torch. So the new venv (``--without-pip``, ``--system-site-packages``) also gets a
``.pth`` file that adds each site-packages folder of the interpreter running this script, after its
own (what it installs shadows them: ``ci/transformers4.txt`` over transformers 5.x). README's test
command and ``tests/unit/test_native_build.py`` create their venvs with it.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def site_dirs() -> list[str]:
    """This interpreter's site-packages folders, in ``sys.path`` order."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def make_venv(path: Path) -> Path:
    """Create the venv at PATH and return its python."""
    path = Path(path)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    own = Path(purelib).resolve()
    lines = [f"import site; site.addsitedir({d!r})" for d in site_dirs() if Path(d).resolve() != own]
    (Path(purelib) / "_parent_environment.pth").write_text("\n".join(lines) + "\n")
    return python


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python ci/make_venv.py PATH", file=sys.stderr)
        return 2
    python = make_venv(Path(argv[0]))
    print(f"{python}: a venv over {sysconfig.get_paths()['purelib']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
