# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.20.2's own v1 scheduler on a CPU, on a virtual clock: the engine half of ``serve_sim.py``.

vLLM schedules (its ``Scheduler`` / ``AsyncScheduler``, its KV-cache manager with the hybrid model's four KV
groups, chunked prefill, prefix caching, preemption, MTP's scheduled drafts); nothing here decides what a
step holds. A ``Replica`` stands for one engine: it asks vLLM's scheduler for a step, prices it with the
step-time model, feeds back what a model runner would return (one token per finished prompt or decode row,
plus the accepted drafts, at a given acceptance) and moves its clock. What it took to run the scheduler
without a GPU (platform, block sizes, KV specs): ``../shared/research/scheduler-on-cpu.md``.

The scheduler runs with pcp=1's accounting: the plugin keeps every PCP rank's KV cache whole (replicated),
so what the scheduler sees at pcp=N is pcp=1's with one GPU's KV memory; the layout enters the step times
only. ``check_interface`` refuses a vLLM whose scheduler interface is not the one driven here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

WRITTEN_FOR = "0.20.2"
# what this module calls or reads, as vLLM 0.20.2 declares it: leading parameters of each callable, fields
EXPECTED_PARAMETERS = {
    "Scheduler.__init__": ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
                           "hash_block_size"),
    "Scheduler.schedule": ("self",),
    "Scheduler.update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "Scheduler.update_draft_token_ids": ("self", "draft_token_ids"),
    "Scheduler.add_request": ("self", "request"),
    "Scheduler.has_requests": ("self",),
    "Request.__init__": ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params"),
    "get_kv_cache_configs": ("vllm_config", "kv_cache_specs", "available_memory"),
    "generate_scheduler_kv_cache_config": ("kv_cache_configs",),
    "resolve_kv_cache_block_sizes": ("kv_cache_config", "vllm_config"),
    "get_request_block_hasher": ("block_size", "caching_hash_fn"),
}
EXPECTED_KEYWORDS = {"Request.__init__": ("arrival_time", "block_hasher")}
EXPECTED_FIELDS = {
    "SchedulerOutput": ("num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_spec_decode_tokens",
                        "preempted_req_ids"),
    "ModelRunnerOutput": ("req_ids", "req_id_to_index", "sampled_token_ids"),
    "DraftTokenIds": ("req_ids", "draft_token_ids"),
}
# read on the objects while it runs (checked on the first scheduler and request built)
SCHEDULER_ATTRIBUTES = ("requests", "running", "waiting", "kv_cache_manager", "num_spec_tokens")
REQUEST_ATTRIBUTES = ("num_computed_tokens", "num_prompt_tokens", "num_tokens", "is_prefill_chunk")


class SchedulerInterfaceError(RuntimeError):
    """vLLM's scheduler is not the one this simulator drives: its numbers would mean nothing."""


@contextlib.contextmanager
def cpu_platform():
    """vLLM's CPU platform while configs are built (without CUDA vLLM picks no platform and its configs
    raise), then whatever was there before: vLLM's modules that bound ``current_platform`` at import
    (``arg_utils``, ``config.model``, ...) are rebound both ways, so nothing else in this process sees it."""
    import sys

    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    # vLLM's own platform resolved first (it is lazy): a module imported inside the block binds the CPU
    # platform, which is rebound to ``old`` on the way out; were ``old`` None there, the next block could
    # not tell those modules from ones that never bound a platform, and they would keep None
    old, new = platforms.current_platform, CpuPlatform()

    def rebind(was, now):
        for name, module in list(sys.modules.items()):
            if name.startswith("vllm") and vars(module).get("current_platform") is was and was is not None:
                module.current_platform = now

    platforms._current_platform = new
    rebind(old, new)
    try:
        yield
    finally:
        platforms._current_platform = old
        rebind(new, old)


