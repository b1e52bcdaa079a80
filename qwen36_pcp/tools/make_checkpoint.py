"""Write a small random checkpoint laid out like a real Qwen3.6 release.

    python -m qwen36_pcp.tools.make_checkpoint OUT_DIR --preset tiny [--seed 0]

or, from Python::

    from qwen36_pcp.tools.make_checkpoint import make_checkpoint
    path = make_checkpoint(out_dir, preset="tiny", seed=0)

What is written (all presets):

* ``config.json`` in the published layout: ``Qwen3_5MoeForConditionalGeneration``
  (``model_type: qwen3_5_moe``) or, for the dense presets, ``Qwen3_5ForConditionalGeneration``
  (``model_type: qwen3_5``); the language model under ``text_config``, a vision tower under
  ``vision_config``.
* ``tokenizer.json`` + ``tokenizer_config.json`` (with a Qwen-style chat template): a byte-level
  BPE trained at build time on a small corpus kept in this file, so that any text tokenizes and
  every id below ``vocab_size`` decodes to something; the Qwen special tokens sit at the same
  offsets as in the real vocabulary (for the full-size presets at exactly the real ids).
* ``generation_config.json``, ``preprocessor_config.json``, ``video_preprocessor_config.json``.
* Unless the preset is config-only: ``model.safetensors`` (or ``--num-shards N`` shards plus
  ``model.safetensors.index.json``) with random bf16 weights under the real tensor names.

Tensor layout (as in the published Qwen3.5/3.6 MoE checkpoints: the ``qwen3.6-35b-a3b``
preset yields exactly the 1811 tensors of the published 35B-A3B index): the routed experts of
the main layers are stored *fused* -- ``model.language_model.layers.N.mlp.experts.gate_up_proj``
``[E, 2*I, H]`` (gate rows first, then up) and ``...experts.down_proj`` ``[E, H, I]`` (no
``.weight`` suffix) -- while the MTP layer stores its experts *per expert*
(``mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight``).
vLLM 0.20.2's ``Qwen3_5Model.load_weights`` / ``Qwen3_5MultiTokenPredictor.load_weights``
accept both forms. Note that transformers 5.17's ``save_pretrained`` would write the main
layers per expert (it reverses its own fused<-per-expert load conversion), which is *not* what
the real release looks like, so this tool writes the safetensors itself and only borrows the
tensor names and shapes from transformers' model classes (instantiated on the meta device).

The MTP tensors (not part of transformers' model) are::

    mtp.fc.weight                         [H, 2H]
    mtp.pre_fc_norm_embedding.weight      [H]
    mtp.pre_fc_norm_hidden.weight         [H]
    mtp.norm.weight                       [H]
    mtp.layers.0.<a full-attention decoder layer: input_layernorm, self_attn.{q,k,v,o}_proj,
                  self_attn.{q,k}_norm, post_attention_layernorm, mlp.*>

The MTP module reuses the main model's ``embed_tokens`` and ``lm_head`` (there is no
``mtp.embed_tokens`` / ``mtp.lm_head``; ``mtp_use_dedicated_embeddings: false``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "build_config",
    "build_tokenizer",
    "logit_gap_stats",
    "main",
    "make_checkpoint",
    "make_weights",
    "tensor_specs",
    "torch_reference_gdn",
]

# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

_MROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
}

# Scale of lm_head.weight relative to initializer_range (0.02). The final RMSNorm output has RMS ~1,
# so the logits are ~N(0, (0.02 * scale * sqrt(H))^2) across the vocabulary. Unscaled (logit std
# ~0.3 for H=256) the next-token distribution is almost flat and the top-1/top-2 gap is a few
# hundredths of a nat. Scaled by 30 (logit std ~9.6), the softmax is peaked. Measured on `tiny`,
# seed 0, transformers fp32 forward on CPU over 512 tokens of the built-in corpus
# (`--report-logit-gaps` / `logit_gap_stats` measure it on a short chat prompt):
#     scale    1: gap median 0.06, mean 0.08, p10 0.008 nats; top-1 prob median 0.00
#     scale   20: gap median 1.13, mean 1.61, p10 0.17;  46% of positions < 1 nat; top-1 p 0.55
#     scale   30: gap median 1.70, mean 2.41, p10 0.25;  34% < 1 nat;                top-1 p 0.75
#     scale   50: gap median 2.83, mean 4.01, p10 0.42;  23% < 1 nat;                top-1 p 0.93
# (the 38-position chat prompt of --report-logit-gaps: median 1.36, mean 1.97, min 0.02 at 30).
# NOTE: the scale does NOT make *greedy* decoding more robust to numerical noise: noise in the
# hidden states perturbs the logits in proportion to the same scale, so gap / perturbation does
# not depend on it. Measured: fp32 vs bf16 transformers forwards (final hidden states differ by
# ~6% relative after 8 layers) pick the same argmax at only 84% of the 512 positions, at every
# scale above. Compare logits/logprobs with a tolerance (or teacher-force), not long greedy
# strings, when checking two bf16 implementations against each other.
# What the scale does buy: peaked sampling distributions (speculative-decoding acceptance) and
# gaps that are large against absolute errors that do not grow with the logit scale.
LM_HEAD_SCALE = 30.0

# std of the MoE router weights (mlp.gate.weight); see _init_rules.
ROUTER_STD = 0.2

# make_checkpoint refuses to materialise random weights beyond this many parameters.
_MAX_RANDOM_PARAMS = 2_000_000_000

# Tiny presets: head counts divisible by 4 wherever vLLM shards them by TP (GDN key/value heads,
# attention query heads, vision heads); KV heads = 2 as in the real model (vLLM replicates KV heads
# when tp > num_key_value_heads). NOTE: vLLM's GDN layer needs linear_num_key_heads % tp == 0, so
# linear_num_key_heads=2 would cap TP at 2 -- hence 4 key / 8 value heads (value = 2 x key, as in
# the real 35B-A3B).
_TINY_TEXT_COMMON = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}

_TINY_VISION = {
    "depth": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 4,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 256,  # a square (16 x 16 grid), as the position interpolation needs
}

_REAL_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
}

PRESETS: dict[str, dict[str, Any]] = {
    # MoE, like Qwen3.6-35B-A3B, tiny. 8 layers = 2 x (3 GDN + 1 attention).
    "tiny": {
        "moe": True,
        "config_only": False,
        "text": {
            **_TINY_TEXT_COMMON,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        },
        "vision": _TINY_VISION,
        # Qwen's special tokens start at this id (real model: 248044 of 248320).
        "special_start": 8192 - 256,
        "bpe_vocab_size": 4096,
    },
    # Dense, like Qwen3.6-27B, tiny.
    "tiny-dense": {
        "moe": False,
        "config_only": False,
        "text": {**_TINY_TEXT_COMMON, "intermediate_size": 512},
        "vision": _TINY_VISION,
        "special_start": 8192 - 256,
        "bpe_vocab_size": 4096,
    },
    # Real Qwen3.6-35B-A3B text shape; config + tokenizer only (for load_format="dummy").
    "qwen3.6-35b-a3b": {
        "moe": True,
        "config_only": True,
        "text": {
            "vocab_size": 248320,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        },
        "vision": _REAL_VISION,
        "special_start": 248044,
        "bpe_vocab_size": 4096,
    },
    # Qwen3.6-27B (dense) text shape, as in the published Qwen3.5/3.6-27B configs;
    # config + tokenizer only.
    "qwen3.6-27b": {
        "moe": False,
        "config_only": True,
        "text": {
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        },
        "vision": _REAL_VISION,
        "special_start": 248044,
        "bpe_vocab_size": 4096,
    },
}

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# Qwen's added tokens, in the order (hence at the offsets from `special_start`) of the real
# vocabulary: <|endoftext|> = start+0, <|im_start|> +1, <|im_end|> +2, <|vision_start|> +9,
# <|vision_end|> +10, <|image_pad|> +12, <|video_pad|> +13, <|fim_pad|> +19, <|file_sep|> +21.
# (content, special)
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Qwen-style ChatML. `add_generation_prompt` opens an assistant turn. `enable_thinking=True`
# additionally opens a <think> block, `enable_thinking=False` inserts an empty one (as the real
# template does); left undefined, nothing is added. List-of-parts content (OpenAI format) is
# supported: text parts are concatenated, image/video parts become the vision placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is true %}"
    "{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Same split rule as the Qwen3.5 tokenizer (contractions, letter runs with one optional leading
# non-letter, single digits, punctuation runs, newlines, whitespace), so that transformers'
# Qwen2/Qwen3.5 tokenizer classes -- which may rebuild the pipeline from vocab + merges -- and
# the tokenizer.json pipeline tokenize identically.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Small built-in training corpus (written for this tool). Only the merges it induces matter.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was a bright cold day in April, and the clocks were striking thirteen while the rain kept falling.
Hello! How are you today? I am fine, thank you. What would you like to talk about this morning?
Please write a short poem about the sea, the wind, and the small boats that return home at night.
The model reads the prompt, fills its cache, and then generates one token at a time until it stops.
In a hybrid network, most layers use a linear attention with a recurrent state, and every fourth
layer uses full softmax attention over the whole context. The recurrent state has a fixed size, so
the memory needed by those layers does not grow with the length of the sequence.
Context parallelism splits a long prompt into chunks that are processed on different devices; the
attention layers exchange keys and values, and the recurrent layers pass their final state forward.
Mixture of experts layers route every token to a few experts out of many, and a shared expert is
always active. The router computes a score for each expert and keeps the highest ones.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 128 256 512 1024 2048 4096.
Dates such as 2024-05-17, times such as 10:45, prices such as $3.50 or 12.99 EUR, and 75% of all.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What is two plus three? Answer: Two plus three is five.
Question: Who wrote the play about the prince of Denmark? Answer: It was written by Shakespeare.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

class Counter:
    def __init__(self):
        self.count = 0

    def step(self, n=1):
        self.count += n
        return self.count
{"name": "weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
Once upon a time there was a little village at the edge of a great forest. The people of the
village were farmers and weavers, and in the evenings they told stories by the fire. One winter a
stranger arrived with a lantern that never went out, and the children followed him everywhere.
He said that he had walked from the mountains in the north, where the snow stays all year, and
that he was looking for a book that had been lost for a hundred years. Nobody in the village knew
of such a book, but the oldest woman remembered a song about a library under the hill.
The weather today is sunny with a few clouds; tomorrow there will be showers in the afternoon and
a light breeze from the west. Temperatures will stay between twelve and eighteen degrees.
To make bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes,
let it rise for an hour, shape it, let it rise again and bake it in a hot oven until golden.
Science is the patient work of asking good questions, measuring carefully, and checking results.
Music, painting, mathematics and language are all ways of finding patterns in the world.
Water boils at one hundred degrees at sea level. Light travels faster than sound. The earth turns
around the sun once a year and around its own axis once a day.
Thank you very much for your help! You're welcome. Let me know if there is anything else I can do.
Les enfants jouent dans le jardin. Die Katze schläft auf dem Sofa. El perro corre en el parque.
Это небольшой пример текста. 这是一个小例子。 これは小さな例です。 🙂 👍 ✓ → ∑ π ≈ 3.14159
"""


