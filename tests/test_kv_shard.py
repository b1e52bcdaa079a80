# SPDX-License-Identifier: Apache-2.0
"""The KV cache sharded over the PCP group (``qwen36_pcp.kv_shard``): vLLM's own block tables write each
token on the rank that keeps it; each rank attends its shard, vLLM's log-sum-exp merge over real gloo ranks
and the rows' own new K/V merged in last give the whole sequence's attention. vLLM's Triton kernels (slot
mapping, merges) run in Triton's interpreter, in a process of their own (vLLM decides at import whether
Triton is usable); a torch stand-in of FlashAttention's varlen call vouches for the composition only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from qwen36_pcp.kv_shard.layout import KVShard

from .attention_reference import varlen_reference

H, KVH, D, BS = 4, 2, 8, 16
SEQ_LENS = [1, 5, 37, 130, 257]  # a request shorter than the group, partial blocks, several blocks


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_shard_partitions_every_sequence(n, interleave):
    pos = np.arange(1000)
    kept = np.stack([KVShard(n, r, interleave).keeps(pos) for r in range(n)])
    assert (kept.sum(0) == 1).all()  # every token on exactly one rank
    lens = torch.tensor([0, 1, 7, 64, 999, 1000])
    for r in range(n):
        shard = KVShard(n, r, interleave)
        local = shard.local_index(pos[kept[r]])
        assert (local == np.arange(kept[r].sum())).all()  # a rank's tokens packed in order
        counts = [int(kept[r][:int(t)].sum()) for t in lens]
        assert shard.local_lens(lens).tolist() == counts


def test_interleave_must_divide_the_block():
    """vLLM's kernel interleaves within a block, ``KVShard`` over positions: they agree only then."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from qwen36_pcp.kv_shard.layout import shard_block_tables

    tables = MultiGroupBlockTable(2, 96, 96, False, torch.device("cpu"), [48], [48], max_num_blocks=[2])
    spec = FullAttentionSpec(block_size=48, num_kv_heads=KVH, head_size=D, dtype=torch.float32)
    shard_block_tables(tables.block_tables, [spec], KVShard(2, 1, 16))
    assert tables[0].cp_kv_cache_interleave_size == 16 and tables[0].pcp_rank == 1
    with pytest.raises(ValueError, match="does not divide"):
        shard_block_tables(tables.block_tables, [spec], KVShard(2, 0, 32))


QUERY_LENS = [1, 4, 1, 4, 1]  # each request's rows this step: a decode row, or a verification of 3 drafts


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)) for t in SEQ_LENS]
    q = torch.randn(sum(QUERY_LENS), H, D, generator=g)  # the rows: each request's last QUERY_LENS positions
    return kv, q


def _decode_worker(rank, group, interleave, empty_lse):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from qwen36_pcp.kv_shard.decode import ShardedRows, attend_sharded
    from qwen36_pcp.kv_shard.layout import shard_block_tables

    n = group.world_size
    shard = KVShard(n, rank, interleave)
    specs = [FullAttentionSpec(block_size=BS, num_kv_heads=KVH, head_size=D, dtype=torch.float32),
             MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,))]
    max_blocks = -(-max(SEQ_LENS) // BS)
    tables = MultiGroupBlockTable(len(SEQ_LENS), max(SEQ_LENS), sum(SEQ_LENS), False, torch.device("cpu"),
                                  [BS, BS], [BS, BS], max_num_blocks=[max_blocks, max_blocks])
    shard_block_tables(tables.block_tables, specs, shard)  # the interleave too
    # the scheduler's blocks: an attention block holds BS x n tokens (each rank its BS of them)
    next_block = 1
    for i, t in enumerate(SEQ_LENS):
        nb = -(-t // (BS * n))
        tables.add_row((list(range(next_block, next_block + nb)), [100 + i]), i)
        next_block += nb
    tables.commit_block_table(len(SEQ_LENS))
    # every token written as the steps that computed it would: through vLLM's slot mapping
    positions = torch.cat([torch.arange(t) for t in SEQ_LENS])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(SEQ_LENS)]), dtype=torch.int32)
    tables.compute_slot_mapping(len(SEQ_LENS), cu, positions)
    slots = tables[0].slot_mapping.gpu[: len(positions)].clone()
    gdn_slots = tables[1].slot_mapping.gpu[: len(positions)].clone()

    kv, q = _case(7 + n + interleave)
    key_cache = torch.zeros(next_block, BS, KVH, D)
    value_cache = torch.zeros_like(key_cache)
    k_all, v_all = torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])
    mine = slots >= 0
    key_cache.view(-1, KVH, D)[slots[mine]] = k_all[mine]
    value_cache.view(-1, KVH, D)[slots[mine]] = v_all[mine]

    # this step's rows: each request's last QUERY_LENS tokens, their K/V from the step's input
    context = [t - m for t, m in zip(SEQ_LENS, QUERY_LENS)]
    k_new = torch.cat([k[c:] for (k, _), c in zip(kv, context)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(kv, context)])
    local = shard.local_lens(torch.tensor(context, dtype=torch.int32))
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(QUERY_LENS)]), dtype=torch.int32)
    rows = ShardedRows(cu_q, max(QUERY_LENS), local, int(local.max()), tables[0].get_device_tensor(len(SEQ_LENS)))
    scale = D**-0.5
    def varlen(**kw):
        return varlen_reference(**kw, empty_lse=empty_lse)

    out = attend_sharded(q, k_new, v_new, key_cache, value_cache, rows, scale, group, torch.empty(q.shape),
                         varlen=varlen)
    ref, _ = varlen_reference(q, k_all, v_all, cu_q, max(QUERY_LENS), scale, True, True,
                              cu_seqlens_k=cu, max_seqlen_k=max(SEQ_LENS))
    return {"slots": slots.tolist(), "gdn_slots": gdn_slots.tolist(), "kept": int(mine.sum()),
            "err": float((out - ref).abs().max()), "merged": out.flatten().tolist()}


