"""The collective ops moedoctor hooks, their normalized names and where their arguments are.

Argument positions are read from each op's schema once, so the hot path indexes a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moedoctor.trace.op_names import C10D_OPS, FUNCTIONAL_OPS

#: The dispatcher ops moedoctor hooks, under their canonical names (``moedoctor.trace.op_names``:
#: the one table of op names the recorder, the Flight Recorder reader, the analysis and the fixes share).
__all__ = ["C10D_OPS", "FUNCTIONAL_OPS", "OpSpec", "all_specs", "op_spec"]

_INPUT_ARGS = ("input_tensors", "input_tensor", "input", "inputs", "tensors", "tensor", "self")
_OUTPUT_ARGS = ("output_tensors", "output_tensor", "outputs", "out", "output")
_GROUP_ARGS = ("process_group", "group_name")
_PEER_ARGS = ("dst", "dstRank", "src", "srcRank")
_ROOT_ARGS = ("root_rank", "rootRank", "dst", "src")


@dataclass(frozen=True, slots=True)
class OpSpec:
    """Where one op keeps the values moedoctor records (indexes into its positional arguments)."""

    namespace: str
    raw_name: str
    op: str
    packet: object
    inputs: int | None
    outputs: int | None
    group: int
    reduce_op: int | None
    async_op: int | None
    peer: int | None
    arg_names: tuple[str, ...]
    root: int | None = None  # rooted ops (broadcast, reduce, gather, scatter): the root's group rank
    in_splits: int | None = None  # all_to_all_single: rows sent to each member
    out_splits: int | None = None  # all_to_all_single: rows received from each member

    #: The op's and the dispatcher op's names as JSON text, for the record.
    op_json: str = field(init=False)
    qualified_json: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "op_json", f'"{self.op}"')
        object.__setattr__(self, "qualified_json", f'"{self.qualified}"')

    @property
    def qualified(self) -> str:
        return f"{self.namespace}::{self.raw_name}"


def _first(names: list[str], wanted: tuple[str, ...]) -> int | None:
    for name in wanted:
        if name in names:
            return names.index(name)
    return None


def op_spec(namespace: str, raw_name: str, normalized: str) -> OpSpec | None:
    """The spec of one op, or None where this torch build does not have it."""
    packet = getattr(getattr(torch.ops, namespace), raw_name, None)
    if packet is None:
        return None
    try:
        overload = packet.default
    except AttributeError:
        return None
    names = [a.name for a in overload._schema.arguments]
    group = _first(names, _GROUP_ARGS)
    if group is None:
        return None
    p2p = normalized in ("send", "recv")
    return OpSpec(
        namespace=namespace,
        raw_name=raw_name,
        op=normalized,
        packet=overload,
        inputs=_first(names, _INPUT_ARGS),
        outputs=_first(names, _OUTPUT_ARGS),
        group=group,
        reduce_op=_first(names, ("reduce_op",)),
        async_op=_first(names, ("async_op",)),
        peer=_first(names, _PEER_ARGS) if p2p else None,
        arg_names=tuple(names),
        root=None if p2p else _first(names, _ROOT_ARGS),
        in_splits=_first(names, ("input_split_sizes",)),
        out_splits=_first(names, ("output_split_sizes",)),
    )


def all_specs() -> list[OpSpec]:
    specs = [op_spec("c10d", raw, norm) for raw, norm in C10D_OPS.items()]
    specs += [op_spec("_c10d_functional", raw, norm) for raw, norm in FUNCTIONAL_OPS.items()]
    return [s for s in specs if s is not None]
