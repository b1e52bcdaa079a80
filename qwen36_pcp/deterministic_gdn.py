# SPDX-License-Identifier: Apache-2.0
"""One answer from vLLM's GDN prefill kernels, whatever their autotuners pick: keep three of them to
configs that give one output.

vLLM 0.20.2's GDN prefill (``chunk_gated_delta_rule``, Triton 3.6) autotunes its kernels by speed, keyed
on head counts and sizes but not on the token count: a process picks each kernel's config at its first
prefill (vLLM's profile run, of a length that differs between pcp=1 and a PCP rank) and keeps it. Three
kernels' outputs depend on that pick (``python -m tests.gpu.diagnose kkt-race --config-sensitivity``,
each kernel pinned to each of its configs in turn while the others run their own picks, 300 to 131072
tokens, the tiny and the 35B shapes with 128-wide values, one H200):

* ``chunk_scaled_dot_kkt_fwd`` (beta * K K^T per 64-token chunk) gives different results for identical
  inputs under 9 to 11 of its 27 configs, all looping over K in blocks of 32 or 64 (up to 10 distinct
  outputs in 10 runs, entries off by up to 2e-2): vLLM's own answers to a prompt of more than ~2k
  tokens changed from run to run. Its BK=128 configs cover Qwen3.6's K = 128 in one block and were
  bitwise repeatable in every sweep.
* ``chunk_fwd_o`` (the output of each chunk) is repeatable under each config, but its BK=64 configs
  with 2 warps give another output than the rest (up to 2.4e-4 apart at 128k tokens); its BK=128
  configs give one.
* ``solve_tril``'s 64x64 merge: its 2-warp configs give another output than its 4- and 8-warp ones at
  32k and 128k tokens (up to 1.5e-5); at 300 and 4096, one output. Kept to the 2-warp ones, which
  were also the fastest there (one timing each).

With those kept, each of the three gave one output under every kept config at the lengths and shapes
swept, so a PCP rank's and pcp=1's picks, or a cold and a warm engine's, no longer part them there;
not yet checked with all three kept at once, nor at state passing's 256-wide augmented values. On GPUs
with less shared memory than Hopper's vLLM's ``chunk_o`` has no BK=128 config: it is left as it is,
with a warning. What it costs: ``docs/design.md`` (Determinism); ``--pin-cost`` times each kernel
autotuned at the prompt's length among all its configs against among the kept ones.

On by default where PCP runs (the PCP worker applies it); ``QWEN36_PCP_DETERMINISTIC_GDN=1`` applies it
in every vLLM process (pcp == 1 and vLLM's own models included: for exact comparisons), ``=0`` nowhere.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

DETERMINISTIC_GDN_ENV = "QWEN36_PCP_DETERMINISTIC_GDN"
ORIGINAL_CONFIGS = "__qwen36_pcp_original_configs__"

logger = logging.getLogger("vllm.qwen36_pcp")  # under vLLM's logger, so that it shows in the engine's log


@dataclass(frozen=True)
class ConfigPin:
    """A GDN prefill kernel of vLLM (``vllm.model_executor.layers.fla.ops.<module>.<kernel>``) kept to
    the autotune configs ``keep`` accepts (described by ``kept``), because of ``why``."""

    module: str
    kernel: str
    keep: Callable
    kept: str
    why: str

    def tuner(self, load: bool = True):
        """The kernel's Triton autotuner: under ``@heuristics`` (``.fn``) or bare; None where this vLLM
        has no autotuner there (without a GPU vLLM puts plain functions in place of its kernels), or
        without ``load`` where its module is not imported yet (importing vLLM's fla ops reads the GPU's
        name: a front end restoring nothing should not)."""
        name = f"vllm.model_executor.layers.fla.ops.{self.module}"
        mod = importlib.import_module(name) if load else sys.modules.get(name)
        obj = getattr(mod, self.kernel, None)
        for tuner in (obj, getattr(obj, "fn", None)):
            if hasattr(tuner, "configs") and hasattr(tuner, "cache"):  # triton's Autotuner
                return tuner
        return None


def _block_k(c) -> int | None:
    return c.kwargs.get("BK")


PINS = (
    ConfigPin("chunk_scaled_dot_kkt", "chunk_scaled_dot_kkt_fwd_kernel", lambda c: _block_k(c) == 128,
              "BK=128", "its other configs race"),
    ConfigPin("chunk_o", "chunk_fwd_kernel_o", lambda c: _block_k(c) == 128,
              "BK=128", "its BK=64, 2-warp configs give another output"),
    ConfigPin("solve_tril", "merge_16x16_to_64x64_inverse_kernel", lambda c: c.num_warps == 2,
              "2-warp", "its 4- and 8-warp configs give another output"),
)


_warned: set[str] = set()  # kernels left as they are, said once per process


def pin_gdn_configs_wanted(pcp: bool) -> bool:
    """On where PCP runs unless ``QWEN36_PCP_DETERMINISTIC_GDN=0``; everywhere with ``=1``."""
    value = os.environ.get(DETERMINISTIC_GDN_ENV, "").strip()
    return value == "1" or (pcp and value != "0")


def pin_gdn_configs(pins=PINS) -> list[str]:
    """Keep each pin's kernel to its kept configs. Idempotent; returns the kernels kept (a kernel this
    vLLM has without an autotuner is left as it is; one without such a config too, with a warning)."""
    applied = []
    for pin in pins:
        tuner = pin.tuner()
        first = tuner is not None and getattr(tuner, ORIGINAL_CONFIGS, None) is None
        if tuner is not None and keep_autotune_configs(tuner, pin.keep):
            applied.append(pin.kernel)
            if first:
                logger.info("qwen36_pcp: vLLM's GDN kernel %s kept to its %s autotune configs (%s; %s=0 "
                            "turns this off)", pin.kernel, pin.kept, pin.why, DETERMINISTIC_GDN_ENV)
        elif tuner is not None and pin.kernel not in _warned:
            _warned.add(pin.kernel)
            logger.warning("qwen36_pcp: vLLM's GDN kernel %s has no %s autotune config: left as it is, "
                           "its output may depend on its autotuner's pick", pin.kernel, pin.kept)
    return applied


def restore_gdn_configs(pins=PINS) -> None:
    """Give each pin's kernel's autotuner all its configs back."""
    for pin in pins:
        tuner = pin.tuner(load=False)
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