def _filler_token(i: int) -> str:
    # Byte-level alphabet: "Ġ" is the space byte, so this decodes to " <t1234>". Never produced
    # by encoding (no merge builds it); it only makes every id decodable.
    return f"\u0120<t{i}>"


def build_tokenizer(
    vocab_size: int, special_start: int, bpe_vocab_size: int = 4096
) -> str:
    """Return the tokenizer.json text.

    Ids: [0, n_bpe) the trained byte-level BPE (the 256 byte symbols first, so any text
    tokenizes); [special_start, special_start + len(SPECIAL_TOKENS)) Qwen's added tokens in
    Qwen's order; every other id below ``vocab_size`` a filler token that decodes to " <tID>".
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    n_special = len(SPECIAL_TOKENS)
    if special_start + n_special > vocab_size:
        raise ValueError(
            f"special tokens [{special_start}, +{n_special}) exceed vocab {vocab_size}"
        )
    bpe_vocab_size = min(bpe_vocab_size, special_start)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=False
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)

    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    n_bpe = len(vocab)
    assert sorted(vocab.values()) == list(range(n_bpe)), (
        "trained vocab is not contiguous"
    )
    # Put the added tokens into the model vocab as well, at the wanted ids: tokenizers then
    # keeps those ids for the added tokens (it ignores the ids given in `added_tokens` when a
    # token is not in the model vocab, and appends it instead).
    special_ids = {}
    for j, (content, _) in enumerate(SPECIAL_TOKENS):
        vocab[content] = special_start + j
        special_ids[special_start + j] = content
    for i in range(n_bpe, vocab_size):
        if i in special_ids:
            continue
        filler = _filler_token(i)
        assert filler not in vocab
        vocab[filler] = i
    assert len(vocab) == vocab_size
    data["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    data["added_tokens"] = [
        {
            "id": special_start + j,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for j, (content, special) in enumerate(SPECIAL_TOKENS)
    ]
    text = json.dumps(data, ensure_ascii=False, indent=None)
    # Sanity: the ids hold.
    check = Tokenizer.from_str(text)
    for j, (content, _) in enumerate(SPECIAL_TOKENS):
        assert check.token_to_id(content) == special_start + j, content
    assert check.get_vocab_size(with_added_tokens=True) == vocab_size
    return text


def _special_id(preset: dict, content: str) -> int:
    names = [c for c, _ in SPECIAL_TOKENS]
    return preset["special_start"] + names.index(content)


def _tokenizer_config(preset: dict) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(_special_id(preset, c)): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for c, s in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            c for c, s in SPECIAL_TOKENS if s and c != "<|endoftext|>"
        ],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def build_config(preset: str | dict) -> dict:
    """The config.json dict for a preset (name or preset dict)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    moe = p["moe"]
    t = dict(p["text"])
    eot = _special_id(p, "<|endoftext|>")
    text_cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": eot,
        "dtype": "bfloat16",
        "eos_token_id": eot,
        "full_attention_interval": 4,
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "layer_types": _layer_types(t["num_hidden_layers"], 4),
        "linear_conv_kernel_dim": t["linear_conv_kernel_dim"],
        "linear_key_head_dim": t["linear_key_head_dim"],
        "linear_num_key_heads": t["linear_num_key_heads"],
        "linear_num_value_heads": t["linear_num_value_heads"],
        "linear_value_head_dim": t["linear_value_head_dim"],
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": t["num_attention_heads"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": copy.deepcopy(_MROPE),
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": t["vocab_size"],
    }
    if moe:
        text_cfg.update(
            {
                "moe_intermediate_size": t["moe_intermediate_size"],
                "num_experts": t["num_experts"],
                "num_experts_per_tok": t["num_experts_per_tok"],
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
                "shared_expert_intermediate_size": t["shared_expert_intermediate_size"],
            }
        )
    else:
        text_cfg["intermediate_size"] = t["intermediate_size"]
    v = p["vision"]
    vision_cfg = {
        "deepstack_visual_indexes": [],
        "depth": v["depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v["hidden_size"],
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": v["intermediate_size"],
        "model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision",
        "num_heads": v["num_heads"],
        "num_position_embeddings": v["num_position_embeddings"],
        "out_hidden_size": t["hidden_size"],
        "patch_size": v["patch_size"],
        "spatial_merge_size": v["spatial_merge_size"],
        "temporal_patch_size": v["temporal_patch_size"],
    }
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration"
            if moe
            else "Qwen3_5ForConditionalGeneration"
        ],
        "dtype": "bfloat16",
        "image_token_id": _special_id(p, "<|image_pad|>"),
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": dict(sorted(text_cfg.items())),
        "tie_word_embeddings": False,
        "video_token_id": _special_id(p, "<|video_pad|>"),
        "vision_config": vision_cfg,
        "vision_end_token_id": _special_id(p, "<|vision_end|>"),
        "vision_start_token_id": _special_id(p, "<|vision_start|>"),
    }


