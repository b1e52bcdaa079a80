# SPDX-License-Identifier: Apache-2.0
"""``python -m qwen36_pcp doctor``: each check's line and the exit code, on CPU (GPUs faked where a test
needs them), with the full-size presets and small config-only checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from qwen36_pcp import doctor
from qwen36_pcp.__main__ import main
from qwen36_pcp.expert_memory import whole_experts_bytes
from qwen36_pcp.tools.make_checkpoint import build_config, make_checkpoint

GiB = 2**30
H200 = doctor.Gpu("NVIDIA H200", (9, 0), 141 * GiB)
H100 = doctor.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB)
SHARDED = 'pass --additional-config \'{"qwen36_pcp": {"moe_experts": "sharded"}}\''
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    """No plugin filter and no GPU mask from the caller's shell; no GPU unless a test fakes some."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(doctor, "visible_gpus", lambda: [])


def fake_gpus(monkeypatch, *gpus: doctor.Gpu) -> None:
    monkeypatch.setattr(doctor, "visible_gpus", lambda: list(gpus))


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = main(["doctor", *argv])
    return rc, capsys.readouterr().out.splitlines()


def line(lines: list[str], start: str) -> str:
    found = [s for s in lines if s.startswith(start)]
    assert len(found) == 1, lines
    return found[0]


def fp8_checkpoint(path: Path) -> Path:
    """config.json of Qwen3.6-35B-A3B in block-wise FP8, as the published FP8 release has it."""
    config = build_config("qwen3.6-35b-a3b")
    keep = ["lm_head", "model.language_model.layers.0.mlp.gate"]  # two of the modules left in bf16
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": keep}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


# ----------------------------------------------------------------------------- GPUs
def test_no_gpu_at_pcp_2_is_a_problem(capsys):
    rc, lines = run(capsys, "qwen3.6-35b-a3b", "--pcp", "2")
    assert rc == 1
    assert "PROBLEM no GPU visible; -tp 1 x -pcp 2 needs 2 NVIDIA GPU(s)" in lines
    assert "        -> run on a machine where nvidia-smi lists 2 GPU(s)" in lines
    assert lines[-1] == "1 problem(s) found"
    # without a GPU the experts are reported, not judged
    assert line(lines, "note    moe_experts='replicated'").endswith("; no GPU to compare with")


def test_fewer_gpus_than_ranks(capsys, monkeypatch):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "--tp", "2", "--pcp", "2")
    assert rc == 1
    assert line(lines, "PROBLEM 2 GPU(s) visible: 2 x NVIDIA H200 (sm90, 141 GiB)").endswith(
        "-tp 2 x -pcp 2 needs 4 on this node, one per rank")


def test_gpu_generations(capsys, monkeypatch):
    fake_gpus(monkeypatch, doctor.Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB), H200)
    rc, lines = run(capsys)
    assert rc == 0, lines  # an unverified generation is a note, not a problem
    assert line(lines, "note    sm80 (Ampere)").startswith(
        "note    sm80 (Ampere): PCP is verified on sm90 (Hopper, flash-attention 3); flash-attention 3 "
        "needs Hopper")
    assert not [s for s in lines if s.startswith("note    sm90")]
    fake_gpus(monkeypatch, *[doctor.Gpu("NVIDIA L40S", (8, 9), 45 * GiB)] * 2)
    assert line(run(capsys)[1], "note    sm89 (Ada Lovelace): PCP is verified on sm90")
    fake_gpus(monkeypatch, *[doctor.Gpu("Tesla V100", (7, 0), 32 * GiB)] * 2)
    rc, lines = run(capsys)
    assert rc == 1
    assert line(lines, "PROBLEM sm70").startswith("PROBLEM sm70 (Volta): vLLM's FLASH_ATTN backend")


def test_gpu_query_failure_is_reported(capsys, monkeypatch):
    def broken():
        raise RuntimeError("driver mismatch")

    monkeypatch.setattr(doctor, "visible_gpus", broken)
    rc, lines = run(capsys)
    assert rc == 1
    assert "PROBLEM GPUs could not be queried (RuntimeError: driver mismatch)" in lines


