"""vLLM 0.20.2's GDN prefill kernel race, and the workaround: keep its autotuner to race-free configs.

In vLLM 0.20.2 (Triton 3.6, H200) ``chunk_scaled_dot_kkt_fwd`` (beta * K K^T per 64-token chunk, the
first step of every GDN prefill) gives different results for identical inputs under 9 to 11 of its 27
autotune configs (by shape and length), all of which loop over K in blocks of 32 or 64 with 4 or 8
warps (up to 10 distinct outputs in 10 runs, entries off by up to 2e-2), and its autotuner may pick one
of them. That is why vLLM's own answers to a prompt of more than ~2k tokens changed from run to run.
The configs with BK == 128 cover Qwen3.6's K = 128 in one block and were bitwise repeatable in every
sweep (``python -m tests.gpu.diagnose kkt-race --sweep-configs``); at 32k-128k tokens of the
Qwen3.6-35B-A3B shape they cost ~0.1% of TTFT.

On by default where PCP runs (the PCP worker applies it); ``QWEN36_PCP_DETERMINISTIC_GDN=1`` applies it
in every vLLM process (pcp == 1 and vLLM's own models included: for exact comparisons), ``=0`` nowhere.
"""

from __future__ import annotations

import logging
import os

from vllm.model_executor.layers.fla.ops import chunk_scaled_dot_kkt

DETERMINISTIC_GDN_ENV = "QWEN36_PCP_DETERMINISTIC_GDN"
ORIGINAL_CONFIGS = "__qwen36_pcp_original_configs__"

logger = logging.getLogger("vllm.qwen36_pcp")  # under vLLM's logger, so that it shows in the engine's log


def race_free_gdn_kkt_wanted(pcp: bool) -> bool:
    """On where PCP runs unless ``QWEN36_PCP_DETERMINISTIC_GDN=0``; everywhere with ``=1``."""
    value = os.environ.get(DETERMINISTIC_GDN_ENV, "").strip()
    return value == "1" or (pcp and value != "0")


def _kkt_tuner():
    # @heuristics -> @autotune -> @jit (without a GPU vLLM puts a plain function there: None)
    return getattr(chunk_scaled_dot_kkt.chunk_scaled_dot_kkt_fwd_kernel, "fn", None)


def race_free_gdn_kkt() -> bool:
    """Keep vLLM's ``chunk_scaled_dot_kkt_fwd`` kernel to its BK=128 autotune configs. Idempotent; False
    when this vLLM's kernel has no such config or no autotuner (then nothing changes)."""
    tuner = _kkt_tuner()
    if tuner is None:
        return False
    first = getattr(tuner, ORIGINAL_CONFIGS, None) is None
    applied = keep_autotune_configs(tuner, lambda c: c.kwargs.get("BK") == 128)
    if applied and first:
        logger.info("qwen36_pcp: vLLM's GDN kernel chunk_scaled_dot_kkt_fwd kept to its race-free autotune "
                    "configs (BK=128; %s=0 turns this off)", DETERMINISTIC_GDN_ENV)
    return applied


def restore_gdn_kkt() -> None:
    """Give the kernel's autotuner all its configs back."""
    tuner = _kkt_tuner()
    if tuner is not None:
        restore_autotune_configs(tuner)


def keep_autotune_configs(tuner, keep) -> bool:
    """Restrict a Triton autotuner to the configs ``keep`` accepts, once (False: none would remain)."""
    if getattr(tuner, ORIGINAL_CONFIGS, None) is not None:
        return True
    configs = list(getattr(tuner, "configs", None) or [])
    kept = [c for c in configs if keep(c)]
    if not kept:
        return False
    setattr(tuner, ORIGINAL_CONFIGS, configs)
    tuner.configs = kept
    tuner.cache.clear()  # choices made among the old configs (the on-disk cache keys on the list)
    return True


def restore_autotune_configs(tuner) -> None:
    configs = getattr(tuner, ORIGINAL_CONFIGS, None)
    if configs is not None:
        tuner.configs = configs
        tuner.cache.clear()
        delattr(tuner, ORIGINAL_CONFIGS)
