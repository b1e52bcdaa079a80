# SPDX-License-Identifier: Apache-2.0
"""Startup messages where vLLM itself would say something cryptic, for our model at pcp > 1
(``early_refusals.before_config_error``, raised from ``patches``' wrapper of ``EngineArgs.create_engine_config``).

No NVIDIA GPU: vLLM 0.20.2 fails before any config exists, ``LLM(...)`` with "Device string must not be
empty", ``vllm serve`` with "Failed to infer device type" while building its parser. The end-to-end
test runs both entry points in a fresh process on vLLM's own no-GPU platform (``UnspecifiedPlatform``,
set explicitly, so that it also holds on a machine with GPUs).

PCP across nodes: vLLM 0.20.2 asserts that tp x pp x dp (PCP left out) divides by nnodes, so
``-tp 1 -pcp 2 --nnodes 2`` dies with "world_size=1 must be divisible by nnodes=2". Tested on
``tests.fake_cuda``'s platform (a GPU platform: the no-GPU message stays out of the way).
"""

import json

import pytest

from harness.dist import run_isolated

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
    from qwen36_pcp import patches

    qwen36_pcp.register()
    from vllm.engine.arg_utils import EngineArgs

    from harness.dist import error_of

    out = {}

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
    out["bad_option"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                            additional_config={"qwen36_pcp": {"gdn_mode": "bogus"}})
    out["negative_option"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                                 additional_config={"qwen36_pcp": {"min_split_tokens": -5}})
    out["serve_bad_option"] = serve("--hf-overrides", json.dumps(OVERRIDES), "-pcp", "2", "--additional-config",
                                    json.dumps({"qwen36_pcp": {"layuot": "zigzag"}}), "--port", "8012")
    patches.install()  # idempotent: still one wrapper around vLLM's code
    out["once"] = all(getattr(getattr(EngineArgs, n), patches.ORIGINAL, None).__module__
                      == "vllm.engine.arg_utils" for n in ("create_engine_config", "add_cli_args"))
    out["static"] = isinstance(inspect.getattr_static(EngineArgs, "add_cli_args"), staticmethod)
    return out


def test_no_gpu_one_message_with_the_numbers(tiny_config_only):
    out = run_isolated(_no_gpu_startup, tiny_config_only)
    assert out["once"] and out["static"], out
    for key, gpus in (("llm", 2), ("llm_tp2", 4), ("serve", 2)):
        msg = out[key]
        assert msg and msg.startswith("MachineRefusal: qwen36_pcp: "), (key, msg)
        tp = 2 if key == "llm_tp2" else 1
        assert f"prefill_context_parallel_size=2 x tensor_parallel_size={tp} needs {gpus} NVIDIA GPUs" in msg
        assert NO_GPU in msg and "Device string" not in msg and "infer device type" not in msg, msg
    # a bad option has its own message first, before the GPU's
    assert out["bad_option"].startswith("ConfigRefusal: qwen36_pcp: gdn_mode must be one of"), out["bad_option"]
    assert "min_split_tokens must be an integer >= 1, got -5" in out["negative_option"], out["negative_option"]
    assert "unknown option(s) ['layuot']" in (out["serve_bad_option"] or ""), out["serve_bad_option"]
    # pcp == 1 and vLLM's own model: vLLM's behaviour and words, untouched
    for key in ("llm_pcp1", "llm_stock"):
        assert "Device string must not be empty" in out[key], (key, out[key])
    for key in ("serve_pcp1", "serve_stock"):
        assert "Failed to infer device type" in out[key], (key, out[key])


def test_command_line_is_read_with_vllms_rules(tmp_path, tiny_config_only):
    from qwen36_pcp.early_refusals import cli_no_gpu_message, no_gpu_message

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


def _nnodes_startup(ckpt, port):
    from tests.fake_cuda import use_fake_cuda

    use_fake_cuda()  # before vLLM's config modules bind the platform
    import vllm.platforms as platforms

    type(platforms._current_platform).device_count = classmethod(lambda cls: 2)  # tp x pcp / nnodes
    import sys

    import qwen36_pcp

    qwen36_pcp.register()
    from vllm.engine.arg_utils import EngineArgs

    from harness.dist import error_of

    out = {}

    def llm(**kw):  # node 0 of two, as LLM(...) is started there
        return error_of(lambda: EngineArgs(model=ckpt, max_model_len=4096, nnodes=2, node_rank=0,
                                           master_addr="127.0.0.1", **kw).create_engine_config())

    out["llm"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2)
    out["llm_pcp1"] = llm(hf_overrides=OVERRIDES)
    out["llm_stock"] = llm(prefill_context_parallel_size=2)
    out["llm_tp2"] = llm(hf_overrides=OVERRIDES, prefill_context_parallel_size=2, tensor_parallel_size=2)

    from vllm.entrypoints.cli.main import main

    def serve(*args):
        sys.argv = ["vllm", "serve", ckpt, "--hf-overrides", json.dumps(OVERRIDES), "--nnodes", "2",
                    "--master-addr", "127.0.0.1", "--max-model-len", "4096", *args]
        return error_of(main)

    out["serve"] = serve("-pcp", "2", "--port", str(port))
    out["serve_headless"] = serve("-pcp", "2", "--node-rank", "1", "--headless")
    out["serve_pcp1"] = serve("--node-rank", "1", "--headless")
    return out


