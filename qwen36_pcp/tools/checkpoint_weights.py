# SPDX-License-Identifier: Apache-2.0
"""The random checkpoint's tensors (``make_checkpoint``): their on-disk names and shapes, from
transformers' model classes on the meta device plus the MTP head, and their random values, each tensor
from a generator of its own, drawn like a trained model's where that matters to the tests (peaked
logits and routing, GDN decays that remember across chunks)."""

from __future__ import annotations

import copy
import hashlib
import math
import re
from typing import Any

# lm_head.weight std = initializer_range x this. The final norm output has RMS ~1, so the logits
# have std ~0.02 x 30 x sqrt(H) (~9.6 for H=256): next-token distributions are peaked like a
# trained model's instead of flat (top-1/top-2 gap ~1.7 nats median on `tiny` instead of 0.06).
LM_HEAD_SCALE = 30.0
# Router (mlp.gate) std: 10x the usual, so top-k routing is peaked like a trained router's and a
# bf16-flipped near-tie between the k-th and (k+1)-th expert costs little.
ROUTER_STD = 0.2

def tensor_specs(config: dict) -> dict[str, tuple[int, ...]]:
    """On-disk tensor name -> shape, sorted by name. The transformers part comes from its model
    class on the meta device (no memory); the MTP part (not in transformers) is one copy of a
    full-attention layer with per-expert experts plus ``mtp.fc`` and three norms."""
    import torch

    if config["model_type"] == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig as ConfigCls
        from transformers import Qwen3_5MoeForConditionalGeneration as ModelCls
    else:
        from transformers import Qwen3_5Config as ConfigCls
        from transformers import Qwen3_5ForConditionalGeneration as ModelCls
    plain = {k: v for k, v in config.items() if k != "quantization_config"}  # the bf16 model's shapes
    with torch.device("meta"):
        model = ModelCls(ConfigCls.from_dict(copy.deepcopy(plain)))
    specs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tc = config["text_config"]
    h = tc["hidden_size"]
    mtp = {"mtp.fc.weight": (h, 2 * h), **{f"mtp.{n}.weight": (h,) for n in
                                            ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    src = f"model.language_model.layers.{tc['layer_types'].index('full_attention')}."
    for name, shape in specs.items():
        if not name.startswith(src):
            continue
        rest = name[len(src):]
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> E x (gate [I, H], up [I, H])
            for e in range(shape[0]):
                for w in ("gate", "up"):
                    mtp[f"mtp.layers.0.mlp.experts.{e}.{w}_proj.weight"] = (shape[1] // 2, shape[2])
        elif rest == "mlp.experts.down_proj":
            mtp.update({f"mtp.layers.0.mlp.experts.{e}.down_proj.weight": shape[1:] for e in range(shape[0])})
        else:
            mtp[f"mtp.layers.0.{rest}"] = shape
    return dict(sorted({**specs, **mtp}.items()))


def _init_rules(std: float) -> list[tuple[str, Any]]:
    """(regex on the tensor name, fn(generator, shape) -> float32 tensor); the first match wins,
    and a tensor matching none is an error rather than a silent default."""
    import torch

    def normal(s):
        return lambda g, shape: torch.randn(shape, generator=g) * s

    def around(center, s):
        return lambda g, shape: center + torch.randn(shape, generator=g) * s

    def a_log(g, shape):  # A = exp(A_log) ~ U(1, 16), as Mamba2 / GDN initialise it
        return torch.log(torch.rand(shape, generator=g) * 15.0 + 1.0)

    def dt_bias(g, shape):
        # softplus(dt_bias) log-uniform in [1e-3, 1e-1]: per-step decay from ~0.2 to ~0.999, so
        # some heads remember ~1000 tokens and the state carried across chunks/ranks matters.
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand(shape, generator=g) * (hi - lo) + lo)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus

    # Norms near, not at, their neutral value, so that a loader skipping one would be noticed.
    gemma_norm, plain_norm = around(0.0, 0.05), around(1.0, 0.05)  # x*(1+w) vs x*w
    return [
        (r"(^|\.)embed_tokens\.weight$", normal(std)),
        (r"^lm_head\.weight$", normal(std * LM_HEAD_SCALE)),
        (r"(input_layernorm|post_attention_layernorm)\.weight$", gemma_norm),
        (r"self_attn\.(q_norm|k_norm)\.weight$", gemma_norm),
        (r"^model\.language_model\.norm\.weight$", gemma_norm),
        (r"^mtp\.(norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$", gemma_norm),
        (r"linear_attn\.norm\.weight$", plain_norm),
        (r"linear_attn\.A_log$", a_log),
        (r"linear_attn\.dt_bias$", dt_bias),
        (r"linear_attn\.conv1d\.weight$", normal(0.3)),  # ~ nn.Conv1d's U(-1/sqrt(k), 1/sqrt(k)), k=4
        (r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$", normal(std)),
        (r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", normal(std)),
        (r"mlp\.gate\.weight$", normal(ROUTER_STD)),
        (r"mlp\.shared_expert_gate\.weight$", normal(std)),
        (r"mlp\.experts\.(gate_up_proj|down_proj)$", normal(std)),
        (r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),
        (r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),
        (r"mlp\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),
        (r"^mtp\.fc\.weight$", normal(std)),
        (r"^model\.visual\..*norm\w*\.weight$", plain_norm),
        (r"^model\.visual\..*\.bias$", normal(std)),
        (r"^model\.visual\..*\.weight$", normal(std)),
    ]


def make_weights(config: dict, seed: int = 0) -> dict[str, Any]:
    """Random bf16 tensors under the on-disk names. Each tensor has its own generator seeded from
    (seed, name), so its values do not depend on which other tensors exist or their order."""
    import torch

    rules = [(re.compile(pat), fn) for pat, fn in _init_rules(config["text_config"]["initializer_range"])]
    out, g = {}, torch.Generator(device="cpu")
    for name, shape in tensor_specs(config).items():
        fn = next((fn for pat, fn in rules if pat.search(name)), None)
        if fn is None:
            raise KeyError(f"no init rule for tensor {name!r} {shape}")
        digest = hashlib.sha256(f"qwen36_pcp/{seed}/{name}".encode()).digest()
        g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        out[name] = fn(g, shape).to(torch.bfloat16).contiguous()
    return out
