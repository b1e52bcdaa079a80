# SPDX-License-Identifier: Apache-2.0
"""The attention layers' KV cache sharded over the PCP group, so that N GPUs hold N times the context
(not an option yet: the split and decode attention over shards are not wired into the layers).

What is here is the part of the layout that vLLM 0.20.2's own pieces carry, with the PCP group as the
context-parallel group: which rank keeps which token and the block tables that write it there
(``layout``), the merge of the ranks' partial attention (``merge``), and the scheduler's view of the
blocks (``accounting``). Deleting this folder removes it whole.
"""
