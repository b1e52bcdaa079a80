# SPDX-License-Identifier: Apache-2.0
"""The PCP model runner's own steps on real gloo ranks: the plan taken once from ``_prepare_inputs``,
CUDA graphs skipped only at split steps, each rank's slice of the inputs, the output gather (with and
without prompt logprobs) and rank 0's sampled rows at unsplit steps (its block tables:
``test_layouts_cpu``).

vLLM's own parts of a step (``_prepare_inputs``, the batch dispatch, the model) are stood in for: the
model is a function of each row's token id and position, so every row the runner hands vLLM can be
checked against the same function over the whole batch. Ranks other than 0 add a rank-dependent
offset to every row (as if their kernels had rounded differently), so a row taken from the wrong copy
is seen.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from harness.runner_stand_in import (
    HIDDEN,
    BlockTables,
    cuda_graphs,
    execute_spread_runner,
    expected_rows,
    model_rows,
    spread_runner,
    stand_in_runner,
)


def _image_prompt(num_tokens: int, images: list[tuple[int, int, int]]):
    """A prompt's placeholder embeddings (one element per row: text rows their token id, image rows a
    value of their own) and its M-RoPE positions from vLLM's Qwen3-VL (``images``: (offset, grid h,
    grid w) in merged tokens, each image ``h x w`` tokens)."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    embeds = torch.arange(num_tokens, dtype=torch.float64) % 8000
    features = []
    for offset, h, w in images:
        embeds[offset:offset + h * w] = 10_000 + torch.arange(h * w, dtype=torch.float64)
        features.append(SimpleNamespace(modality="image", mm_position=SimpleNamespace(offset=offset),
                                        data={"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 2 * h, 2 * w]))}))
    config = SimpleNamespace(video_token_id=-2, vision_start_token_id=-3, vision_end_token_id=-4,
                             vision_config=SimpleNamespace(spatial_merge_size=2))
    positions, _ = Qwen3VLForConditionalGeneration._get_mrope_input_positions(
        list(range(num_tokens)), features, config)
    return embeds, positions


def _steps(rank, group):
    """Three steps through one runner: a split step, the same with prompt logprobs, an unsplit one."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.runner_hooks.warm_up import warm_pcp_collectives

    dispatched, seen = [], []
    runner = stand_in_runner(group, PCPConfig(min_split_tokens=512), model_rows(rank, seen), dispatched)
    # each rank's drafter proposes its own tokens (as if its kernels had rounded differently)
    GPUModelRunner.propose_draft_token_ids = lambda self, *a, **kw: torch.full((3, 2), 100 + rank)
    warm_pcp_collectives(group, runner.pcp_config, runner.device)  # every rank in chain order: returns
    results = {}
    # decodes first (vLLM's order), a continuing prompt, a fresh one; 4 rows of padding
    # MTP on: a step of prompt tokens alone, one with a request's drafts (verification rows), one
    # with a request past its prompt and no drafts
    mtp, drafts = SimpleNamespace(method="mtp"), {"req0": [5, 6]}
    # (request 0 of the last two is past its 17-token prompt, request 1 a fresh 3000-token prompt)
    prompts4 = [17, 40, 3000, 700]
    for name, num_computed, num_new, num_prompt, logprobs, spec, scheduled_drafts in (
            ("split", [17, 40, 0, 0], [1, 1, 3000, 700], prompts4, False, None, {}),
            ("split_prompt_logprobs", [17, 40, 0, 0], [1, 1, 3000, 700], prompts4, True, None, {}),
            ("unsplit", [17, 40, 3000, 700], [1, 1, 1, 1], prompts4, False, None, {}),
            ("mtp_prompts", [0, 0], [3000, 700], [3000, 700], False, mtp, {}),
            # a continuing chunk split (its prompt's earlier chunks in the cache) beside a fresh one
            ("mtp_continuing", [4096, 0], [4096, 700], [20000, 700], False, mtp, {}),
            ("mtp_drafts", [17, 0], [3, 3000], [17, 3000], False, mtp, drafts),
            ("mtp_decode", [17, 0], [1, 3000], [17, 3000], False, mtp, {})):
        num_new = np.array(num_new, dtype=np.int32)
        runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(num_computed + [0] * 12),
                                             num_prompt_tokens=np.array(num_prompt + [0] * 12),
                                             req_id_to_index={f"req{i}": i for i in range(len(num_new))})
        _vllm_step_buffers(runner, num_computed, num_new, num_prompt, scheduled_drafts)
        runner.num_prompt_logprobs = {"req": 5} if logprobs else {}
        runner.speculative_config = spec
        scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens=scheduled_drafts)
        logits_indices, _ = runner._prepare_inputs(scheduler_output, num_new)
        runner._determine_batch_execution_and_padding(0, 0, num_new, 0, False)
        starts = np.concatenate([[0], np.cumsum(num_new)[:-1]])
        ids = torch.from_numpy(np.concatenate([np.arange(n) * 7 + 3 + i for i, n in enumerate(num_new)]))
        pos = torch.from_numpy(np.concatenate([c + np.arange(n) for c, n in zip(num_computed, num_new)]))
        pad = 4
        ids, pos = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)]), torch.cat([pos, torch.zeros(pad,
                                                                                                    dtype=pos.dtype)])
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})):
            hidden = runner._model_forward(input_ids=ids, positions=pos)
        step = runner.pcp_step
        results[name] = {"hidden": hidden, "expected": expected_rows(ids, pos), "rows": logits_indices.long(),
                         "split": None if step.plan is None else step.plan.split.tolist(),
                         "seen": seen[-1], "t_pad": None if step.plan is None else step.plan.t_pad,
                         "force_eager": dispatched[-1], "starts": starts}
        runner.pcp_step = None  # what execute_model's finally does
    results["images"] = _image_step(runner, seen, dispatched)
    results["drafts"] = runner.propose_draft_token_ids()
    results["drafter"] = _drafter_steps(runner, rank)
    return results


def _vllm_step_buffers(runner, num_computed, num_new, num_prompt, drafts: dict, rejected=()) -> None:
    """What vLLM's ``_prepare_inputs`` leaves in the runner's buffers that the plan reads with MTP: each
    request's drafts past its prompt (-1: none, or not past it) and the sequence lengths on the device,
    which under async scheduling hold the previous step's rejected drafts (``rejected`` per request)
    less than the host counts."""
    decode_drafts = np.full(16, -1, dtype=np.int32)
    for req_id, d in drafts.items():
        i = int(req_id[3:])
        if num_computed[i] >= num_prompt[i]:
            decode_drafts[i] = len(d)
    runner.num_decode_draft_tokens = SimpleNamespace(np=decode_drafts)
    lens = np.array(num_computed) + np.array(num_new) - np.pad(np.array(rejected, dtype=np.int64),
                                                               (0, len(num_new) - len(rejected)))
    runner.seq_lens = torch.from_numpy(np.pad(lens, (0, 16 - len(lens)))).to(torch.int32)


def _image_step(runner, seen, dispatched):
    """A split step of a vision-language model: ``inputs_embeds`` (image embeddings merged in) and [3, T]
    M-RoPE positions instead of token ids; a fresh prompt with an image across its first block
    boundary (pcp=2: 750 tokens) and a prompt's second chunk with an image across the chunk boundary
    (its first rows come from the chunk before); prompt logprobs bring every row."""
    from vllm.forward_context import ForwardContext, override_forward_context

    num_computed, num_new = [0, 4096], np.array([3000, 4096], dtype=np.int32)
    prompts = [_image_prompt(3000, [(600, 20, 20)]), _image_prompt(12000, [(4000, 20, 25), (6000, 8, 8)])]
    runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(num_computed + [0] * 12),
                                         num_prompt_tokens=np.array([3000, 12000] + [0] * 12))
    runner.num_prompt_logprobs, runner.speculative_config = {"req": 1}, None
    runner._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens={}), num_new)
    runner._determine_batch_execution_and_padding(0, 0, num_new, 0, False)
    pad = 4
    embeds = torch.cat([p[0][c:c + n] for p, c, n in zip(prompts, num_computed, num_new)] + [torch.zeros(pad)])
    pos = torch.cat([p[1][:, c:c + n] for p, c, n in zip(prompts, num_computed, num_new)]
                    + [torch.zeros(3, pad, dtype=torch.int64)], dim=1)
    embeds = embeds[:, None].expand(-1, HIDDEN).contiguous()
    with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})):
        hidden = runner._model_forward(input_ids=None, positions=pos, inputs_embeds=embeds)
    step = runner.pcp_step
    runner.pcp_step = None
    n = int(num_new.sum())
    return {"hidden": hidden[:n], "expected": expected_rows(None, pos, embeds)[:n], "seen": seen[-1],
            "split": step.plan.split.tolist(), "t_pad": step.plan.t_pad, "force_eager": dispatched[-1],
            "image_rows": int((embeds[:n, 0] >= 10_000).sum()), "axes_differ": bool((pos[1] != pos[2]).any())}


class _Drafter(torch.nn.Module):
    """The MTP drafter's model stood in for: each row's output is its input hidden state plus the
    stand-in model of its token id and position (``rank`` added off the primary copies, as ``_model``);
    each call's rows, context and CUDA-graph mode are noted. Called as vLLM's ``support_torch_compile``
    calls the MTP model: ``forward`` directly, past any module hook."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.calls, self.contexts = rank, [], []

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids=None, positions=None, hidden_states=None, inputs_embeds=None):
        from vllm.forward_context import get_forward_context

        from qwen36_pcp.layers.context import current_pcp_context

        ctx = current_pcp_context()
        rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        self.calls.append((rows, ctx is not None, get_forward_context().cudagraph_runtime_mode))
        self.contexts.append(ctx)
        out = hidden_states + expected_rows(input_ids, positions, inputs_embeds)
        noise = torch.full((out.shape[0],), float(self.rank), dtype=out.dtype)
        if ctx is not None:
            noise[torch.from_numpy(ctx.plan.primary[self.rank])] = 0.0
        return out + noise[:, None]


def _drafter_steps(runner, rank):
    """A split MTP step, then vLLM's drafter as ``EagleProposer.propose`` calls its model: a first pass
    over every row of the step, then one pass over each request's last row; with ``mtp_first_pass``
    "split" and "whole", and split with embeddings and [3, T] M-RoPE positions (a vision-language
    drafter's inputs). Then a split step whose drafter does not run, and an unsplit step after it:
    its first pass runs whole."""
    import dataclasses

    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    num_computed, num_new = [0, 4096], np.array([3000, 4096], dtype=np.int32)
    ids = torch.from_numpy(np.concatenate([np.arange(n) * 5 + 1 + i for i, n in enumerate(num_new)]))
    pos = torch.from_numpy(np.concatenate([c + np.arange(n) for c, n in zip(num_computed, num_new)]))
    last = torch.from_numpy(np.cumsum(num_new) - 1)
    embeds = ids.double()[:, None].expand(-1, HIDDEN).contiguous()
    mrope = torch.stack([pos, pos % 7, pos % 11])

    def propose(self, hidden, inputs, ends):  # vLLM's two passes, in the drafter's forward context
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                                     cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)):
            first = self.drafter.model(hidden_states=hidden, **inputs)
            second = self.drafter.model(hidden_states=first[ends], **{  # each request's last row
                k: None if v is None else v[..., ends] if k == "positions" else v[ends] for k, v in inputs.items()})
        return first, second

    saved = GPUModelRunner.propose_draft_token_ids
    GPUModelRunner.propose_draft_token_ids = propose
    drafter = _Drafter(rank)
    runner.drafter = SimpleNamespace(model=drafter, needs_extra_input_slots=False)
    runner.speculative_config, runner.num_prompt_logprobs = SimpleNamespace(method="mtp"), {}
    runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(num_computed + [0] * 12),
                                         num_prompt_tokens=np.array([3000, 12000] + [0] * 12))
    text = {"input_ids": ids, "positions": pos, "inputs_embeds": None}
    vision = {"input_ids": None, "positions": mrope, "inputs_embeds": embeds}

    def step(new, inputs, ends=last, propose: bool = True, drafts: dict | None = None):
        runner._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens=drafts or {}), new)
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})):
            hidden = runner._model_forward(**inputs)
        plan = runner.pcp_step.plan
        runner.pcp_step = None
        if not propose:
            return None
        first, second = runner.propose_draft_token_ids(hidden, inputs, ends)
        calls, contexts = list(drafter.calls), list(drafter.contexts)
        drafter.calls.clear()
        drafter.contexts.clear()
        return {"hidden": hidden, "first": first, "second": second, "calls": calls, "plan": plan,
                "seqused_k": None if contexts[0] is None else contexts[0].t.seqused_k.tolist(),
                "t_pad": plan.t_pad if plan else None, "model_back": runner.drafter.model is drafter,
                "local": plan.local_full_idx[rank][:plan.num_local_tokens].copy() if plan else None}

    out = {}
    try:
        _vllm_step_buffers(runner, num_computed, num_new, [3000, 12000], {})
        for name, mode, inputs in (("split", "split", text), ("whole", "whole", text),
                                   ("split_vision", "split", vision)):
            runner.pcp_config = dataclasses.replace(runner.pcp_config, mtp_first_pass=mode)
            out[name] = step(num_new, inputs)
        # a request verifying 2 drafts (3 rows) beside the two prompts: the host counts its previous
        # step's 2 rejected drafts as accepted, vLLM's device lengths do not
        runner.pcp_config = dataclasses.replace(runner.pcp_config, mtp_first_pass="split")
        verify_new, verify_computed = np.array([3, *num_new], dtype=np.int32), [20, *num_computed]
        runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(verify_computed + [0] * 12),
                                             num_prompt_tokens=np.array([17, 3000, 12000] + [0] * 12),
                                             req_id_to_index={"req0": 0, "req1": 1, "req2": 2})
        _vllm_step_buffers(runner, verify_computed, verify_new, [17, 3000, 12000], {"req0": [7, 8]}, rejected=[2])
        verify_ids = torch.cat([torch.tensor([90, 91, 92]), ids])
        verify_pos = torch.cat([torch.tensor([18, 19, 20]), pos])
        verify_last = torch.cat([torch.arange(3), last + 3])
        out["verify"] = step(verify_new, {"input_ids": verify_ids, "positions": verify_pos, "inputs_embeds": None},
                             verify_last, drafts={"req0": [7, 8]})
        out["verify_target"], out["verify_read"] = expected_rows(verify_ids, verify_pos), verify_last
        runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(num_computed + [0] * 12),
                                             num_prompt_tokens=np.array([3000, 12000] + [0] * 12))
        step(num_new, text, propose=False)  # its drafter does not run (the input did not fit it)
        runner.input_batch.num_computed_tokens_cpu[:2] = [3000, 8192]
        out["after"] = step(np.array([1, 1], dtype=np.int32), {"input_ids": ids[last], "positions": pos[last] + 1,
                                                                 "inputs_embeds": None}, torch.arange(2))
    finally:
        GPUModelRunner.propose_draft_token_ids = saved
    out["target"], out["target_vision"], out["last"] = expected_rows(ids, pos), expected_rows(None, mrope, embeds), last
    return out


