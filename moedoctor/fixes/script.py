"""``python -m moedoctor.fixes.script SCRIPT ARGS``: run SCRIPT as ``python SCRIPT ARGS`` would,
with the branches a fix names rewritten (``moedoctor.fixes.rewrite``). ``moedoctor verify`` launches
a job this way only when a fix's branch is in the job's own script."""

from __future__ import annotations

import builtins
import os
import sys
import tokenize
import types


def main() -> None:
    from moedoctor.fixes import rewrite

    if len(sys.argv) < 2:
        sys.exit("usage: python -m moedoctor.fixes.script SCRIPT [ARGS...]")
    path = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(path)  # as for `python SCRIPT`: the script's folder first
    wanted = rewrite.install_import_hook()
    with tokenize.open(path) as f:
        source = f.read()
    code = rewrite.rewrite(source, path, wanted)
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
