# SPDX-License-Identifier: Apache-2.0
"""The PCP group's collectives, set up while vLLM profiles memory (``PCPModelRunner.profile_run``)."""

from __future__ import annotations

import torch

from ..config import PCPConfig
from ..plan import PCPPlan


def warm_pcp_collectives(group, config: PCPConfig, device: torch.device) -> None:
    """Every kind of call a split step makes on the PCP group, once: the communicators (NCCL's, and
    vLLM's point-to-point connections between each pair of consecutive run owners) are set up here,
    their buffers inside the profile and their setup time outside the first request's."""
    world, rank = group.world_size, group.rank_in_group
    x = torch.zeros(1, device=device)
    group.all_gather(x, dim=0)
    group.broadcast(x, 0)
    chain = PCPPlan([0], [config.split_threshold(world)], world, rank, config).summary_runs
    for (src, _, _), (dst, _, _) in zip(chain, chain[1:]):
        if rank == src:
            group.send(x, dst)
        elif rank == dst:
            group.recv(x.shape, x.dtype, src)