# split steps (split at N = 2, 3, 4): (cached tokens, new tokens) per request: a fresh prompt; a chunk beside a
# fresh prompt and a decode row; a prefix hit on a long context
SPLIT_STEPS = [([0], [700]), ([13, 0, 70], [290, 1100, 1]), ([517, 0], [600, 5])]


def correct_attn_out_reference(out, lses, cp_rank, ctx=None, is_lse_base_on_e=True):
    """vLLM's ``correct_attn_out`` in torch: this rank's output rescaled by its share of the merged lse."""
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    lse = torch.logsumexp(lses, 0)
    factor = torch.exp(lses[cp_rank] - lse).nan_to_num(0.0)
    return out * factor.unsqueeze(-1), lse


def merge_attn_states_reference(output, prefix_output, prefix_lse, suffix_output, suffix_lse, **_):
    """vLLM's ``merge_attn_states`` in torch (lse [H, T], contiguous as its kernel indexes it; +inf read as
    -inf)."""
    assert prefix_lse.is_contiguous() and suffix_lse.is_contiguous()
    assert prefix_lse.shape == suffix_lse.shape == output.shape[1::-1]
    p, s = (torch.where(x == float("inf"), float("-inf"), x).transpose(0, 1).unsqueeze(-1)
            for x in (prefix_lse, suffix_lse))
    m = torch.maximum(p, s)
    wp, ws = torch.exp(p - m).nan_to_num(0.0), torch.exp(s - m).nan_to_num(0.0)
    output.copy_((prefix_output * wp + suffix_output * ws) / (wp + ws))


