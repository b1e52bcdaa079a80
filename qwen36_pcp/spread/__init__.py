# SPDX-License-Identifier: Apache-2.0
"""``decode="spread"``: each decoding request on one rank, its owner, which alone computes its rows; a
step of decode rows alone runs as vLLM's own decode of each rank's requests. Everything of it the
runner holds is ``SpreadDecode`` (``runner_part.py``), created by the runner with that option."""

from .runner_part import SpreadDecode

__all__ = ["SpreadDecode"]