# ----------------------------------------------------------------------------- options
def option_error(additional_config: dict) -> str:
    from qwen36_pcp.config import PCPConfig

    with pytest.raises(ValueError) as e:
        PCPConfig.from_additional_config(additional_config)
    return str(e.value)


@pytest.mark.parametrize("options, message", [
    ('{"qwen36_pcp": {"gdn_mode": "fast"}}', None),  # the plugin's own message for these two
    ('{"qwen36_pcp": {"moe_expert": "sharded"}}', None),
    ('{"qwen36_pcp": "sharded"}', ("PROBLEM options: qwen36_pcp: additional_config['qwen36_pcp'] must be a JSON "
                                   "object of options, got 'sharded'")),
    ("{qwen36_pcp: 1}", "PROBLEM --additional-config is not JSON: Expecting property name enclosed in double "
                        "quotes: line 1 column 2 (char 1)"),
])
def test_bad_option_is_reported_with_its_message(capsys, monkeypatch, options, message):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "--additional-config", options)
    assert rc == 1
    if message is None:
        error = option_error(json.loads(options))
        assert error.startswith("qwen36_pcp: ") and ("gdn_mode" in error or "moe_expert" in error)
        message = f"PROBLEM options: {error}"
    assert message in lines
    assert lines[-1] == "1 problem(s) found"


@pytest.mark.parametrize("key", ["qwen36pcp", "qwen_36_pcp", "Qwen36_PCP", "qwen3_pcp"])
def test_misspelled_key(capsys, monkeypatch, key):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "--additional-config", json.dumps({key: {"moe_experts": "sharded"}}))
    assert rc == 1
    assert line(lines, f"PROBLEM additional_config key {key!r}").startswith(
        f"PROBLEM additional_config key {key!r} looks like a misspelling of 'qwen36_pcp'")
    assert f"        -> rename {key!r} to 'qwen36_pcp'" in lines


def test_other_vllm_keys_are_not_misspellings(capsys, monkeypatch):
    fake_gpus(monkeypatch, H200, H200)
    config = {"gdn_prefill_backend": "triton", "qwen36_pcp": {"moe_experts": "sharded"}}
    rc, lines = run(capsys, "--additional-config", json.dumps(config))
    assert rc == 0, lines
    assert "ok      options: PCPConfig(layout='zigzag', gdn_mode='relay', min_split_tokens=4096, " \
           "moe_experts='sharded', vision_encoder='split', decode='replicated', mtp_first_pass='split')" in lines


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "PROBLEM -tp 0: must be 1 or more"),
    (["--pcp", "-1"], "PROBLEM -pcp -1: must be 1 or more"),
    (["--gpu-memory-utilization", "1.5"], "PROBLEM --gpu-memory-utilization 1.5: must be in (0, 1]"),
])
def test_bad_sizes(capsys, argv, message):
    rc, lines = run(capsys, "qwen3.6-35b-a3b", *argv)
    assert rc == 1
    assert message in lines
    assert not [s for s in lines if "GPU visible" in s]  # not judged with a bad size


# ----------------------------------------------------------------------------- environment
def test_vllm_version(capsys, monkeypatch):
    fake_gpus(monkeypatch, H200, H200)
    monkeypatch.setattr(doctor, "vllm_version", lambda: "0.21.0")
    rc, lines = run(capsys)
    assert rc == 1
    assert line(lines, "PROBLEM vLLM 0.21.0").startswith(
        "PROBLEM vLLM 0.21.0; the plugin is written for 0.20.2")
    assert "        -> pip install vllm==0.20.2" in lines


def test_plugin_left_out_by_vllm_plugins(capsys, monkeypatch):
    fake_gpus(monkeypatch, H200, H200)
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    rc, lines = run(capsys)
    assert rc == 1
    assert "PROBLEM VLLM_PLUGINS='other_plugin' leaves qwen36_pcp out, so vLLM would not load it" in lines
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin,qwen36_pcp")
    assert run(capsys)[0] == 0


