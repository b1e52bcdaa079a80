"""Split attention and GDN context parallel with vLLM's real kernels, bf16, 2 GPUs over NCCL.

Run on a 2-GPU machine:  python -m pytest -q -s tests/gpu/test_layers_gpu.py
"""

import json
import os

import pytest
import torch

from qwen36_pcp.tools.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_layers_match_one_gpu_bf16():
    from .layer_cases_gpu import all_cases

    results = run_distributed(all_cases, 2, backend="nccl")
    print(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "layers_gpu.json"), "w") as f:
            json.dump(results, f, indent=1)
    for per_rank in results:
        for name, r in per_rank.items():
            if name.startswith("attention"):
                # zigzag + end-aligned causal FA is the same computation: bitwise
                assert r["output"]["max_abs"] == 0.0, (name, r)
                assert r["cache_k"]["max_abs"] == 0.0 and r["cache_v"]["max_abs"] == 0.0
            else:
                # island re-runs the unsplit kernels and the relay starts every block from its true
                # state on whole chunks: exact; state passing: bf16 correction term
                for mode in ("island", "relay"):
                    assert r[mode]["output"]["max_abs"] == 0.0, (name, mode, r)
                    assert r[mode]["ssm_state"]["max_abs"] == 0.0, (name, mode, r)
                    assert r[mode]["conv_state"]["max_abs"] == 0.0, (name, mode, r)
                assert r["state_passing"]["output"]["max_rel"] < 2e-2, (name, r)
                assert r["state_passing"]["ssm_state"]["max_rel"] < 1e-2, (name, r)
                assert r["state_passing"]["conv_state"]["max_abs"] == 0.0
