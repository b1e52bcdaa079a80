# SPDX-License-Identifier: Apache-2.0
"""PCP across two nodes through vLLM's multiprocessing launcher, both nodes on this machine.

    python -m pytest -q -s tests/gpu/test_two_nodes.py     # one GPU is enough (shared-GPU worker)

tp=2 inside each node x pcp=2 across the nodes, as docs/multi-node.md launches it: node 0 is an
``LLM(..., nnodes=2, node_rank=0, master_addr=127.0.0.1)`` engine, node 1 a second process set started
as vLLM prescribes for a secondary node, ``vllm serve MODEL ... --nnodes 2 --node-rank 1 --headless``
with the same engine arguments. Node 0 runs PCP rank 0 (global ranks 0, 1), node 1 PCP rank 1 (2, 3),
so every PCP collective crosses from one process set to the other. On one GPU every rank is on GPU 0
(``shared_gpu``); with 4 GPUs each node gets two.

The two-node engine must give the one-node tp=2 x pcp=2 engine's answers bit for bit on the defaults
engine's batches (case 1, short splits, max_tokens=1, abort mid-prefill): the same kernels on the same
rows, the same bytes through the same collectives. Every wait is bounded, and node 1's process set is
stopped and gone at the end. (pcp=2 with one rank per node, tp=1, is refused by vLLM 0.20.2's
argument check, with the plugin's message: ``tests/test_startup_messages.py``.)
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tests.fake_cuda import free_port

from . import e2e
from .test_pcp_e2e import CASE1_LENGTHS, layout_jobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NODES = 2
LAYOUT = "tp2_pcp2"
REFERENCE = f"defaults_{LAYOUT}"  # test_pcp_e2e's one-node engine, the same job
NODE1_STOP_S = 60
NODE1_DRAIN_S = 30  # its workers and multiprocessing helpers exit after the launcher; then killed


def _node_specs(shared: bool):
    """(node 0's engine spec, node 1's LLM kwargs): the one-node spec plus the launcher's arguments,
    and vLLM's batch defaults written out for node 1 (a ``vllm serve`` would otherwise take the
    server's smaller step budget, and node 1's workers must size their buffers as node 0 schedules)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    spec, _ = layout_jobs()[REFERENCE]
    tokens, seqs = EngineArgs.get_batch_defaults(spec["llm"]["tensor_parallel_size"])  # as vLLM calls it
    llm = {**spec["llm"], "nnodes": NODES, "master_addr": "127.0.0.1", "master_port": free_port()}
    if shared:
        llm = e2e.on_shared_gpu({"llm": llm})["llm"]
    node0 = {**spec, "llm": {**llm, "node_rank": 0}}
    node1 = {**llm, "node_rank": 1, "headless": True,
             "max_num_batched_tokens": tokens[UsageContext.LLM_CLASS],
             "max_num_seqs": seqs[UsageContext.LLM_CLASS]}
    return node0, node1


def _two_nodes(gpus: str) -> dict:
    visible = gpus.split(",")
    shared = len(visible) < 4
    node0, node1 = _node_specs(shared)
    gpus0, gpus1 = (gpus, gpus) if shared else (",".join(visible[:2]), ",".join(visible[2:4]))
    log_path = e2e.out_dir() / "two_nodes_node1.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", node1["model"],
                                 *e2e.cli_flags(node1)], cwd=e2e.REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=e2e.child_env(gpus1, HF_HUB_OFFLINE="1"), start_new_session=True)
        try:
            result = e2e.engine(node0, name="two_nodes_tp2_pcp2", gpus=gpus0)
        finally:
            t0 = time.time()
            left = e2e.stop_group(proc, timeout=NODE1_STOP_S, drain_s=NODE1_DRAIN_S)
    result["node1"] = {"exit_code": proc.returncode, "stop_s": round(time.time() - t0, 1), "left": left}
    e2e.save("two_nodes_tp2_pcp2", result)
    return result


def two_node_jobs():
    reference = layout_jobs()[REFERENCE]
    return {REFERENCE: reference, "two_nodes_tp2_pcp2": (_two_nodes, reference[1])}


@pytest.mark.engine_jobs(builder=two_node_jobs)
def test_two_nodes_give_the_one_node_answers_bit_for_bit(engine_pool):
    one = e2e.result(engine_pool, REFERENCE)
    two = e2e.result(engine_pool, "two_nodes_tp2_pcp2")
    c = e2e.compare(e2e.outputs(one), e2e.outputs(two))
    identical = e2e.outputs(one) == e2e.outputs(two)
    print(f"[two nodes] tp2 x pcp2 on 2 nodes vs 1 node: ok={c['ok']} identical={identical} "
          f"max|dlogprob|={c['max_logprob_diff']:.4g} nonfinite={c['nonfinite']} | node 1: {two['node1']}")
    e2e.save("two_nodes", {**c, "identical": identical, "node1": two["node1"],
                           "actions": {k: two[k] for k in ("max_tokens_one", "abort_mid_prefill")}})
    assert c["ok"] and identical, c
    assert two["max_tokens_one"] == one["max_tokens_one"] == [1] * len(CASE1_LENGTHS)
    assert two["abort_mid_prefill"]["finished"] == one["abort_mid_prefill"]["finished"]
    assert two["node1"]["left"] == 0, two["node1"]
