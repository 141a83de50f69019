"""Branch fixes: one ``if`` of the job's own code made collective, as the file is compiled.

Some fixes cannot patch a function: the rank-local decision is an ``if`` inline in the training
loop (``if not math.isfinite(loss.item()): continue``). The analysis names that ``if``
(``moedoctor.analysis.evidence.source.decision_branch``) and the report carries it in the fix's settings::

    skip-step-collectively:
      branch: {file: /abs/train.py, line: 86, agree: any}

Here the ``if``'s test is wrapped, in the syntax tree, in a call to ``__moedoctor_branch__(test,
fix, line)``; the fix installed in the worker decides what the call returns (for ``agree: any``: the
test's value all-reduced with MAX over the default group, so a rank whose own test is false follows
the ones whose test is true). Line numbers, tracebacks and call sites stay those of the file.

* Modules are rewritten by an import hook (``install_import_hook``), their bytecode cache bypassed.
* The script itself is compiled before anything could hook it: ``moedoctor verify`` launches it
  through ``python -m moedoctor.fixes.script SCRIPT ARGS`` (``script_command``).

No torch here; the fixes register what the call does (``on_branch``).
"""

from __future__ import annotations

import ast
import builtins
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from moedoctor import environment
from moedoctor.fixes.base import FixConfigError

CALL = "__moedoctor_branch__"
MODES = ("any", "all")

_handlers: dict[str, Callable[[Any, int], Any]] = {}
#: (file, line) -> fix name, for every branch the fixes named in this process' environment.
_wanted: dict[tuple[str, int], str] = {}
#: (file, line) of the branches actually rewritten in this process.
applied: set[tuple[str, int]] = set()
_activated = False


def parse_branch(value: Any) -> dict:
    """A ``branch`` setting, validated: ``{file, line, agree}``."""
    if not isinstance(value, Mapping):
        raise FixConfigError(f"branch: expected a mapping {{file, line, agree}}, got {value!r}")
    unknown = set(value) - {"file", "line", "agree", "test"}
    if unknown:
        raise FixConfigError(f"branch: unknown key(s) {sorted(unknown)}; expected file, line, agree")
    file, line, agree = value.get("file"), value.get("line"), value.get("agree", "any")
    if not isinstance(file, str) or not file.endswith(".py"):
        raise FixConfigError(f"branch.file: expected the path of a .py file, got {file!r}")
    if not isinstance(line, int) or isinstance(line, bool) or line < 1:
        raise FixConfigError(f"branch.line: expected a line number, got {line!r}")
    if agree not in MODES:
        raise FixConfigError(f"branch.agree: expected 'any' or 'all', got {agree!r}")
    out = {"file": os.path.abspath(file), "line": line, "agree": agree}
    if isinstance(value.get("test"), str):
        out["test"] = value["test"]
    return out


def wanted_from_env(environ: Mapping[str, str] = os.environ) -> dict[tuple[str, int], str]:
    """The branches the fixes named in ``MOEDOCTOR_FIXES`` ask for, from ``MOEDOCTOR_FIX_CONFIG``."""
    names = environment.fixes(environ)
    path = environment.fix_config(environ)
    if not names or not path:
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    found = {}
    for name in names:
        branch = (config.get(name) or {}).get("branch") if isinstance(config, dict) else None
        if isinstance(branch, dict) and isinstance(branch.get("file"), str) and isinstance(branch.get("line"), int):
            found[(os.path.normpath(branch["file"]), branch["line"])] = name
    return found


def rewrite(source: str | bytes, filename: str, wanted: Mapping[tuple[str, int], str]) -> Any:
    """``source`` compiled with the wanted branches' tests wrapped; records them in ``applied``."""
    tree = ast.parse(source, filename)
    path = os.path.normpath(filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (path, node.lineno) in wanted:
            call = ast.Call(
                func=ast.Name(CALL, ast.Load()),
                args=[node.test, ast.Constant(wanted[(path, node.lineno)]), ast.Constant(node.lineno)],
                keywords=[],
            )
            node.test = ast.copy_location(call, node.test)
            applied.add((path, node.lineno))
    ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec", dont_inherit=True)


def _dispatch(value: Any, fix: str, line: int) -> Any:
    handler = _handlers.get(fix)
    return value if handler is None else handler(value, line)


def on_branch(fix: str, handler: Callable[[Any, int], Any]) -> None:
    """What ``fix``'s wrapped tests return: ``handler(local value, line)``."""
    _handlers[fix] = handler


def activate(environ: Mapping[str, str] = os.environ) -> dict[tuple[str, int], str]:
    """Make the wrapper callable from any module (a builtin) and remember the wanted branches (the
    fix config is read once per process: the bootstrap and the script runner both ask)."""
    global _activated
    if not _activated:
        _activated = True
        _wanted.update(wanted_from_env(environ))
        if _wanted:
            setattr(builtins, CALL, _dispatch)
    return dict(_wanted)


# -- modules ------------------------------------------------------------------------------------------


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):  # never the cached bytecode: it has the original test
        source = self.get_data(self.path)
        return rewrite(source, self.path, _wanted)

    def set_data(self, path, data, *, _mode=0o666):  # and never write the rewritten one to the cache
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader) or not spec.origin:
            return None
        origin = os.path.normpath(spec.origin)
        if not any(file == origin for file, _ in _wanted):
            return None
        spec.loader = _Loader(fullname, spec.origin)
        return spec


def install_import_hook(environ: Mapping[str, str] = os.environ) -> dict[tuple[str, int], str]:
    """Rewrite the wanted branches of the modules imported from now on; returns them."""
    wanted = activate(environ)
    if wanted and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return wanted


# -- the script ---------------------------------------------------------------------------------------


def script_command(command: list[str], files: set[str]) -> list[str]:
    """``command`` with its script run through ``-m moedoctor.fixes.script`` when a wanted branch is
    in that script (``torchrun [opts] train.py`` -> ``torchrun [opts] -m moedoctor.fixes.script
    train.py``; the same for ``python train.py``); unchanged otherwise."""
    for i, arg in enumerate(command):
        if arg.endswith(".py") and os.path.normpath(os.path.abspath(arg)) in files:
            return [*command[:i], "-m", "moedoctor.fixes.script", *command[i:]]
        if arg.endswith(".py"):
            break
    return list(command)