def _generation_config(p: dict) -> dict:
    eot = _special_id(p, "<|endoftext|>")
    return {
        "bos_token_id": eot,
        "do_sample": False,
        "eos_token_id": [_special_id(p, "<|im_end|>"), eot],
        "pad_token_id": eot,
    }


def _preprocessor_configs(p: dict) -> tuple[dict, dict]:
    v = p["vision"]
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": v["spatial_merge_size"],
        "patch_size": v["patch_size"],
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": v["temporal_patch_size"],
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
    }
    return image, video


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def tensor_specs(config: dict) -> dict[str, tuple[int, ...]]:
    """On-disk tensor names -> shapes, for a config.json dict.

    Names and shapes of the HF part come from transformers' own model class, built on the meta
    device (no memory, no init). The MTP tensors are added by hand (see the module docstring).
    """
    import torch

    moe = config["model_type"] == "qwen3_5_moe"
    if moe:
        from transformers import Qwen3_5MoeConfig as ConfigCls
        from transformers import Qwen3_5MoeForConditionalGeneration as ModelCls
    else:
        from transformers import Qwen3_5Config as ConfigCls
        from transformers import Qwen3_5ForConditionalGeneration as ModelCls

    hf_config = ConfigCls.from_dict(copy.deepcopy(config))
    with torch.device("meta"):
        model = ModelCls(hf_config)
    specs: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        specs[name] = tuple(t.shape)
    del model

    tc = config["text_config"]
    hidden = tc["hidden_size"]
    full_idx = tc["layer_types"].index("full_attention")
    src = f"model.language_model.layers.{full_idx}."
    mtp: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for name, shape in specs.items():
        if not name.startswith(src):
            continue
        rest = name[len(src) :]
        if rest == "mlp.experts.gate_up_proj":
            n_exp, two_i, h = shape
            for e in range(n_exp):
                mtp[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = (two_i // 2, h)
                mtp[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = (two_i // 2, h)
        elif rest == "mlp.experts.down_proj":
            n_exp, h, i = shape
            for e in range(n_exp):
                mtp[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = (h, i)
        else:
            mtp[f"mtp.layers.0.{rest}"] = shape
    specs.update(mtp)
    return dict(sorted(specs.items()))


def _tensor_seed(seed: int, name: str) -> int:
    # Per-tensor seed from (seed, name): a tensor's values do not depend on which other tensors
    # exist or on the order they are generated in.
    digest = hashlib.sha256(f"qwen36_pcp/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_rules(config: dict, lm_head_scale: float) -> list[tuple[str, Callable]]:
    """(regex on the tensor name, fn(generator, shape) -> float32 tensor). First match wins;
    a tensor that matches none is an error (no silent defaults)."""
    import torch

    std = config["text_config"]["initializer_range"]  # 0.02

    def normal(s):
        return lambda g, shape: torch.randn(shape, generator=g) * s

    def around(center, s):
        return lambda g, shape: center + torch.randn(shape, generator=g) * s

    def a_log(g, shape):
        # A = exp(A_log) ~ U(1, 16), as Mamba2 / GDN initialise it.
        return torch.log(torch.rand(shape, generator=g) * 15.0 + 1.0)

    def dt_bias(g, shape):
        # Mamba2-style: dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1], i.e. per-step decay
        # exp(-A * dt) from ~0.2 to ~0.999: some heads forget within a token, others remember
        # ~1000 tokens, so the recurrent state carried across prefill chunks (and across
        # context-parallel ranks) measurably matters.
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand(shape, generator=g) * (hi - lo) + lo)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus

    # Norm weights are *not* exactly their neutral value (a loader that skips one would go
    # unnoticed otherwise) but close to it: N(neutral, 0.05).
    gemma_norm = around(
        0.0, 0.05
    )  # Qwen3_5(Moe)RMSNorm computes x_hat * (1 + w): neutral 0
    plain_norm = around(
        1.0, 0.05
    )  # RMSNormGated (linear_attn.norm) and LayerNorm: neutral 1
    return [
        # language model + MTP
        (r"(^|\.)embed_tokens\.weight$", normal(std)),
        (r"^lm_head\.weight$", normal(std * lm_head_scale)),
        (r"(input_layernorm|post_attention_layernorm)\.weight$", gemma_norm),
        (r"self_attn\.(q_norm|k_norm)\.weight$", gemma_norm),
        (r"^model\.language_model\.norm\.weight$", gemma_norm),
        (r"^mtp\.(norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$", gemma_norm),
        (r"linear_attn\.norm\.weight$", plain_norm),
        (r"linear_attn\.A_log$", a_log),
        (r"linear_attn\.dt_bias$", dt_bias),
        # depthwise causal conv, kernel 4: like nn.Conv1d's default U(-1/sqrt(k), 1/sqrt(k))
        (r"linear_attn\.conv1d\.weight$", normal(0.3)),
        (
            r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$",
            normal(std),
        ),
        (r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", normal(std)),
        # Router: 10x the usual std (router logits ~N(0, 3^2) for H=256), so top-k routing is
        # peaked like a trained router's: then a near-tie between the k-th and (k+1)-th expert
        # (which bf16 noise does flip) costs little, because the k-th expert's weight is small.
        # Measured on `tiny`: fp32 vs bf16 forward, final hidden-state relative error 9.2% with
        # std 0.02 vs 6.2% with 0.2; argmax agreement 79% -> 85%.
        (r"mlp\.gate\.weight$", normal(ROUTER_STD)),
        (r"mlp\.shared_expert_gate\.weight$", normal(std)),
        (r"mlp\.experts\.(gate_up_proj|down_proj)$", normal(std)),  # fused [E, ., .]
        (r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),
        (r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),
        (r"mlp\.(gate_proj|up_proj|down_proj)\.weight$", normal(std)),  # dense MLP
        (r"^mtp\.fc\.weight$", normal(std)),
        # vision tower
        (r"^model\.visual\..*norm\w*\.weight$", plain_norm),
        (r"^model\.visual\..*\.bias$", normal(std)),
        (r"^model\.visual\..*\.weight$", normal(std)),
    ]


def make_weights(
    config: dict,
    seed: int = 0,
    lm_head_scale: float = LM_HEAD_SCALE,
    specs: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Random bf16 tensors under the on-disk names, deterministic in (seed, name)."""
    import torch

    if specs is None:
        specs = tensor_specs(config)
    rules = [(re.compile(pat), fn) for pat, fn in _init_rules(config, lm_head_scale)]
    out = {}
    g = torch.Generator(device="cpu")
    for name, shape in specs.items():
        for pat, fn in rules:
            if pat.search(name):
                g.manual_seed(_tensor_seed(seed, name))
                out[name] = fn(g, shape).to(torch.bfloat16).contiguous()
                break
        else:
            raise KeyError(f"no init rule for tensor {name!r} {shape}")
    return out


def _write_safetensors(out_dir: Path, tensors: dict, num_shards: int) -> list[str]:
    from safetensors.torch import save_file

    for old in list(out_dir.glob("*.safetensors")) + [
        out_dir / "model.safetensors.index.json"
    ]:
        if old.exists():
            old.unlink()
    names = sorted(tensors)
    if num_shards <= 1:
        save_file(
            {n: tensors[n] for n in names},
            str(out_dir / "model.safetensors"),
            metadata={"format": "pt"},
        )
        return ["model.safetensors"]
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    total = sum(sizes.values())
    target = total / num_shards
    shards: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if acc >= target * len(shards) and len(shards) < num_shards:
            shards.append([])
        shards[-1].append(n)
        acc += sizes[n]
    files = []
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {n: tensors[n] for n in shard},
            str(out_dir / fname),
            metadata={"format": "pt"},
        )
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out_dir / "model.safetensors.index.json", index)
    return files


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(
        json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------


def make_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    seed: int = 0,
    *,
    config_only: bool | None = None,
    num_shards: int = 1,
    lm_head_scale: float = LM_HEAD_SCALE,
) -> Path:
    """Write a checkpoint directory for ``preset`` into ``out_dir`` and return its path.

    ``config_only`` defaults to the preset's setting (True for the full-size presets). Existing
    ``*.safetensors`` files (and the index) in ``out_dir`` are removed first; other files are
    overwritten or left alone.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    if config_only is None:
        config_only = p["config_only"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = build_config(p)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(p))
    image_pp, video_pp = _preprocessor_configs(p)
    _write_json(out / "preprocessor_config.json", image_pp)
    _write_json(out / "video_preprocessor_config.json", video_pp)
    tok_json = build_tokenizer(
        p["text"]["vocab_size"], p["special_start"], p["bpe_vocab_size"]
    )
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(p))

    if config_only:
        for old in list(out.glob("*.safetensors")) + [
            out / "model.safetensors.index.json"
        ]:
            if old.exists():
                old.unlink()
    else:
        specs = tensor_specs(config)
        numel = sum(math.prod(shape) for shape in specs.values())
        if numel > _MAX_RANDOM_PARAMS:
            raise ValueError(
                f"preset {preset!r} has {numel / 1e9:.1f}B parameters; write it config-only and "
                "load it with load_format='dummy'"
            )
        tensors = make_weights(
            config, seed=seed, lm_head_scale=lm_head_scale, specs=specs
        )
        _write_safetensors(out, tensors, num_shards)
    return out


@contextlib.contextmanager
def torch_reference_gdn(model_cls):
    """Make transformers' Qwen3.5 modeling module use its pure-PyTorch gated-delta-rule and
    causal-conv1d paths (while the context is open). transformers binds the `fla` /
    `causal_conv1d` kernels at import time when those packages are importable, and fla's Triton
    kernels cannot run on a CPU-only machine."""
    import inspect

    mod = sys.modules[model_cls.__module__]
    names = [
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ]
    saved = {n: getattr(mod, n) for n in names if hasattr(mod, n)}
    try:
        for n, fn in saved.items():
            setattr(mod, n, inspect.unwrap(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


def logit_gap_stats(
    ckpt_dir: str | os.PathLike, text: str | None = None, dtype: str = "float32"
) -> dict:
    """Run transformers' model (CPU) on ``text`` and report the top-1 minus top-2 logit gaps
    over all positions (for documenting / tuning ``LM_HEAD_SCALE``)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(ckpt_dir)
    if cfg.model_type == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForConditionalGeneration as ModelCls
    else:
        from transformers import Qwen3_5ForConditionalGeneration as ModelCls
    tok = AutoTokenizer.from_pretrained(ckpt_dir)
    if text is None:
        text = tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": "Tell me a short story about a lighthouse keeper and a storm.",
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
    model = ModelCls.from_pretrained(ckpt_dir, dtype=getattr(torch, dtype)).eval()
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad(), torch_reference_gdn(ModelCls):
        logits = model(input_ids=ids).logits[0].float()
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).sort().values
    probs = logits.softmax(-1).max(-1).values
    n = gaps.numel()
    return {
        "num_positions": n,
        "logit_std": float(logits.std(dim=-1).mean()),
        "gap_min": float(gaps[0]),
        "gap_p10": float(gaps[int(0.1 * (n - 1))]),
        "gap_median": float(gaps[(n - 1) // 2]),
        "gap_mean": float(gaps.mean()),
        "frac_gap_lt_1": float((gaps < 1.0).float().mean()),
        "top1_prob_median": float(probs.median()),
        "argmax": logits.argmax(-1).tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qwen36_pcp.tools.make_checkpoint",
        description="Write a random Qwen3.6-style checkpoint (config, tokenizer, bf16 weights).",
    )
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--config-only",
        action="store_true",
        help="write no weights (implied by the full-size presets), e.g. for load_format='dummy'",
    )
    ap.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="split the weights into N files + index",
    )
    ap.add_argument("--lm-head-scale", type=float, default=LM_HEAD_SCALE)
    ap.add_argument(
        "--report-logit-gaps",
        action="store_true",
        help="afterwards run transformers on CPU (fp32) and print top-1/top-2 logit gap stats",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = make_checkpoint(
        args.out_dir,
        preset=args.preset,
        seed=args.seed,
        config_only=True if args.config_only else None,
        num_shards=args.num_shards,
        lm_head_scale=args.lm_head_scale,
    )
    dt = time.perf_counter() - t0
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"wrote {out} ({args.preset}, seed {args.seed}) in {dt:.1f}s, {total / 2**20:.1f} MiB:"
    )
    for f in sorted(out.iterdir()):
        if f.is_file():
            print(f"  {f.name:40s} {f.stat().st_size:>12,d}")
    if args.report_logit_gaps:
        if not any(out.glob("*.safetensors")):
            print("no weights written; skipping --report-logit-gaps", file=sys.stderr)
        else:
            stats = logit_gap_stats(out)
            stats.pop("argmax")
            print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
