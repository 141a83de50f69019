"""PLACEHOLDER: being written."""
from moedoctor.fixes.base import Fix


def _install(runtime) -> None:
    raise NotImplementedError("key-manifest-checkpoint is being written")


FIX = Fix(name="key-manifest-checkpoint", patterns=(), summary="(being written)", mechanism="", risk="", cost="", check="",
          targets=(), install=_install)
