# SPDX-License-Identifier: Apache-2.0
"""Write a small random checkpoint laid out like a published Qwen3.6 / Qwen3.5 release.

    python -m qwen36_pcp.tools.make_checkpoint OUT_DIR --preset tiny [--seed 0] [--num-shards N] [--fp8]

or ``make_checkpoint(out_dir, preset="tiny", seed=0)`` from Python.

Random weights let the plugin be tested end to end without downloading a model; the layout is
the real one so that the loader paths exercised are the ones a real checkpoint takes:

* ``config.json``: ``Qwen3_5MoeForConditionalGeneration`` (``tiny``, ``qwen3.6-35b-a3b``) or
  ``Qwen3_5ForConditionalGeneration`` (``tiny-dense``, ``qwen3.6-27b``), the language model under
  ``text_config``, a vision tower under ``vision_config``; plus the generation and preprocessor
  configs.
* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level tokenizer with the Qwen special
  tokens at the offsets of the real vocabulary (at exactly the real ids for the full-size presets)
  and a ChatML chat template.
* ``model.safetensors`` (or ``--num-shards N`` files plus an index): random bf16 weights under the
  published names ``model.language_model.*``, ``lm_head.weight``, ``model.visual.*`` and
  ``mtp.*``. The vision and MTP tensors are there because a loader of the text model has to
  skip or map them. The main layers store their routed experts fused (``...mlp.experts.
  gate_up_proj`` ``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``), the MTP layer per
  expert (``mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight``), as in the releases.
  transformers' ``save_pretrained`` would write the main layers per expert, so the files are
  written here; only the names and shapes come from transformers' model classes (built on the
  meta device).
* ``--fp8`` (``fp8=True``): the same weights in the block-wise FP8 layout of the published
  Qwen3.6-35B-A3B-FP8 (``fp8_checkpoint.py`` says which modules and why).

The full-size presets are config-only: use them with vLLM's ``load_format="dummy"``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoint_weights import make_weights, tensor_specs
from .fp8_checkpoint import fp8_quantization_config, to_fp8

__all__ = ["CHAT_TEMPLATE", "PRESETS", "SPECIAL_TOKENS", "BadInput", "build_config", "build_tokenizer",
           "main", "make_checkpoint", "make_weights", "tensor_specs"]

_MROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
          "mrope_interleaved": True, "mrope_section": [11, 11, 10]}

# Tiny shapes: every head count vLLM shards by TP/CP divides by 4 (GDN needs linear_num_key_heads
# % tp == 0); 2 KV heads and value heads = 2 x key heads, as in the real 35B-A3B.
_TINY_TEXT = {"vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 4,
              "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4}
_TINY_VISION = {"depth": 1, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "patch_size": 16,
                "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 256}  # a square grid, as position interpolation needs
_REAL_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 2304}
_REAL_GDN = {"head_dim": 256, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320}

# pixels of all of a video's frames together that the video processor keeps (it shrinks the frames
# of a larger video): the published value (about 12k tokens), and the tiny presets' (about 64k
# tokens, so that one video can fill a long prompt)
PUBLISHED_VIDEO_MAX_PIXELS = 25165824
TINY_VIDEO_MAX_PIXELS = 2**27

# moe: MoE or dense MLP; config_only: no weights (full size); special_start: id of <|endoftext|>,
# the first Qwen special token (real vocabulary: 248044 of 248320).
PRESETS: dict[str, dict[str, Any]] = {
    # like Qwen3.6-35B-A3B, tiny: 8 layers = 2 x (3 GDN + 1 attention)
    "tiny": {"moe": True, "config_only": False, "special_start": 8192 - 256, "vision": _TINY_VISION,
             "video_max_pixels": TINY_VIDEO_MAX_PIXELS,
             "text": {**_TINY_TEXT, "num_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}},
    # like Qwen3.6-27B (dense), tiny
    "tiny-dense": {"moe": False, "config_only": False, "special_start": 8192 - 256,
                   "video_max_pixels": TINY_VIDEO_MAX_PIXELS,
                   "vision": _TINY_VISION, "text": {**_TINY_TEXT, "intermediate_size": 512}},
    "qwen3.6-35b-a3b": {"moe": True, "config_only": True, "special_start": 248044, "vision": _REAL_VISION,
                        "text": {**_REAL_GDN, "hidden_size": 2048, "num_hidden_layers": 40,
                                 "num_attention_heads": 16, "num_key_value_heads": 2,
                                 "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}},
    "qwen3.6-27b": {"moe": False, "config_only": True, "special_start": 248044, "vision": _REAL_VISION,
                    "text": {**_REAL_GDN, "hidden_size": 5120, "intermediate_size": 17408,
                             "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                             "linear_num_value_heads": 48}},
}

# Qwen's added tokens in the order of the real vocabulary (so at the real offsets from
# special_start); the first 14 are special (skipped when decoding with skip_special_tokens).
_TOKENS = ("<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
           "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
           "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
           "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
           "<think> </think>").split()
SPECIAL_TOKENS: list[tuple[str, bool]] = [(t, j < 14) for j, t in enumerate(_TOKENS)]

# Qwen-style ChatML. add_generation_prompt opens an assistant turn; enable_thinking=True opens a
# <think> block, False inserts an empty one (as the real template does). List-of-parts content
# (OpenAI format) works: text parts are concatenated, image/video parts become vision placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


class BadInput(ValueError):
    """An argument make_checkpoint refuses; the CLI prints it as a one-line usage error."""


def _special_id(p: dict, content: str) -> int:
    return p["special_start"] + _TOKENS.index(content)


def build_tokenizer(vocab_size: int, special_start: int) -> str:
    """The tokenizer.json text: ids 0-255 are the 256 bytes (GPT-2 byte-level alphabet, so any
    text tokenizes; no merges), the Qwen special tokens start at ``special_start``, and every
    other id is a filler that decodes to " <tID>" (a random model can emit any id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if special_start < 256 or special_start + len(_TOKENS) > vocab_size:
        raise ValueError(f"special tokens at {special_start} do not fit vocab_size {vocab_size}")
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    byte_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}
    vocab = {byte_char[b]: b for b in range(256)}
    specials = {special_start + j: t for j, t in enumerate(_TOKENS)}
    # "\u0120" is the byte-level space; no merge builds a filler, so encoding never yields one.
    vocab.update({specials.get(i, f"\u0120<t{i}>"): i for i in range(256, vocab_size)})
    # The added tokens sit in the model vocab too: tokenizers keeps their ids only then.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok.to_str()


