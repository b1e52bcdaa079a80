"""Every place where qwen36_pcp touches vLLM internals. Written for vLLM 0.20.2.

Each hook is named after what it fixes, is installed at most once per process (``install`` is
idempotent; ``qwen36_pcp.register`` installs them only on vLLM 0.20.2), and acts only when the running
model is ``Qwen3_6ForCausalLM`` with prefill_context_parallel_size > 1; otherwise it calls vLLM's code
unchanged. One opt-in exception: ``QWEN36_PCP_DETERMINISTIC_GDN=1`` applies the workaround for vLLM's
GDN kernel race (``race_free_gdn_kkt``) in every process, for exact comparisons at pcp == 1.

KV cache under PCP: vLLM 0.20.2 would SHARD the KV cache over PCP ranks (and rejects hybrid models).
We keep it REPLICATED: every PCP rank holds the whole KV cache and every request's GDN states, so block
accounting and slot mapping are those of pcp == 1, consistently in the engine core (scheduler, KV-cache
sizing) and in the workers (block tables, slot mapping). Split steps write all ranks' new K/V into every
rank's cache; decode then runs replicated on every rank.

Experts under PCP: vLLM 0.20.2 shards them over TP x PCP; our model keeps them whole on every PCP
rank unless ``moe_experts="sharded"`` (``whole_experts_on_every_pcp_rank``).

Runner: each step's plan comes from the scheduler output (identical on all ranks); split steps run
without CUDA graphs (captured for whole-batch sizes; the torch.compile'd graph still runs), each rank
runs the model on its token slice, and an all-gather brings every rank the rows vLLM reads next (each
request's last row; every row when a request wants prompt logprobs), so sampling, logprobs and prompt
logprobs see exactly what they see at pcp == 1.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import sys

import numpy as np
import torch

from .checks import (
    cli_no_gpu_message,
    names_our_architecture,
    nnodes_message,
    no_gpu_message,
    triton_gdn_prefill_under_pcp,
    validate_pcp_config,
    wants_whole_experts,
)
from .config import ARCHITECTURE, pcp_config_of, uses_pcp
from .plan import PCPPlan


_PATCHED_MARK = "__qwen36_pcp_original__"
_installed = False
# Set in a worker process once its model runner serves our model with pcp > 1.
_worker_kv_replicated = False
# True while our model's layers are built with whole experts on every PCP rank.
_building_whole_experts = False
# Set in a front-end process once it has made an engine config for our model with pcp > 1.
_front_end_serves_pcp = False


def _as_pcp1(vllm_config):
    """A shallow copy of the config that says pcp == 1 (for replicated-KV block accounting)."""
    view = copy.copy(vllm_config)
    parallel = copy.copy(vllm_config.parallel_config)
    object.__setattr__(parallel, "prefill_context_parallel_size", 1)
    object.__setattr__(view, "parallel_config", parallel)
    return view


def _patch(owner, name: str, make_wrapper) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` once (idempotent; a static method stays one)."""
    current = getattr(owner, name)
    if getattr(current, _PATCHED_MARK, None) is not None:
        return
    wrapper = make_wrapper(current)
    functools.update_wrapper(wrapper, current)
    setattr(wrapper, _PATCHED_MARK, current)
    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        wrapper = staticmethod(wrapper)
    setattr(owner, name, wrapper)


# =============================================================================== startup checks
def install_startup_checks() -> None:
    """Run our checks where vLLM verifies model-specific config (VllmConfig.__post_init__)."""
    from vllm.model_executor.models import config as model_configs

    base = model_configs.MODELS_CONFIG_MAP["Qwen3_5MoeForConditionalGeneration"]
    if model_configs.MODELS_CONFIG_MAP.get(ARCHITECTURE) is not None:
        return

    class Qwen36PCPConfig(base):
        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            base.verify_and_update_config(vllm_config)  # Qwen3.5's mamba_ssm_dtype handling
            validate_pcp_config(vllm_config)
            triton_gdn_prefill_under_pcp(vllm_config)

    model_configs.MODELS_CONFIG_MAP[ARCHITECTURE] = Qwen36PCPConfig