def test_plugin_not_installed(capsys, monkeypatch):
    import importlib.metadata

    fake_gpus(monkeypatch, H200, H200)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    rc, lines = run(capsys)
    assert rc == 1
    assert line(lines, "PROBLEM the vllm.general_plugins entry point qwen36_pcp is not installed")


# ----------------------------------------------------------------------------- experts
@pytest.mark.parametrize("tp, figure", [("1", "60 GiB"), ("2", "30 GiB")])
def test_experts_of_qwen36_35b_a3b(capsys, tp, figure):
    _, lines = run(capsys, "qwen3.6-35b-a3b", "--tp", tp)
    assert line(lines, "note    moe_experts='replicated'").startswith(
        f"note    moe_experts='replicated': {figure} of experts per GPU (bfloat16, split over tp = {tp})")


def test_qwen36_35b_a3b_fits_a_141_gib_gpu_at_tp_1(capsys, monkeypatch):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "qwen3.6-35b-a3b", "--pcp", "2")
    assert rc == 0, lines
    assert ("ok      moe_experts='replicated': 60 GiB of experts per GPU (bfloat16, split over tp = 1), within "
            "the 102 GiB the startup check allows (80% of gpu_memory_utilization=0.9 x 141 GiB)") in lines
    assert "ok      2 GPU(s): 2 x NVIDIA H200 (sm90, 141 GiB); -tp 1 x -pcp 2 needs 2" in lines
    assert lines[-1].startswith("no problem found; start it with: vllm serve MODEL_DIR --hf-overrides "
                                "'{\"architectures\": [\"Qwen3_6ForCausalLM\"]}' -tp 1 -pcp 2")


def test_qwen36_35b_a3b_does_not_fit_an_80_gib_gpu_at_tp_1(capsys, monkeypatch):
    fake_gpus(monkeypatch, H100, H100)
    rc, lines = run(capsys, "qwen3.6-35b-a3b", "--pcp", "2")
    assert rc == 1
    assert ("PROBLEM moe_experts='replicated': 60 GiB of experts per GPU (bfloat16, split over tp = 1), more "
            "than the 57.6 GiB the startup check allows (80% of gpu_memory_utilization=0.9 x 80 GiB)") in lines
    assert f"        -> {SHARDED} (30 GiB per GPU), or raise tp (-tp 2: 30 GiB)" in lines
    # either way out passes
    assert run(capsys, "qwen3.6-35b-a3b", "--pcp", "2", "--additional-config",
               '{"qwen36_pcp": {"moe_experts": "sharded"}}')[0] == 0
    fake_gpus(monkeypatch, *[H100] * 4)
    assert run(capsys, "qwen3.6-35b-a3b", "--pcp", "2", "--tp", "2")[0] == 0
    # a lower gpu_memory_utilization moves the limit
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "qwen3.6-35b-a3b", "--gpu-memory-utilization", "0.5")
    assert rc == 1 and line(lines, "PROBLEM moe_experts=").endswith(
        "more than the 56.4 GiB the startup check allows (80% of gpu_memory_utilization=0.5 x 141 GiB)")


def test_fp8_block_wise_checkpoint(capsys, monkeypatch, tmp_path):
    ckpt = fp8_checkpoint(tmp_path / "fp8")
    like = doctor.model_config_like(json.loads((ckpt / "config.json").read_text()))
    blocks = 2 * 4 * 16 + 16 * 4  # fp32 scales of one expert's w13 and w2 in 128x128 blocks
    assert whole_experts_bytes(SimpleNamespace(model_config=like)) == 30 * GiB + 40 * 256 * 4 * blocks
    fake_gpus(monkeypatch, H100, H100)
    rc, lines = run(capsys, str(ckpt))
    assert rc == 0, lines
    assert line(lines, "ok      moe_experts='replicated'").startswith(
        "ok      moe_experts='replicated': 30 GiB of experts per GPU (fp8, 128x128 blocks, split over tp = 1), "
        "within the 57.6 GiB")
    assert lines[-1].startswith(f"no problem found; start it with: vllm serve {ckpt} --hf-overrides")


