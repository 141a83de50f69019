"""One owner per format and per setting (issue 34): the run directory's layout (``moedoctor/layout.py``),
the environment contract (``moedoctor/environment.py``) and the manifest's keys and reader
(``moedoctor/manifest_format.py``) are spelled nowhere else in the package.

The scan reads every module's syntax tree (docstrings left out; comments are not in it):

- a run-directory path: a string that names one of the run directory's files (``manifest.json``,
  ``report.json``, ``job.log``, a supervisor lock, ...), a folder of it joined with ``/``
  (``run_dir / "traces"``), or a folder written as a path (``"stacks/..."``, ``f"gpu/{name}"``);
- a ``MOEDOCTOR_*`` name in any string;
- a manifest key read by hand from something called a manifest (``manifest.get("status")``,
  ``manifest["command"]``), or a manifest file parsed by hand (``json.loads(...manifest...)``,
  ``load_manifest(...)``).

Nothing is allow-listed but the three owners. ``test_the_scan_finds_each_kind`` plants one of each
kind, so the scan itself is shown to fail when it should.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from moedoctor import environment, layout, manifest_format

PACKAGE = Path(__file__).resolve().parents[2] / "moedoctor"
OWNERS = {
    "layout": PACKAGE / "layout.py",
    "environment": PACKAGE / "environment.py",
    "manifest": PACKAGE / "manifest_format.py",
}

_FILES = (
    layout.MANIFEST,
    layout.REPORT,
    layout.VERIFICATION,
    layout.FIX_CONFIG,
    layout.JOB_LOG,
    layout.NODE_LOGS,
    layout.JOB_LOGS,
    layout.LOCK_PREFIX,
)
_FOLDERS = (
    layout.TRACES,
    layout.STACKS,
    layout.GPU,
    layout.CONTROL,
    layout.FIXES,
    layout.FLIGHT_RECORDER,
    layout.PARAMS,
)
_FOLDER_PATH = re.compile(r"(?<![\w.-])(?:" + "|".join(map(re.escape, _FOLDERS)) + r")/")


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _is_manifest(node: ast.AST) -> bool:
    return "manifest" in ast.unparse(node).lower()


def findings(source: str, owner: set[str] = frozenset()) -> list[tuple[int, str, str]]:
    """``(line, kind, text)`` of every spelling outside its owner in ``source``; ``owner``: which of
    ``layout``, ``environment``, ``manifest`` the module owns."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if "layout" not in owner:
                if any(name in text for name in _FILES) or _FOLDER_PATH.search(text):
                    found.append((node.lineno, "layout", text))
            if "environment" not in owner and environment.PREFIX in text:
                found.append((node.lineno, "environment", text))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and "layout" not in owner:
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value in _FOLDERS:
                    found.append((node.lineno, "layout", f"/ {side.value!r}"))
        elif "manifest" not in owner:
            if isinstance(node, ast.Subscript) and _is_manifest(node.value):
                key = node.slice
                if isinstance(key, ast.Constant) and key.value in manifest_format.KEYS:
                    found.append((node.lineno, "manifest", ast.unparse(node)))
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
                if (
                    name == "get"
                    and isinstance(node.func, ast.Attribute)
                    and _is_manifest(node.func.value)
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in manifest_format.KEYS
                ):
                    found.append((node.lineno, "manifest", ast.unparse(node)))
                elif name == "load_manifest" or (name in ("loads", "load") and any(map(_is_manifest, node.args))):
                    found.append((node.lineno, "manifest", ast.unparse(node)))
    return found


def test_formats_and_settings_are_spelled_only_by_their_owners():
    owned = {path: kind for kind, path in OWNERS.items()}
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        owner = {owned[path]} if path in owned else set()
        for line, kind, text in findings(path.read_text(), owner):
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {kind} spelled by hand: {text[:80]!r}")
    assert not problems, "spelled outside their owner:\n" + "\n".join(problems)


def test_the_scan_finds_each_kind():
    planted = '''
import json, os
"""a docstring may say manifest.json, traces/ and MOEDOCTOR_RUN_DIR"""
traces = run_dir / "traces"
report = f"{run_dir}/report.json"
message = f"stacks/{name} unreadable"
run = os.environ.get("MOEDOCTOR_RUN_DIR")
status = manifest.get("status")
command = self.manifest["command"]
doc = json.loads(layout.manifest.read_text())
kind = "traces"  # an evidence kind, not a path: allowed
'''
    kinds = sorted((line, kind) for line, kind, _ in findings(planted))
    assert kinds == [(4, "layout"), (5, "layout"), (6, "layout"), (7, "environment"), (8, "manifest"),
                     (9, "manifest"), (10, "manifest")], kinds
    assert findings(planted, {"layout", "environment", "manifest"}) == []


def test_the_owners_declare_what_the_scan_looks_for():
    assert all(var.name.startswith(environment.PREFIX) for var in environment.VARIABLES)
    assert len({var.name for var in environment.VARIABLES}) == len(environment.VARIABLES)
    assert set(layout.OWN_ENTRIES) >= {layout.MANIFEST, layout.REPORT, layout.TRACES, layout.STACKS}
    assert {"status", "command", "nodes", "hang", "ranks"} <= manifest_format.KEYS