def _prefill_worker(rank, group, empty_lse):
    """A split step over the sharded context on gloo ranks. vLLM's merge kernels (checked in Triton's
    interpreter by the decode test) are replaced by torch references here: too slow interpreted at this
    many rows; the block-table slots of the context are ``KVShard``'s, which the decode test holds to
    vLLM's kernel."""
    import vllm.v1.attention.ops.merge_attn_states as merge_states_module

    import qwen36_pcp.kv_shard.merge as merge_module

    merge_module.correct_attn_out = correct_attn_out_reference
    merge_states_module.merge_attn_states = merge_attn_states_reference
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from qwen36_pcp.kv_shard.layout import shard_block_tables
    from qwen36_pcp.kv_shard.prefill import SplitShardRows, attend_split_sharded
    from qwen36_pcp.plan import PCPConfig, PCPPlan

    n = group.world_size
    shard = KVShard(n, rank)

    def varlen(**kw):
        return varlen_reference(**kw, empty_lse=empty_lse)

    worst = 0.0
    for step, (cached, new) in enumerate(SPLIT_STEPS):
        total = [c + m for c, m in zip(cached, new)]
        g = torch.Generator().manual_seed(11 + step)
        kv = [(torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)) for t in total]
        q_full = torch.randn(sum(new), H, D, generator=g)
        max_blocks = -(-max(total) // BS)
        tables = MultiGroupBlockTable(len(total), max(total), sum(total), False, torch.device("cpu"), [BS], [BS],
                                      max_num_blocks=[max_blocks])
        shard_block_tables(tables.block_tables, [FullAttentionSpec(block_size=BS, num_kv_heads=KVH, head_size=D,
                                                                   dtype=torch.float32)], shard)
        next_block = 1
        for i, t in enumerate(total):
            nb = -(-t // (BS * n))
            tables.add_row((list(range(next_block, next_block + nb)),), i)
            next_block += nb
        tables.commit_block_table(len(total))
        # the cached context, as earlier steps left it
        key_cache = torch.zeros(next_block, BS, KVH, D)
        value_cache = torch.zeros_like(key_cache)
        bt = tables[0].get_cpu_tensor()
        for i, (k, v) in enumerate(kv):  # the cached context, each token on the rank that keeps it
            pos = np.flatnonzero(shard.keeps(np.arange(cached[i])))
            idx = torch.from_numpy(shard.local_index(pos))
            slots = bt[i, idx // BS].long() * BS + idx % BS
            key_cache.view(-1, KVH, D)[slots] = k[pos]
            value_cache.view(-1, KVH, D)[slots] = v[pos]
        plan = PCPPlan(cached, new, n, rank, PCPConfig(min_split_tokens=64))
        assert plan.splits_any
        full = torch.from_numpy(plan.local_full_idx[rank])
        k_new = torch.cat([k[c:] for (k, _), c in zip(kv, cached)])
        v_new = torch.cat([v[c:] for (_, v), c in zip(kv, cached)])
        pad = full < 0
        local_k, local_v = k_new[full.clamp(min=0)], v_new[full.clamp(min=0)]
        local_k[pad] = 0
        local_v[pad] = 0
        k_all, v_all = group.all_gather(local_k, dim=0), group.all_gather(local_v, dim=0)
        rows = SplitShardRows.of(plan, shard, "cpu")
        out = attend_split_sharded(q_full[full.clamp(min=0)], k_all, v_all, key_cache, value_cache,
                                   tables[0].get_device_tensor(len(total)), rows, D**-0.5, group,
                                   torch.empty(plan.t_pad, H, D), varlen=varlen)
        # the reference: each request's rows causal over its whole sequence
        cu_q = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32)
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(total)]), dtype=torch.int32)
        ref, _ = varlen_reference(q_full, torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), cu_q,
                                  max(new), D**-0.5, True, True, cu_seqlens_k=cu_k,
                                  max_seqlen_k=max(total))
        m = rows.rows
        assert (out[m:] == 0).all()
        worst = max(worst, float((out[:m] - ref[full[:m]]).abs().max()))
    return worst


def _decode_cases() -> dict:
    from harness.dist import run_distributed

    out = {}
    for n, interleave, empty_lse in ((2, 1, "inf"), (3, 1, "-inf"), (4, 2, "inf"), (8, 1, "-inf")):
        out[f"{n}_{interleave}"] = run_distributed(_decode_worker, n, interleave, float(empty_lse))
    return out


def test_sharded_decode_merges_to_whole_attention():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    code = "import json, tests.test_kv_shard as t; print('RESULT ' + json.dumps(t._decode_cases()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    for key, ranks in json.loads(lines[0][7:]).items():
        n, interleave = map(int, key.split("_"))
        pos = np.concatenate([np.arange(t) for t in SEQ_LENS])
        # vLLM's kernel: a token's slot on the rank that keeps it, the pad slot (-1) on every other
        slots = np.array([r["slots"] for r in ranks])
        assert ((slots >= 0).sum(0) == 1).all(), key
        for r, res in enumerate(ranks):
            assert ((slots[r] >= 0) == KVShard(n, r, interleave).keeps(pos)).all(), key
            assert len(set(slots[r][slots[r] >= 0])) == res["kept"], key  # no two tokens on one slot
            # the GDN group's table stays pcp == 1's: every rank maps every token
            assert (np.array(res["gdn_slots"]) >= 0).all(), key
            assert res["err"] < 1e-5, (key, r, res["err"])
            assert res["merged"] == ranks[0]["merged"], key  # one answer on every rank
        assert sum(r["kept"] for r in ranks) == sum(SEQ_LENS)


# ------------------------------------------------------------------------ the scheduler's accounting
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0))


PROMPTS = (2944, 2990)  # tokens of a prompt: a whole number of blocks at every N, and one that is not


