"""How moedoctor's commands print their help, beside typer's defaults: the ``--help`` flag shows no
``<bool>`` placeholder (a flag takes no value), and the usage line names a required argument as
``PATH``, not ``{PATH}``."""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup


def _plain_help(option: Any) -> Any:
    if option is not None:
        option.metavar = ""
    return option


class Command(TyperCommand):
    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help(super().get_help_option(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [_plain_metavar(p) for p in pieces]


def _plain_metavar(piece: str) -> str:
    """``{PATH}`` -> ``PATH``, ``{PATH}...`` (several) -> ``PATH...``."""
    many = piece.endswith("}...")
    core = piece[:-3] if many else piece
    if core.startswith("{") and core.endswith("}"):
        return core[1:-1] + ("..." if many else "")
    return piece


class Group(TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help(super().get_help_option(ctx))