def _spread_steps(rank, group):
    """decode="spread" through the runner: a decode step of 5 requests (each rank runs its own as
    vLLM's batch, through vLLM's FULL graph of that size), of 3 requests (at pcp=4 rank 3 owns none),
    the 5 again without CUDA graphs and past the request buffers, decode rows beside a split and a
    short prompt, a short prompt alone, a hand-over, the 5 all on rank 0 (owners kept from earlier
    steps: its graph of 8 rows is larger than the batch)."""
    from vllm.config import CUDAGraphMode

    from qwen36_pcp.spread.decode_owners import DecodeOwners

    seen, calls, results = [], {}, {}
    runner = spread_runner(group, rank, seen, calls)
    layers = runner.spread.attention_groups[0][1]
    decode = (["a", "b", "c", "d", "e"], [17, 40, 3000, 700, 9], [1] * 5, [17, 40, 3000, 700, 9])
    decode3 = (["f", "g", "h"], [5, 6, 7], [1] * 3, [5, 6, 7])
    for name, req_ids, num_computed, num_new, num_prompt in (
            ("decode", *decode), ("decode3", *decode3), ("decode_eager", *decode), ("decode_past_buffers", *decode),
            ("mixed", ["c", "a", "e", "p", "q"], [3001, 18, 10, 0, 0], [1, 1, 1, 5000, 30], [3000, 17, 9, 5000, 30]),
            ("prompt", ["r"], [0], [30], [30]),
            # request a, decoded on one rank, comes back with three tokens of a grown prompt
            ("handover", ["a", "b"], [19, 41], [3, 1], [22, 40]), ("decode_lopsided", *decode)):
        cuda_graphs(runner, CUDAGraphMode.NONE if name == "decode_eager" else CUDAGraphMode.FULL_AND_PIECEWISE)
        if name in ("decode3", "decode_eager", "decode_past_buffers", "decode_lopsided"):
            runner.spread.owners = DecodeOwners(group.world_size)
        if name == "decode_lopsided":
            runner.spread.owners.owner.update({r: 0 for r in req_ids})
        # the padded batch (4 rows at pcp=2) past the request buffers: eager at its own size
        runner.max_num_reqs = 3 if name == "decode_past_buffers" else 16
        num_new = np.array(num_new, dtype=np.int32)
        runner.input_batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array(num_computed),
                                             num_prompt_tokens=np.array(num_prompt), block_table=BlockTables())
        runner.requests = {r: SimpleNamespace(num_tokens=p) for r, p in zip(req_ids, num_prompt)}
        runner.requests.update({r: SimpleNamespace(num_tokens=1) for r in "abcdefghpqr" if r not in req_ids})
        # prefix caching at two steps: GDN states block by block (blocks of STATE_BLOCK tokens), each
        # rank's its own values; request j's blocks in state group 1 from j * 4000 on
        align = name in ("decode", "mixed")
        runner.cache_config = SimpleNamespace(mamba_cache_mode="align" if align else "none")
        states = _states(rank)
        runner.spread.state_groups = ([1], STATE_BLOCK, [[SimpleNamespace(kv_cache=tuple(states))]])
        for j, r in enumerate(req_ids):
            runner.requests[r].block_ids = ([], list(range(j * 4000, j * 4000 + 2000)))
        results[name] = _run_spread_step(runner, layers, seen, calls, states, num_computed, num_new)
        plan = results[name]["plan"]
        results[name]["handovers"] = None if plan is None else plan.handovers
    return results


