# SPDX-License-Identifier: Apache-2.0
"""The CPU stand-ins of the PCP model runner that tests and benchmarks both drive: the model as a function
of each row's token id and position (ranks other than 0 add their rank off the primary copies, so a row
taken from the wrong copy is seen), a runner with the plugin's own state but none of vLLM's GPU buffers,
one with vLLM's buffers on the CPU for ``decode="spread"`` (its parts of a step stood in for as they use
those buffers), vLLM's CUDA-graph dispatcher keys, and attention layers whose impl is the plugin's over a
torch cache write (vLLM's ``reshape_and_cache_flash`` is a CUDA op)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

HIDDEN = 4


def model_rows(rank: int, seen: list):
    """hidden[row] = (id, position, id * position, 1), plus ``rank`` except on the primary copies of a
    split step's rows (a split row's only copy)."""

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        from qwen36_pcp.layers.context import current_pcp_context

        ctx = current_pcp_context()
        seen.append(((input_ids if input_ids is not None else inputs_embeds).shape[0], ctx is not None))
        hidden = expected_rows(input_ids, positions, inputs_embeds)
        ids = hidden[:, 0]
        noise = torch.full((ids.shape[0],), float(rank), dtype=torch.float64)
        if ctx is not None:  # a split row's one copy is its primary one
            noise[torch.from_numpy(ctx.plan.primary[rank])] = 0.0
        return hidden + noise[:, None]

    return forward


def expected_rows(ids: torch.Tensor | None, pos: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The stand-in model: a function of each row's token id (or its embedding's first element) and
    its position (all three M-RoPE axes when ``pos`` is [3, T])."""
    ids = (ids if ids is not None else embeds[:, 0]).double()
    pos = pos.double() if pos.dim() == 1 else pos[0].double() * 1e6 + pos[1].double() * 1e3 + pos[2].double()
    return torch.stack([ids, pos, ids * pos, torch.ones_like(ids)], dim=1)


