# SPDX-License-Identifier: Apache-2.0
"""The step's state: what the runner decided once, after ``_prepare_inputs``, handed to every part that
acts on the step (the dispatch, the slots, the metadata, the forward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..plan import PCPPlan

if TYPE_CHECKING:
    from ..spread.owned_batch import OwnedBatch


@dataclass(frozen=True)
class StepDrafts:
    """A step's speculative drafts as the plan needs them (``StepPlanner.drafts``)."""

    # per request: vLLM's GDN layers verify it (None: they verify none, as vLLM's builder rules where no
    # request past its prompt has drafts)
    verify: np.ndarray | None
    num_read: np.ndarray  # per request: the rows vLLM reads (1 + its drafts)
    uniform: bool  # vLLM's uniform batch of verifications (a spread step with decode="spread")


@dataclass(frozen=True)
class PCPStep:
    """What the runner decided for this step."""

    plan: PCPPlan | None  # None: an unsplit step
    logits_indices: torch.Tensor  # the rows vLLM samples from
    owned: OwnedBatch | None = None  # a spread decode step: the batch of this rank's own requests
    # a spread decode step with a drafter: the whole batch's metadata the drafter reads (its heads put
    # back after the forward)
    drafter_metadata: object = None

    @property
    def split(self) -> bool:
        """A planned step that is not a spread decode step: a local slice of the batch, run eagerly."""
        return self.plan is not None and self.owned is None
