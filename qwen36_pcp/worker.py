# SPDX-License-Identifier: Apache-2.0
"""The worker at pcp > 1: vLLM's GPU ``Worker`` with the PCP model runner.

vLLM builds its worker from ``parallel_config.worker_cls`` in every process it starts (multiprocessing
workers, Ray's V2 executor, the ranks of a headless node), so this one class carries the plugin's
runner through all of them. The plugin's config hook selects it for our model at pcp > 1
(``checks.select_pcp_worker``); a worker class of one's own must build on it.
"""

from __future__ import annotations

import contextlib

import vllm.v1.worker.gpu_model_runner as gpu_model_runner_module
from vllm.v1.worker.gpu_worker import Worker

from .config import uses_pcp
from .deterministic_gdn import pin_gdn_configs, pin_gdn_configs_wanted
from .runner_hooks import PCPModelRunner


@contextlib.contextmanager
def model_runner_class(runner_cls: type):
    """``Worker.init_device`` builds ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, looked up when it
    runs; this makes that name ``runner_cls`` while the block runs, and vLLM's class again after."""
    original = gpu_model_runner_module.GPUModelRunner
    if not issubclass(runner_cls, original):
        raise TypeError(f"{runner_cls.__qualname__} is not a subclass of vLLM's GPUModelRunner")
    gpu_model_runner_module.GPUModelRunner = runner_cls
    try:
        yield
    finally:
        gpu_model_runner_module.GPUModelRunner = original


class PCPWorker(Worker):
    """vLLM's GPU worker; for our model at pcp > 1 its model runner is ``PCPModelRunner``."""

    def init_device(self):
        if not uses_pcp(self.vllm_config):
            return super().init_device()
        if pin_gdn_configs_wanted(pcp=True):
            pin_gdn_configs()
        with model_runner_class(PCPModelRunner):
            super().init_device()
        if not isinstance(self.model_runner, PCPModelRunner):
            raise RuntimeError(
                "qwen36_pcp: vLLM's Worker.init_device did not build the PCP model runner (it no longer "
                "builds vllm.v1.worker.gpu_model_runner.GPUModelRunner): this vLLM is not the 0.20.2 the "
                f"plugin was written for; got {type(self.model_runner).__qualname__}")