def stand_in_runner(group, config, model, dispatched: list):
    """A ``PCPModelRunner``'s own state, without vLLM's GPU buffers, with vLLM's parts of a step stood
    in for in this rank's process (``_prepare_inputs``: each request's last row; the batch dispatch:
    ``force_eager`` noted in ``dispatched``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.runner_hooks import PCPModelRunner

    GPUModelRunner._prepare_inputs = lambda self, so, n: (torch.from_numpy(np.cumsum(n) - 1).to(torch.int32), None)
    GPUModelRunner._determine_batch_execution_and_padding = (
        lambda self, *a, force_eager=False, **kw: dispatched.append(force_eager))
    runner = object.__new__(PCPModelRunner)
    runner.speculative_config, runner.num_prompt_logprobs, runner.uniform_decode_query_len = None, {}, 1
    runner.model, runner.device = model, torch.device("cpu")
    runner.build_parts(config, group)
    return runner


def cuda_graphs(runner, mode, kv_write_split: bool = True, query_len: int = 1) -> None:
    """The runner's compilation config and vLLM's CUDA graph dispatcher with keys for graphs of 1, 2,
    4 and 8 requests under ``mode``, each ``query_len`` rows (MTP: 1 + K, as vLLM sizes its graphs
    then); ``kv_write_split``: vLLM's K/V write among the splitting ops (its default: run eagerly
    between the graphs)."""
    from vllm.config import CompilationConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    ops = list(CompilationConfig._attention_ops)
    if kv_write_split:
        ops += ["vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    sizes = [query_len * n for n in (1, 2, 4, 8)]
    config = CompilationConfig(mode=3, cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                               max_cudagraph_capture_size=sizes[-1], splitting_ops=ops)
    spec = SimpleNamespace(num_speculative_tokens=query_len - 1) if query_len > 1 else None
    dispatcher = CudagraphDispatcher(SimpleNamespace(compilation_config=config, speculative_config=spec,
                                                     lora_config=None,
                                                     scheduler_config=SimpleNamespace(max_num_seqs=16)))
    dispatcher.initialize_cudagraph_keys(mode, query_len)
    runner.compilation_config, runner.cudagraph_dispatcher = config, dispatcher


class BlockTables:
    """vLLM's ``MultiGroupBlockTable`` as the runner reads it: per KV-cache group (attention, GDN)
    vLLM's ``BlockTable`` on the CPU (its rows on the host, committed to its device buffer, and its
    slot mapping)."""

    def __init__(self, rows: int = 16, tokens: int = 8192):
        from vllm.v1.worker.block_table import BlockTable

        self.block_tables = [BlockTable(16, rows, 4, tokens, False, torch.device("cpu"), 16, 1) for _ in range(2)]

    def __getitem__(self, group: int):
        return self.block_tables[group]


def spread_runner(group, rank, seen, calls, cache_blocks: int = 16):
    """A stand-in runner for ``decode="spread"`` with vLLM's buffers (on the CPU) and its parts of a
    step stood in for as they use those buffers: ``_prepare_inputs`` fills the whole batch's query
    starts, sequence lengths, block-table rows, slots (attention slot = 7 + 11 x the token's row),
    ids and positions; the dispatch asks vLLM's dispatcher (graphs of 1, 2, 4, 8 rows);
    ``_get_slot_mappings`` sets the slots past the unpadded rows to -1; ``_build_attention_metadata``
    notes what it would read (the buffers' heads); the model, as a CUDA graph would, reads the ids
    and positions at the heads and writes each row's K/V (a function of its id and position) at the
    head slots into two attention layers' caches."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from qwen36_pcp.config import PCPConfig

    model = model_rows(rank, seen)
    runner = stand_in_runner(group, PCPConfig(decode="spread"), None, [])
    cpu = torch.device("cpu")
    runner.query_start_loc = CpuGpuBuffer(17, dtype=torch.int32, device=cpu, pin_memory=False)
    runner.input_ids = CpuGpuBuffer(8192, dtype=torch.int64, device=cpu, pin_memory=False)
    runner.seq_lens, runner.positions = torch.zeros(16, dtype=torch.int32), torch.zeros(8192, dtype=torch.int64)
    runner.optimistic_seq_lens_cpu = torch.zeros(16, dtype=torch.int32)
    runner.model_config, runner.dtype = SimpleNamespace(get_hidden_size=lambda: HIDDEN), torch.float64
    runner.max_num_reqs = 16
    layers = pcp_attention_layers([torch.zeros(2, cache_blocks, 8, 1, HIDDEN, dtype=torch.float64) for _ in range(2)])
    runner.spread.attention_groups = [(0, layers)]
    runner.spread.attach_kv_stage(layers)  # (``load_model``'s)

    def prepare(self, so, num_new):
        reqs, computed = len(num_new), self.input_batch.num_computed_tokens_cpu[: len(num_new)]
        cu = np.concatenate([[0], np.cumsum(num_new)])
        tokens = int(cu[-1])
        self.query_start_loc.np[: reqs + 1], self.query_start_loc.np[reqs + 1:] = cu, cu[-1]
        self.query_start_loc.copy_to_gpu()
        self.seq_lens[:reqs], self.seq_lens[reqs:] = torch.from_numpy(computed + num_new), 0
        self.optimistic_seq_lens_cpu.copy_(self.seq_lens)
        ids = [np.arange(n) * 7 + 3 + i for i, n in enumerate(num_new)]
        self.input_ids.gpu[:tokens] = torch.from_numpy(np.concatenate(ids))
        positions = [c + np.arange(n) for c, n in zip(computed, num_new)]
        self.positions[:tokens] = torch.from_numpy(np.concatenate(positions))
        for g, table in enumerate(self.input_batch.block_table.block_tables):
            for i in range(reqs):  # request i holds 1 + i % 4 blocks, 10 i + 100 g onwards
                table.add_row(list(range(10 * i + 100 * g, 10 * i + 100 * g + 1 + i % 4)), i)
            table.commit_block_table(reqs)
            table.slot_mapping.gpu[:tokens] = torch.arange(tokens) * 11 + 7 + 1000 * g
        return torch.from_numpy(cu[1:] - 1), None

    def dispatch(self, *args, force_eager=False, **kw):
        q = self.uniform_decode_query_len
        uniform = kw["max_num_scheduled_tokens"] == q and kw["num_tokens"] == kw["num_reqs"] * q
        mode, desc = self.cudagraph_dispatcher.dispatch(
            kw["num_tokens"], uniform_decode=uniform, valid_modes={CUDAGraphMode.NONE} if force_eager else None)
        calls["dispatch"] = (kw["num_tokens"], kw["num_reqs"], force_eager, mode, desc.num_tokens)
        return mode, desc, False, None, None

    def slot_mappings(self, num_tokens_padded, num_reqs_padded, num_tokens_unpadded, ubatch_slices=None):
        calls["slot_mappings"] = (num_tokens_padded, num_tokens_unpadded)
        out = {}
        for g, table in enumerate(self.input_batch.block_table.block_tables):
            out[g] = table.slot_mapping.gpu[:num_tokens_padded]
            out[g][num_tokens_unpadded:num_tokens_padded] = -1
        return out, {}

    def build(self, **kw):
        if self.speculative_config is not None and not any(self.attn_groups):  # the drafter's (whole batch)
            return {}, SimpleNamespace(drafter=True, num_tokens=kw["num_tokens"], num_reqs=kw["num_reqs"],
                                       slots=kw["slot_mappings"][0].tolist())
        rows = kw.get("num_reqs_padded") or kw["num_reqs"]
        tables = self.input_batch.block_table.block_tables
        if self.speculative_config is not None:  # what the GDN builder reads: accepted tokens, drafts
            calls["verification"] = (self.num_accepted_tokens.gpu.tolist(), self.num_decode_draft_tokens.cpu.tolist())
        calls["metadata"] = {**{k: kw[k] for k in ("num_tokens", "num_reqs", "num_tokens_padded", "num_reqs_padded")},
                             "starts": self.query_start_loc.gpu[: rows + 1].tolist(),
                             "host_starts": self.query_start_loc.cpu[: rows + 1].tolist(),
                             "seq_lens": self.seq_lens[:rows].tolist(),
                             "host_seq_lens": self.optimistic_seq_lens_cpu[:rows].tolist(),
                             "blocks": [t.block_table.gpu[:rows].tolist() for t in tables],
                             "slots": [t.slot_mapping.gpu[:rows].tolist() for t in tables]}
        return {}, None

    def forward(input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        hidden = model(input_ids=input_ids, positions=positions)
        if runner.pcp_step.owned is None:  # (the layers of a split step write through the context)
            return hidden
        slots = runner.input_batch.block_table[0].slot_mapping.gpu[: input_ids.shape[0]]
        for j, layer in enumerate(layers):  # each layer's cache write (``unified_kv_cache_update``)
            kv = expected_rows(input_ids, positions)[:, None, :] + j
            layer.impl.do_kv_cache_update(layer, kv, -kv, layer.kv_cache, slots)
        return hidden

    GPUModelRunner._prepare_inputs = prepare
    GPUModelRunner._determine_batch_execution_and_padding = dispatch
    GPUModelRunner._get_slot_mappings = slot_mappings
    GPUModelRunner._build_attention_metadata = lambda self, *a, **kw: build(self, **kw)
    runner.model = forward
    return runner


def execute_spread_runner(runner, num_new: np.ndarray, drafts: dict | None = None):
    """The runner's parts of a step (``_spread_runner``'s) in ``execute_model``'s order: the inputs, the
    dispatch, the slots, the metadata, the model; (the rows vLLM samples, the graph mode, the hidden
    states, the common metadata vLLM would hand the drafter). ``runner.pcp_step`` stays the step's.
    ``drafts``: the scheduled drafts by request id (MTP)."""
    from vllm.forward_context import ForwardContext, override_forward_context

    tokens, reqs = int(num_new.sum()), len(num_new)
    so = SimpleNamespace(scheduled_spec_decode_tokens=drafts or {},
                         num_scheduled_tokens=dict(zip(runner.input_batch.req_ids, num_new.tolist())))
    logits_indices, _ = runner._prepare_inputs(so, num_new)
    mode, desc, *_ = runner._determine_batch_execution_and_padding(
        num_tokens=tokens, num_reqs=reqs, num_scheduled_tokens_np=num_new,
        max_num_scheduled_tokens=int(num_new.max()), use_cascade_attn=False)
    rows = desc.num_tokens
    runner._get_slot_mappings(num_tokens_padded=rows, num_reqs_padded=rows, num_tokens_unpadded=tokens)
    _, common = runner._build_attention_metadata(num_tokens=tokens, num_reqs=reqs, max_query_len=1,
                                                 num_tokens_padded=rows, num_reqs_padded=rows)
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                             cudagraph_runtime_mode=mode, batch_descriptor=desc)
    with override_forward_context(context):
        hidden = runner._model_forward(input_ids=runner.input_ids.gpu[:rows], positions=runner.positions[:rows])
    return logits_indices, mode, hidden, common


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference of vLLM's reshape_and_cache_flash: cache [num_blocks, block_size, kvh, d]."""
    keep = slots >= 0
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k[slots[keep]] = k[keep].to(flat_k.dtype)
    flat_v[slots[keep]] = v[keep].to(flat_v.dtype)


def pcp_attention_layers(caches: list[torch.Tensor], writer=None) -> list:
    """vLLM ``Attention`` stand-ins over these caches ([2, blocks, block_size, kv_heads, head_dim], any
    stride order) whose impl is the plugin's ``PCPFlashAttentionImpl`` (built without vLLM's
    constructor) over a FlashAttention impl whose cache write (vLLM's ``reshape_and_cache_flash``, a
    CUDA op) is the impl's ``cache_writer(k, v, kv_cache, slots)`` (default: ``write_kv_reference`` on
    the cache's K and V)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from qwen36_pcp.layers.pcp_attention import PCPFlashAttentionImpl

    class CPUCacheWrite(FlashAttentionImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
            self.cache_writer(key, value, kv_cache, slots)

    class Impl(PCPFlashAttentionImpl, CPUCacheWrite):  # the plugin's impl, then the CPU cache write
        pass

    layers = []
    for cache in caches:
        impl = object.__new__(Impl)
        impl.num_kv_heads, impl.head_size = cache.shape[3], cache.shape[4]
        impl.cache_writer = writer or (lambda k, v, cache, slots: write_kv_reference(k, v, cache[0], cache[1], slots))
        layers.append(SimpleNamespace(kv_cache=cache, impl=impl))
    return layers


def exchange_slots(plan, slot_mapping):
    """``owned_batch.kv_exchange_slots`` of a spread decode step's plan, built on the host as
    ``OwnedBatch.write_heads`` builds it."""
    from qwen36_pcp.spread.owned_batch import kv_exchange_rows, kv_exchange_slots

    rows = kv_exchange_rows(plan)
    return kv_exchange_slots(slot_mapping, torch.from_numpy(rows.clip(min=0)), torch.from_numpy(rows >= 0))
