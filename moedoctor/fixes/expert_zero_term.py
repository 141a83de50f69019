"""``expert-zero-term`` (pattern ``inactive-experts``): idle experts join the graph with zero gradients.

Mechanism: the cheaper variant of ``expert-dense``. The block's original sparse forward runs
unchanged; forward pre-hooks on its experts note which of them ran during the call. Each expert that
did not run is then called on an empty slice of the block input (zero tokens) and
``expert(x[:0]).sum() * -0.0`` is added to the block output. Its parameters are in the autograd graph
on every rank and get zero gradients, so FSDP2 reduce-scatters the same gradients everywhere. The
output is bitwise the sparse output: adding -0.0 leaves every float as it is (-0.0 and NaN included;
adding +0.0 would turn -0.0 into +0.0).

Targets: the ``modulelist`` blocks of ``expert-dense`` (moedoctor's fixture block, transformers 4.x
``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``) and ``--config``
``blocks:`` of kind ``modulelist``. transformers 5.x fused experts are not targets; they are watched
only so that their status says why they are left alone ("not needed: fused experts are one
parameter": an idle expert only leaves a zero slice of a gradient that exists on every rank).

Refusal: when an expert is its own FSDP2 unit (``fully_shard`` per expert, torchtitan style; FSDP1 or
ZeRO-3 likewise), calling an idle expert after the sparse loop all-gathers it at a different point
than the ranks that ran it, which is a new desync. The fix then says so on stderr and in its status
and leaves the block's behaviour unchanged: use ``expert-dense``, which runs every expert in the same
order on every rank.

Check (``moedoctor verify``): on the first 2 calls of each block per rank that add a zero term, the
output with the zero term must be bitwise the sparse output (compared as integers). A block whose
first call had no idle expert records "not checked" until one has.

Cost: one call on an empty input per idle expert per forward, and its backward: a few kernel launches,
no FLOPs to speak of, no activation memory; plus a forward pre-hook per expert. Measured (CPU, one
thread, median forward+backward of one block, one expert idle): fixture block (4 experts, top-2, 32
tokens, hidden 16) 1.07 ms sparse, 1.35 ms with the zero term; 16 experts, top-2, 1024 tokens,
hidden 256, intermediate 512: 59 ms and 60 ms.

Structural mode (``lists: auto``, ``moedoctor/fixes/_member_lists.py``): no class is patched. Every
module list of two or more same-class members with parameters is watched through torch's global
module hooks; idle members are called on empty inputs in index order (before a higher-numbered member
runs, and after the owner's forward for the rest), so every member runs once per owner forward in
one order on every rank, experts that are their own FSDP2 units included; the zero term is added to
the owner's output. Its check: per owner forward, every member ran once, in index order (a job's
loop that calls members twice or out of order fails it). The report writes ``lists: auto`` when the
seeds' classes are not what the job ran.

Risk: the block must call its experts through ``module(...)``: an expert called as ``expert.forward``
is not seen by the hooks and gets a (harmless) zero term as well. The hooks stay on the experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moedoctor.fixes._moe_blocks import (
    CHECKED_CALLS,
    FUSED,
    MODULELIST,
    BlockSpec,
    PerInstance,
    builtin_targets,
    check_forward_signature,
    first_tensor,
    modulelist_problem,
    parse_blocks_config,
    require_transformers4,
    sharded_experts_reason,
    specs_for,
    with_first_tensor,
)
from moedoctor.fixes.base import Fix, FixConfigError
from moedoctor.layout import REPORT

NAME = "expert-zero-term"
CHECK = "output bitwise equal to sparse"
#: What the idle experts' sum is multiplied by: -0.0, because x + (-0.0) is x for every float (x + 0.0
#: would turn a -0.0 output into +0.0, which the check sees).
_ZERO = -0.0
NOT_NEEDED = "not needed: fused experts are one parameter"


def _parse_config(section: Mapping[str, Any]) -> dict:
    section = dict(section)
    lists = section.pop("lists", None)
    if lists not in (None, "auto"):
        raise FixConfigError(f"lists: expected 'auto' (every module list of same-class members), got {lists!r}")
    parsed = parse_blocks_config(section, NAME, kinds=(MODULELIST,))
    return {**parsed, "lists": "auto"} if lists else parsed


def _install(runtime) -> None:
    if runtime.config.get("lists") == "auto":
        # No class to patch: torch's global module hooks watch every module list (_member_lists).
        from moedoctor.fixes._member_lists import TARGET, MemberLists
        from moedoctor.fixes.runtime import TargetState

        state = runtime.targets.setdefault(TARGET, TargetState(TARGET, "lists: auto"))
        MemberLists(runtime, state).install()
        return
    # The fused transformers 5 classes are watched too, only to say why they are left alone.
    for spec in specs_for(runtime.config):
        runtime.patch(spec.target, _replacer(runtime, spec))


def _replacer(runtime, spec: BlockSpec):
    def replace(original, owner):
        if spec.kind == FUSED:
            raise RuntimeError(NOT_NEEDED)
        require_transformers4(spec, NOT_NEEDED)
        check_forward_signature(original, ("hidden_states",))
        return _zero_term_forward(runtime, spec, original)

    return replace


class _ExpertsRun:
    """Which experts of one block ran during its current call (forward pre-hooks, set once)."""

    def __init__(self, block: Any, spec: BlockSpec) -> None:
        self.problem = modulelist_problem(block, spec, routing=False)
        self.ran: set[int] = set()
        self.checked = 0
        self.reported_nothing_to_check = False
        self.reported_refusal = False
        if self.problem is None:
            for index, expert in enumerate(getattr(block, spec.experts)):
                expert.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def ran(_module, _args):
            self.ran.add(index)

        return ran


def _zero_term_forward(runtime, spec: BlockSpec, original):
    runs = PerInstance(lambda block: _ExpertsRun(block, spec))

    def forward(self, hidden_states):
        import torch

        run = runs(self)
        name = type(self).__name__
        if run.problem is not None:
            runtime.note(f"not applied to {name}: {run.problem}; its original sparse forward runs")
            return original(self, hidden_states)
        experts = getattr(self, spec.experts)
        refusal = sharded_experts_reason(experts)
        if refusal is not None:
            runtime.note(
                f"REFUSED on {name}: {refusal}. Running an idle expert after the sparse loop would "
                "all-gather it at a different point than on the ranks that ran it (a new desync), so the "
                "block is left as it was (sparse: an idle expert still desyncs the ranks). Use expert-dense."
            )
            if runtime.checks_enabled and not run.reported_refusal:
                run.reported_refusal = True
                runtime.check(CHECK, None, f"{name}: refused ({refusal})")
            return original(self, hidden_states)
        run.ran.clear()
        output = original(self, hidden_states)
        idle = [index for index in range(len(experts)) if index not in run.ran]
        if not torch.is_grad_enabled():
            return output
        if not idle:
            if runtime.checks_enabled and not run.reported_nothing_to_check:
                run.reported_nothing_to_check = True
                runtime.check(CHECK, None, f"{name}: not checked yet: no call so far had an idle expert")
            return output
        empty = _no_tokens(hidden_states)
        zero = sum(experts[index](empty).sum() for index in idle) * _ZERO
        hidden = first_tensor(output)
        fixed = hidden + zero.to(hidden.dtype)
        if runtime.checks_enabled and run.checked < CHECKED_CALLS:
            run.checked += 1
            _check_bitwise(runtime, name, hidden, fixed, idle)
        return with_first_tensor(output, fixed)

    return forward


def _no_tokens(hidden_states: Any) -> Any:
    """The block input cut to zero tokens: what an idle expert runs on."""
    return hidden_states.detach().reshape(-1, hidden_states.shape[-1])[:0]


_SAME_WIDTH_INT = {
    "torch.float64": "int64",
    "torch.float32": "int32",
    "torch.float16": "int16",
    "torch.bfloat16": "int16",
}


def _check_bitwise(runtime, name: str, sparse: Any, fixed: Any, idle: list[int]) -> None:
    import torch

    with torch.no_grad():
        as_int = _SAME_WIDTH_INT.get(str(sparse.dtype))
        if as_int is None:
            same = torch.equal(sparse, fixed)
        else:
            same = torch.equal(sparse.view(getattr(torch, as_int)), fixed.view(getattr(torch, as_int)))
    runtime.check(
        CHECK,
        same,
        f"{name}: zero term for idle expert(s) {idle}: output "
        f"{'bitwise unchanged' if same else 'CHANGED'} ({sparse.numel()} values)",
        worst=0.0 if same else float((fixed.detach().double() - sparse.detach().double()).abs().max()),
    )


FIX = Fix(
    name=NAME,
    patterns=("inactive-experts",),
    summary="keep idle experts in the graph with a zero-weighted empty-input term (output bitwise unchanged)",
    mechanism="Wraps the MoE block's forward: the sparse loop runs as before; every expert that got no token "
    "is called on an empty slice of the input and sum() * -0.0 of it is added to the output, so its "
    "parameters get zero gradients on every rank and FSDP2 reduces the same tensors everywhere.",
    risk="Refused (behaviour unchanged, a loud note) when experts are their own FSDP2 units: an idle expert run "
    "late would all-gather out of order; use expert-dense there. Not needed for fused (transformers 5) experts.",
    cost="one empty-input expert call (and its backward) per idle expert per forward",
    check="first 2 calls per block and rank that add a zero term: the output must be bitwise the sparse output",
    targets=builtin_targets(kinds=(MODULELIST,)),
    install=_install,
    by_structure="any module list of same-class experts (lists: auto; no class needed)",
    parse_config=_parse_config,
    config_help="blocks: [{class: 'module:Class', experts: experts}] (modulelist blocks only); or lists: auto "
    "(no class: every module list of same-class members runs whole, in index order, per forward of "
    f"its owner; written by `moedoctor analyze` into {REPORT} for MoE code it has no class for)",
)