def _run_spread_step(runner, layers, seen, calls, states, num_computed, num_new, drafts=None) -> dict:
    """One step through a ``_spread_runner`` on cleared caches (``execute_spread_runner``) and what it
    left: the hidden states and the stand-in model's expected rows, the rows vLLM samples, the plan and
    its owners, the owned batch, the stand-ins' calls, the model's calls, the graph mode, the drafter's
    metadata, each attention layer's K/V, the whole batch's ids and positions, the GDN states."""
    for layer in layers:
        layer.kv_cache.zero_()
    calls.clear()
    before = len(seen)
    logits_indices, mode, hidden, common = execute_spread_runner(runner, num_new, drafts)
    whole_ids = torch.from_numpy(np.concatenate([np.arange(n) * 7 + 3 + i for i, n in enumerate(num_new)]))
    whole_pos = torch.from_numpy(np.concatenate([c + np.arange(n) for c, n in zip(num_computed, num_new)]))
    step, runner.pcp_step = runner.pcp_step, None
    return {"hidden": hidden, "expected": expected_rows(whole_ids, whole_pos), "rows": logits_indices.long(),
            "plan": step.plan, "owner": None if step.plan is None else step.plan.owner.tolist(),
            "owned": step.owned, "calls": dict(calls), "seen": seen[before:], "mode": mode, "common": common,
            "kv": [(layer.kv_cache[0].reshape(-1, HIDDEN).clone(), layer.kv_cache[1].reshape(-1, HIDDEN).clone())
                   for layer in layers],
            "whole": (whole_ids, whole_pos), "states": [x.clone() for x in states]}


