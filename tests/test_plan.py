# SPDX-License-Identifier: Apache-2.0
"""Properties of the per-step PCP plan over many small random cases (pure host code)."""

import itertools

import numpy as np
import pytest

from qwen36_pcp.config import GDN_CHUNK, PCPConfig
from qwen36_pcp.plan import PCPPlan
from qwen36_pcp.plan_records import block_bounds, block_owner


def random_batches(seed, count, max_new=1200):
    """Batches of 1-5 requests: decode rows, short prompts and prompts long enough to split (the
    split threshold is 64 tokens per block: 256 at pcp=2 zigzag, 512 at pcp=4, 768 at pcp=3)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        num_reqs = int(rng.integers(1, 6))
        num_new = rng.integers(1, max_new, size=num_reqs)
        decode = rng.random(num_reqs) < 0.3
        num_new[decode] = 1
        num_computed = np.where(rng.random(num_reqs) < 0.5, rng.integers(0, 200, size=num_reqs), 0)
        yield num_computed, num_new


def decode_owners(num_new, world_size, seed):
    """A random owner for every one-token row (decode="spread": the rows ``decode_owners`` assigns),
    -1 elsewhere."""
    rng = np.random.default_rng(seed)
    return np.where(np.asarray(num_new) == 1, rng.integers(0, world_size, size=len(num_new)), -1)


CASES = [
    (n, layout, min_split)
    for n in (2, 3, 4)
    for layout in ("zigzag", "contiguous")
    for min_split in (1, 700)
]


@pytest.mark.parametrize("world_size,layout,min_split", CASES)
def test_plan_properties(world_size, layout, min_split):
    cfg = PCPConfig(layout=layout, min_split_tokens=min_split)
    seen = {"split": 0, "replicated": 0, "owned": 0}
    for k, (num_computed, num_new) in enumerate(random_batches(world_size * 7 + min_split, 120)):
        owner = decode_owners(num_new, world_size, k) if k % 2 else None  # decode="spread" every other
        plans = [PCPPlan(num_computed, num_new, world_size, r, cfg, owner) for r in range(world_size)]
        p0 = plans[0]
        # identical on every rank (no collective needed)
        for p in plans[1:]:
            assert np.array_equal(p.local_full_idx, p0.local_full_idx)
            assert p.segments == p0.segments and p.t_pad == p0.t_pad
        # every new token owned (primary) by exactly one rank; replicated tokens on every rank
        owners = np.zeros(p0.num_tokens, dtype=int)
        copies = np.zeros(p0.num_tokens, dtype=int)
        for r in range(world_size):
            rows = p0.local_full_idx[r]
            valid = rows >= 0
            np.add.at(copies, rows[valid], 1)
            np.add.at(owners, rows[valid & p0.primary[r]], 1)
        assert (owners == 1).all()
        for i in range(p0.num_reqs):
            seg = slice(p0.req_start[i], p0.req_start[i + 1])
            expected = 1 if p0.split[i] or p0.owner[i] >= 0 else world_size
            assert (copies[seg] == expected).all()
            if p0.owner[i] >= 0:  # only on its owner
                assert np.isin(np.arange(seg.start, seg.stop), p0.local_full_idx[p0.owner[i]]).all()
        # splitting rule: requests shorter than the threshold (and decode rows) are replicated; the
        # threshold never lets a block start off the 64-token chunk grid
        threshold = max(min_split, GDN_CHUNK * cfg.num_blocks(world_size))
        assert np.array_equal(p0.split, num_new >= threshold)
        assert not p0.split[num_new == 1].any()
        seen["split"] += int(p0.split.sum())
        seen["replicated"] += int((~p0.split & (p0.owner < 0)).sum())
        seen["owned"] += int((p0.owner >= 0).sum())
        assert p0.num_replicated == int((~p0.split & (p0.owner < 0)).sum())
        assert p0.decode_spread_only == bool((p0.owner >= 0).all())
        # equal padded token count, and nothing wasted beyond the largest rank
        counts = p0.tokens_per_rank()
        assert p0.t_pad == max(1, counts.max())
        # segments tile each split request in order, blocks go to the right owners
        for i in p0.split_reqs:
            segs = sorted(
                (s for r in range(world_size) for s in p0.segments[r] if s.req == i),
                key=lambda s: s.start,
            )
            assert [s.block for s in segs] == list(range(cfg.num_blocks(world_size)))
            assert segs[0].start == 0 and segs[-1].end == num_new[i]
            assert all(a.end == b.start and a.length >= 1 for a, b in zip(segs, segs[1:]))
            for r in range(world_size):
                for s in p0.segments[r]:
                    if s.req == i:
                        assert block_owner(s.block, world_size, layout) == r
        # every block but the last on whole GDN chunks (pcp=1's chunk grid); the relay's runs are
        # row ranges
        for i in p0.split_reqs:
            assert (p0.block_bounds[int(i)][:-1] % GDN_CHUNK == 0).all()
            assert (np.diff(p0.block_bounds[int(i)]) >= GDN_CHUNK).all()
        for r in range(world_size):
            runs = p0.run_rows(r)
            assert len(runs) == sum(own == r for own, _, _ in p0.summary_runs) * bool(p0.splits_any)
            rep_rows = sum(s.length for s in p0.segments[r] if s.block < 0)
            covered = [rep_rows] + [int(c[0]) for c in runs] + [int(c[-1]) for c in runs]
            assert sorted(covered)[0] == rep_rows  # replicated rows first, then the runs
            for cu in runs:
                for k, i in enumerate(p0.split_reqs):
                    rows = p0.local_full_idx[r, cu[k] : cu[k + 1]] - p0.req_start[i]
                    assert np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows)))  # in order
        # last token owner: the rank with the primary copy of the last new token
        owner = p0.last_token_owner()
        for i in range(p0.num_reqs):
            last = p0.req_start[i + 1] - 1
            r = int(np.argwhere((p0.local_full_idx == last) & p0.primary)[0][0])
            assert owner[i] == r
            if p0.split[i]:
                assert owner[i] == (0 if layout == "zigzag" else world_size - 1)
            elif p0.owner[i] >= 0:
                assert owner[i] == p0.owner[i]
            else:
                assert owner[i] == 0
        # attention virtual sequences: query i of a segment sees keys [0, c + start + i]
        for r in range(world_size):
            seqs = p0.attention_seqs(r)
            cu, used, reqs = seqs.cu_q, seqs.seqused_k, seqs.reqs
            for j, s in enumerate(p0.segments[r]):
                assert cu[j + 1] - cu[j] == s.length
                assert used[j] == num_computed[s.req] + s.end and reqs[j] == s.req
        # gathered rows: each full token written exactly once
        g = p0.gathered_full_idx()
        assert np.array_equal(np.sort(g[g >= 0]), np.arange(p0.num_tokens))
        assert np.array_equal(g[p0.gathered_of_full], np.arange(p0.num_tokens))
    assert min(seen.values()) >= 10, seen  # every branch ran


def test_zigzag_balances_causal_work():
    """With equal blocks zigzag gives every rank the same causal attention work; contiguous does not.
    Blocks are whole 64-token GDN chunks, so equal up to a chunk."""
    for world_size, n in itertools.product((2, 3, 4), (1000, 6400, 65536)):
        work = {}
        for layout in ("zigzag", "contiguous"):
            plan = PCPPlan([0], [n], world_size, 0, PCPConfig(layout=layout, min_split_tokens=1))
            assert plan.splits_any
            per_rank = []
            for r in range(world_size):
                seqs = plan.attention_seqs(r)
                cu, used = seqs.cu_q, seqs.seqused_k
                lens = np.diff(cu)
                # query q of a segment of length L ending at e sees e - L + q + 1 keys
                per_rank.append(sum(int(L * (e - L) + L * (L + 1) // 2) for L, e in zip(lens, used)))
            work[layout] = np.array(per_rank)
        total = n * (n + 1) // 2
        assert work["zigzag"].sum() == work["contiguous"].sum() == total
        zz = work["zigzag"]
        assert zz.max() / zz.min() <= 1 + 4 * world_size * GDN_CHUNK / n
        cont = work["contiguous"]
        assert cont.max() / cont.min() > 2  # the last rank does (2N-1)x the first's work


def test_split_floor_one_chunk_per_block():
    """Whatever min_split_tokens says, a request is split only from one 64-token chunk per block on."""
    for world_size, layout in itertools.product((2, 4, 8), ("zigzag", "contiguous")):
        cfg = PCPConfig(layout=layout, min_split_tokens=1)
        floor = GDN_CHUNK * cfg.num_blocks(world_size)
        assert cfg.split_threshold(world_size) == floor
        assert PCPConfig(layout=layout, min_split_tokens=floor + 5).split_threshold(world_size) == floor + 5
        for n in (1, 2 * world_size, 63, 65, floor - 1):
            plan = PCPPlan([0, 7], [n, 1], world_size, 0, cfg)
            assert not plan.splits_any
            assert plan.t_pad == n + 1
            assert (plan.last_token_owner() == 0).all()
        plan = PCPPlan([0, 7], [floor, 1], world_size, 1, cfg)
        per_rank = floor // world_size  # one chunk per block
        assert plan.splits_any and plan.t_pad == per_rank + 1
        assert (np.diff(plan.block_bounds[0]) == GDN_CHUNK).all()
    with pytest.raises(ValueError, match="fewer than one 64-token chunk per block"):
        block_bounds(100, 4)


def test_step_splits_matches_plan():
    cfg = PCPConfig(min_split_tokens=8)
    for num_computed, num_new in random_batches(3, 50):
        for world_size in (1, 2, 4):
            plan = PCPPlan(num_computed, num_new, world_size, 0, cfg)
            assert cfg.step_splits(num_new, world_size) == plan.splits_any


def test_conv_sources_point_at_the_previous_inputs():
    """Every halo / final-state entry refers to exactly the input at position p-1, p-2, ... of its request
    (an owned row's new input on its owner: the only rank that holds it)."""
    width = 4
    for world_size, layout in itertools.product((2, 3, 4), ("zigzag", "contiguous")):
        cfg = PCPConfig(layout=layout, min_split_tokens=1)
        for k, (num_computed, num_new) in enumerate(random_batches(11 + world_size, 80)):
            owner = decode_owners(num_new, world_size, k) if k % 2 else None
            plan = PCPPlan(num_computed, num_new, world_size, 0, cfg, owner)
            w1 = width - 1
            num_segs = plan.max_segments
            # what each index-space row holds: ("new", req, pos) / ("cached", req, k) / zero
            rows = {}
            for r in range(world_size):
                tails = plan.tail_rows(width, r)
                for j in range(num_segs):
                    for w in range(w1):
                        full = plan.local_full_idx[r, tails[j, w]]
                        req = int(np.searchsorted(plan.req_start, full, side="right") - 1) if full >= 0 else -1
                        rows[(r * num_segs + j) * w1 + w] = ("new", req,
                                                             int(full - plan.req_start[req]) if full >= 0 else None)
            for i in range(plan.num_reqs):
                for w in range(w1):
                    rows[world_size * num_segs * w1 + i * w1 + w] = ("cached", i, w - w1)
            zero = world_size * num_segs * w1 + plan.num_reqs * w1

            def expect(i, p):
                if p >= 0:
                    return ("new", i, p)
                return ("cached", i, p) if num_computed[i] > 0 else "zero"

            for r in range(world_size):
                sources = plan.conv_sources(width, r)
                halo, final = sources.halo, sources.final
                for j, s in enumerate(plan.segments[r]):
                    for w in range(w1):
                        got = "zero" if halo[j, w] == zero else rows[halo[j, w]]
                        assert got == expect(s.req, s.start - w1 + w)
                for i in range(plan.num_reqs):
                    for w in range(w1):
                        got = "zero" if final[i, w] == zero else rows[final[i, w]]
                        assert got == expect(i, int(num_new[i]) - w1 + w)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="layout"):
        PCPConfig(layout="ring")
    with pytest.raises(ValueError, match="gdn_mode"):
        PCPConfig(gdn_mode="ring")
    with pytest.raises(ValueError, match="decode"):
        PCPConfig(decode="sharded")
    with pytest.raises(ValueError, match="owner"):  # a split request has no owner
        PCPPlan([0], [5000], 2, 0, PCPConfig(), owner=np.array([1]))
    with pytest.raises(ValueError, match="handover"):  # an owned request is not handed over
        PCPPlan([9], [1], 2, 0, PCPConfig(), owner=np.array([1]), handover=np.array([1]))
    with pytest.raises(ValueError, match="moe_experts"):
        PCPConfig(moe_experts="mirrored")
    with pytest.raises(ValueError, match="unknown option"):
        PCPConfig.from_additional_config({"qwen36_pcp": {"layuot": "zigzag"}})
    assert PCPConfig.from_additional_config(None) == PCPConfig()


