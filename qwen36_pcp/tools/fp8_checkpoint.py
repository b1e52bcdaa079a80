# SPDX-License-Identifier: Apache-2.0
"""The block-wise FP8 layout of the published Qwen3.6-35B-A3B-FP8, as vLLM's ``Fp8Config`` loads it
(``make_checkpoint --fp8``).

``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}``. The projections of attention, GDN
(``in_proj_qkv``, ``in_proj_z``, ``out_proj``), the shared expert and every expert are float8_e4m3fn
with a ``<module>.weight_scale_inv`` fp32 tensor, one scale per 128x128 block (weight ~= fp8 x
scale). The experts are stored per expert, main layers too (``...mlp.experts.{e}.{gate,up,down}_proj
.weight``): vLLM maps block scales only per expert. In bf16 and listed in ``modules_to_not_convert``:
every other weight matrix (embeddings, ``lm_head``, the router ``mlp.gate``, ``mlp.shared_expert_gate``,
GDN's ``in_proj_a`` / ``in_proj_b``, whose 2 x num_v_heads rows vLLM cannot block-quantize, ``conv1d``,
the vision tower, ``mtp.fc``); norms, ``A_log`` and ``dt_bias`` stay bf16 as always. vLLM needs each
TP shard of a quantized matrix to be whole 128-blocks: the tiny presets load at tp=1 (the experts' 128
intermediate rows would split at tp=2), Qwen3.6-35B-A3B up to tp=4.
"""

from __future__ import annotations

import re

__all__ = ["FP8_BLOCK", "fp8_block_quantize", "fp8_quantization_config", "to_fp8"]

FP8_BLOCK = 128
# Stored in FP8 (outside the vision tower); every other weight matrix is listed as not converted.
_FP8_WEIGHTS = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                          r"|mlp\.(shared_expert\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def _stored_in_fp8(name: str) -> bool:
    return not name.startswith("model.visual.") and _FP8_WEIGHTS.search(name) is not None


def _per_expert(tensors: dict) -> dict:
    """The main layers' fused experts (``gate_up_proj`` [E, 2I, H], gate first; ``down_proj`` [E, H, I])
    as per-expert weights, the layout of the FP8 releases."""
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                out[f"{m[1]}.{e}.down_proj.weight"] = t[e]
            else:
                out[f"{m[1]}.{e}.gate_proj.weight"], out[f"{m[1]}.{e}.up_proj.weight"] = t[e].chunk(2)
    return dict(sorted(out.items()))


def fp8_quantization_config(specs: dict[str, tuple[int, ...]]) -> dict:
    """The ``quantization_config`` for a checkpoint of these bf16 tensor shapes: block-wise FP8 and
    the modules left in bf16 (the experts, fused or not, are all FP8)."""
    keep = [n.removesuffix(".weight") for n, shape in specs.items()
            if n.endswith(".weight") and len(shape) >= 2 and not _stored_in_fp8(n)]
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": keep,
            "quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def fp8_block_quantize(w, block: int = FP8_BLOCK):
    """(float8_e4m3fn weight, fp32 [ceil(N/block), ceil(K/block)] scales) of a [N, K] weight: each
    block's amax maps to the e4m3 maximum, and weight ~= fp8 x scale (vLLM's ``weight_scale_inv``)."""
    import torch

    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * block, kb * block)
    return q[:n, :k].contiguous(), scale


def to_fp8(tensors: dict) -> dict:
    """bf16 checkpoint tensors -> the ``--fp8`` layout (experts per expert, FP8 weights + scales)."""
    out = {}
    for name, t in _per_expert(tensors).items():
        if _stored_in_fp8(name):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = fp8_block_quantize(t)
        else:
            out[name] = t.contiguous()
    return dict(sorted(out.items()))
