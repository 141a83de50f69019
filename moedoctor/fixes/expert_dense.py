"""``expert-dense`` (pattern ``inactive-experts``): every expert runs on every token, every step.

Mechanism: the sparse MoE loop (``for expert_idx in expert_hit``) runs only the experts that received
tokens, so an expert nobody routed to on one rank is missing from that rank's autograd graph: its
parameters get no gradient there, and FSDP2 reduce-scatters a different set of gradients (seed 002:
Qwen3-30B-A3B under FSDP2 hangs or aborts in ``loss.backward()``). The replacement forward routes
exactly as before, then runs every expert on all tokens and weights each token's output by its
routing weight, zero where the token was not routed. The output is the sparse output (the zero
terms add exact zeros; a matmul over all tokens may round differently from one over a subset, ~1e-7
in fp32), routed experts get the same gradients, unrouted ones get zero gradients, and the graph,
hence every collective FSDP2 issues for it, is the same on every rank. With experts as FSDP2 units
of their own, every expert is all-gathered, in the same order, on every rank. Under non-reentrant
activation checkpointing (pattern ``checkpoint-recompute-mismatch``) the block saves the same tensors,
of the same shapes, in forward and recompute whatever the routing, so a recompute that routes
differently (routing state changed by the forward) no longer makes ``torch.utils.checkpoint`` raise.

Targets (the ``forward`` of each; more with ``--config``, ``blocks:``):

* ``modulelist`` blocks, experts in an ``nn.ModuleList``, ``forward(hidden_states) -> (hidden_states,
  router_logits)``: moedoctor's fixture block (routing from its ``route`` method) and transformers
  4.x ``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock`` (routing from
  ``self.gate`` as transformers 4.53 does it: softmax in float, top-k, renormalized when
  ``norm_topk_prob``; Mixtral's router jitter reproduced). Under transformers 5 those classes are
  refused ("not patched"): their experts are fused.
* ``fused`` transformers 5.x experts (``Qwen3MoeExperts`` and the 53 other classes with the same
  ``forward`` and parameter layout, ``_moe_blocks.TRANSFORMERS5_FUSED_EXPERTS``): ``forward(hidden_states,
  top_k_index, top_k_weights)`` loops over all experts with dense weights. The patch replaces the
  ``@use_experts_implementation`` dispatcher, so ``grouped_mm``/``batched_mm``/kernels are bypassed
  while the fix is on. FSDP2 alone does not desync on fused experts (one parameter: an idle expert
  only leaves a zero slice of a gradient that exists everywhere); the patch makes the computation
  itself rank-independent. Instances with another layout (bias, transposed weights, no gate, post-
  expert norm, expert parallel) are left alone at their first call, with a note.

Check (``moedoctor verify``): on the first 2 calls of each block or experts instance per rank, and on
its first 2 calls where an expert got no token (the calls the fix is for), the original sparse
forward runs after the dense one, under ``torch.no_grad()``, on a copy of the input and with the
random generators replayed and then restored (it sees Mixtral's router jitter as the dense forward
did, and takes no random numbers from the job). The outputs must agree within a tolerance for the
dtype (fp32: rtol 1e-4, atol 1e-5; bf16: rtol 2e-2, atol 1e-2); the largest difference is reported.
The check proves the fix only on a forward where an expert got no token: where no checked call of a
rank had one, it also compares the first token of a checked call alone (every expert outside that
token's top-k gets none), and where even that has no idle expert (top-k = all experts) the check
fails at the job's end, "not shown".
Not checked when the experts are their own FSDP2 (or FSDP1, ZeRO-3) units: the sparse forward would
all-gather only the experts this rank routes to, a collective its peers do not issue.

Cost: about num_experts / top_k times the expert FLOPs and the experts' activation memory (every
expert sees every token; 64 experts, top-8: 8x). Measured (CPU, one thread, median forward+backward
of one block, one expert idle): fixture block (4 experts, top-2, 32 tokens, hidden 16) 1.07 ms
sparse, 1.05 ms dense (overheads dominate); 8 experts, top-2, 1024 tokens, hidden 256, intermediate
512: 55 ms sparse, 199 ms dense (3.6x); 16 experts: 59 ms, 385 ms (6.5x). Fused 5.x experts also lose
``grouped_mm``: Qwen3MoeExperts, 16 experts, same sizes: 63 ms grouped_mm, 107 ms eager, 469 ms
dense. Fine for small models and debug runs, for verifying a diagnosis, or where experts are few;
with many experts prefer ``expert-zero-term`` (modulelist blocks) or fused experts.

Risk: none to the numbers beyond the check's tolerance, except that 0 x inf = NaN: an expert whose
output overflows on a token it was not routed to now poisons that token. Memory may run out. The
check runs the sparse forward a second time: a block with side effects in forward (counters, an
auxiliary loss kept on the module) sees them twice on checked calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moedoctor.fixes._moe_blocks import (
    CHECKED_CALLS,
    FIXTURE_BLOCK,
    FUSED,
    BlockSpec,
    PerInstance,
    apply_router_jitter,
    builtin_targets,
    check_forward_signature,
    compare,
    dense_weights,
    first_tensor,
    fused_problem,
    idle_experts,
    modulelist_problem,
    parse_blocks_config,
    replayed_rng,
    require_transformers4,
    rng_state,
    route_tokens,
    sharded_experts_reason,
    specs_for,
)
from moedoctor.fixes.base import Fix

NAME = "expert-dense"
CHECK = "dense output equals sparse"
FIXTURE_SPEC = BlockSpec(FIXTURE_BLOCK, route="route")


def _parse_config(section: Mapping[str, Any]) -> dict:
    return parse_blocks_config(section, NAME)


# -- the dense forwards ------------------------------------------------------------------------------


def dense_block_forward(block: Any, hidden_states: Any, spec: BlockSpec = FIXTURE_SPEC) -> tuple[Any, Any]:
    """A modulelist block's forward with every expert run on every token, unrouted tokens weighted
    by zero; returns ``(hidden_states, router_logits)`` like the sparse loop."""
    out, router_logits, _selected = _dense_block(block, hidden_states, spec)
    return out, router_logits


def _dense_block(block: Any, hidden_states: Any, spec: BlockSpec) -> tuple[Any, Any, Any]:
    import torch

    experts = getattr(block, spec.experts)
    hidden_dim = hidden_states.shape[-1]
    apply_router_jitter(block, hidden_states, spec)
    flat = hidden_states.view(-1, hidden_dim)
    router_logits, routing_weights, selected_experts = route_tokens(block, flat, spec)
    weights = dense_weights(selected_experts, routing_weights, len(experts))
    out = torch.zeros_like(flat)
    for index, expert in enumerate(experts):  # the sparse loop's order: each token sums the same terms
        out = out + (expert(flat) * weights[:, index, None]).to(flat.dtype)
    if spec.shared_expert:  # after the routed sum, as Qwen2-MoE's block adds it
        out = out + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return out.view(hidden_states.shape), router_logits, selected_experts


def expert_dense_forward(self: Any, hidden_states: Any) -> tuple[Any, Any]:
    """``Block.forward = expert_dense_forward`` for blocks routed by a ``route`` method (moedoctor's
    fixture ``TinyMoeSparseMoeBlock``)."""
    return dense_block_forward(self, hidden_states, FIXTURE_SPEC)


def dense_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """A transformers 5.x fused experts ``forward`` looping over all experts with dense weights."""
    import torch
    import torch.nn.functional as F

    weights = dense_weights(top_k_index, top_k_weights, self.num_experts)
    out = torch.zeros_like(hidden_states)
    for index in range(self.num_experts):
        gate, up = F.linear(hidden_states, self.gate_up_proj[index]).chunk(2, dim=-1)
        current = F.linear(self.act_fn(gate) * up, self.down_proj[index])
        out = out + (current * weights[:, index, None]).to(out.dtype)
    return out


# -- installing ---------------------------------------------------------------------------------------


def _install(runtime) -> None:
    checks = _DenseChecks(runtime) if runtime.checks_enabled else None
    for spec in specs_for(runtime.config):
        runtime.patch(spec.target, _replacer(runtime, spec, checks))


def _replacer(runtime, spec: BlockSpec, checks: _DenseChecks | None):
    def replace(original, owner):
        if spec.kind == FUSED:
            check_forward_signature(original, ("hidden_states", "top_k_index", "top_k_weights"))
            apply_gate = getattr(owner, "_apply_gate", None)
            if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
                raise TypeError(f"{owner.__name__} has its own _apply_gate; the dense loop computes act_fn(gate) * up")
            return _fused_forward(runtime, original, checks)
        require_transformers4(spec, "expert-dense patches their fused experts class instead")
        check_forward_signature(original, ("hidden_states",))
        return _block_forward(runtime, spec, original, checks)

    return replace


def _block_forward(runtime, spec: BlockSpec, original, checks: _DenseChecks | None):
    problems = PerInstance(lambda block: modulelist_problem(block, spec))

    def forward(self, hidden_states):
        problem = problems(self)
        if problem is not None:
            runtime.note(f"not applied to {type(self).__name__}: {problem}; its original sparse forward runs")
            return original(self, hidden_states)
        if checks is not None and checks.wanted(self):
            return checks.block(self, hidden_states, original, spec)
        return dense_block_forward(self, hidden_states, spec)

    return forward


def _fused_forward(runtime, original, checks: _DenseChecks | None):
    layouts = PerInstance(lambda experts: [])  # [its problem or None], found at its first call

    def forward(self, hidden_states, top_k_index, top_k_weights):
        layout = layouts(self)
        if not layout:
            layout.append(fused_problem(self, hidden_states))
        problem = layout[0]
        if problem is not None:
            runtime.note(f"not applied to {type(self).__name__}: {problem}; its original forward runs")
            return original(self, hidden_states, top_k_index, top_k_weights)
        if checks is not None and checks.wanted(self):
            return checks.fused(self, hidden_states, top_k_index, top_k_weights, original)
        return dense_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    return forward


class _Budget:
    """How many of one instance's calls were checked, in all and with an idle expert."""

    def __init__(self) -> None:
        self.checked = 0
        self.checked_idle = 0
        self.forced = False  # a one-token comparison was run for it (no call of its had an idle expert)
        self.skip_reported = False

    def wanted(self) -> bool:
        return self.checked < CHECKED_CALLS or self.checked_idle < CHECKED_CALLS

    def take(self, idle: list[int]) -> bool:
        if self.checked < CHECKED_CALLS or (idle and self.checked_idle < CHECKED_CALLS):
            self.checked += 1
            self.checked_idle += bool(idle)
            return True
        return False