def _accounting(ckpt):
    from tests.fake_cuda import engine_config, use_fake_cuda

    use_fake_cuda()
    import qwen36_pcp

    qwen36_pcp.register()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from qwen36_pcp.kv_shard.accounting import sharded_scheduler_config, sharded_scheduler_vllm_config

    cfg = engine_config(ckpt, enable_prefix_caching=True, max_num_batched_tokens=131072, max_num_seqs=64)
    bs = cfg.cache_config.block_size
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=bs, shapes=((3, 1536), (8, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                      mamba_type="gdn_attention", mamba_cache_mode=cfg.cache_config.mamba_cache_mode)
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn)] + [
        KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], mamba) for i in (0, 1, 2)]
    engine_kvc = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[KVCacheTensor(size=1 << 20, shared_by=["x"])],
                               kv_cache_groups=groups)
    cfg.cache_config.num_gpu_blocks = engine_kvc.num_blocks
    out = {"block_size": bs, "mamba_cache_mode": cfg.cache_config.mamba_cache_mode}
    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)

    def step(sched, so):
        """vLLM's runner output for ``so``: a token for each request whose prompt is done."""
        ids = list(so.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens for r in ids]
        sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                       sampled_token_ids=[[7] if d else [] for d in done]))

    for prompt in PROMPTS:
        ids = list(range(100, 100 + prompt))
        for n in (1, 2, 4, 8):
            kvc = sharded_scheduler_config(engine_kvc, n)
            block, hash_block = kvu.resolve_kv_cache_block_sizes(kvc, cfg)
            hasher = kvu.get_request_block_hasher(hash_block, hash_fn)
            scfg = sharded_scheduler_vllm_config(cfg, n)
            sched = Scheduler(vllm_config=scfg, kv_cache_config=kvc,
                              structured_output_manager=StructuredOutputManager(scfg), block_size=block,
                              hash_block_size=hash_block, log_stats=False)

            def request(rid, tokens, hasher=hasher):
                return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), None, block_hasher=hasher)

            sched.add_request(request("a", ids))
            chunks = []
            while sched.requests["a"].num_computed_tokens < prompt:
                so = sched.schedule()
                chunks.append(so.num_scheduled_tokens["a"])
                step(sched, so)
            null = sched.kv_cache_manager.block_pool.null_block.block_id
            res = {"chunks": chunks, "specs": [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups],
                   "blocks": [sum(1 for i in b if i != null) for b in sched.kv_cache_manager.get_block_ids("a")]}
            # the prompt and more: a prefix hit on what "a" left in the cache
            sched.add_request(request("b", ids + list(range(7, 7 + 300))))
            so = sched.schedule()
            res["hit"] = sched.requests["b"].num_computed_tokens - so.num_scheduled_tokens.get("b", 0)
            step(sched, so)
            # how many more prompts of this length (distinct) the pool starts at once
            res["free"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
            for i in range(60):
                sched.add_request(request(f"c{i}", [7 + i] + ids[1:]))
            so = sched.schedule()
            res["started"] = sum(1 for r in so.num_scheduled_tokens if r.startswith("c"))
            out[f"{prompt}_{n}"] = res
    return out


def test_sharded_accounting_holds_n_times_the_context(tiny_ckpt, fake_cuda_ranks):
    out = fake_cuda_ranks.isolated(_accounting, tiny_ckpt)
    print(json.dumps(out, indent=1))
    bs = out["block_size"]
    assert out["mamba_cache_mode"] == "align"
    for prompt in PROMPTS:
        for n in (1, 2, 4, 8):
            res = out[f"{prompt}_{n}"]
            assert res["specs"] == [bs * n, bs, bs, bs], res  # the GDN groups' blocks stay one state each
            attn, *gdn = res["blocks"]
            assert attn == -(-prompt // (bs * n)), res  # an attention block holds bs x n tokens
            assert gdn == out[f"{prompt}_1"]["blocks"][1:], res  # as many states as pcp=1 keeps
            # the chunks end on a long block's end, where the GDN state is kept: the hit is every whole block
            assert res["hit"] == prompt // (bs * n) * (bs * n), res
            # each new prompt's first chunk takes its attention blocks and a state block per GDN group
            per_prompt = -(-res["chunks"][0] // (bs * n)) + 3
            assert res["started"] == min(60, res["free"] // per_prompt), res
    started = [out[f"{PROMPTS[0]}_{n}"]["started"] for n in (1, 2, 4, 8)]
    # the same pool starts N times the prompts (more: the first two requests' share shrinks with N)
    assert all(s >= n * started[0] > 0 for s, n in zip(started, (1, 2, 4, 8))), started


@pytest.mark.parametrize("n,empty_lse", [(2, float("inf")), (3, float("-inf")), (4, float("-inf"))])
def test_split_step_attends_every_shard(n, empty_lse):
    from harness.dist import run_distributed

    worst = run_distributed(_prefill_worker, n, empty_lse)
    assert max(worst) < 1e-5, worst