def _vllm():
    """vLLM's modules this simulator drives."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.v1 import outputs, request
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched import async_scheduler, output, scheduler

    return {"Scheduler": scheduler.Scheduler, "AsyncScheduler": async_scheduler.AsyncScheduler,
            "SchedulerOutput": output.SchedulerOutput, "ModelRunnerOutput": outputs.ModelRunnerOutput,
            "DraftTokenIds": outputs.DraftTokenIds, "Request": request.Request, "kv_cache_utils": kv_cache_utils}


def _unwrapped(fn):
    """vLLM's function under the plugin's patch (``qwen36_pcp.patches`` keeps it on its wrapper)."""
    try:
        from qwen36_pcp.patches import ORIGINAL
    except ImportError:  # the plugin is not installed: vLLM's functions are vLLM's
        return fn
    while getattr(fn, ORIGINAL, None) is not None:
        fn = getattr(fn, ORIGINAL)
    return fn


def check_interface(mods: dict | None = None) -> None:
    """One error naming every difference between vLLM's scheduler interface and the one driven here."""
    import vllm

    mods = mods or _vllm()
    problems = []
    owners = {"Scheduler": mods["Scheduler"], "Request": mods["Request"]}
    for name, expected in EXPECTED_PARAMETERS.items():
        owner, _, attr = name.rpartition(".")
        fn = getattr(owners[owner], attr, None) if owner else getattr(mods["kv_cache_utils"], name, None)
        if not callable(fn) or getattr(fn, "__isabstractmethod__", False):
            problems.append(f"{name} is missing")
            continue
        fn = _unwrapped(fn)
        signature = inspect.signature(fn).parameters
        params = list(signature)
        required = [p for p in params[len(expected):] if signature[p].default is inspect.Parameter.empty
                    and signature[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if tuple(params[:len(expected)]) != expected or required:
            problems.append(f"{name} takes ({', '.join(params)}), expected ({', '.join(expected)}, ...)")
        missing = [k for k in EXPECTED_KEYWORDS.get(name, ()) if k not in params]
        if missing:
            problems.append(f"{name} has no parameter {', '.join(missing)}")
    for name, fields in EXPECTED_FIELDS.items():
        have = {f.name for f in dataclasses.fields(mods[name])} if dataclasses.is_dataclass(mods[name]) else set()
        missing = [f for f in fields if f not in have]
        if missing:
            problems.append(f"{name} has no field {', '.join(missing)}")
    if not issubclass(mods["AsyncScheduler"], mods["Scheduler"]):
        problems.append("AsyncScheduler is not a Scheduler")
    if problems:
        raise SchedulerInterfaceError(
            f"vLLM {vllm.__version__}'s scheduler interface differs from the one serve_sim drives (written for "
            f"vLLM {WRITTEN_FOR}): " + "; ".join(problems))


def _check_object(obj, attributes: tuple[str, ...], what: str) -> None:
    missing = [a for a in attributes if not hasattr(obj, a)]
    if missing:
        import vllm

        raise SchedulerInterfaceError(f"vLLM {vllm.__version__}'s {what} has no {', '.join(missing)} (serve_sim "
                                      f"is written for vLLM {WRITTEN_FOR})")


class EngineShape(NamedTuple):
    """What the scheduler's configuration depends on (one cached setup each)."""

    tp: int = 1
    budget: int = 8192  # max_num_batched_tokens
    max_num_seqs: int = 1024  # vllm serve's default on H100/H200
    max_model_len: int = 262144
    kv_bytes: int = 50 << 30  # one GPU's KV cache memory
    mtp: int = 0  # MTP drafts per step
    prefix_caching: bool | None = None  # None: vLLM's default for the model
    async_scheduling: bool = True  # vllm serve's default
    layers: int = 40
    preset: str = "qwen3.6-35b-a3b"


def model_dir(preset: str, layers: int) -> str:
    """A folder with the preset's config.json (the first ``layers`` layers): all vLLM reads of a checkpoint."""
    from qwen36_pcp.tools.make_checkpoint import build_config

    config = build_config(preset)
    text = config["text_config"]
    if layers != text["num_hidden_layers"]:
        assert layers % text["full_attention_interval"] == 0, "whole periods of the layer pattern"
        text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
    path = Path(tempfile.gettempdir()) / "qwen36_pcp_serve_sim" / f"{preset}-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


@functools.lru_cache(maxsize=64)
def engine_setup(shape: EngineShape) -> dict:
    """vLLM's config, KV-cache config and block sizes for ``shape``, built as the engine core builds them on a
    GPU: EngineArgs, FLASH_ATTN's block size aligned to the GDN state's page, the layers' KV specs."""
    with cpu_platform():
        return _engine_setup(shape)


def _engine_setup(shape: EngineShape) -> dict:
    mods = _vllm()
    check_interface(mods)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from vllm.config.vllm import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: F401 - imported for the schedulers

    spec = {"method": "mtp", "num_speculative_tokens": shape.mtp} if shape.mtp else None
    vc = EngineArgs(model=model_dir(shape.preset, shape.layers), load_format="dummy",
                    max_model_len=shape.max_model_len, max_num_batched_tokens=shape.budget,
                    max_num_seqs=shape.max_num_seqs, enable_chunked_prefill=True,
                    enable_prefix_caching=shape.prefix_caching, skip_tokenizer_init=True,
                    speculative_config=spec, language_model_only=True, tensor_parallel_size=shape.tp,
                    distributed_executor_backend="mp" if shape.tp > 1 else None).create_engine_config()
    cc, mc = vc.cache_config, vc.model_config
    cc.block_size = 16  # the CPU platform's 128 back to CUDA's default, then aligned as the GPU path does
    with set_current_vllm_config(vc):
        Platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    vc.scheduler_config.async_scheduling = shape.async_scheduling
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    specs = {}
    for i, kind in enumerate(mc.hf_text_config.layer_types):
        if kind == "full_attention":
            specs[f"layers.{i}.attn"] = FullAttentionSpec(
                block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                head_size=mc.get_head_size(), dtype=mc.dtype)
        else:
            specs[f"layers.{i}.linear_attn"] = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vc)),
                dtypes=model_cls.get_mamba_state_dtype_from_config(vc), block_size=cc.mamba_block_size,
                page_size_padded=cc.mamba_page_size_padded, mamba_type="gdn_attention",
                mamba_cache_mode=cc.mamba_cache_mode, num_speculative_blocks=shape.mtp)
    kvu = mods["kv_cache_utils"]
    kv_cfg = kvu.generate_scheduler_kv_cache_config(kvu.get_kv_cache_configs(vc, [specs], [shape.kv_bytes]))
    cc.num_gpu_blocks = kv_cfg.num_blocks
    cc.block_size = min(g.kv_cache_spec.block_size for g in kv_cfg.kv_cache_groups)
    vc.validate_block_size()
    block, hash_block = kvu.resolve_kv_cache_block_sizes(kv_cfg, vc)
    hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)  # as EngineCore.__init__ does
    return {"mods": mods, "vllm_config": vc, "kv_cache_config": kv_cfg, "block_size": block,
            "hash_block_size": hash_block, "hasher": kvu.get_request_block_hasher(hash_block, hash_fn),
            "prefix_caching": cc.enable_prefix_caching, "mamba_cache_mode": cc.mamba_cache_mode,
            "num_blocks": kv_cfg.num_blocks}