def test_pcp_across_nodes_one_message_with_the_numbers(tiny_config_only, fake_cuda_ranks):
    from tests.fake_cuda import free_port

    out = fake_cuda_ranks.isolated(_nnodes_startup, tiny_config_only, free_port())
    for key in ("llm", "serve", "serve_headless"):
        msg = out[key]
        assert msg and msg.startswith("ConfigRefusal: qwen36_pcp: vLLM 0.20.2 needs tensor_parallel_size x "
                                      "pipeline_parallel_size x data_parallel_size to be a multiple of "
                                      "nnodes"), (key, msg)
        assert "1 x 1 x 1 = 1 is not a multiple of nnodes=2" in msg, (key, msg)
        assert "-tp 2 -pcp 2 --nnodes 2" in msg and "docs/multi-node.md" in msg, (key, msg)
        assert "must be divisible" not in msg, (key, msg)
    # pcp == 1 and vLLM's own model: vLLM's assertion, untouched
    for key in ("llm_pcp1", "llm_stock", "serve_pcp1"):
        assert out[key] == "AssertionError: world_size=1 must be divisible by nnodes=2.", (key, out[key])
    # TP a multiple of nnodes passes, here and in vLLM: the whole config is built
    assert out["llm_tp2"] is None, out["llm_tp2"]


def test_nnodes_message_numbers():
    from qwen36_pcp.early_refusals import nnodes_message

    msg = nnodes_message(1, 1, 1, 2, 2)
    assert "keep TP inside a node" in msg and "-tp 2 -pcp 2 --nnodes 2 (each node then runs 2 ranks" in msg
    assert "3 x 1 x 1 = 3 is not a multiple of nnodes=2" in nnodes_message(3, 1, 1, 4, 2)
    assert "-tp 4 -pcp 4 --nnodes 2 (each node then runs 8 ranks" in nnodes_message(3, 1, 1, 4, 2)
    spans = nnodes_message(1, 1, 1, 2, 4)  # nnodes does not divide pcp: TP cannot stay inside a node
    assert "-tp 4 -pcp 2 --nnodes 4 (TP groups then span nodes" in spans and "keep TP" not in spans
    # pcp == 1, one node, or a split vLLM accepts: nothing to say
    for args in ((1, 1, 1, 1, 2), (1, 1, 1, 2, 1), (2, 1, 1, 2, 2), (1, 2, 1, 2, 2), (8, 1, 1, 2, 2)):
        assert nnodes_message(*args) is None, args


def test_option_warnings_name_the_key_and_the_value_in_effect():
    """What a user's options get before the engine starts: a misspelled ``qwen36_pcp`` key is named
    (vLLM passes additional_config on unread), a ``min_split_tokens`` under the split floor comes with
    the value in effect, a bad option is the error; vLLM's own keys and good options say nothing."""
    import logging

    from qwen36_pcp.early_refusals import logger, options_message

    class Records(logging.Handler):  # vLLM's loggers do not propagate to pytest's capture
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logger.addHandler(records)
    try:
        assert options_message({"qwen36pcp": {"gdn_mode": "island"}}, 2) is None
        assert options_message('{"qwen36_pcp": {"min_split_tokens": 100}}', 8) is None  # JSON text too
        quiet = len(records.messages)
        assert options_message({"gdn_prefill_backend": "triton", "qwen36_pcp": {"layout": "contiguous"}}, 2) is None
    finally:
        logger.removeHandler(records)
    messages = records.messages
    assert "'qwen36pcp' is not 'qwen36_pcp'" in messages[0], messages
    assert "min_split_tokens=100 is under the split floor" in messages[1]
    assert "fewer than 1024 new tokens" in messages[1]
    assert len(messages) == quiet  # nothing for vLLM's own keys and good options
    assert "gdn_mode must be one of" in options_message({"qwen36_pcp": {"gdn_mode": "bogus"}}, 2)
    assert "must be a JSON object" in options_message({"qwen36_pcp": ["relay"]}, 2)
