# SPDX-License-Identifier: Apache-2.0
"""Narrow linear layers run on the step's full row count at pcp > 1, so they round as at pcp == 1.

cuBLAS picks the kernel of a product by its shape, the row count included, and the kernels differ in
summation order. For the wide projections that choice leaves every row's bits as they are, but the
shared-expert gate ([T, H] x [H, 1]) came out one bf16 ulp apart from pcp=1's on a few rows when a
rank ran half the step's rows (found with ``python -m tests.gpu.diagnose dump`` on a batch of 1 to
65536-token prompts), and the GDN layers after it carried that into every later token of the request. At a split step
such a layer
runs on its rows padded to pcp=1's row count for the step (``PCPContext.num_tokens_padded``): cuBLAS
then sees pcp=1's shape. For an output this narrow the extra rows cost next to nothing; the padded
copy is one hidden-state tensor of the full step, which vLLM's memory profile (an unsplit step of
that size) covers. A spread decode step is no split: its rows are a subset of pcp=1's batch anyway.

The padding happens inside a custom op, where the step's PCP context is read at run time (a
compiled graph would otherwise keep the branch it was traced with). ``PCPReplicatedLinear`` takes the
place of vLLM's ``ReplicatedLinear`` in our model at pcp > 1 (``layers.classes``); it is vLLM's layer
unless its output is that narrow and unquantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.utils.torch_utils import direct_register_custom_op

from .context import current_pcp_context

# widest output that gets pcp=1's row count
MAX_NARROW_OUTPUT = 1


def _full_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    ctx = current_pcp_context()
    rows = x.shape[0]
    full = 0 if ctx is None else ctx.num_tokens_padded
    if rows >= full:
        return F.linear(x, weight, bias)
    padded = x.new_empty((full, *x.shape[1:]))  # the extra rows' outputs are dropped
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows].clone()


def _full_rows_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


direct_register_custom_op(
    op_name="qwen36_pcp_full_rows_linear",
    op_func=_full_rows_linear,
    fake_impl=_full_rows_linear_fake,
    dispatch_key="CompositeExplicitAutograd",
)


def is_narrow(module: ReplicatedLinear) -> bool:
    """An unquantized replicated linear layer with at most ``MAX_NARROW_OUTPUT`` outputs."""
    return isinstance(module.quant_method, UnquantizedLinearMethod) and module.output_size <= MAX_NARROW_OUTPUT


class PCPReplicatedLinear(ReplicatedLinear):
    """vLLM's ReplicatedLinear; a narrow one runs on the step's full row count at split steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.full_rows = is_narrow(self)

    def forward(self, x: torch.Tensor):
        if not self.full_rows:
            return super().forward(x)
        bias = self.bias if not self.skip_bias_add else None
        output = torch.ops.vllm.qwen36_pcp_full_rows_linear(x, self.weight, bias)
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)