def startup_messages_before_config() -> None:
    """Our model at pcp > 1 with engine arguments that vLLM 0.20.2 refuses in words that name neither
    PCP nor the fix: one message with the numbers instead, raised before vLLM's own code.

    * No NVIDIA GPU (``checks.no_gpu_message``) instead of vLLM's "Device string must not be empty".
      Our config hook comes too late for it: vLLM fails before any config exists, in the
      ``DeviceConfig`` of an empty device type (a machine without a GPU gets vLLM's
      ``UnspecifiedPlatform``). ``vllm serve`` fails even earlier, while building its argument parser
      (``EngineArgs.add_cli_args`` computes the ``DeviceConfig`` default: "Failed to infer device
      type"), before any argument is parsed: when that fails, the command line (``sys.argv``) is read
      for our model and pcp, and vLLM's error is replaced only if it asks for both.
    * PCP across nodes with tp x pp x dp not a multiple of nnodes (``checks.nnodes_message``) instead
      of vLLM's bare assertion "world_size=1 must be divisible by nnodes=2", which leaves PCP out.

    Both are checked first thing in ``EngineArgs.create_engine_config`` (what ``LLM(...)``, the engine
    and a parsed ``vllm serve`` call first, where the engine arguments are first seen whole), in the
    order vLLM meets them: the device, then the nodes. Only for our model (named in ``hf_overrides``
    or in a local config.json) at pcp > 1, as every hook here: anything else (pcp == 1, vLLM's own
    models) keeps vLLM's behaviour and messages. The CPU tests' fake CUDA platform has device type
    ``"cuda"``: no GPU message there.
    """
    from vllm.engine.arg_utils import EngineArgs

    def device_type() -> str:
        from vllm import platforms

        return getattr(platforms.current_platform, "device_type", "") or ""

    def make_create(orig):
        def create_engine_config(self, *args, **kwargs):
            global _front_end_serves_pcp
            if self.prefill_context_parallel_size > 1 and names_our_architecture(self.model, self.hf_overrides):
                message = no_gpu_message(self.prefill_context_parallel_size, self.tensor_parallel_size,
                                         device_type())
                if message is not None:
                    raise RuntimeError(message)
                message = nnodes_message(self.tensor_parallel_size, self.pipeline_parallel_size,
                                         self.data_parallel_size, self.prefill_context_parallel_size,
                                         self.nnodes)
                if message is not None:
                    raise ValueError(message)
            config = orig(self, *args, **kwargs)
            if uses_pcp(config):  # this process is a front end of ours (detokenizer_prompt_tail)
                _front_end_serves_pcp = True
            return config

        return create_engine_config

    def make_cli(orig):
        def add_cli_args(parser, *args, **kwargs):
            try:
                return orig(parser, *args, **kwargs)
            except RuntimeError as e:
                message = cli_no_gpu_message(sys.argv[1:], device_type())
                if message is None or "device type" not in str(e):  # vLLM's "Failed to infer device type"
                    raise
                raise RuntimeError(message) from e

        return add_cli_args

    _patch(EngineArgs, "create_engine_config", make_create)
    _patch(EngineArgs, "add_cli_args", make_cli)


# ============================================================ front end: first token's detokenization
PROMPT_TAILS = (32, 256, 2048)  # prompt tokens to prime the detokenizer with: the first whose text is not empty


def detokenizer_prompt_tail() -> None:
    """Detokenize a request's first output token from the end of its prompt, not the whole prompt.

    vLLM 0.20.2's ``FastIncrementalDetokenizer`` primes tokenizers' ``DecodeStream`` with every prompt
    id, and the stream's first step decodes the whole prompt twice: about a microsecond per prompt
    token on the first token's path (``benchmarks/bench_detokenizer.py``), the same at every pcp, so
    the more ranks the larger its share of TTFT. The stream emits the decoded primed ids + token minus
    the decoded primed ids, and after its first emitted text keeps only the new ids. With a byte-level
    decoder (Qwen's) the text is UTF-8 decoded from the ids' bytes, which resumes at the next whole
    character: priming with a tail of the prompt whose text is not empty and does not end in an
    unfinished character ('\ufffd') emits the same text, character for character. A prompt whose text
    ends in '\ufffd' (then the stream behaves differently; a longer tail would end the same way),
    short prompts and other decoders keep vLLM's priming. Only in a process that made an engine config
    for our model at pcp > 1 (``_front_end_serves_pcp``, set by ``startup_messages_before_config``).
    """
    import msgspec
    from vllm.v1.engine import detokenizer

    def make(orig):
        def __init__(self, tokenizer, request):
            tail = prompt_tail(tokenizer, request) if _front_end_serves_pcp else None
            if tail is not None:
                request = msgspec.structs.replace(request, prompt_token_ids=tail)
            orig(self, tokenizer, request)

        return __init__

    _patch(detokenizer.FastIncrementalDetokenizer, "__init__", make)