def _one_batch_decoding_on(rank, group):
    """Three spread decode steps of one batch (5 requests, a token further at each step, their
    attention slots moved at each step) through a runner that reuses the batch's plan, device rows and
    step tensors from step to step and through one made to build them anew at every step: per step the
    metadata, the hidden states, the caches' K/V and the step tensors."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.layers.context import StepTensors

    out = {}
    for reuse in (True, False):
        seen, calls = [], {}
        runner = spread_runner(group, rank, seen, calls)
        cuda_graphs(runner, CUDAGraphMode.FULL_AND_PIECEWISE)
        layers = runner.spread.attention_groups[0][1]
        prepare = GPUModelRunner._prepare_inputs  # the stand-in's
        steps = []
        for step in range(3):
            def moved(self, so, num_new, step=step):
                rows = prepare(self, so, num_new)
                self.input_batch.block_table.block_tables[0].slot_mapping.gpu[: int(num_new.sum())] += 13 * step
                return rows
            GPUModelRunner._prepare_inputs = moved
            if not reuse:
                runner.spread.latest = None
            req_ids, computed = list("abcde"), np.array([17, 40, 3000, 700, 9]) + step
            runner.input_batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=computed,
                                                 num_prompt_tokens=np.array([17, 40, 3000, 700, 9]),
                                                 block_table=BlockTables())
            runner.requests = {r: SimpleNamespace(num_tokens=int(c) + 1, block_ids=([], [])) for r, c in zip(req_ids,
                                                                                                             computed)}
            runner.cache_config = SimpleNamespace(mamba_cache_mode="none")
            calls.clear()
            _, mode, hidden, _ = execute_spread_runner(runner, np.ones(5, dtype=np.int32))
            plan, owned = runner.pcp_step.plan, runner.pcp_step.owned
            fresh, used = StepTensors.build(plan, "cpu"), owned.step_tensors(plan, "cpu")
            steps.append({"metadata": calls.get("metadata"), "hidden": hidden.clone(), "mode": mode,
                          "kv": [layer.kv_cache.clone() for layer in layers], "owned": id(owned),
                          "computed": plan.num_computed.tolist(),
                          "tensors": (fresh, used)})
            runner.pcp_step = None
        GPUModelRunner._prepare_inputs = prepare
        out[reuse] = steps
    return out


def _verification_steps(rank, group):
    """decode="spread" with MTP (K = 3) through the runner: a step of 5 requests verifying 3 drafts each
    (each rank runs its own as vLLM's uniform batch of 4-row queries, through vLLM's FULL graph of that
    size), the same batch a step later (its owned batch reused), then two of them beside a prompt (they
    stay with their owners, which verify them in the step's plan), then every request verifying with
    one still a recompute's leftover (it alone handed over, every state block of its from its owner)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    seen, calls, results = [], {}, {}
    runner = spread_runner(group, rank, seen, calls, cache_blocks=32)
    runner.speculative_config, runner.uniform_decode_query_len = SimpleNamespace(num_speculative_tokens=3), 4
    runner.attn_groups, runner.uses_mrope = [["attention"], ["gdn"]], False
    layers = runner.spread.attention_groups[0][1]
    runner.spread.attach_kv_stage(layers)  # (``load_model``'s: rows for 1 + K per request)
    cpu = torch.device("cpu")
    runner.num_accepted_tokens = CpuGpuBuffer(16, dtype=torch.int32, device=cpu, pin_memory=False)
    runner.num_decode_draft_tokens = CpuGpuBuffer(16, dtype=torch.int32, device=cpu, pin_memory=False)
    runner.num_accepted_tokens.gpu.copy_(torch.arange(16) % 4 + 1)  # request i: 1 + i % 4 accepted
    cuda_graphs(runner, CUDAGraphMode.FULL_AND_PIECEWISE, query_len=4)
    prepare = GPUModelRunner._prepare_inputs  # the stand-in's

    def buffers(self):
        tables = self.input_batch.block_table.block_tables
        return [self.query_start_loc.gpu, self.seq_lens, self.optimistic_seq_lens_cpu, self.input_ids.gpu,
                self.positions, *(t.slot_mapping.gpu for t in tables), *(t.block_table.gpu for t in tables)]

    def with_drafts(self, so, num_new):  # vLLM's draft counts of a verification step, then a snapshot
        rows = prepare(self, so, num_new)
        # async scheduling: the host counts the previous step's drafts as accepted; vLLM's device lengths
        # hold what was (request i: i % 3 fewer)
        self.seq_lens[: len(num_new)] -= torch.arange(len(num_new), dtype=torch.int32) % 3
        drafts = so.scheduled_spec_decode_tokens
        self.num_decode_draft_tokens.cpu.fill_(-1)
        for i, r in enumerate(self.input_batch.req_ids):
            if r in drafts:
                self.num_decode_draft_tokens.cpu[i] = len(drafts[r])
        calls["whole"] = [b.clone() for b in buffers(self)]
        return rows

    GPUModelRunner._prepare_inputs = with_drafts
    base = {r: 10 * j for j, r in enumerate("abcdep")}  # each request's 4 state blocks from here
    verify = (list("abcde"), [17, 40, 3000, 700, 9], [4] * 5, [17, 40, 3000, 700, 9])
    steps = (("verify", *verify), ("verify_again", verify[0], [c + 4 for c in verify[1]], *verify[2:]),
             ("mixed", ["a", "b", "p"], [25, 48, 0], [4, 4, 600], [17, 40, 600]),
             # all verifying, but e's rows are still a recompute's (its owner ended by it): not spread
             ("verify_recompute", verify[0], [29, 52, 3008, 708, 17], *verify[2:]))
    for name, req_ids, num_computed, num_new, num_prompt in steps:
        if name == "verify_recompute":
            runner.spread.owners.prefill_end["e"] = 10 ** 6
        num_new = np.array(num_new, dtype=np.int32)
        runner.input_batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array(num_computed),
                                             num_prompt_tokens=np.array(num_prompt), block_table=BlockTables(),
                                             req_id_to_index={r: i for i, r in enumerate(req_ids)})
        runner.requests = {r: SimpleNamespace(num_tokens=n + 4, block_ids=([], list(range(base[r], base[r] + 4))))
                           for r, n in zip("abcdep", [17, 40, 3000, 700, 9, 600])}
        runner.cache_config = SimpleNamespace(mamba_cache_mode="none")
        states = _states(rank)
        runner.spread.state_groups = ([1], STATE_BLOCK, [[SimpleNamespace(kv_cache=tuple(states))]])
        drafts = {r: [-1] * 3 for r in req_ids if r != "p"}
        result = _run_spread_step(runner, layers, seen, calls, states, num_computed, num_new, drafts)
        result.update(owned_id=id(result["owned"]), owners_after=dict(runner.spread.owners.owner),
                      restored=all(torch.equal(a, b) for a, b in zip(buffers(runner), calls["whole"])))
        results[name] = result
    GPUModelRunner._prepare_inputs = prepare
    return results


