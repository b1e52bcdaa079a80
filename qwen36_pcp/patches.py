# SPDX-License-Identifier: Apache-2.0
"""What of vLLM 0.20.2 the plugin must replace in place, because no extension point reaches it.

The runner, the worker and the layers are subclasses selected through vLLM's own extension points
(``worker_cls``, the out-of-tree layer registry). What is left is here, one ``Patch`` each, named
after what it fixes:

* the engine core's KV accounting (three): vLLM 0.20.2 would size and account the KV cache as sharded
  over the PCP ranks and rejects hybrid models there; the plugin keeps it whole on every rank, so the
  scheduler's blocks, the cache's memory and its block sizes must be pcp == 1's;
* the startup messages (two): on a machine without a GPU vLLM fails before any config exists, in words
  that name neither PCP nor the fix, and refuses PCP across nodes with a bare assertion; bad plugin
  options get their message first; a refusal of our config check reaches the caller as itself, not
  inside pydantic's ``ValidationError``;
* the first token's detokenization (one): ``prompt_tail``.

Besides these, ``install`` adds our model's config check to vLLM's ``MODELS_CONFIG_MAP`` (a registry
vLLM reads by architecture) and, with ``QWEN36_PCP_DETERMINISTIC_GDN=1``, keeps three GDN kernels to
configs that give one output (``deterministic_gdn``), and puts ``refusal.excepthook`` in front of
``sys.excepthook`` (Python's hook, not vLLM's: an uncaught refusal ends the program with its message
alone). Each wrapper calls vLLM's code unchanged unless our model runs at pcp > 1. ``install`` checks
every target's signature first (a changed vLLM fails at startup with one message naming the hook), is
idempotent, and ``uninstall`` puts vLLM's originals back.
"""

from __future__ import annotations

import copy
import inspect
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import vllm.v1.engine.core as engine_core
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models import config as model_configs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
from vllm.v1.kv_cache_interface import FullAttentionSpec

from . import checks, deterministic_gdn, early_refusals, refusal
from .config import ARCHITECTURES, uses_pcp
from .prompt_tail import prompt_tail

ORIGINAL = "__qwen36_pcp_original__"


class VllmChanged(RuntimeError):
    """A hook's target in vLLM is not what the plugin was written for."""


def as_pcp1(vllm_config):
    """A shallow copy of the config that says pcp == 1 (for replicated-KV block accounting)."""
    view = copy.copy(vllm_config)
    parallel = copy.copy(vllm_config.parallel_config)
    object.__setattr__(parallel, "prefill_context_parallel_size", 1)
    object.__setattr__(view, "parallel_config", parallel)
    return view


@dataclass(frozen=True)
class Patch:
    """``owner.name`` replaced by ``make(vllm's function)``; ``params``: the leading parameters of
    vLLM's function the wrapper relies on (checked at install)."""

    owner: object
    name: str
    params: tuple[str, ...]
    make: Callable[[Callable], Callable]
    why: str

    @property
    def target(self) -> str:
        owner = self.owner
        where = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        return f"{where}.{self.name}"

    def _current(self) -> tuple[Callable, bool]:
        """The function at ``owner.name`` now, and whether it sits there as a static method."""
        current = inspect.getattr_static(self.owner, self.name)
        static = isinstance(current, staticmethod)
        return (current.__func__ if static else current), static

    def _set(self, func: Callable, static: bool) -> None:
        setattr(self.owner, self.name, staticmethod(func) if static else func)

    def original(self) -> Callable:
        func, _ = self._current()
        return getattr(func, ORIGINAL, func)

    def check(self) -> None:
        params = tuple(inspect.signature(self.original()).parameters)
        if params[: len(self.params)] != self.params:
            raise VllmChanged(
                f"qwen36_pcp: vLLM's {self.target} takes {params}, the plugin was written for "
                f"{self.params} (vLLM 0.20.2); not installing it ({self.why})")

    def install(self) -> None:
        func, static = self._current()
        if getattr(func, ORIGINAL, None) is not None:
            return  # installed already
        wrapper = self.make(func)
        wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = func.__name__, func.__qualname__, func.__doc__
        setattr(wrapper, ORIGINAL, func)
        self._set(wrapper, static)

    def uninstall(self) -> None:
        func, static = self._current()
        original = getattr(func, ORIGINAL, None)
        if original is not None:
            self._set(original, static)


# ======================================================================= engine core: KV accounting
def _resolve_kv_cache_block_sizes(orig):
    def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
        return orig(kv_cache_config, as_pcp1(vllm_config) if uses_pcp(vllm_config) else vllm_config)

    return resolve_kv_cache_block_sizes


def _scheduler_init(orig):
    def __init__(self, vllm_config, *args, **kwargs):
        if not uses_pcp(vllm_config):
            return orig(self, vllm_config, *args, **kwargs)
        orig(self, as_pcp1(vllm_config), *args, **kwargs)
        self.vllm_config = vllm_config  # the rest of the scheduler sees the real config
        self.parallel_config = vllm_config.parallel_config

    return __init__


