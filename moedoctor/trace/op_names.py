"""Every name a collective goes by, and the one moedoctor compares: ``canonical_op``.

One op reaches moedoctor under several names, and which one depends on the backend, the torch
version and the API the job used: a list ``dist.all_gather`` is ``c10d::allgather_`` at the
dispatcher and ``nccl:all_gather`` in the Flight Recorder, while FSDP2's gather is
``dist.all_gather_into_tensor`` (torch <= 2.12), ``dist.all_gather_single`` (2.13),
``c10d::_allgather_base_`` at the dispatcher and ``nccl:_allgather_base`` or
``nccl:all_gather_into_tensor`` in the Flight Recorder. The recorder (dispatcher names), the Flight
Recorder reader (profiling names), the analysis and the fixes (Python API names) all map them here,
so a name one backend lowers differently cannot make two ranks, two runs or a forward and its
recompute disagree. The vocabulary is ``moedoctor.events.COLLECTIVE_OPS | P2P_OPS``.

A leaf: no torch, nothing of moedoctor but ``events``.
"""

from __future__ import annotations

from moedoctor.events import COLLECTIVE_OPS, P2P_OPS

#: c10d dispatcher ops (``torch.ops.c10d``: what ``torch.distributed`` and C++ callers such as the
#: DDP reducer dispatch to).
C10D_OPS: dict[str, str] = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather_coalesced",
    "allgather_into_tensor_coalesced_": "all_gather_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_coalesced",
    "broadcast_": "broadcast",
    "barrier": "barrier",
    "monitored_barrier_": "monitored_barrier",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}

#: Functional collectives at the dispatcher (``torch.ops._c10d_functional``: DTensor redistribution,
#: FSDP2 helpers, clip_grad_norm_ on DTensors).
FUNCTIONAL_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced_": "all_reduce_coalesced",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}

#: Flight Recorder profiling-name bases (after ``nccl:`` / ``gloo:``), lowercased, that differ from
#: the canonical names. Covers the names torchfrtrace knows (``flight_recorder/components/types.py``).
PROFILING_NAMES: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "all_reduce_barrier": "barrier",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_v": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_v": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_to_all_v_single": "all_to_all",
    "_broadcast_oop": "broadcast",
    "_reduce_oop": "reduce",
    "recvanysource": "recv",
    "recv_any_source": "recv",
}

#: ``torch.distributed`` functions (and ``torch.distributed._functional_collectives``'s) that issue
#: one collective, under the canonical name of what they issue. The list and the tensor forms of a
#: gather or reduce-scatter are one op: they move the same bytes, and a backend may lower either
#: one to the other (NCCL runs an equal-size list ``all_gather`` as one flat all-gather).
PYTHON_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_tensor": "all_gather",  # functional
    "all_gather_tensor_autograd": "all_gather",
    "all_gather_coalesced": "all_gather_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "broadcast": "broadcast",
    "_broadcast_coalesced": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
}

#: Every known name -> canonical; where two tables spell one name, they agree (a unit test checks).
_ALL: dict[str, str] = {**C10D_OPS, **FUNCTIONAL_OPS, **PROFILING_NAMES, **PYTHON_OPS}
CANONICAL_OPS = COLLECTIVE_OPS | P2P_OPS


def canonical_op(name: str) -> str | None:
    """The canonical name of ``name`` in any of its spellings, None when it names no known collective.

    Accepts a dispatcher name with or without namespace and overload (``c10d::_allgather_base_``,
    ``_c10d_functional.all_gather_into_tensor.default``), a profiling name with or without backend
    prefix or peer (``nccl:all_gather_into_tensor``, ``nccl:send 0->1``), a Python API name
    (``all_gather_single``), or a canonical name (returned as is)."""
    text = name.strip()
    if "::" in text:
        text = text.split("::", 1)[1]
    elif ":" in text:
        text = text.split(":", 1)[1]
    text = text.strip().split()[0] if text.strip() else ""
    for prefix in ("torch.ops.", "c10d.", "_c10d_functional.", "c10d_functional."):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    for overload in (".default", ".out"):
        if text.endswith(overload):
            text = text[: -len(overload)]
    text = text.lower()
    if text in CANONICAL_OPS:
        return text
    found = _ALL.get(text)
    if found is None and text.endswith("_"):
        found = _ALL.get(text[:-1])
    return found
