# SPDX-License-Identifier: Apache-2.0
"""The attention layers' KV cache sharded over the PCP group, so that N GPUs hold N times the context
(not an option yet: nothing of the product calls it).

With the PCP group as vLLM 0.20.2's context-parallel group: which rank keeps which token and the block
tables that write it there (``layout``), the merge of the ranks' partial attention (``merge``), the
attention over shards of the rows every rank holds (``decode``) and of a split step's rows
(``prefill``), and the scheduler's view of the blocks (``accounting``). Deleting this folder removes it
whole.
"""
