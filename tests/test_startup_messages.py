"""Startup messages where vLLM itself would say something cryptic: PCP for our model on a machine where
vLLM finds no NVIDIA GPU (``runner_hooks.no_gpu_message_at_startup``).

vLLM 0.20.2 without a GPU fails before any config exists: ``LLM(...)`` with "Device string must not be
empty", ``vllm serve`` with "Failed to infer device type" while building its parser. The end-to-end
test runs both entry points in a fresh process on vLLM's own no-GPU platform (``UnspecifiedPlatform``,
set explicitly, so that it also holds on a machine with GPUs).
"""

import json

import pytest

from tests.dist import run_isolated

ARCH = "Qwen3_6ForCausalLM"
OVERRIDES = {"architectures": [ARCH]}
NO_GPU = "no GPU is visible (CUDA not available"


@pytest.fixture(scope="module")
def tiny_config_only(tmp_path_factory):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", config_only=True))


def _no_gpu_startup(ckpt):
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    platforms._current_platform = UnspecifiedPlatform()  # before vLLM's config modules bind it
    import inspect
    import sys

    import qwen36_pcp
    from qwen36_pcp import runner_hooks

    qwen36_pcp.register()
    from vllm.engine.arg_utils import EngineArgs

    out = {}

    def error_of(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - the message is what is tested
            return f"{type(e).__name__}: {e}"
        return None

    def llm(**kw):  # what LLM(...) and the engine call first
        return error_of(lambda: EngineArgs(model=ckpt, max_model_len=4096, **kw).create_engine_config())

    out["llm"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2)
    out["llm_tp2"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2, tensor_parallel_size=2)
    out["llm_pcp1"] = llm(hf_overrides=OVERRIDES)
    out["llm_stock"] = llm(prefill_context_parallel_size=2)

    from vllm.entrypoints.cli.main import main

    def serve(*args):
        sys.argv = ["vllm", "serve", ckpt, *args]
        return error_of(main)

    out["serve"] = serve("--hf-overrides", json.dumps(OVERRIDES), "-pcp", "2", "--port", "8011")
    out["serve_pcp1"] = serve("--hf-overrides", json.dumps(OVERRIDES))
    out["serve_stock"] = serve("-pcp", "2")
    runner_hooks.no_gpu_message_at_startup()  # idempotent: still one wrapper around vLLM's code
    out["once"] = all(getattr(getattr(EngineArgs, n), runner_hooks._PATCHED_MARK, None).__module__
                      == "vllm.engine.arg_utils" for n in ("create_engine_config", "add_cli_args"))
    out["static"] = isinstance(inspect.getattr_static(EngineArgs, "add_cli_args"), staticmethod)
    return out


def test_no_gpu_one_message_with_the_numbers(tiny_config_only):
    out = run_isolated(_no_gpu_startup, tiny_config_only)
    assert out["once"] and out["static"], out
    for key, gpus in (("llm", 2), ("llm_tp2", 4), ("serve", 2)):
        msg = out[key]
        assert msg and msg.startswith("RuntimeError: qwen36_pcp: "), (key, msg)
        tp = 2 if key == "llm_tp2" else 1
        assert f"prefill_context_parallel_size=2 x tensor_parallel_size={tp} needs {gpus} NVIDIA GPUs" in msg
        assert NO_GPU in msg and "Device string" not in msg and "infer device type" not in msg, msg
    # pcp == 1 and vLLM's own model: vLLM's behaviour and words, untouched
    for key in ("llm_pcp1", "llm_stock"):
        assert "Device string must not be empty" in out[key], (key, out[key])
    for key in ("serve_pcp1", "serve_stock"):
        assert "Failed to infer device type" in out[key], (key, out[key])


def test_command_line_is_read_with_vllms_rules(tmp_path, tiny_config_only):
    from qwen36_pcp.checks import cli_no_gpu_message, no_gpu_message

    def msg(*args, device_type=""):
        return cli_no_gpu_message(["serve", *args], device_type)

    ours = ["--hf-overrides", json.dumps(OVERRIDES)]
    assert "needs 2 NVIDIA GPUs" in msg(tiny_config_only, *ours, "-pcp", "2")
    assert "tensor_parallel_size=2 needs 8" in msg(tiny_config_only, "--prefill_context_parallel_size=4",
                                                    "--tensor-parallel-size", "2", *ours)
    assert "needs 2" in msg(tiny_config_only, "--hf-overrides.architectures+", ARCH, "-pcp", "2")
    assert "needs 2" in msg("--model", tiny_config_only, "-pcp", "2", *ours, "--enforce-eager")
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(f"prefill-context-parallel-size: 2\nhf-overrides: '{json.dumps(OVERRIDES)}'\n")
    assert "needs 2" in msg(tiny_config_only, "--config", str(yaml))
    # a local checkpoint whose config.json names our architecture needs no hf_overrides
    ckpt = tmp_path / "ours"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": [ARCH]}))
    assert "needs 2" in msg(str(ckpt), "-pcp", "2")
    # not ours, pcp == 1, or unreadable: None (vLLM's message stands)
    assert msg(tiny_config_only, "-pcp", "2") is None
    assert msg(tiny_config_only, *ours) is None
    assert msg(tiny_config_only, *ours, "-pcp", "two") is None
    assert msg(tiny_config_only, *ours, "-pcp", "2", device_type="cuda") is None  # a GPU platform
    cpu = no_gpu_message(2, 1, "cpu")
    assert "needs 2 NVIDIA GPUs" in cpu and "'cpu' platform" in cpu