def _same(x, y) -> bool:
    """Equal tensors, or dataclasses of them field by field."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if dataclasses.is_dataclass(x):
        return type(x) is type(y) and all(_same(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x))
    return x == y


def _spread_runs(rank, group):
    """``_spread_steps`` and ``_one_batch_decoding_on`` in one set of rank processes."""
    return {"steps": _spread_steps(rank, group), "batch": _one_batch_decoding_on(rank, group),
            "verification": _verification_steps(rank, group)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"pcp{n}")
def spread_runs(request):
    """(world size, each rank's ``_spread_runs``)."""
    return request.param, run_distributed(_spread_runs, request.param)


def test_a_batch_decoding_on_reuses_its_plan_and_rows_with_each_steps_lengths_and_slots(spread_runs):
    for rank, runs in enumerate(spread_runs[1]):
        out = runs["batch"]
        reused, anew = out[True], out[False]
        assert len({s["owned"] for s in reused}) == 1  # one batch, built at the first step
        for step, (a, b) in enumerate(zip(reused, anew)):
            assert a["computed"] == (np.array([17, 40, 3000, 700, 9]) + step).tolist()
            assert a["metadata"] == b["metadata"], (rank, step)
            assert torch.equal(a["hidden"], b["hidden"]) and a["mode"] == b["mode"]
            assert all(torch.equal(x, y) for x, y in zip(a["kv"], b["kv"])), (rank, step)
            # the step tensors kept from the first step, with this step's keys, are this plan's
            assert _same(*a["tensors"]), (rank, step, a["tensors"])
            if a["metadata"] is not None:  # a rank with requests of its own: its lengths moved on
                assert a["metadata"]["seq_lens"][:1] != reused[0]["metadata"]["seq_lens"][:1] or step == 0


STATE_BLOCK = 2


def _states(rank):
    """A GDN layer's conv and SSM states in the blocks' slots, a rank's own values."""
    return [torch.arange(20000 * 3, dtype=torch.bfloat16).view(20000, 3) + 100 * rank,
            torch.arange(20000 * 4, dtype=torch.float32).view(20000, 2, 2) + 1000 * rank]


def test_spread_decode_steps_through_the_runner(spread_runs):
    from vllm.config import CUDAGraphMode

    world_size, ranks = spread_runs[0], [runs["steps"] for runs in spread_runs[1]]
    computed = {"decode": [17, 40, 3000, 700, 9], "decode3": [5, 6, 7], "decode_eager": [17, 40, 3000, 700, 9],
                "decode_past_buffers": [17, 40, 3000, 700, 9], "decode_lopsided": [17, 40, 3000, 700, 9]}
    for rank, results in enumerate(ranks):
        decode, mixed, prompt = (results[k] for k in ("decode", "mixed", "prompt"))
        # each decode row on one rank, balanced (5 rows: 3 + 2 at pcp=2, 2 + 1 + 1 + 1 at pcp=4)
        assert decode["owner"] == ranks[0]["decode"]["owner"]
        assert sorted(np.bincount(decode["owner"], minlength=world_size).tolist()) == (
            [2, 3] if world_size == 2 else [1, 1, 1, 2])
        # the same owners at the next step, where the decode rows sit beside a split and a short prompt
        owner_of = dict(zip("abcde", decode["owner"]))
        assert mixed["owner"] == [owner_of["c"], owner_of["a"], owner_of["e"], -1, -1]
        for name in ("decode", "decode3", "decode_eager", "decode_past_buffers", "decode_lopsided"):
            step = results[name]
            owner, calls = np.array(step["owner"]), step["calls"]
            mine = np.flatnonzero(owner == rank)  # in the plan's local order: by request
            n = len(mine)
            # the batch every rank runs: the most any rank owns, padded to a captured graph (3 -> 4,
            # 2 -> 2, 1 -> 1), unpadded without graphs; dispatched as a decode batch of that size
            most = int(np.bincount(owner, minlength=world_size).max())
            eager = name == "decode_eager" or (name == "decode_past_buffers" and world_size == 2)
            rows = most if eager else {1: 1, 2: 2, 3: 4, 5: 8}[most]
            assert step["owned"].num_rows == rows and step["owned"].num_reqs == n
            assert calls["dispatch"] == (rows, rows, name == "decode_past_buffers" and eager, step["mode"], rows)
            assert step["mode"] == (CUDAGraphMode.NONE if eager else CUDAGraphMode.FULL)
            # vLLM's metadata of a batch of the rank's own requests, read at the buffers' heads
            seq_lens = (np.array(computed[name]) + 1)[mine].tolist()
            if n:
                meta = calls["metadata"]
                assert (meta["num_tokens"], meta["num_reqs"], meta["num_tokens_padded"],
                        meta["num_reqs_padded"]) == (n, n, rows, rows)
                assert meta["starts"] == meta["host_starts"] == [min(i, n) for i in range(rows + 1)]
                assert meta["seq_lens"][:n] == seq_lens and meta["host_seq_lens"][:n] == seq_lens
                assert not any(meta["seq_lens"][n:])
                # each owned request's blocks at the head (a row's columns past its blocks are not read)
                assert [[row[: 1 + i % 4] for i, row in zip(mine, meta["blocks"][g])] for g in range(2)] == [
                    [list(range(10 * i + 100 * g, 10 * i + 100 * g + 1 + i % 4)) for i in mine] for g in range(2)]
                assert meta["slots"][0] == (mine * 11 + 7).tolist() + [-1] * (rows - n)
                assert calls["slot_mappings"] == (rows, n)
                # the model ran once, on the rank's own rows at the heads, without a PCP context
                (count, with_ctx), = step["seen"]
                assert count == rows and not with_ctx
            else:  # no request of its own: no metadata, no model
                assert "metadata" not in calls or calls["metadata"] is None
                assert step["seen"] == []
            # every sampled row is its owner's bits (the stand-in model adds its rank), on every rank
            sampled = step["rows"]
            owner_noise = torch.from_numpy(owner)[:, None].double()
            assert torch.equal(step["hidden"][sampled], step["expected"][sampled] + owner_noise), (name, rank)
            # every rank's caches hold every request's new K/V (its owner's, through the output gather)
            ids, pos = step["whole"]
            slots = torch.arange(len(ids)) * 11 + 7
            for j, (k, v) in enumerate(step["kv"]):
                assert torch.equal(k[slots], expected_rows(ids, pos) + j) and torch.equal(v[slots],
                                                                                          -k[slots]), (name, rank, j)
        assert results["decode3"]["owner"] == ([0, 1, 2] if world_size == 4 else [0, 1, 0])  # pcp=4: rank 3 none
        assert results["decode_lopsided"]["owner"] == [0] * 5 and results["decode_lopsided"]["owned"].num_rows == 8
        # a mixed step splits as before: the layers get the step's PCP context, no owned batch
        assert mixed["owned"] is None and mixed["calls"]["dispatch"][2] and all(c for _, c in mixed["seen"])
        assert torch.equal(mixed["hidden"][mixed["rows"]], mixed["expected"][mixed["rows"]])
        # a step with neither decode rows nor a split stays whole
        assert prompt["owner"] is None and not prompt["calls"]["dispatch"][2] and prompt["seen"] == [(30, False)]
        # a hand-over is planned (the GDN layers broadcast the owner's states first), nothing split
        handover = results["handover"]
        assert handover["owner"] == [-1, owner_of["b"]] and handover["handovers"] == [(0, owner_of["a"])]
        assert torch.equal(handover["hidden"][handover["rows"]], handover["expected"][handover["rows"]])
        # with prefix caching, the blocks owned rows fill (after the step: a 18 and e 10 tokens, c 3002
        # beside a split) hold their owner's states on every rank; every other slot this rank's own
        for name, filled in (("decode", {"a": (0, 18), "e": (4, 10)}), ("mixed", {"c": (0, 3002)}),
                             ("decode3", {})):
            expected = _states(rank)
            for r, (j, tokens) in filled.items():
                slot = j * 4000 + tokens // STATE_BLOCK - 1
                for e, src in zip(expected, _states(owner_of.get(r, 0))):
                    e[slot] = src[slot]
            assert all(torch.equal(x, e) for x, e in zip(results[name]["states"], expected)), (name, rank)


def test_verification_steps_spread_through_the_runner(spread_runs):
    """MTP with decode="spread" (``_verification_steps``): each rank verifies its own requests' drafts
    as vLLM's uniform batch (their accepted-token counts and drafts where the GDN metadata reads them),
    every row's hidden state and K/V reach every rank, the drafter gets the whole batch's metadata and
    the buffers' whole values back; beside a prompt they stay with their owners, and only a request that
    is not a decode row (a recompute's leftover) is handed over."""
    from vllm.config import CUDAGraphMode

    world_size, ranks = spread_runs[0], [runs["verification"] for runs in spread_runs[1]]
    for rank, results in enumerate(ranks):
        owner_of = dict(zip("abcde", results["verify"]["owner"]))
        assert sorted(np.bincount(list(owner_of.values()), minlength=world_size).tolist()) == (
            [2, 3] if world_size == 2 else [1, 1, 1, 2])
        assert results["verify_again"]["owned_id"] == results["verify"]["owned_id"]  # a batch verifying on
        for name, computed in (("verify", [17, 40, 3000, 700, 9]), ("verify_again", [21, 44, 3004, 704, 13])):
            step, calls = results[name], results[name]["calls"]
            owner = np.array(step["owner"])
            mine = np.flatnonzero(owner == rank)
            n, most = len(mine), int(np.bincount(owner, minlength=world_size).max())
            reqs = {1: 1, 2: 2, 3: 4}[most]  # requests of the captured graph the busiest rank's fit in
            rows = 4 * reqs
            assert step["owned"].num_rows == rows and step["owned"].query_len == 4 and step["owned"].num_reqs == n
            assert calls["dispatch"] == (rows, reqs, False, CUDAGraphMode.FULL,
                                         rows) and step["mode"] == CUDAGraphMode.FULL
            meta = calls["metadata"]
            assert (meta["num_tokens"], meta["num_reqs"], meta["num_tokens_padded"], meta["num_reqs_padded"]) == (
                4 * n, n, rows, reqs)
            assert meta["starts"] == meta["host_starts"] == [4 * min(i, n) for i in range(reqs + 1)]
            assert meta["seq_lens"] == (np.array(computed) + 4 - np.arange(5) % 3)[mine].tolist() + [0] * (reqs - n)
            assert meta["host_seq_lens"][:n] == (np.array(computed) + 4)[mine].tolist()  # an upper bound
            accepted, drafts = calls["verification"]
            assert accepted[:reqs] == [1 + i % 4 for i in mine] + [1] * (reqs - n), (name, rank, accepted)
            assert drafts[:reqs] == [3] * n + [-1] * (reqs - n)
            tokens = [4 * i + k for i in mine for k in range(4)]
            assert meta["slots"][0] == ([t * 11 + 7 for t in tokens] + [-1] * rows)[:reqs]
            (count, with_ctx), = step["seen"]
            assert count == rows and not with_ctx
            # every row of the batch (the rejection sampler and the drafter read them all) is its owner's
            row_owner = torch.from_numpy(np.repeat(owner, 4))[:, None].double()
            assert torch.equal(step["hidden"][:20], step["expected"] + row_owner), (name, rank)
            ids, pos = step["whole"]
            slots = torch.arange(20) * 11 + 7
            for j, (k, v) in enumerate(step["kv"]):
                assert torch.equal(k[slots], expected_rows(ids, pos) + j) and torch.equal(v[slots], -k[slots])
            # the drafter's metadata is the whole batch's, built before the heads were written; every
            # buffer the step wrote holds the whole batch's values again after the forward
            assert (step["common"].drafter, step["common"].num_tokens, step["common"].num_reqs) == (True, 20, 5)
            assert step["common"].slots == slots.tolist() and step["restored"], (name, rank)
        # a prompt beside two verifying requests: they stay with their owners, which verify them in the
        # step's plan (their 4 rows first on the owner, then the prompt's rows on every rank); nothing is
        # handed over
        mixed = results["mixed"]
        mine = [owner_of["a"], owner_of["b"]]
        assert mixed["owner"] == mine + [-1] and mixed["owned"] is None
        assert mixed["seen"] == [(600 + 4 * max(mine.count(r) for r in range(world_size)), True)], rank
        assert mixed["plan"].verify.tolist() == [True, True,
                                                 False] and mixed["plan"].verify_rows() == 4 * mine.count(rank)
        assert set(mixed["owners_after"]) == set("abcde")
        assert all(torch.equal(x, e) for x, e in zip(mixed["states"], _states(rank))), rank
        _check_read_rows(mixed, [range(0, 4), range(4, 8), [607]])
        # every request verifying, e's rows still a recompute's (its owner ended by it): e is handed over
        # (every state block of its owner's) and verified on every rank; the others stay with their owners
        recompute = results["verify_recompute"]
        owners = [owner_of[r] for r in "abcd"]
        assert recompute["owner"] == owners + [-1] and recompute["owned"] is None
        assert recompute["plan"].gdn_plan is None  # every request verified: no GDN work of the PCP path
        assert recompute["seen"] == [(4 + 4 * max(owners.count(r) for r in range(world_size)), True)], rank
        assert recompute["owners_after"] == {r: owner_of[r] for r in "abcd"}
        expected = _states(rank)
        for e, src in zip(expected, _states(owner_of["e"])):
            e[40:44] = src[40:44]
        assert all(torch.equal(x, e) for x, e in zip(recompute["states"], expected)), rank
        _check_read_rows(recompute, [range(4 * i, 4 * i + 4) for i in range(5)])


def _check_read_rows(step: dict, read: list) -> None:
    """The rows of a planned step are their primary copies' (the stand-in model's rows without a rank's
    noise): the verifying requests' 4 rows from their owners, a prompt's from rank 0; the stand-in has
    no drafter that splits its first pass, so every row is gathered (vLLM's drafter reads them all)."""
    hidden, expected = step["hidden"], step["expected"]
    rows = torch.tensor([r for rs in read for r in rs])
    assert torch.equal(hidden[rows], expected[rows])
    assert torch.equal(hidden[: expected.shape[0]], expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_and_unsplit_steps_through_the_runner(world_size):
    ranks = run_distributed(_steps, world_size)
    for rank, results in enumerate(ranks):
        split, with_logprobs, unsplit = (results[k] for k in ("split", "split_prompt_logprobs", "unsplit"))
        # one plan, taken once: the two prompts split, the decode rows not; graphs skipped only then
        assert split["split"] == [False, False, True, True] and unsplit["split"] is None
        assert split["force_eager"] and with_logprobs["force_eager"] and not unsplit["force_eager"]
        # each rank ran the model on its slice (t_pad rows) with the step's context; unsplit: every row
        assert split["seen"] == (split["t_pad"], True) and split["t_pad"] < 3000
        assert unsplit["seen"] == (4 + 4, False)
        # the rows vLLM samples from are the whole batch's, from their primary copies, on every rank
        rows = split["rows"]
        assert torch.equal(split["hidden"][rows], split["expected"][rows]), rank
        others = torch.ones(split["hidden"].shape[0], dtype=torch.bool)
        others[rows] = False
        assert not split["hidden"][others].any()  # the rows vLLM does not read stay zero
        # with prompt logprobs every row is the whole batch's (padding zero)
        n = split["expected"].shape[0] - 4
        assert torch.equal(with_logprobs["hidden"][:n], with_logprobs["expected"][:n]), rank
        assert not with_logprobs["hidden"][n:].any()
        # unsplit steps: the sampled rows are rank 0's on every rank (the others keep their own)
        rows = unsplit["rows"]
        assert torch.equal(unsplit["hidden"][rows], unsplit["expected"][rows]), rank
        assert torch.equal(unsplit["hidden"][4:], unsplit["expected"][4:] + rank)

        # MTP: a step of prompt tokens splits and brings every row (the drafter reads them all)
        prompts = results["mtp_prompts"]
        assert prompts["split"] == [True, True] and prompts["force_eager"]
        n = prompts["expected"].shape[0] - 4
        assert torch.equal(prompts["hidden"][:n], prompts["expected"][:n]), rank
        cont = results["mtp_continuing"]
        assert cont["split"] == [True, True]
        n = cont["expected"].shape[0] - 4
        assert torch.equal(cont["hidden"][:n], cont["expected"][:n]), rank
        # a request verifying drafts beside a prompt: the prompt splits, the verification rows are
        # computed whole (every row from its primary copy: the stand-in's drafter is not split)
        drafts = results["mtp_drafts"]
        assert drafts["split"] == [False, True] and drafts["force_eager"]
        assert drafts["seen"] == (drafts["t_pad"], True)
        n = drafts["expected"].shape[0] - 4
        assert torch.equal(drafts["hidden"][:n], drafts["expected"][:n]), rank
        # a request past its prompt without drafts anywhere in the step (vLLM's non-speculative decode
        # path) keeps the step whole
        assert results["mtp_decode"]["split"] is None and not results["mtp_decode"]["force_eager"]
        assert results["mtp_decode"]["seen"] == (3005, False)
        # images: each rank ran its rows of inputs_embeds and of the [3, T] positions; every row back
        images = results["images"]
        assert images["split"] == [True, True] and images["force_eager"] and images["seen"] == (images["t_pad"], True)
        # image rows with their own h, w: 400, 404 of the straddling image (96 were in the chunk before), 64
        assert images["image_rows"] == 400 + 404 + 64 and images["axes_differ"]
        assert torch.equal(images["hidden"], images["expected"]), rank
        # every rank feeds rank 0's drafts into its next step
        assert torch.equal(results["drafts"], torch.full((3, 2), 100)), rank
        _check_drafter(results["drafter"], rank)


def _check_drafter(d: dict, rank: int) -> None:
    """The MTP drafter after a split step (``_drafter_steps``)."""
    from vllm.config import CUDAGraphMode

    target, last = d["target"], d["last"]
    split, whole = d["split"], d["whole"]
    # split: the target's output holds the rank's own rows in place and every request's last row;
    # nothing else is gathered
    local = torch.from_numpy(split["local"])
    kept = torch.zeros(target.shape[0], dtype=torch.bool)
    kept[local], kept[last] = True, True
    assert torch.equal(split["hidden"][kept], target[kept]), rank
    assert not split["hidden"][~kept].any()
    # the first pass ran this rank's rows with the step's context, eagerly; the second every row
    # without it, in the drafter's own graph mode; the proposer has its model back
    assert split["calls"] == [(split["t_pad"], True, CUDAGraphMode.NONE), (2, False, CUDAGraphMode.PIECEWISE)]
    assert split["model_back"] and whole["model_back"]
    # the rows the drafter samples from: hidden + model of the whole batch, from the primary copies
    assert torch.equal(split["first"][last], 2 * target[last]), rank
    others = torch.ones(target.shape[0], dtype=torch.bool)
    others[last] = False
    assert not split["first"][others].any()
    # whole: every target row gathered, the first pass over every row on every rank; the same drafts
    assert torch.equal(whole["hidden"], target), rank
    assert whole["calls"] == [(target.shape[0], False, CUDAGraphMode.PIECEWISE), (2, False, CUDAGraphMode.PIECEWISE)]
    assert torch.equal(whole["first"][last], split["first"][last] + rank)
    assert torch.equal(whole["second"], split["second"] + rank)
    # embeddings and M-RoPE positions: the rank's rows along the positions' last axis
    vision, target = d["split_vision"], d["target_vision"]
    assert vision["calls"][0] == (vision["t_pad"], True, CUDAGraphMode.NONE)
    assert torch.equal(vision["first"][last], 2 * target[last]), rank
    # a split step whose drafter did not run leaves nothing behind: the next step's first pass is whole
    assert d["after"]["calls"][0] == (2, False, CUDAGraphMode.PIECEWISE)
    # verification rows beside split prompts: the verifying request whole and first on every rank, its
    # keys vLLM's device length (21, not the host's 23: two drafts of its previous step rejected); the
    # target's gather and the first pass's bring every row vLLM reads (its 3 rows, the prompts' last)
    # from the primary copies, and nothing else
    verify, target, read = d["verify"], d["verify_target"], d["verify_read"]
    plan = verify["plan"]
    assert plan.split.tolist() == [False, True, True] and plan.verify.tolist() == [True, False, False]
    assert plan.local_full_idx[rank][:3].tolist() == [0, 1, 2] and plan.verify_rows() == 3
    assert verify["seqused_k"][0] == 21 and plan.attention_seqs().seqused_k[0] == 23
    kept = torch.zeros(target.shape[0], dtype=torch.bool)
    kept[torch.from_numpy(verify["local"])], kept[read] = True, True
    assert torch.equal(verify["hidden"][kept], target[kept]), rank
    assert not verify["hidden"][~kept].any()
    assert verify["calls"][0] == (verify["t_pad"], True, CUDAGraphMode.NONE)
    assert torch.equal(verify["first"][read], 2 * target[read]), rank
    others = torch.ones(target.shape[0], dtype=torch.bool)
    others[read] = False
    assert not verify["first"][others].any()


def test_a_proposal_that_skips_the_model_raises():
    """The target's gather kept only a rank's rows: a drafter that proposed without its model's first
    call being split would have read zeros, so it raises instead."""
    from qwen36_pcp.draft_first_pass import split_first_pass

    model = object()
    proposer = SimpleNamespace(model=model)
    with pytest.raises(RuntimeError, match="could not be split"):
        with split_first_pass(proposer, ctx=object()):
            assert proposer.model is not model
    assert proposer.model is model


@pytest.mark.parametrize("decode,mtp,mode,held", [("spread", True, "none", True), ("spread", False, "align", True),
                                                   ("spread", False, "none", False), ("replicated", True, "align",
                                                                                      False)])
def test_the_memory_profile_holds_a_state_broadcast_where_spread_sends_states(monkeypatch, decode, mtp, mode, held):
    """With ``decode="spread"`` and GDN states to send (MTP's hand-overs, prefix caching's filled blocks)
    the profile run broadcasts a state payload at its largest while twice that is held (the sender's
    blocks and packed payload): the bound, or one block column of the model's GDN layers where that is
    larger; otherwise nothing beyond the split steps' calls."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import qwen36_pcp.spread.runner_part as spread_module
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.runner_hooks import PCPModelRunner

    class StateLayer(torch.nn.Module, MambaBase):  # a GDN layer's states: a bf16 conv window, an fp32 SSM state
        mamba_type = "gdn_attention"

        def __init__(self, ssm):
            super().__init__()
            self.ssm = ssm

        def get_state_shape(self):
            return (2, 10), (self.ssm,)

        def get_state_dtype(self):
            return torch.bfloat16, torch.float32

    monkeypatch.setattr(spread_module, "MAX_PAYLOAD_BYTES", 1000)
    monkeypatch.setattr(GPUModelRunner, "profile_run", lambda self: None)  # vLLM's part: its dummy runs
    zeros = torch.zeros
    # a column of 2 x (40 + 4 * ssm) bytes: 480 (the bound is larger), 1600 (one column is)
    for ssm, largest in ((50, 1000), (190, 1600)):
        sizes, peak = [], []
        group = SimpleNamespace(world_size=2, rank_in_group=0, all_gather=lambda x, dim: x,
                                send=lambda x, dst: None, recv=lambda shape, dtype, src: None,
                                broadcast=lambda x, src: sizes.append(x.numel()) or x)
        monkeypatch.setattr(torch, "zeros", lambda *a, **kw: peak.append(a[0]) or zeros(*a, **kw))
        runner = object.__new__(PCPModelRunner)
        runner.device = torch.device("cpu")
        runner.speculative_config = SimpleNamespace() if mtp else None
        runner.cache_config = SimpleNamespace(mamba_cache_mode=mode)
        runner.model = torch.nn.Sequential(StateLayer(ssm), torch.nn.Linear(1, 1), StateLayer(ssm))
        runner.build_parts(PCPConfig(decode=decode), group)
        runner.profile_run()
        assert sizes == ([1, largest] if held else [1]) and (2 * largest in peak) == held


def test_a_spread_step_dispatched_at_another_size_raises(monkeypatch):
    """A spread decode step's heads, slots and metadata are written for the plan's padded rows: were
    vLLM's dispatch to pad the owned batch otherwise (a vLLM whose padding no longer matches the
    plan's), the step raises instead of running a batch of stale rows."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.runner_hooks import PCPModelRunner

    asked = []

    def vllm_dispatch(self, *args, force_eager=False, **kw):
        asked.append((kw["num_tokens"], kw["num_reqs"], kw["max_num_scheduled_tokens"], force_eager))
        return "mode", SimpleNamespace(num_tokens=padded), False, None, None

    monkeypatch.setattr(GPUModelRunner, "_determine_batch_execution_and_padding", vllm_dispatch)
    runner = object.__new__(PCPModelRunner)
    runner.build_parts(PCPConfig(decode="spread"), SimpleNamespace(world_size=2, rank_in_group=0))
    runner.pcp_step = SimpleNamespace(owned=SimpleNamespace(num_rows=4, eager=False, query_len=1), plan=None)
    whole = dict(num_tokens=9, num_reqs=9, num_scheduled_tokens_np=np.ones(9, dtype=np.int32),
                 max_num_scheduled_tokens=1, use_cascade_attn=False)
    padded = 4
    mode, desc, *_ = runner._determine_batch_execution_and_padding(**whole)
    assert (mode, desc.num_tokens) == ("mode", 4) and asked == [(4, 4, 1, False)]  # the owned batch's size
    padded = 8
    with pytest.raises(RuntimeError, match="spread decode step of 4 rows as a batch of 8"):
        runner._determine_batch_execution_and_padding(**whole)
    # verification rows (MTP, K = 3): two requests' 8 rows, a uniform batch of 4-row queries
    runner.pcp_step.owned = SimpleNamespace(num_rows=8, eager=False, query_len=4)
    asked.clear()
    runner._determine_batch_execution_and_padding(**whole)
    assert asked == [(8, 2, 4, False)]


def test_a_context_for_another_row_count_shares_the_steps_tensors():
    """The drafter's first pass may run at another padded row count than the target: the same plan
    and device tensors, a padded count of its own, never fewer rows than the step's tokens."""
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.plan import PCPPlan

    plan = PCPPlan([0], [3000], 2, 1, PCPConfig(min_split_tokens=512))
    ctx = PCPContext(plan, SimpleNamespace(world_size=2, rank_in_group=1), "cpu", num_tokens_padded=3004)
    assert ctx.for_rows(3004) is ctx
    other = ctx.for_rows(3008)
    assert other.num_tokens_padded == 3008 and other.t is ctx.t and other.plan is plan and ctx.num_tokens_padded == 3004
    with pytest.raises(ValueError, match="smaller"):
        ctx.for_rows(2999)


@pytest.mark.parametrize("decode", ["spread", "replicated"])
def test_load_model_gives_the_attention_layers_their_kv_stage(monkeypatch, decode):
    """With ``decode="spread"`` the runner's ``load_model`` (vLLM's part stood in for: it builds the
    model) attaches one K/V stage to every attention layer of the model, before vLLM's
    ``capture_model`` captures the graphs that must hold its copies; with ``"replicated"``, none."""
    import contextlib

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import qwen36_pcp.runner_hooks.runner as runner_module
    import qwen36_pcp.spread.runner_part as spread_module
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers.pcp_attention import PCPFlashAttentionImpl
    from qwen36_pcp.runner_hooks import PCPModelRunner

    class StubAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.impl = object.__new__(PCPFlashAttentionImpl)
            self.impl.num_kv_heads, self.impl.head_size = 2, 8

    monkeypatch.setattr(spread_module, "Attention", StubAttention)
    monkeypatch.setattr(runner_module, "pcp_model_build", lambda config: contextlib.nullcontext({}))
    monkeypatch.setattr(GPUModelRunner, "load_model", lambda self, *a, **kw: setattr(
        self, "model", torch.nn.Sequential(StubAttention(), torch.nn.Linear(1, 1), StubAttention())))
    runner = object.__new__(PCPModelRunner)
    runner.build_parts(PCPConfig(decode=decode), SimpleNamespace(world_size=2, rank_in_group=0))
    runner.vllm_config, runner.max_num_reqs, runner.dtype, runner.device = None, 4, torch.float32, torch.device("cpu")
    runner.uniform_decode_query_len = 3  # MTP with K = 2: 3 verification rows per request
    runner.load_model()
    stages = [runner.model[i].impl.kv_stage for i in (0, 2)]
    if decode == "replicated":
        assert stages == [None, None]
        return
    assert [index for _, index in stages] == [0, 1] and stages[0][0] is stages[1][0] is runner.spread.kv_stage
    assert runner.spread.kv_stage.rows.shape == (4 * 3, 2, 2, 2, 8)


@pytest.mark.parametrize("unpadded", [False, True])
def test_the_drafter_runs_whole_where_vllm_drops_rejected_rows_from_its_first_pass(unpadded):
    """vLLM's unpadded drafter batch (``disable_padded_drafter_batch``) runs its first pass over the
    accepted rows only, not the plan's rows: that first pass is not split, and every row is gathered."""
    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.runner_hooks import PCPModelRunner

    runner = object.__new__(PCPModelRunner)
    runner.build_parts(PCPConfig(), SimpleNamespace(world_size=2, rank_in_group=0))
    runner.num_prompt_logprobs = {}
    runner.speculative_config = SimpleNamespace(method="mtp", disable_padded_drafter_batch=unpadded)
    runner.drafter = SimpleNamespace(needs_extra_input_slots=False)
    split = runner.drafter_part.split_enabled()
    assert split is (not unpadded) and runner.drafter_part.reads_every_row(split) is unpadded


def test_the_parts_call_the_next_class_in_the_runners_mro(monkeypatch):
    """The parts call vLLM's methods through ``PCPModelRunner.vllm`` (``super()``), so a runner class that
    puts its own ``GPUModelRunner`` subclass after ``PCPModelRunner`` sees every forward, a step's too;
    and the planner reads the runner's config at each step."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.runner_hooks import PCPModelRunner
    from qwen36_pcp.runner_hooks.step import PCPStep

    seen = []
    monkeypatch.setattr(GPUModelRunner, "_model_forward", lambda self, *a, **kw: seen.append("vllm") or kw["x"])

    class Tap(GPUModelRunner):
        def _model_forward(self, *args, **kwargs):
            seen.append("tap")
            return super()._model_forward(*args, **kwargs)

    class Mine(PCPModelRunner, Tap):
        pass

    runner = object.__new__(Mine)
    group = SimpleNamespace(world_size=2, rank_in_group=1, all_gather=lambda x, dim: torch.cat([x + 1, x]))
    runner.build_parts(PCPConfig(), group)
    runner.pcp_step = PCPStep(plan=None, logits_indices=torch.tensor([1]))
    hidden = runner._model_forward(x=torch.zeros(3, 2))
    assert seen == ["tap", "vllm"] and hidden[1].tolist() == [1.0, 1.0] and hidden[0].tolist() == [0.0, 0.0]
    runner.pcp_step = None
    runner._model_forward(x=torch.zeros(1, 2))  # outside a step (profiling, capture): vLLM's through the MRO
    assert seen[2:] == ["tap", "vllm"]
    # the planner's config is the runner's at each step
    runner.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.zeros(1, dtype=np.int64),
                                         num_prompt_tokens=np.array([1024]))
    assert runner.planner.plan(np.array([1024]))[0] is None  # under the default floor: whole
    runner.pcp_config = PCPConfig(min_split_tokens=256)
    assert runner.planner.plan(np.array([1024]))[0].split.tolist() == [True]