def _one_token(tensor: Any) -> Any:
    """The first token of ``tensor`` ([..., hidden]), with as many dimensions."""
    first = tensor.reshape(-1, tensor.shape[-1])[:1]
    return first.reshape((1,) * (tensor.dim() - 1) + (tensor.shape[-1],)).clone()


class _DenseChecks:
    """The dense output against the original sparse forward, on each instance's first calls and
    its first calls with an idle expert. The sparse forward runs after the dense one, on a copy of
    the input and with the random generators replayed, so it sees what the dense forward saw."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.budgets = PerInstance(lambda module: _Budget())
        self.compared = 0  # calls compared on this rank, all instances
        self.compared_idle = 0  # of which with an idle expert
        self.idle_example = ""  # e.g. "TinyMoeSparseMoeBlock idle expert(s) [3]", from the job's own forward
        self.forced_example = ""  # the same, from a one-token comparison the check forced
        self.worst = 0.0
        self.unforceable = ""  # why no idle expert could be forced (every expert routed on one token)
        runtime.at_finish(self._finish)

    def _finish(self) -> None:
        """The check proves the fix only on a forward where an expert got no token: fail it where this
        rank compared forwards but none of them had one (``not shown``)."""
        if self.compared and not self.compared_idle:
            why = self.unforceable or "no compared call had one and none was forced"
            self.runtime.check(
                CHECK,
                False,
                f"not shown: {self.compared} call{'s' if self.compared > 1 else ''} compared, none with an idle "
                f"expert ({why}); the check never compared the case the fix is for",
            )

    def _force_idle(self, budget: _Budget, name: str, run: Any) -> None:
        """No checked call of this instance had an idle expert and none of this rank's did: compare
        ``run() -> (dense, sparse, idle)`` on one token of the call, where every expert outside the
        token's top-k gets none (once per instance)."""
        if budget.forced or self.compared_idle:
            return
        budget.forced = True
        dense, sparse, idle = run()
        if not idle:
            self.unforceable = f"{name} routes one token to every expert"
            return
        self._record(name, dense, sparse, idle, forced=True)

    def wanted(self, module: Any) -> bool:
        return self.budgets(module).wanted()

    def block(self, block: Any, hidden_states: Any, original, spec: BlockSpec) -> tuple[Any, Any]:
        import torch

        name, budget = type(block).__name__, self.budgets(block)
        experts = getattr(block, spec.experts)
        reason = sharded_experts_reason(experts)
        if reason is not None:
            if not budget.skip_reported:
                budget.skip_reported = True
                self.runtime.check(
                    CHECK,
                    None,
                    f"{name}: not checked: {reason}; the sparse forward would all-gather "
                    "only the experts this rank routes to, a collective its peers do not "
                    "issue",
                )
            return dense_block_forward(block, hidden_states, spec)
        saved_input, saved_rng = hidden_states.detach().clone(), rng_state(hidden_states)
        out, router_logits, selected = _dense_block(block, hidden_states, spec)
        idle = idle_experts(selected, len(experts))
        if budget.take(idle):
            with torch.no_grad(), replayed_rng(saved_input, saved_rng):
                sparse = original(block, saved_input.clone())
            self._record(name, out, first_tensor(sparse), idle)
            if not idle:
                self._force_idle(budget, name, lambda: self._one_token_block(block, saved_input, original, spec))
        return out, router_logits

    @staticmethod
    def _one_token_block(block: Any, saved_input: Any, original, spec: BlockSpec) -> tuple[Any, Any, list[int]]:
        import torch

        one = _one_token(saved_input)
        state = rng_state(one)
        with torch.no_grad():
            with replayed_rng(one, state):
                dense, _logits, selected = _dense_block(block, one.clone(), spec)
            with replayed_rng(one, state):
                sparse = first_tensor(original(block, one.clone()))
        return dense, sparse, idle_experts(selected, len(getattr(block, spec.experts)))

    def fused(self, experts: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any, original) -> Any:
        import torch

        dense = dense_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
        idle = idle_experts(top_k_index, experts.num_experts)
        budget, name = self.budgets(experts), type(experts).__name__
        if budget.take(idle):
            with torch.no_grad():  # calls the function: no module hooks, so no collectives
                sparse = original(experts, hidden_states.detach(), top_k_index, top_k_weights.detach())
            self._record(name, dense, sparse, idle)
            if not idle:

                def one_token() -> tuple[Any, Any, list[int]]:
                    index, weights = top_k_index[:1], top_k_weights[:1].detach()
                    with torch.no_grad():
                        one_dense = dense_experts_forward(experts, hidden_states[:1].detach(), index, weights)
                        one_sparse = original(experts, hidden_states[:1].detach(), index, weights)
                    return one_dense, one_sparse, idle_experts(index, experts.num_experts)

                self._force_idle(budget, name, one_token)
        return dense

    def _record(self, name: str, dense: Any, sparse: Any, idle: list[int], forced: bool = False) -> None:
        if dense.shape != sparse.shape:
            self.runtime.check(CHECK, False, f"{name}: dense output {tuple(dense.shape)}, sparse {tuple(sparse.shape)}")
            return
        passed, worst, tolerance = compare(dense, sparse)
        idle_text = f"idle expert(s) {idle}" if idle else "no idle expert"
        if not passed:
            self.runtime.check(
                CHECK,
                False,
                f"{name} ({idle_text}): max |dense - sparse| = {worst:.3g} beyond {tolerance}",
                worst=worst,
            )
            return
        self.compared += 1
        self.worst = max(self.worst, worst)
        if idle:
            self.compared_idle += 1
            if forced:
                self.forced_example = f"{name} {idle_text}"
            else:
                self.idle_example = self.idle_example or f"{name} {idle_text}"
        shown = [self.idle_example] if self.idle_example else []
        if self.forced_example:
            shown.append(f"forced on one token of a checked call: {self.forced_example}")
        with_idle = (
            f", {self.compared_idle} with an idle expert ({'; '.join(shown)})"
            if self.compared_idle
            else ", none with an idle expert"
        )
        self.runtime.check(
            CHECK,
            True,
            f"{self.compared} calls compared{with_idle}: max |dense - sparse| = {self.worst:.3g} ({tolerance})",
            worst=worst,
        )


