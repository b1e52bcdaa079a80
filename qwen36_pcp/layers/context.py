"""The PCP context: one object per step, passed to every PCP layer.

It holds the host plan, its device index tensors and the PCP process group (vLLM's GroupCoordinator,
the object ``vllm.distributed.get_pcp_group()`` returns). All PCP communication of a split step goes
through ``all_gather`` and ``broadcast_primary`` here, so the bytes a step sends are counted in one place.
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import PCPPlan, PlanTensors


class PCPContext:
    def __init__(self, plan: PCPPlan, group, device: torch.device | str):
        if group.world_size != plan.world_size or group.rank_in_group != plan.rank:
            raise ValueError(
                f"plan is for rank {plan.rank}/{plan.world_size}, group is "
                f"{group.rank_in_group}/{group.world_size}"
            )
        self.plan = plan
        self.group = group
        self.device = torch.device(device)
        self.t: PlanTensors = plan.device_tensors(self.device)
        self.bytes_sent = 0  # per rank, for benchmarks and tests

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def rank(self) -> int:
        return self.plan.rank

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0, rank-major."""
        x = x.contiguous()
        self.bytes_sent += x.numel() * x.element_size()
        return self.group.all_gather(x, dim=0)

    def broadcast_primary(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank: what every rank computed for the replicated requests is kept
        from the primary copy only, so a split step cannot leave the ranks' caches apart bit by bit."""
        x = x.contiguous()
        if self.rank == 0:
            self.bytes_sent += x.numel() * x.element_size()
        return self.group.broadcast(x, 0)

    def gather_output(self, hidden: torch.Tensor, num_rows: int, all_rows: bool) -> torch.Tensor:
        """The step's hidden states in the runner's full row order: ``num_rows`` rows, padding zero.

        vLLM reads only the row of each request's last new token (it samples from it) unless a request
        wants prompt logprobs, which read every row: ``all_rows=False`` gathers ``num_reqs`` rows per
        rank instead of ``t_pad`` and leaves the other rows zero; the rows vLLM reads are the same bits.
        """
        out = hidden.new_zeros(num_rows, *hidden.shape[1:])
        if all_rows:
            gathered = self.all_gather(hidden)
            out[: self.plan.num_tokens] = gathered.index_select(0, self.t.gathered_of_full)
            return out
        full, send, pick = self._cached("sample_rows", lambda: tuple(
            self.to_device(x) for x in self.plan.sample_rows()))
        rows = self.all_gather(hidden.index_select(0, send))
        out.index_copy_(0, full, rows.index_select(0, pick))
        return out

    # ---------------------------------------------------------------- cached
    def _cached(self, key, build):
        extra = self.t.extra
        if key not in extra:
            extra[key] = build()
        return extra[key]

    def to_device(self, x: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(dtype=dtype).to(
            self.device, non_blocking=True
        )

    def conv_index(self, width: int):
        """(tail_rows [S, w-1], halo [S, w-1], final [R, w-1]) for a short conv of this width."""

        def build():
            halo, final = self.plan.conv_sources(width)
            tails = self.plan.tail_rows(width)
            return self.to_device(tails), self.to_device(halo), self.to_device(final)

        return self._cached(("conv", width), build)

    def gdn_index(self):
        """Per-step GDN indices: segments that start from the cache, replicated segments, and this
        rank's blocks of the split requests (block -> local positions, on host and device)."""

        def build():
            plan = self.plan
            segs = plan.local_segments
            starts_from_cache = np.array(
                [s.block <= 0 and plan.num_computed[s.req] > 0 for s in segs], dtype=bool
            )
            replicated = [j for j, s in enumerate(segs) if s.block < 0]
            block_slots = plan.split_block_slots()
            return {
                "starts_from_cache": self.to_device(starts_from_cache, torch.bool),
                "replicated_slots": self.to_device(np.array(replicated, dtype=np.int64)),
                "replicated_reqs": self.to_device(
                    np.array([segs[j].req for j in replicated], dtype=np.int64)
                ),
                "split_reqs": self.to_device(plan.split_reqs.astype(np.int64)),
                "block_slots": block_slots,
                "block_slots_dev": {
                    b: self.to_device(np.array(v, dtype=np.int64)) for b, v in block_slots.items()
                },
            }

        return self._cached("gdn", build)

    def relay_index(self):
        """Per-step GDN relay indices: the replicated requests' rows (first in the local layout) and
        this rank's runs (row range, sequence bounds relative to it on host and device)."""

        def build():
            plan = self.plan
            segs, offs = plan.local_segments, plan.seg_offsets[plan.rank]
            n_rep = sum(s.block < 0 for s in segs)
            rep_reqs = np.array([s.req for s in segs[:n_rep]], dtype=np.int64)

            def bounds(cu):
                cu_cpu = torch.from_numpy(np.ascontiguousarray(cu - cu[0], dtype=np.int32))
                return cu_cpu.to(self.device, non_blocking=True), cu_cpu

            runs = [(int(cu[0]), int(cu[-1]), *bounds(cu)) for cu in plan.run_rows()]
            return {
                "replicated": (int(offs[n_rep]), *bounds(offs[: n_rep + 1])),
                "replicated_reqs": self.to_device(rep_reqs),
                "replicated_from_cache": self.to_device(plan.num_computed[rep_reqs] > 0, torch.bool),
                "split_reqs": self.to_device(plan.split_reqs.astype(np.int64)),
                "split_from_cache": self.to_device(plan.num_computed[plan.split_reqs] > 0, torch.bool),
                "runs": runs,
            }

        return self._cached("relay", build)


FORWARD_CONTEXT_KEY = "qwen36_pcp"


def current_pcp_context() -> PCPContext | None:
    """The PCP context of the running step (set by the runner hook), or None on unsplit steps."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return get_forward_context().additional_kwargs.get(FORWARD_CONTEXT_KEY)