class Arrival(NamedTuple):
    """One request of the traffic: when it arrives (s), its prompt's and its output's tokens."""

    time: float
    prompt: int
    output: int
    prompt_ids: tuple[int, ...] | None = None  # given ids (a shared prefix hits the prefix cache); None: random


@dataclasses.dataclass
class RequestRecord:
    arrival: float
    prompt: int
    output: int
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per output carrying tokens
    tokens: int = 0
    finished: float | None = None


@dataclasses.dataclass
class StepRecord:
    start: float
    end: float
    kind: str  # "prefill", "mixed", "decode", "verify"
    split: bool
    prompt_tokens: int
    rows: int  # decode and verification rows
    requests: int
    kv_usage: float
    preempted: int


def step_rows(sched, so, rows_cls) -> list:
    """The step as the step-time model reads it: one ``Rows`` per scheduled request (after ``schedule()``
    advanced each request's computed tokens by its scheduled ones)."""
    out = []
    for rid, n in so.num_scheduled_tokens.items():
        r = sched.requests[rid]
        drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
        before = r.num_computed_tokens - n
        decoding = before >= r.num_prompt_tokens and n == 1 + drafts
        out.append(rows_cls(n, before, not decoding, drafts if decoding else 0))
    return out


class Replica:
    """One engine: vLLM's scheduler, a virtual clock, and the step-time model ``step_time(rows) -> dict``."""

    def __init__(self, shape: EngineShape, step_time: Callable, rows_cls, accept: float = 0.0, seed: int = 0):
        setup = engine_setup(shape)
        mods = setup["mods"]
        from vllm.v1.structured_output import StructuredOutputManager

        self.async_ = shape.async_scheduling
        cls = mods["AsyncScheduler"] if self.async_ else mods["Scheduler"]
        vc = setup["vllm_config"]
        self.sched = cls(vllm_config=vc, kv_cache_config=setup["kv_cache_config"],
                         structured_output_manager=StructuredOutputManager(vc), block_size=setup["block_size"],
                         hash_block_size=setup["hash_block_size"], log_stats=False)
        _check_object(self.sched, SCHEDULER_ATTRIBUTES, "Scheduler")
        self.mods, self.setup, self.step_time, self.rows_cls = mods, setup, step_time, rows_cls
        self.mtp, self.accept, self.rng = self.sched.num_spec_tokens, accept, random.Random(seed)
        self.np_rng = np.random.default_rng(seed)  # prompt ids: random, so that no two prompts share a prefix
        self.host = 0.0  # when the engine core next calls schedule()
        self.gpu_free = 0.0  # when the last scheduled step ends
        self.pending = None  # async: the step in flight whose output is not applied yet
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.stuck = False

    # ------------------------------------------------------------------ traffic in
    def add(self, rid: str, arrival: Arrival) -> None:
        from vllm.sampling_params import SamplingParams

        ids = list(arrival.prompt_ids) if arrival.prompt_ids else self.np_rng.integers(
            100, 150000, arrival.prompt).tolist()
        req = self.mods["Request"](rid, ids, SamplingParams(max_tokens=arrival.output, ignore_eos=True), None,
                                   arrival_time=arrival.time, block_hasher=self.setup["hasher"])
        _check_object(req, REQUEST_ATTRIBUTES, "Request")
        if not self.busy():
            self.host = max(self.host, arrival.time)
        self.sched.add_request(req)
        self.records[rid] = RequestRecord(arrival.time, arrival.prompt, arrival.output)
        self.stuck = False

    def busy(self) -> bool:
        return (self.sched.has_requests() or self.pending is not None) and not self.stuck

    def load(self) -> int:
        """vLLM's data-parallel balancing score: waiting x 4 + running (``DPLBAsyncMPClient``)."""
        return 4 * len(self.sched.waiting) + len(self.sched.running)

    # ------------------------------------------------------------------ the clock
    def advance(self, until: float) -> None:
        """Run every step the engine core would start before ``until``."""
        while self.busy() and self.host < until:
            if not self._iterate():
                break

    def _iterate(self) -> bool:
        """One pass of the engine core's loop (``EngineCore.step`` or, async, ``step_with_batch_queue`` with
        two batches in flight): schedule, run, and apply the oldest output."""
        so = self.sched.schedule() if self.sched.has_requests() else None
        if so is not None and so.total_num_scheduled_tokens:
            rows = step_rows(self.sched, so, self.rows_cls)
            priced = self.step_time(rows)
            start = max(self.host, self.gpu_free)
            self.gpu_free = end = start + priced["total"]
            batch = (so, self._model_output(so), end)
            self._record(so, rows, priced, start, end)
            if not self.async_:
                self._apply(batch)
            elif self.pending is None:
                self.pending = batch  # the queue is not full: schedule the next batch at once
            else:
                self.pending, batch = batch, self.pending
                self._apply(batch)
            return True
        if self.pending is not None:
            batch, self.pending = self.pending, None
            self._apply(batch)
            return True
        self.stuck = self.sched.has_requests()  # nothing schedulable until something arrives
        return False

    def _model_output(self, so):
        """What the model runner returns: nothing for a partial prompt, else 1 token and the accepted drafts
        (each draft accepted with probability ``accept`` while the ones before it were)."""
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            ids.append(rid)
            if self.sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            drafts, accepted = len(so.scheduled_spec_decode_tokens.get(rid, ())), 0
            while accepted < drafts and self.rng.random() < self.accept:
                accepted += 1
            sampled.append([self.rng.randrange(100, 150000) for _ in range(1 + accepted)])
        return self.mods["ModelRunnerOutput"](req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                              sampled_token_ids=sampled)

    def _apply(self, batch) -> None:
        so, mro, end = batch
        self.host = max(self.host, end)
        for eco in self.sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                rec = self.records[out.request_id]
                if out.new_token_ids:
                    rec.token_times.append(end)
                    rec.tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    rec.finished = end
        if self.mtp and not self.async_:  # EngineCore.post_step: the drafter's proposals for the next step
            live = [r for r in mro.req_ids if r in self.sched.requests and not self.sched.requests[r].is_finished()]
            self.sched.update_draft_token_ids(self.mods["DraftTokenIds"](
                live, [[self.rng.randrange(100, 150000) for _ in range(self.mtp)] for _ in live]))

    def _record(self, so, rows, priced, start, end) -> None:
        prompt = sum(r.new for r in rows if r.prompt)
        dec = [r for r in rows if not r.prompt]
        kind = ("mixed" if dec else "prefill") if prompt else ("verify" if any(r.drafts for r in dec) else "decode")
        self.steps.append(StepRecord(start, end, kind, bool(priced.get("split")), prompt, sum(r.new for r in dec),
                                     len(rows), self.sched.kv_cache_manager.usage,
                                     len(so.preempted_req_ids or ())))