def test_tiny_checkpoint_folder_passes(capsys, monkeypatch, tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", config_only=True)
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, str(ckpt), "--pcp", "2")
    assert rc == 0, lines
    # 8 layers x 8 experts x 3 x 256 x 128 bf16
    assert line(lines, "ok      moe_experts='replicated'").startswith(
        "ok      moe_experts='replicated': 12 MiB of experts per GPU (bfloat16, split over tp = 1)")
    assert [s[:8] for s in lines[:-1]] == ["ok      "] * (len(lines) - 1)


def test_flat_text_config(capsys, monkeypatch, tmp_path):
    """A config.json that is the text model itself (no text_config) reads the same."""
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps(build_config("qwen3.6-35b-a3b")["text_config"]))
    fake_gpus(monkeypatch, H100, H100)
    rc, lines = run(capsys, str(flat), "--tp", "2")
    assert rc == 1  # 4 ranks, 2 GPUs
    assert line(lines, "ok      moe_experts='replicated'").startswith(
        "ok      moe_experts='replicated': 30 GiB of experts per GPU (bfloat16, split over tp = 2)")


def test_dense_and_non_hybrid_models(capsys, monkeypatch, tmp_path):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys, "qwen3.6-27b")
    assert rc == 0 and "ok      experts: none (a dense model)" in lines
    config = build_config("tiny")
    config["text_config"]["layer_types"] = ["full_attention"] * 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, lines = run(capsys, str(tmp_path))
    assert rc == 1
    assert line(lines, "PROBLEM -pcp 2 does not support a non-hybrid model (PCP here is for Gated DeltaNet + "
                       "full-attention hybrids; layer_types=['full_attention'])")  # the engine's words
    assert run(capsys, str(tmp_path), "--pcp", "1")[0] == 0  # pcp=1 is vLLM's own model


def test_model_left_out_or_unknown(capsys, monkeypatch, tmp_path):
    fake_gpus(monkeypatch, H200, H200)
    rc, lines = run(capsys)
    assert rc == 0
    assert "note    model checks skipped: no MODEL given (a checkpoint folder or a preset)" in lines
    rc, lines = run(capsys, str(tmp_path / "missing"))
    assert rc == 1
    assert line(lines, "PROBLEM model: ").startswith(
        f"PROBLEM model: {str(tmp_path / 'missing')!r} is neither a folder with a config.json")
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8, "layer_types": ["linear_attention",
                                                                                         "full_attention"]}))
    rc, lines = run(capsys, str(tmp_path))
    assert rc == 1
    assert line(lines, "PROBLEM model: its config.json cannot be read as a Qwen3.6 config (AttributeError:")


# ----------------------------------------------------------------------------- the command line
def test_command_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on any machine
    env.pop("VLLM_PLUGINS", None)
    cmd = [sys.executable, "-m", "qwen36_pcp", "doctor"]
    help_run = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert help_run.returncode == 0, help_run.stderr
    assert help_run.stdout.startswith("usage: python -m qwen36_pcp doctor")
    assert "--additional-config JSON" in help_run.stdout
    check = subprocess.run([*cmd, "qwen3.6-35b-a3b", "--pcp", "2"], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=120)
    assert check.returncode == 1, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    assert lines[:2] == ["ok      vLLM 0.20.2",
                         "ok      plugin registered (vllm.general_plugins: qwen36_pcp = qwen36_pcp:register)"]
    assert "PROBLEM no GPU visible (CUDA_VISIBLE_DEVICES=''); -tp 1 x -pcp 2 needs 2 NVIDIA GPU(s)" in lines
    assert lines[-1] == "1 problem(s) found"