FIX = Fix(
    name=NAME,
    patterns=("inactive-experts", "checkpoint-recompute-mismatch"),
    summary="run every expert on every token (zero weight where not routed), so every rank has the same graph",
    mechanism="Replaces the MoE block's (or transformers 5 fused experts') forward: routing as before, then "
    "every expert runs on all tokens, weighted by its routing weight, zero where a token was not "
    "routed. Same output; every expert parameter gets a gradient on every rank, so FSDP2 reduces the "
    "same tensors everywhere.",
    risk="~num_experts/top_k times the expert FLOPs and activation memory. 0 x inf = NaN: an expert overflowing "
    "on a token it was not routed to poisons it. Fused experts lose grouped_mm kernels while it is on.",
    cost="~num_experts/top_k x expert FLOPs and activation memory (CPU, one block forward+backward, 1024 tokens, "
    "top-2: 3.6x with 8 experts, 6.5x with 16)",
    check="first 2 calls of each block per rank, and first 2 with an idle expert: the original sparse forward on "
    "the same input (no_grad, RNG replayed) must match within the dtype's tolerance; skipped when experts "
    "are their own FSDP units",
    targets=builtin_targets(),
    install=_install,
    parse_config=_parse_config,
    config_help="blocks: [{class: 'module:Class', kind: modulelist|fused, experts: experts, route: METHOD}]",
)
