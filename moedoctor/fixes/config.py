"""``--config FILE``: where the fixes find the user's code. YAML, one section per fix name::

    expert-dense:
      blocks:
        - class: mypkg.model:MyMoeBlock
    skip-step-collectively:
      decision: mypkg.train:grad_norm_is_nonfinite

Loaded with ``yaml.safe_load``; each section is validated by its fix, so an error names the file,
the fix and the key. Sections for fixes that are not being applied are validated too (a typo should
not wait for the day that fix is used).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from moedoctor.errors import MoedoctorError
from moedoctor.layout import RunDir
from moedoctor.fixes.base import Fix, FixConfigError


def load_fix_config(path: Path, fixes: Iterable[Fix]) -> dict[str, dict]:
    """``{fix name: normalized section}`` for every section of ``path``."""
    known = {fix.name: fix for fix in fixes}
    try:
        data: Any = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise MoedoctorError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MoedoctorError(f"--config {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return validate_fix_config(data, known.values(), f"--config {path}")


def validate_fix_config(data: Any, fixes: Iterable[Fix], where: str) -> dict[str, dict]:
    """``{fix name: normalized section}`` from a mapping read from ``where`` (a ``--config`` file, or
    the settings ``moedoctor analyze`` derived into report.json)."""
    known = {fix.name: fix for fix in fixes}
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MoedoctorError(f"{where}: expected a mapping of fix names to settings, got a {type(data).__name__}")
    config: dict[str, dict] = {}
    for name, section in data.items():
        fix = known.get(name)
        if fix is None:
            raise MoedoctorError(f"{where}: unknown fix {name!r}; sections are fix names: {', '.join(known)}")
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise MoedoctorError(f"{where}: {name}: expected a mapping, got {section!r}")
        try:
            config[name] = fix.parse_config(section)
        except FixConfigError as e:
            raise MoedoctorError(f"{where}: {name}: {e.message}") from None
    return config


def write_fix_config(run_dir: Path, config: dict[str, dict]) -> Path | None:
    """Save a loaded config where the workers read it (``MOEDOCTOR_FIX_CONFIG``); None if empty."""
    if not config:
        return None
    path = RunDir(Path(run_dir).resolve()).fix_config
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return path