def prompt_tail(tokenizer, request) -> list[int] | None:
    """The prompt's last ids that prime the detokenizer as the whole prompt does, or None."""
    from tokenizers import decoders

    ids = request.prompt_token_ids
    backend = tokenizer._tokenizer
    if ids is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    for n in PROMPT_TAILS:
        if len(ids) <= n:
            return None
        text = backend.decode(ids[-n:], skip_special_tokens=request.sampling_params.skip_special_tokens)
        if text:  # else only skipped or empty tokens: a longer tail
            return None if text.endswith("\ufffd") else ids[-n:]
    return None


# ================================================================ model: whole experts per rank
@contextlib.contextmanager
def whole_experts_on_every_pcp_rank(vllm_config):
    """Build our model's MoE layers with every expert whole on each PCP rank (no-op otherwise).

    vLLM 0.20.2 shards each expert's intermediate dimension over TP x PCP and wraps the experts in a
    PCP all-gather and a bf16 reduce-scatter. That is tp=2's MoE arithmetic: it alone moves pcp=2 as
    far from pcp=1 as tp=2 is (docs/validation.md), and it costs two
    collectives per MoE layer in every step, decode included. With whole experts each rank runs its
    own tokens through pcp=1's kernel, which gives every token the same bits whatever the batch split
    (checked with vLLM's GEMM and fused-MoE kernels), and decode needs no MoE collective; the price is the experts'
    full memory on every GPU (checked at startup). ``moe_experts="sharded"`` keeps vLLM's way.
    """
    global _building_whole_experts
    if not wants_whole_experts(vllm_config):
        yield
        return
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    def make(orig):
        def __init__(self, *args, **kwargs):
            if _building_whole_experts and kwargs.get("pcp_size") is None:
                kwargs["pcp_size"] = 1  # FusedMoEParallelConfig then flattens TP over TP alone
            orig(self, *args, **kwargs)

        return __init__

    _patch(FusedMoE, "__init__", make)
    _building_whole_experts = True
    try:
        yield
    finally:
        _building_whole_experts = False


# ============================================================= engine core: replicated KV cache
def replicated_kv_block_sizes() -> None:
    """Hybrid models have several KV groups; 0.20.2 raises for those under PCP. Resolve as pcp == 1."""
    import vllm.v1.engine.core as core

    def make(orig):
        def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
            if uses_pcp(vllm_config):
                vllm_config = _as_pcp1(vllm_config)
            return orig(kv_cache_config, vllm_config)

        return resolve_kv_cache_block_sizes

    _patch(core, "resolve_kv_cache_block_sizes", make)


def replicated_kv_scheduler_accounting() -> None:
    """The scheduler's KV-cache manager (and its hybrid/mamba asserts) sees pcp == 1."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def make(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            if not uses_pcp(vllm_config):
                return orig(self, vllm_config, *args, **kwargs)
            orig(self, _as_pcp1(vllm_config), *args, **kwargs)
            self.vllm_config = vllm_config
            self.parallel_config = vllm_config.parallel_config

        return __init__

    _patch(Scheduler, "__init__", make)


def replicated_kv_memory_sizing() -> None:
    """A full-attention layer needs the whole sequence's KV on every PCP rank, not 1/pcp of it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def make(orig):
        def max_memory_usage_bytes(self, vllm_config):
            if uses_pcp(vllm_config):
                vllm_config = _as_pcp1(vllm_config)
            return orig(self, vllm_config)

        return max_memory_usage_bytes

    _patch(FullAttentionSpec, "max_memory_usage_bytes", make)


# =================================================================== worker: replicated KV cache
def replicated_kv_block_tables() -> None:
    """Block tables and slot mapping as at pcp == 1 (the whole sequence's slots on every rank)."""
    import vllm.v1.worker.block_table as block_table
    import vllm.v1.worker.gpu_model_runner as gmr

    def make_init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if _worker_kv_replicated:
                self.pcp_world_size, self.pcp_rank = 1, 0

        return __init__

    _patch(block_table.BlockTable, "__init__", make_init)

    def make_size(orig):
        def get_total_cp_world_size():
            total = orig()
            if _worker_kv_replicated:
                from vllm.distributed import get_pcp_group

                total //= get_pcp_group().world_size
            return total

        return get_total_cp_world_size

    for module in (block_table, gmr):
        _patch(module, "get_total_cp_world_size", make_size)


