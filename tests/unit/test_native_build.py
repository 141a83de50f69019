"""The native recorder is built per environment (issue 12): its build folder in torch's extension
cache is keyed by the environment (``sys.prefix``), torch's and the source's install locations and
the versions, so two environments never share one and overwrite each other's build; whenever a
build runs, stderr says so. The real two-environment builds (about 2 x 40 s) are ``heavy``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moedoctor.recorder import native

REPO = Path(__file__).resolve().parents[2]
BUILDING = "moedoctor: building the native recorder for this environment (first run, ~40 s)..."
KEY = dict(prefix="/envs/a", torch_dir="/envs/a/lib/python3.11/site-packages/torch",
           source_path="/src/moedoctor/recorder/native/kernel.cpp", torch_version="2.13.0", python_version="3.11.7")


def test_the_build_key_names_the_environment_and_what_the_build_depends_on():
    name = native.build_key(b"source", **KEY)
    assert name.isidentifier() and name.startswith("moedoctor_native_")
    assert native.build_key(b"source", **KEY) == name
    for key, other in (("prefix", "/envs/b"), ("torch_dir", "/envs/b/lib/python3.11/site-packages/torch"),
                       ("source_path", "/other-clone/moedoctor/recorder/native/kernel.cpp"),
                       ("torch_version", "2.12.0"), ("python_version", "3.11.8")):
        assert native.build_key(b"source", **{**KEY, key: other}) != name, key
    assert native.build_key(b"source 2", **KEY) != name


def make_venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages (the same torch and Python), made by
    ``ci/make_venv.py`` (as README's ``.venv-tf4``): ``--system-site-packages`` alone would see the
    base interpreter's packages when this one is itself a venv, without torch."""
    subprocess.run([sys.executable, str(REPO / "ci" / "make_venv.py"), str(path)], check=True, capture_output=True,
                   timeout=120)
    return path / "bin" / "python"


def in_python(python: Path | str, code: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(REPO), **env)
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600, env=environment,
                          cwd=REPO)


def test_two_environments_with_the_same_torch_get_two_build_folders(tmp_path):
    venv = make_venv(tmp_path / "venv")
    code = "from moedoctor.recorder import native; import torch; print(native.extension_name(), torch.__file__)"
    here, there = in_python(sys.executable, code), in_python(venv, code)
    assert here.returncode == 0 and there.returncode == 0, here.stderr[-2000:] + there.stderr[-2000:]
    (name_here, torch_here), (name_there, torch_there) = here.stdout.split(), there.stdout.split()
    assert torch_here == torch_there  # the very same torch
    assert name_here != name_there


def test_a_build_is_announced_and_a_cached_one_is_not(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    loads = []

    def fake_load(name, **kwargs):  # ninja: build the library where it is missing, else load it
        library = tmp_path / name / f"{name}.so"
        if not library.exists():
            loads.append(name)
            library.write_bytes(b"")
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    said: list[str] = []
    assert native._build(said.append) == "module"
    assert [f"moedoctor: {m}" for m in said[:1]] == [BUILDING]
    assert said[1].startswith("native recorder built for this environment in ")
    said.clear()
    assert native._build(said.append) == "module" and said == []  # cached: loaded, nothing said
    assert len(loads) == 1


@pytest.mark.heavy
def test_two_environments_build_once_each_and_never_rebuild_each_other(tmp_path):
    """Real builds into an empty extension cache: the venv builds (and says so), this interpreter
    builds its own (and says so), and the venv then loads its build as it left it."""
    venv = make_venv(tmp_path / "venv")
    cache = tmp_path / "torch_extensions"
    code = ("from moedoctor.recorder import native; ok = native.available(); "
            "print(ok, native.extension_name(), native.reason[-300:])")
    first = in_python(venv, code, TORCH_EXTENSIONS_DIR=str(cache))
    assert first.stdout.startswith("True"), first.stdout + first.stderr[-2000:]
    assert first.stderr.count(BUILDING) == 1
    venv_name = first.stdout.split()[1]
    library = cache / venv_name / f"{venv_name}.so"
    built_at = library.stat().st_mtime_ns
    second = in_python(sys.executable, code, TORCH_EXTENSIONS_DIR=str(cache))
    assert second.stdout.startswith("True") and second.stderr.count(BUILDING) == 1, second.stderr[-2000:]
    assert second.stdout.split()[1] != venv_name
    third = in_python(venv, code, TORCH_EXTENSIONS_DIR=str(cache))
    assert third.stdout.startswith("True") and "native recorder" not in third.stderr, third.stderr[-2000:]
    assert library.stat().st_mtime_ns == built_at


def test_the_kernel_writes_every_key_from_the_header_the_schema_generates():
    """``kernel.cpp`` spells no record key itself: each comes from a macro of ``moedoctor_schema.h``
    (``schema.cpp_header``), so a key renamed in the schema is renamed in the C++ writer, and a key the
    kernel writes that the schema dropped is an undefined macro: the build fails and the Python
    kernels record (``available()`` is False, ``reason`` says why)."""
    import re

    from moedoctor.trace import schema

    source = (REPO / "moedoctor" / "recorder" / "native" / "kernel.cpp").read_text()
    code = "\n".join(line.split("//")[0] for line in source.splitlines())  # comments may quote records
    assert not re.findall(r'\\"[A-Za-z_]+\\":', code), "a key spelled in kernel.cpp, not taken from the header"
    header = schema.cpp_header()
    defined = set(re.findall(r"^#define (MDK_\w+) ", header, flags=re.M))
    used = set(re.findall(r"\bMDK_\w+", code))
    assert used and used <= defined, sorted(used - defined)
    assert '#define MDK_COLLECTIVE_P2P_SEQ ",\\"pseq\\":"' in header
    assert '#define MDK_COLLECTIVE_KIND "{\\"k\\":\\"c\\""' in header
    assert all(schema.cpp_macro(r, k.key) in defined for r in schema.CPP_NAMES.values() for k in r.keys)


def test_the_build_name_digests_the_schema_header(monkeypatch):
    """A schema change is a new build of the kernel (its name digests the generated header)."""
    name = native.extension_name()
    header = native._schema_header()
    monkeypatch.setattr(native, "_schema_header", lambda: header.replace('\\"seq\\"', '\\"sq\\"'))
    assert native.extension_name() != name


def test_the_header_is_written_once_per_text(tmp_path):
    include = native._write_schema_header(tmp_path)
    header = include / "moedoctor_schema.h"
    assert header.read_text() == native._schema_header()
    mtime = header.stat().st_mtime_ns
    os.utime(header, ns=(mtime - 10**9, mtime - 10**9))
    native._write_schema_header(tmp_path)  # same text: untouched (ninja rebuilds on a newer header)
    assert header.stat().st_mtime_ns == mtime - 10**9