def test_register_does_nothing_on_another_vllm(monkeypatch, caplog):
    import qwen36_pcp

    monkeypatch.setattr(qwen36_pcp, "vllm_version", lambda: "0.21.0")
    monkeypatch.setattr(qwen36_pcp, "_warned", False)
    with caplog.at_level("WARNING", logger="qwen36_pcp"):
        qwen36_pcp.register()
        qwen36_pcp.register()
    lines = [r for r in caplog.records if "0.21.0" in r.getMessage()]
    assert len(lines) == 1 and "not loaded" in lines[0].getMessage()


def _plain(x):
    """``x`` with numpy arrays, dataclasses and containers turned into lists and dicts (comparable)."""
    import dataclasses

    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, PCPPlan):
        return _plan_state(x)
    if dataclasses.is_dataclass(x):
        return _plain(vars(x))
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _plan_state(plan: PCPPlan) -> dict:
    """Everything a plan holds and derives, per rank: its attributes (cached properties included,
    once computed) and what its methods give."""
    from functools import cached_property

    for name, value in vars(PCPPlan).items():
        if isinstance(value, cached_property):
            getattr(plan, name)
    state = _plain(vars(plan))
    for r in range(plan.world_size):
        state[f"rank{r}"] = _plain((plan.attention_seqs(r), plan.conv_sources(4, r), plan.tail_rows(4, r),
                                    plan.run_rows(r), plan.split_block_slots(r)))
    state["sample"] = _plain(plan.sample_rows())
    return state


