"""PLACEHOLDER: being written."""
from moedoctor.fixes.base import Fix


def _install(runtime) -> None:
    raise NotImplementedError("expert-zero-term is being written")


FIX = Fix(name="expert-zero-term", patterns=(), summary="(being written)", mechanism="", risk="", cost="", check="",
          targets=(), install=_install)
