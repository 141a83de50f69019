"""Layers import only downward.

    cli -> render -> verification / triage -> analysis -> trace -> events (and the shared leaves)

``runner`` (launching and supervising a job), ``recorder`` (inside the job) and ``fixes`` (injected
into the job) sit beside that chain: the CLI, verification and triage use them; the analysis, the
trace format and the event record never do. Checked two ways: statically, every ``import`` of every
module of a lower layer (at any depth of the module, deferred imports included); and dynamically,
``import moedoctor.analysis`` in a fresh interpreter loads no runner, recorder, fix, CLI module or
torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moedoctor"
#: What each lower layer must never import (by module-path prefix).
FORBIDDEN = {
    "moedoctor.events": ("moedoctor.trace", "moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder",
                         "moedoctor.fixes", "moedoctor.cli", "moedoctor.render", "moedoctor.verification",
                         "moedoctor.triage"),
    "moedoctor.trace": ("moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder", "moedoctor.fixes",
                        "moedoctor.cli", "moedoctor.render", "moedoctor.verification", "moedoctor.triage"),
    "moedoctor.analysis": ("moedoctor.runner", "moedoctor.recorder", "moedoctor.fixes", "moedoctor.cli",
                           "moedoctor.render", "moedoctor.verification", "moedoctor.triage"),
    "moedoctor.run_records": ("moedoctor.trace", "moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder",
                              "moedoctor.fixes", "moedoctor.cli", "moedoctor.render", "moedoctor.verification",
                              "moedoctor.triage"),
    "moedoctor.render": ("moedoctor.cli", "moedoctor.runner", "moedoctor.recorder"),
    "moedoctor.verification": ("moedoctor.cli", "moedoctor.render"),
    "moedoctor.triage": ("moedoctor.cli", "moedoctor.render"),
    "moedoctor.rank_states": ("moedoctor.trace", "moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder",
                              "moedoctor.fixes", "moedoctor.cli", "moedoctor.render", "moedoctor.verification",
                              "moedoctor.triage"),
    "moedoctor.layout": ("moedoctor.events", "moedoctor.trace", "moedoctor.analysis", "moedoctor.runner",
                         "moedoctor.recorder", "moedoctor.fixes", "moedoctor.cli", "moedoctor.render",
                         "moedoctor.verification", "moedoctor.triage", "moedoctor.run_records"),
    "moedoctor.environment": ("moedoctor.events", "moedoctor.trace", "moedoctor.analysis", "moedoctor.runner",
                              "moedoctor.recorder", "moedoctor.fixes", "moedoctor.cli", "moedoctor.render",
                              "moedoctor.verification", "moedoctor.triage", "moedoctor.run_records",
                              "moedoctor.layout"),
    "moedoctor.manifest_format": ("moedoctor.events", "moedoctor.trace", "moedoctor.analysis", "moedoctor.runner",
                                  "moedoctor.recorder", "moedoctor.fixes", "moedoctor.cli", "moedoctor.render",
                                  "moedoctor.verification", "moedoctor.triage"),
    "moedoctor.run_status": ("moedoctor.trace", "moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder",
                             "moedoctor.fixes", "moedoctor.cli", "moedoctor.render", "moedoctor.verification",
                             "moedoctor.triage"),
    "moedoctor.wording": ("moedoctor.trace", "moedoctor.analysis", "moedoctor.runner", "moedoctor.recorder",
                          "moedoctor.fixes", "moedoctor.cli", "moedoctor.render", "moedoctor.verification",
                          "moedoctor.triage"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _layer_files(layer: str) -> list[Path]:
    base = PACKAGE.parent.joinpath(*layer.split("."))
    return sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_lower_layer_imports_nothing_above_it(layer):
    upward = []
    for path in _layer_files(layer):
        for line, name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                upward.append(f"{_module_name(path)}:{line} imports {name}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_importing_the_analysis_loads_no_runner_recorder_fix_cli_or_torch():
    code = ("import sys, moedoctor.analysis; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
            "(['moedoctor', 'runner'], ['moedoctor', 'recorder'], ['moedoctor', 'fixes'], ['moedoctor', 'cli'])); "
            "print(' '.join(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"moedoctor.analysis loaded: {result.stdout} {result.stderr[-2000:]}"


def _analysis_graph() -> dict[str, set[str]]:
    """Each analysis module's imports of other analysis modules, at any depth of the module:
    deferred ones and ``if TYPE_CHECKING:`` ones included (an import put there to dodge a cycle is
    the cycle still). ``from moedoctor.analysis.x import y`` counts as importing the module
    ``moedoctor.analysis.x.y`` where that is one, else ``moedoctor.analysis.x``."""
    analysis = PACKAGE / "analysis"
    modules = {_module_name(path) for path in analysis.rglob("*.py")}
    graph = {}
    for path in analysis.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: ``from . import x`` in package ``a.b`` is ``a.b.x``
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every elementary import cycle of ``graph``, once each (from its least module)."""
    cycles = []

    def visit(module, path):
        for target in sorted(graph.get(module, ())):
            if target == path[0]:
                cycles.append(" -> ".join([*path, target]))
            elif target not in path and target > path[0]:
                visit(target, [*path, target])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_the_analysis_has_no_import_cycle():
    """No module of ``moedoctor.analysis`` reaches itself through its imports: ``loading.load`` ->
    ``loading.scan`` -> ``loading.run_data`` (not back), ``from_stacks`` -> ``patterns`` (no pattern
    imports ``from_stacks``: the stack reader lives in ``evidence.stack_reading``), ``model`` ->
    ``mechanisms.vocabulary`` (which imports nothing of the analysis), the registry ``patterns`` -> each
    pattern module -> ``patterns.base`` (no pattern module imports the registry)."""
    graph = _analysis_graph()
    assert "moedoctor.analysis.loading.scan" in graph["moedoctor.analysis.loading.load"]  # the reader sees imports
    assert "moedoctor.analysis.patterns.straggler" in graph["moedoctor.analysis.patterns"]
    assert not graph["moedoctor.analysis.mechanisms.vocabulary"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles in the analysis:\n" + "\n".join(cycles)


def test_the_cycle_finder_finds_a_cycle():
    """``_cycles`` reports a cycle through a deferred import (the shape of the former ``load`` <->
    ``scan``), once."""
    assert _cycles({"a.load": {"a.scan"}, "a.scan": {"a.load"}, "a.view": {"a.load"}}) == ["a.load -> a.scan -> a.load"]
    assert _cycles({"a.load": {"a.scan"}, "a.scan": set()}) == []


def _recorder_graph() -> dict[str, set[str]]:
    """Each recorder module's runtime imports (deferred ones included) of other recorder modules;
    ``from moedoctor.recorder import x`` counts as importing ``moedoctor.recorder.x``."""
    recorder = PACKAGE / "recorder"
    modules = {_module_name(path) for path in recorder.rglob("*.py")}
    graph = {}
    for path in recorder.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        name = _module_name(path)
        graph[name] = {m for m in found if m in modules and m != name and m != "moedoctor.recorder"}
    return graph


def test_the_recorder_has_no_import_cycle():
    """The recorder's modules import one way (``core`` -> ``kernels`` / ``progress`` / ``native`` ->
    ``records`` -> ``writer``, ``groups``): no module reaches itself through runtime imports, deferred
    ones included (``if TYPE_CHECKING:`` imports are for annotations only)."""
    graph = _recorder_graph()
    assert {"moedoctor.recorder.core", "moedoctor.recorder.native", "moedoctor.recorder.progress"} <= graph.keys()
    cycles = []

    def visit(module, path):
        for target in sorted(graph.get(module, ())):
            if target == path[0]:
                cycles.append(" -> ".join([*path, target]))
            elif target not in path and target > path[0]:  # each cycle once, from its least module
                visit(target, [*path, target])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "import cycles in the recorder:\n" + "\n".join(cycles)


def test_the_native_kernel_and_the_progress_thread_use_no_private_name_of_the_recorder_core():
    """What ``native`` and ``progress`` share with the Python kernels lives in ``records``, ``groups``
    and ``kernels``: none reaches into ``core`` for a private helper (``core._json_str`` was one)."""
    for name in ("native/__init__.py", "progress.py", "fr_poller.py", "kernels.py", "records.py"):
        text = (PACKAGE / "recorder" / name).read_text()
        assert "core._" not in text and "import core" not in text.replace("import core_", ""), name