@pytest.mark.parametrize("owner", [None, [0, 1, 1, 0, -1]])
def test_a_plan_at_other_computed_counts_is_that_plan_built_anew(owner):
    """``with_computed``: a spread decode step's plan reused a token later (every request owned, and a
    split step too) holds and derives exactly what the plan built at the new counts does."""
    config = PCPConfig(min_split_tokens=64, decode="spread")
    if owner is None:
        num_new, owner_arr = np.array([300, 1, 90, 1, 7]), None
    else:
        num_new, owner_arr = np.array([1, 1, 1, 1, 7]), np.array(owner)
    for world in (2, 4):
        before, after = np.array([0, 40, 3000, 5, 12]), np.array([0, 41, 3001, 6, 19])
        reused = PCPPlan(before, num_new, world, 1, config, owner_arr, min_rows=4)
        _plan_state(reused)  # its cached properties computed before it moves on
        moved = reused.with_computed(after)
        assert _plan_state(moved) == _plan_state(PCPPlan(after, num_new, world, 1, config, owner_arr, min_rows=4))
        assert reused.num_computed.tolist() == before.tolist()  # the plan itself unchanged
    with pytest.raises(ValueError, match="one count per request"):
        reused.with_computed(np.array([1, 2]))


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("spread", [False, True])
def test_verified_requests_come_first_and_the_others_plan_is_the_rest(world_size, spread):
    """With MTP verification rows beside split prompts: the verified requests (replicated, or on their
    owners) are never split and lead each rank's rows; after them each rank's rows are exactly those of
    the plan of the other requests (``gdn_plan``, numbered as vLLM numbers its non-speculative
    requests); vLLM reads every verification row and each other request's last row, from its primary
    copy."""
    rng = np.random.default_rng(world_size)
    config = PCPConfig(min_split_tokens=64)
    num_new = np.array([4, 5000, 4, 1100, 1, 4, 9000, 2])
    num_computed = np.array([900, 0, 20, 0, 40, 7000, 4096, 0])
    verify = np.array([True, False, True, False, False, True, False, False])
    owner = np.where(verify, rng.integers(0, world_size, len(num_new)), -1) if spread else None
    num_read = np.where(verify, num_new, 1)
    sent = []
    for rank in range(world_size):
        plan = PCPPlan(num_computed, num_new, world_size, rank, config, owner, verify=verify, num_read=num_read)
        assert not plan.split[verify].any() and plan.split.tolist() == [False, True, False, True, False, False,
                                                                         True, False]
        mine = [i for i in np.flatnonzero(verify) if owner is None or owner[i] == rank]
        assert plan.verified_on().tolist() == mine and plan.verify_rows() == 4 * len(mine)
        assert [s.req for s in plan.local_segments[: len(mine)]] == mine
        rest = plan.gdn_plan
        keep = np.flatnonzero(~verify)
        assert rest.num_new.tolist() == num_new[keep].tolist()
        assert rest.num_computed.tolist() == num_computed[keep].tolist()
        n, skip = rest.num_local_tokens, plan.verify_rows()
        assert plan.num_local_tokens == skip + n
        # the same rows in the same order: the other plan's tokens are the full batch's of its requests
        to_full = np.concatenate([plan.req_start[i] + np.arange(num_new[i]) for i in keep])
        assert plan.local_full_idx[rank][skip: skip + n].tolist() == to_full[rest.local_full_idx[rank][:n]].tolist()
        rows = plan.sample_rows()
        ends = plan.req_start[1:]
        assert rows.full.tolist() == [r for i, e in enumerate(ends) for r in range(e - num_read[i], e)]
        primary = plan.gathered_of_full[rows.full] // plan.t_pad
        request = np.repeat(np.arange(8), num_read)
        verified_on = owner[request] if spread else np.zeros(len(request), dtype=int)
        assert (primary[verify[request]] == verified_on[verify[request]]).all()
        sent.append(plan.local_full_idx[rank][rows.send])  # the full token of each row this rank sends
    # the gather (every rank's sent rows, rank-major) picked at ``pick`` holds every row vLLM reads
    gathered = np.concatenate(sent)
    assert gathered[rows.pick].tolist() == rows.full.tolist()
    all_verified = PCPPlan([9, 9], [4, 4], world_size, 0, config, verify=np.array([True, True]))
    none_verified = PCPPlan([0], [300], world_size, 0, config)
    assert all_verified.gdn_plan is None and none_verified.gdn_plan is none_verified
    with pytest.raises(ValueError, match="not verified"):
        PCPPlan([9, 0], [4, 300], world_size, 0, config, handover=np.array([1, -1]), verify=np.array([True, False]))
    with pytest.raises(ValueError, match="num_read"):
        PCPPlan([9, 0], [4, 300], world_size, 0, config, verify=np.array([True, False]), num_read=np.array([5, 1]))