def _max_memory_usage_bytes(orig):
    def max_memory_usage_bytes(self, vllm_config):
        return orig(self, as_pcp1(vllm_config) if uses_pcp(vllm_config) else vllm_config)

    return max_memory_usage_bytes


# ========================================================================= startup messages
# The engine configs of ours at pcp > 1 alive in this process (front ends: the detokenizer switch).
_pcp_front_ends: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def serves_pcp() -> bool:
    """Whether an engine config for our model at pcp > 1, made in this process, is still alive."""
    return len(_pcp_front_ends) > 0


def _create_engine_config(orig):
    def create_engine_config(self, *args, **kwargs):
        if early_refusals.names_our_architecture(self.model, self.hf_overrides):
            error = early_refusals.before_config_error(self)
            if error is not None:
                raise error
        try:
            config = orig(self, *args, **kwargs)
        except ValueError as e:  # pydantic's ValidationError is one
            refused = refusal.refusal_in(e)
            if refused is None or refused is e:
                raise
            raise refused from None  # our config check's message, without pydantic's listing around it
        if uses_pcp(config):
            _pcp_front_ends[id(config)] = config
        return config

    return create_engine_config


def _add_cli_args(orig):
    def add_cli_args(parser, *args, **kwargs):
        try:
            return orig(parser, *args, **kwargs)
        except RuntimeError as e:
            error = early_refusals.cli_before_config_error(sys.argv[1:], early_refusals.device_type())
            if error is None or "device type" not in str(e):  # vLLM's "Failed to infer device type"
                raise
            raise error from e

    return add_cli_args


# ==================================================================== first token's detokenization
def _detokenizer_init(orig):
    def __init__(self, tokenizer, request):
        tail = prompt_tail(tokenizer, request) if serves_pcp() else None
        if tail is not None:
            request = msgspec.structs.replace(request, prompt_token_ids=tail)
        orig(self, tokenizer, request)

    return __init__


PATCHES = (
    Patch(engine_core, "resolve_kv_cache_block_sizes", ("kv_cache_config", "vllm_config"),
          _resolve_kv_cache_block_sizes, "hybrid KV-cache groups resolved as at pcp == 1"),
    Patch(Scheduler, "__init__", ("self", "vllm_config"), _scheduler_init,
          "the scheduler's KV-cache manager accounts blocks as at pcp == 1"),
    Patch(FullAttentionSpec, "max_memory_usage_bytes", ("self", "vllm_config"), _max_memory_usage_bytes,
          "a full-attention layer needs the whole sequence's KV on every PCP rank"),
    Patch(EngineArgs, "create_engine_config", ("self",), _create_engine_config,
          "bad options, no GPU and nodes refused in words that name PCP, before vLLM's own checks; "
          "the config check's refusal raised as itself, not inside pydantic's ValidationError"),
    Patch(EngineArgs, "add_cli_args", ("parser",), _add_cli_args,
          "vllm serve without a GPU: PCP's message instead of vLLM's 'Failed to infer device type'"),
    Patch(FastIncrementalDetokenizer, "__init__", ("self", "tokenizer", "request"), _detokenizer_init,
          "the first token detokenized from the prompt's tail"),
)


# ==================================================================== the model's config check
def _config_check_class():
    base = model_configs.MODELS_CONFIG_MAP["Qwen3_5MoeForConditionalGeneration"]

    class Qwen36PCPConfig(base):
        """Qwen3.5's config handling, then the plugin's startup checks (``VllmConfig.__post_init__``)."""

        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            base.verify_and_update_config(vllm_config)  # Qwen3.5's mamba_ssm_dtype handling
            checks.validate_pcp_config(vllm_config)
            checks.triton_gdn_prefill_under_pcp(vllm_config)
            checks.select_pcp_worker(vllm_config)

    return Qwen36PCPConfig


_installed = False


def install() -> None:
    """Check every target, then install everything (idempotent). ``register()`` calls it on vLLM 0.20.2."""
    global _installed
    if _installed:
        return
    for patch in PATCHES:
        patch.check()
    for patch in PATCHES:
        patch.install()
    for architecture in ARCHITECTURES:
        if model_configs.MODELS_CONFIG_MAP.get(architecture) is None:
            model_configs.MODELS_CONFIG_MAP[architecture] = _config_check_class()
    if deterministic_gdn.pin_gdn_configs_wanted(pcp=False):
        deterministic_gdn.pin_gdn_configs()
    refusal.install_excepthook()
    _installed = True


def uninstall() -> None:
    """vLLM's originals back, everywhere ``install`` changed them."""
    global _installed
    for patch in PATCHES:
        patch.uninstall()
    for architecture in ARCHITECTURES:
        model_configs.MODELS_CONFIG_MAP.pop(architecture, None)
    deterministic_gdn.restore_gdn_configs()
    refusal.uninstall_excepthook()
    _pcp_front_ends.clear()
    _installed = False