# ======================================================================== worker: the runner
class RunnerPCPState:
    """Per model runner: the PCP config and group, and the step's split decision."""

    def __init__(self, vllm_config):
        from vllm.distributed import get_pcp_group

        self.config = pcp_config_of(vllm_config)
        self.group = get_pcp_group()
        self.world_size = self.group.world_size
        self.rank = self.group.rank_in_group
        self.split_step = False

    def plan(self, runner, num_tokens_padded: int) -> PCPPlan | None:
        num_reqs = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        num_new = np.diff(qsl).astype(np.int64)
        if not self.config.step_splits(num_new, self.world_size):
            return None
        num_computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        return PCPPlan(num_computed, num_new, self.world_size, self.rank, self.config,
                       num_tokens_padded=num_tokens_padded)


def _state(runner) -> RunnerPCPState | None:
    state = getattr(runner, "_qwen36_pcp", None)
    if state is None and uses_pcp(runner.vllm_config):
        state = runner._qwen36_pcp = RunnerPCPState(runner.vllm_config)
    return state


def runner_split_steps() -> None:
    """Split each long prompt over the PCP ranks inside the V1 GPU model runner."""
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .layers.context import FORWARD_CONTEXT_KEY, PCPContext

    def make_init(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            global _worker_kv_replicated
            if uses_pcp(vllm_config):
                _worker_kv_replicated = True
                if race_free_gdn_kkt_wanted(pcp=True):
                    race_free_gdn_kkt()
            orig(self, vllm_config, *args, **kwargs)

        return __init__

    def make_execute(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            state = _state(self)
            if state is None:
                return orig(self, scheduler_output, *args, **kwargs)
            state.split_step = state.config.step_splits(
                scheduler_output.num_scheduled_tokens.values(), state.world_size
            )
            try:
                return orig(self, scheduler_output, *args, **kwargs)
            finally:
                state.split_step = False

        return execute_model

    def make_padding(orig):
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            state = getattr(self, "_qwen36_pcp", None)
            if state is not None and state.split_step:
                # CUDA graphs were captured for full-batch sizes; a split step runs a local slice
                # (through the compiled graph where there is one: force_eager only skips the graphs).
                kwargs["force_eager"] = True
            return orig(self, *args, **kwargs)

        return _determine_batch_execution_and_padding

    def make_forward(orig):
        def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                           inputs_embeds=None, **model_kwargs):
            state = _state(self)
            if state is None:
                return orig(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                            **model_kwargs)
            full = input_ids if input_ids is not None else inputs_embeds
            plan = state.plan(self, full.shape[0]) if state.split_step else None
            if plan is None:
                hidden = orig(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                              **model_kwargs)
                return _same_sample_rows(self, state, hidden)
            ctx = PCPContext(plan, state.group, full.device)
            idx = ctx.t.local_idx
            forward_context = get_forward_context()
            forward_context.additional_kwargs[FORWARD_CONTEXT_KEY] = ctx
            try:
                hidden = orig(
                    self,
                    None if input_ids is None else input_ids.index_select(0, idx),
                    None if positions is None else positions.index_select(-1, idx),
                    intermediate_tensors,
                    None if inputs_embeds is None else inputs_embeds.index_select(0, idx),
                    **model_kwargs,
                )
            finally:
                forward_context.additional_kwargs.pop(FORWARD_CONTEXT_KEY, None)
            # vLLM 0.20.2 reads every row only for prompt logprobs (``_get_prompt_logprobs_dict``);
            # otherwise ``hidden_states[logits_indices]``, each request's last row (speculative
            # decoding and pooling, which read more, are refused at startup)
            return ctx.gather_output(hidden, plan.num_tokens_padded, all_rows=bool(self.num_prompt_logprobs))

        return _model_forward

    _patch(GPUModelRunner, "__init__", make_init)
    _patch(GPUModelRunner, "execute_model", make_execute)
    _patch(GPUModelRunner, "_determine_batch_execution_and_padding", make_padding)
    _patch(GPUModelRunner, "_model_forward", make_forward)


def _same_sample_rows(runner, state: RunnerPCPState, hidden: torch.Tensor) -> torch.Tensor:
    """Unsplit steps run replicated; make the rows that get sampled bit-identical on every rank.

    (With ``moe_experts="sharded"`` and more than two ranks vLLM's MoE reduce-scatter may sum in a
    different order per rank; every rank must sample the same token because it feeds its own sample
    into the next step.)
    """
    num_reqs = runner.input_batch.num_reqs
    return rank0_rows(state.group, hidden, runner.query_start_loc.gpu[1 : num_reqs + 1].long() - 1)


def rank0_rows(group, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden`` with its ``rows`` replaced in place by rank 0's (one all-gather of those rows)."""
    rank0 = group.all_gather(hidden.index_select(0, rows).contiguous(), dim=0)[: rows.shape[0]]
    hidden.index_copy_(0, rows, rank0)
    return hidden


# ============================================================ vLLM 0.20.2: GDN prefill kernel race
DETERMINISTIC_GDN_ENV = "QWEN36_PCP_DETERMINISTIC_GDN"


def race_free_gdn_kkt() -> bool:
    """Keep vLLM's GDN ``chunk_scaled_dot_kkt_fwd`` kernel to its autotune configs without a race.

    In vLLM 0.20.2 (Triton 3.6, H200) this kernel (beta * K K^T per 64-token chunk, the first step
    of every GDN prefill) gives different results for identical inputs under 9 to 11 of its 27
    autotune configs (by shape and length), all of which loop over K in blocks of 32 or 64 with 4 or
    8 warps (up to 10 distinct outputs in 10 runs, entries off by up to 2e-2), and its autotuner may
    pick one of them. That is why vLLM's own answers to a prompt of more than ~2k tokens changed
    from run to run. The configs with BK == 128 cover Qwen3.6's K = 128 in one block and were
    bitwise repeatable in every sweep (``python -m tests.gpu.diagnose kkt-race --sweep-configs``);
    at 32k-128k tokens of the Qwen3.6-35B-A3B shape they cost ~0.1% of TTFT. Idempotent; False when
    this vLLM's kernel has no such config (then nothing changes).
    """
    from vllm.model_executor.layers.fla.ops import chunk_scaled_dot_kkt

    # @heuristics -> @autotune -> @jit (without a GPU vLLM puts a plain function there)
    tuner = getattr(chunk_scaled_dot_kkt.chunk_scaled_dot_kkt_fwd_kernel, "fn", None)
    if tuner is None:
        return False
    first = getattr(tuner, _PATCHED_MARK, None) is None
    applied = keep_autotune_configs(tuner, lambda c: c.kwargs.get("BK") == 128)
    if applied and first:  # under vLLM's logger, so that it shows in the engine's log
        logging.getLogger("vllm.qwen36_pcp").info(
            "qwen36_pcp: vLLM's GDN kernel chunk_scaled_dot_kkt_fwd kept to its race-free autotune "
            "configs (BK=128; %s=0 turns this off)", DETERMINISTIC_GDN_ENV)
    return applied


def keep_autotune_configs(tuner, keep) -> bool:
    """Restrict a Triton autotuner to the configs ``keep`` accepts, once (False: none would remain)."""
    if getattr(tuner, _PATCHED_MARK, None) is not None:
        return True
    configs = list(getattr(tuner, "configs", None) or [])
    kept = [c for c in configs if keep(c)]
    if not kept:
        return False
    setattr(tuner, _PATCHED_MARK, configs)
    tuner.configs = kept
    tuner.cache.clear()  # choices made among the old configs (the on-disk cache keys on the list)
    return True


def race_free_gdn_kkt_wanted(pcp: bool) -> bool:
    """On by default where PCP runs (pcp > 1, our model); ``QWEN36_PCP_DETERMINISTIC_GDN=1`` turns it
    on in every vLLM process (pcp == 1 and vLLM's own models included: for exact comparisons),
    ``=0`` turns it off everywhere."""
    value = os.environ.get(DETERMINISTIC_GDN_ENV, "").strip()
    return value == "1" or (pcp and value != "0")


# ==================================================================================== install
def install() -> None:
    """Install every hook (idempotent). ``register()`` calls it only on vLLM 0.20.2."""
    global _installed
    if _installed:
        return
    install_startup_checks()
    startup_messages_before_config()
    detokenizer_prompt_tail()
    replicated_kv_block_sizes()
    replicated_kv_scheduler_accounting()
    replicated_kv_memory_sizing()
    replicated_kv_block_tables()
    runner_split_steps()
    if race_free_gdn_kkt_wanted(pcp=False):
        race_free_gdn_kkt()
    _installed = True
