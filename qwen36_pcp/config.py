# SPDX-License-Identifier: Apache-2.0
"""The plugin's options and the one question every hook asks first: is this our model at pcp > 1?

A leaf module (it imports nothing of the package), so the model, the plan and the runner hooks can
all read it without importing each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
from dataclasses import dataclass

import numpy as np

ARCHITECTURE = "Qwen3_6ForCausalLM"  # text only (the vision tower of a published checkpoint is skipped)
VL_ARCHITECTURE = "Qwen3_6ForConditionalGeneration"  # with the vision tower: images and video
ARCHITECTURES = (ARCHITECTURE, VL_ARCHITECTURE)
OPTIONS_KEY = "qwen36_pcp"  # additional_config={"qwen36_pcp": {...}}

LAYOUTS = ("zigzag", "contiguous")
GDN_MODES = ("relay", "state_passing", "island")
MOE_EXPERTS = ("replicated", "sharded")
VISION_ENCODER = ("split", "replicated")
DECODE = ("replicated", "spread")
MTP_FIRST_PASS = ("whole", "split")

# vLLM's name for a drafter built from the checkpoint's own ``mtp.*`` head, and the draft architectures
# that Qwen3.5 / Qwen3.6 checkpoints become (``SpeculativeConfig.hf_config_override``)
MTP_METHOD = "mtp"
MTP_DRAFTERS = ("Qwen3_5MoeMTP", "Qwen3_5MTP")

# fla's chunk size: the chunked GDN kernels cut every sequence into 64-token chunks from its start.
GDN_CHUNK = 64


@dataclass(frozen=True)
class PCPConfig:
    """User-facing PCP options, from ``additional_config={"qwen36_pcp": {...}}``."""

    layout: str = "zigzag"
    gdn_mode: str = "relay"
    # below a few thousand new tokens a step is bound by the host launching its kernels, which a split
    # does not shorten: the step-time model puts the break-even of a fresh prompt at about 8k tokens
    # for every pcp (eager), of a chunk deep in a long prompt at 3k-6k; 4096 keeps vLLM's 8192-token
    # serve chunks split beside decode rows (docs/performance.md)
    min_split_tokens: int = 4096
    moe_experts: str = "replicated"
    # the vision-language class: each rank encodes its share of a step's frames (layers/vision_split.py),
    # or every rank encodes every image and video (pcp=1's bits)
    vision_encoder: str = "split"
    # decode rows: computed by every rank (pcp=1's bits), or each by the one rank that owns the request
    # while it decodes (``decode_owners.py``): a rank's decode step then computes about 1/N of the rows
    decode: str = "replicated"
    # the MTP drafter's first pass at a split step: each rank over its own rows with the step's plan
    # (``draft_first_pass.py``), or every rank over every row (the target's rows all gathered first)
    mtp_first_pass: str = "split"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"qwen36_pcp: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.gdn_mode not in GDN_MODES:
            raise ValueError(
                f"qwen36_pcp: gdn_mode must be one of {GDN_MODES}, got {self.gdn_mode!r}"
            )
        if self.moe_experts not in MOE_EXPERTS:
            raise ValueError(
                f"qwen36_pcp: moe_experts must be one of {MOE_EXPERTS}, got {self.moe_experts!r}"
            )
        if self.vision_encoder not in VISION_ENCODER:
            raise ValueError(
                f"qwen36_pcp: vision_encoder must be one of {VISION_ENCODER}, got {self.vision_encoder!r}"
            )
        if self.decode not in DECODE:
            raise ValueError(f"qwen36_pcp: decode must be one of {DECODE}, got {self.decode!r}")
        if self.mtp_first_pass not in MTP_FIRST_PASS:
            raise ValueError(f"qwen36_pcp: mtp_first_pass must be one of {MTP_FIRST_PASS}, "
                             f"got {self.mtp_first_pass!r}")
        if not isinstance(self.min_split_tokens, int) or self.min_split_tokens < 1:
            raise ValueError(
                f"qwen36_pcp: min_split_tokens must be an integer >= 1, got {self.min_split_tokens!r}"
            )

    @classmethod
    def from_additional_config(cls, additional_config: dict | None) -> PCPConfig:
        options = (additional_config or {}).get(OPTIONS_KEY, {}) or {}
        if not isinstance(options, dict):
            raise ValueError(f"qwen36_pcp: additional_config['{OPTIONS_KEY}'] must be a JSON object of "
                             f"options, got {options!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"qwen36_pcp: unknown option(s) {unknown} in additional_config['{OPTIONS_KEY}']; "
                f"known: {sorted(known)}"
            )
        return cls(**options)

    def num_blocks(self, world_size: int) -> int:
        return 2 * world_size if self.layout == "zigzag" else world_size

    def split_threshold(self, world_size: int) -> int:
        """Fewest new tokens a request needs to be split: ``min_split_tokens``, and never fewer than
        one whole 64-token GDN chunk per block.

        Why the floor: the GDN relay scans a rank's adjacent blocks (zigzag: blocks N-1 and N) as one
        sequence, and fla's chunked kernels are only right on pieces that are whole chunks. A block
        that is not (blocks of a prompt shorter than 64 x 2N tokens) made the relay's chunk grid
        disagree with the one its chunk-local stage used, which gave NaN (pcp=8, 520-900 tokens).
        With the floor every block but a request's last is a whole number of chunks, so each
        block's scan cuts exactly pcp=1's chunks (the relay is then pcp=1 bit for bit), and a prompt
        too short to give each block a chunk runs replicated, as pcp=1 runs it. The floor is 64 x 2N
        tokens for zigzag (pcp=2: 256, pcp=8: 1024), 64 x N for contiguous.
        """
        return max(int(self.min_split_tokens), GDN_CHUNK * self.num_blocks(world_size))

    def step_splits(self, num_new_tokens, world_size: int) -> bool:
        """Whether a step with these per-request new-token counts splits any request."""
        if world_size <= 1:
            return False
        threshold = self.split_threshold(world_size)
        return bool((np.asarray(num_new_tokens) >= threshold).any())


def misspelled_option_keys(additional_config: dict | None) -> list[str]:
    """Keys of ``additional_config`` that look like a misspelling of ``qwen36_pcp`` (vLLM passes the
    dict through unread, so ``{"qwen36pcp": {...}}`` would otherwise be ignored without a word)."""
    keys = [k for k in (additional_config or {}) if isinstance(k, str) and k != OPTIONS_KEY]
    squeezed = OPTIONS_KEY.replace("_", "")
    return [k for k in keys if difflib.get_close_matches(k.lower().replace("_", "").replace("-", ""),
                                                         [squeezed], n=1, cutoff=0.75)]


def below_split_floor(config: PCPConfig, world_size: int) -> str | None:
    """A note when ``min_split_tokens`` is under the split floor (64 tokens per block), with the value
    in effect; None otherwise."""
    floor = config.split_threshold(world_size)
    if world_size <= 1 or config.min_split_tokens >= floor:
        return None
    return (f"qwen36_pcp: min_split_tokens={config.min_split_tokens} is under the split floor of "
            f"{GDN_CHUNK} tokens per block ({config.num_blocks(world_size)} blocks at "
            f"prefill_context_parallel_size={world_size}, layout={config.layout!r}): prompts of fewer than "
            f"{floor} new tokens run unsplit")


def uses_pcp(vllm_config) -> bool:
    """One of our models with prefill_context_parallel_size > 1: the only case any hook acts on."""
    if vllm_config is None or vllm_config.model_config is None:
        return False
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
    return pcp > 1 and our_architecture(vllm_config) is not None


def our_architecture(vllm_config) -> str | None:
    """The name of our model class the config asks for (``ARCHITECTURES``), or None."""
    archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    return next((a for a in archs if a in ARCHITECTURES), None)


def pcp_config_of(vllm_config) -> PCPConfig:
    return PCPConfig.from_additional_config(vllm_config.additional_config)


# Set while the PCP model runner builds the model (``runner.PCPModelRunner.load_model``): our model at
# pcp > 1 refuses to be built by any other runner, whose block tables would give other ranks' tokens
# the pad slot while the engine core accounts the cache as whole on every rank.
_built_by_pcp_runner: contextvars.ContextVar[bool] = contextvars.ContextVar("qwen36_pcp_runner", default=False)


@contextlib.contextmanager
def pcp_runner_builds_model():
    token = _built_by_pcp_runner.set(True)
    try:
        yield
    finally:
        _built_by_pcp_runner.reset(token)


def built_by_pcp_runner() -> bool:
    return _built_by_pcp_runner.get()