def _tokenizer_config(p: dict) -> dict:
    decoder = {str(_special_id(p, t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": s} for t, s in SPECIAL_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "additional_special_tokens": [t for t, s in SPECIAL_TOKENS[1:] if s], "bos_token": None,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
            "errors": "replace", "model_max_length": 262144, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def build_config(preset: str | dict) -> dict:
    """The config.json dict of a preset (its name or its PRESETS entry)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    moe, t, eot = p["moe"], p["text"], _special_id(p, "<|endoftext|>")
    n = t["num_hidden_layers"]
    text = {**t, "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
            "bos_token_id": eot, "dtype": "bfloat16", "eos_token_id": eot, "full_attention_interval": 4,
            "hidden_act": "silu", "initializer_range": 0.02, "mamba_ssm_dtype": "float32",
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
            "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-6,
            "rope_parameters": copy.deepcopy(_MROPE), "tie_word_embeddings": False, "use_cache": True}
    if moe:
        text.update({"output_router_logits": False, "router_aux_loss_coef": 0.001})
    vision = {**p["vision"], "deepstack_visual_indexes": [], "hidden_act": "gelu_pytorch_tanh",
              "in_channels": 3, "initializer_range": 0.02, "out_hidden_size": t["hidden_size"],
              "model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision"}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "dtype": "bfloat16", "image_token_id": _special_id(p, "<|image_pad|>"),
        "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": False, "video_token_id": _special_id(p, "<|video_pad|>"),
        "vision_config": dict(sorted(vision.items())), "vision_end_token_id": _special_id(p, "<|vision_end|>"),
        "vision_start_token_id": _special_id(p, "<|vision_start|>"),
    }


def _side_configs(p: dict) -> dict[str, dict]:
    """generation_config.json and the image/video preprocessor configs (what vLLM's Qwen3-VL
    processor reads), keyed by file name."""
    eot, v = _special_id(p, "<|endoftext|>"), p["vision"]
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "merge_size": v["spatial_merge_size"],
              "patch_size": v["patch_size"], "processor_class": "Qwen3VLProcessor", "resample": 3,
              "rescale_factor": 1 / 255, "temporal_patch_size": v["temporal_patch_size"]}
    return {
        "generation_config.json": {"bos_token_id": eot, "do_sample": False,
                                   "eos_token_id": [_special_id(p, "<|im_end|>"), eot], "pad_token_id": eot},
        "preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessor",
                                     "size": {"longest_edge": 16777216, "shortest_edge": 65536}},
        "video_preprocessor_config.json": {
            **common, "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"longest_edge": p.get("video_max_pixels", PUBLISHED_VIDEO_MAX_PIXELS), "shortest_edge": 4096},
            "fps": 2, "min_frames": 4,
            "max_frames": 768},
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _remove_weights(out: Path) -> None:
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)


def _write_safetensors(out: Path, tensors: dict, num_shards: int) -> None:
    """One file, or ``num_shards`` files of about equal size (names in sorted order, at least one tensor
    each; ``make_checkpoint`` refuses more shards than tensors) + index."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    if num_shards == 1:
        save_file({n: tensors[n] for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in names}
    total = sum(sizes.values())
    shards: list[list[str]] = [[]]
    acc = 0
    for j, n in enumerate(names):
        # a new shard at each size threshold, and at the end one per tensor while shards are missing:
        # a tensor larger than a shard's share crosses several thresholds at once
        missing = num_shards - len(shards)
        if missing and shards[-1] and (acc >= total / num_shards * len(shards) or len(names) - j <= missing):
            shards.append([])
        shards[-1].append(n)
        acc += sizes[n]
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _check_args(out: Path, preset: str, seed: int, num_shards: int, config_only: bool, force: bool) -> None:
    if preset not in PRESETS:
        raise BadInput(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if not isinstance(seed, int) or seed < 0:
        raise BadInput(f"seed must be an integer >= 0, got {seed!r}")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise BadInput(f"number of shards must be an integer >= 1, got {num_shards!r}")
    if PRESETS[preset]["config_only"] and not config_only:
        raise BadInput(f"preset {preset!r} is full size and config-only: write no weights and load it "
                       "with load_format='dummy'")
    if config_only and num_shards != 1:
        why = f"preset {preset!r} is config-only" if PRESETS[preset]["config_only"] else "config_only is set"
        raise BadInput(f"{num_shards} weight shards asked for, but {why}: no weights are written")
    if out.exists() and not out.is_dir():
        raise BadInput(f"output path {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists() and not force:
        raise BadInput(f"output directory {str(out)!r} is not empty and holds no config.json; "
                       "pass --force (force=True) to write into it anyway")


def make_checkpoint(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, num_shards: int = 1, *,
                    config_only: bool | None = None, force: bool = False, fp8: bool = False) -> Path:
    """Write ``preset`` into ``out_dir`` and return its path (``fp8``: in the block-wise FP8 layout,
    the same weights as without it, quantized).

    ``config_only`` defaults to the preset's own setting (True for the full-size presets, whose
    weights are refused: tens of GB of random numbers help no one). ``out_dir`` may be missing,
    empty or a checkpoint (holds a config.json), which is then overwritten: its old weight files
    are removed, so a config-only rewrite leaves no stale weights. Any other non-empty directory
    is refused unless ``force``, so that a mistyped path does not fill a directory with files.
    Bad arguments raise :class:`BadInput` before anything is written.
    """
    out = Path(out_dir)
    p = PRESETS.get(preset, {})
    config_only = p.get("config_only", False) if config_only is None else config_only
    _check_args(out, preset, seed, num_shards, config_only, force)
    config = build_config(p)
    if fp8:
        config["quantization_config"] = fp8_quantization_config(tensor_specs(config))
    weights = None
    if not config_only:  # made before anything is written: the number of shards is checked against them
        weights = make_weights(config, seed)
        weights = to_fp8(weights) if fp8 else weights
        if num_shards > len(weights):
            raise BadInput(f"{num_shards} weight shards asked for, but preset {preset!r}"
                           f"{' in fp8' if fp8 else ''} has {len(weights)} tensors and a shard holds at least "
                           f"one: pass --num-shards {len(weights)} or fewer")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    for name, obj in _side_configs(p).items():
        _write_json(out / name, obj)
    (out / "tokenizer.json").write_text(build_tokenizer(p["text"]["vocab_size"], p["special_start"]),
                                        encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(p))
    _remove_weights(out)
    if weights is not None:
        _write_safetensors(out, weights, num_shards)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qwen36_pcp.tools.make_checkpoint", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a random-weight checkpoint laid out like a published Qwen3.6 release "
                    "(config, tokenizer, bf16 safetensors), or only its config and tokenizer.",
        epilog="OUT_DIR may be missing, empty, or an earlier checkpoint (holds config.json), which is "
               "overwritten and loses its old weight files; any other non-empty directory needs --force. "
               "The full-size presets are config-only: load them with vLLM's load_format='dummy'.")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint into")
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS), metavar="PRESET",
                    help=f"model shape, one of {', '.join(PRESETS)}: the tiny ones (MoE, dense) get random "
                         "weights, the others are the real full-size configs")
    ap.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random weights (>= 0)")
    ap.add_argument("--num-shards", type=int, default=1, metavar="N",
                    help="split the weights into this many files plus model.safetensors.index.json "
                         "(at most one per tensor)")
    ap.add_argument("--config-only", action="store_true",
                    help="write config and tokenizer but no weights (implied by the full-size presets)")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty directory that is not a checkpoint")
    ap.add_argument("--fp8", action="store_true",
                    help="block-wise FP8 (128x128 scales) in the layout of the published Qwen3.6-35B-A3B-FP8")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = make_checkpoint(args.out_dir, args.preset, args.seed, args.num_shards,
                              config_only=True if args.config_only else None, force=args.force, fp8=args.fp8)
    except BadInput as e:
        ap.error(str(e))
    except OSError as e:  # e.g. a parent of OUT_DIR is a file, or no permission
        ap.error(f"cannot write {args.out_dir}: {e}")
    files = sorted(f for f in out.iterdir() if f.is_file())
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {out} ({args.preset}{', fp8' if args.fp8 else ''}, seed {args.seed}) in "
          f"{time.perf_counter() - t0:.1f}s, "
          f"{total / 2**20:.1f} MiB:")
    for f in files:
        print(f"  {f.name:40s} {f.stat().st_size:>12,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
