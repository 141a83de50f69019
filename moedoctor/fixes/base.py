"""What a fix module declares: ``Fix`` (name, patterns, mechanism, risk, cost, check, targets) and
``Target`` (a class attribute or module function, by import path).

Nothing here imports torch: ``moedoctor fixes`` and ``moedoctor verify`` read the registry in the
supervisor. A fix's ``install`` runs in each worker process (``moedoctor.fixes.runtime``) and is
the only part that touches torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moedoctor.errors import MoedoctorError

if TYPE_CHECKING:
    from moedoctor.fixes.runtime import FixRuntime


class FixConfigError(MoedoctorError):
    """A ``--config`` file (or one section of it) that cannot be used, said in one line."""


@dataclass(frozen=True)
class Target:
    """What a fix replaces: ``module:Qualified.name``, e.g. ``_lib.moe:TinyMoeSparseMoeBlock.forward``.

    The module is patched right after it is imported in the worker. ``__main__`` (the training
    script itself) is patched when the script calls ``init_process_group``: by then its functions
    are defined, and it looks them up by name at call time."""

    path: str
    note: str = ""

    def __post_init__(self) -> None:
        module, _, qualname = self.path.partition(":")
        if (
            not module
            or not qualname
            or any(not part.isidentifier() for part in qualname.split("."))
            or any(not part.isidentifier() for part in module.split("."))
        ):
            raise FixConfigError(
                f"target {self.path!r}: expected 'package.module:Name' or 'package.module:Class.method'"
            )

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.path.partition(":")[2]

    def describe(self) -> str:
        return f"{self.path} ({self.note})" if self.note else self.path


def parse_target(value: Any, where: str, note: str = "") -> Target:
    """A target named in a ``--config`` file; ``where`` locates it in the message."""
    if not isinstance(value, str):
        raise FixConfigError(f"{where}: expected 'package.module:Name', got {value!r}")
    try:
        return Target(value.strip(), note)
    except FixConfigError as e:
        raise FixConfigError(f"{where}: {e.message}") from None


def parse_targets(section: Mapping[str, Any], key: str) -> list[str]:
    """The ``module:function`` paths under ``key`` of a ``--config`` section: one string or a list
    (none when the key is absent)."""
    value = section.get(key, [])
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list):
        raise FixConfigError(f"{key}: expected 'module:function' or a list of them, got {value!r}")
    return [parse_target(v, f"{key}[{i}]").path for i, v in enumerate(value)]


@dataclass(frozen=True)
class Fix:
    """One fix module, as the registry lists it.

    ``install(runtime)`` runs in every worker of a job started with the fix named; it patches its
    targets through ``runtime.patch`` and reports its numerical checks through ``runtime.check``.
    ``parse_config(section)`` validates the fix's section of ``--config`` and returns it normalized
    (plain JSON types); it raises ``FixConfigError`` with the offending key."""

    name: str
    patterns: tuple[str, ...]
    summary: str
    mechanism: str
    risk: str
    cost: str
    check: str
    targets: tuple[Target, ...]
    install: Callable[[FixRuntime], None]
    parse_config: Callable[[Mapping[str, Any]], dict] = field(default=lambda section: _no_config(section))
    config_help: str = ""
    #: Code the fix reaches without a target: what ``moedoctor analyze`` finds for it by structure
    #: and writes into the report's ``fix_config`` (empty: the targets and ``--config`` only).
    by_structure: str = ""

    def all_targets(self, config: Mapping[str, Any]) -> tuple[Target, ...]:
        """The built-in targets plus those named in this fix's (normalized) config section."""
        extra = tuple(Target(path, "from --config") for path in config.get("targets", ()))
        return self.targets + tuple(t for t in extra if t not in self.targets)


def _no_config(section: Mapping[str, Any]) -> dict:
    if section:
        raise FixConfigError(f"takes no settings, got {sorted(section)}")
    return {}
