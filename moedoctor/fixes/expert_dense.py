"""PLACEHOLDER: being written."""
from moedoctor.fixes.base import Fix


def _install(runtime) -> None:
    raise NotImplementedError("expert-dense is being written")


FIX = Fix(name="expert-dense", patterns=(), summary="(being written)", mechanism="", risk="", cost="", check="",
          targets=(), install=_install)
