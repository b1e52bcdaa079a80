# SPDX-License-Identifier: Apache-2.0
"""The collectives of one split step, from its plan: what each rank's ``PCPContext`` issues.

Per rank and layer kind, the list of ``(kind, bytes, peer)`` the layer code calls through
``PCPContext`` (``Collective``: the payload is one rank's input of a gather, the tensor of a
broadcast, send or recv). ``benchmarks/test_step_traffic.py`` runs the layers on gloo ranks and
checks that these lists are what ``PCPContext.collectives`` recorded, call for call, so the step-time
model (``predict_ttft.py``), which prices these lists, counts what the code sends.

Layer kinds: ``attention`` (the step's new K/V, gathered for the replicated cache; at a spread decode
step it rides in the output gather), ``gdn`` in each
mode (conv halo; relay: the replicated requests' states from rank 0, each run's end state to the next
run's owner, the final states from the last owner; state passing: the replicated states and one
gather of the block summaries; island: the whole batch's inputs), and ``output`` (the rows vLLM
reads after the step). vLLM's own collectives (TP's all-reduces, sharded experts' gather and
reduce-scatter) are not issued through the context; the model counts them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen36_pcp.plan import PCPPlan

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class LayerShape:
    """Per TP rank: the attention K/V heads and head size, the GDN key/value heads and head sizes and
    conv width, the hidden size; the activations' bytes per element."""

    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_k: int
    gdn_head_v: int
    conv_width: int
    hidden: int
    act_bytes: int = BF16

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_head_k + self.gdn_v_heads * self.gdn_head_v

    @property
    def state_bytes(self) -> int:
        """One request's recurrent state, fp32 [HV, V, K]."""
        return self.gdn_v_heads * self.gdn_head_v * self.gdn_head_k * FP32


Call = tuple[str, int, int]  # (kind, bytes, peer)


def _new_kv_bytes(plan: PCPPlan, s: LayerShape) -> int:
    """One attention layer's new K/V of a rank: [t_pad, kv_heads, 2 x head_dim]."""
    return plan.t_pad * s.kv_heads * 2 * s.head_dim * s.act_bytes


def attention(plan: PCPPlan, s: LayerShape) -> list[Call]:
    """``split_attention.gather_kv_for_cache``; none at a spread decode step, whose new K/V travels
    with the output gather (``output``, ``owned_batch.defer_staged_kv``)."""
    return [] if plan.decode_spread_only else [("all_gather", _new_kv_bytes(plan, s), -1)]


def _conv_halo(plan: PCPPlan, s: LayerShape) -> Call:
    """``gdn_cp.conv_with_halo``: each segment's last width-1 inputs (as many segments as the rank that
    has the most)."""
    return ("all_gather", plan.max_segments * (s.conv_width - 1) * s.conv_dim * s.act_bytes, -1)


def _replicated_states(plan: PCPPlan, s: LayerShape, rank: int) -> list[Call]:
    reps = plan.num_replicated  # the requests a rank owns (decode="spread") keep their states there
    return [("broadcast", reps * s.state_bytes, 0)] if reps else []


def gdn(plan: PCPPlan, s: LayerShape, mode: str, rank: int) -> list[Call]:
    if plan.decode_spread_only:  # vLLM's decode kernels on the rank's own rows
        return []
    if mode == "island":  # mixed_qkv, b, a of the local rows
        heads = s.gdn_v_heads * s.act_bytes
        return [("all_gather", plan.t_pad * s.conv_dim * s.act_bytes, -1),
                ("all_gather", plan.t_pad * heads, -1), ("all_gather", plan.t_pad * heads, -1)]
    split, chain = len(plan.split_reqs), plan.summary_runs
    replicated = _replicated_states(plan, s, rank)
    if not split:
        return [_conv_halo(plan, s), *replicated]
    if mode == "relay":  # the replicated requests' states first, then the chain
        calls = [_conv_halo(plan, s), *replicated]
        for j, (owner, _, _) in enumerate(chain):
            if owner != rank:
                continue
            if j > 0:
                calls.append(("recv", split * s.state_bytes, chain[j - 1][0]))
            if j + 1 < len(chain):
                calls.append(("send", split * s.state_bytes, chain[j + 1][0]))
        return calls + [("broadcast", split * s.state_bytes, chain[-1][0])]
    # state passing: per run one summary ([V+K, K] per head), the run holding block 0 only its end
    # state ([V, K]); every rank's payload padded to the largest
    summary = s.gdn_v_heads * (s.gdn_head_v + s.gdn_head_k) * s.gdn_head_k * FP32
    sizes = [sum(split * (s.state_bytes if first == 0 else summary) for own, first, _ in chain if own == r)
             for r in range(plan.world_size)]
    return [_conv_halo(plan, s), ("all_gather", max(sizes), -1), *replicated]


def output(plan: PCPPlan, s: LayerShape, all_rows: bool, attention_layers: int = 0) -> list[Call]:
    """``PCPContext.gather_output``: every row when a request wants prompt logprobs, else one per
    request; at a spread decode step with the new K/V of the step's ``attention_layers`` too."""
    rows = plan.t_pad if all_rows else plan.num_reqs
    kv = attention_layers * _new_kv_bytes(plan, s) if plan.decode_spread_only else 0
    return [("all_gather", rows * s.hidden * s.act_bytes + kv, -1)]
