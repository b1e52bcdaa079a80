# SPDX-License-Identifier: Apache-2.0
"""At a split step the narrow linear layers run on pcp=1's row count (cuBLAS then picks pcp=1's
kernel); elsewhere (a spread decode step included: its CUDA graph holds the op unpadded) they are the
plain product."""

from types import SimpleNamespace

import torch


def test_narrow_linear_runs_on_the_steps_full_row_count(monkeypatch):
    import qwen36_pcp.layers.full_rows_linear as frl

    shapes = []
    real = frl.F.linear

    def linear(x, w, b=None):
        shapes.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(frl.F, "linear", linear)
    x, w = torch.randn(5, 8), torch.randn(1, 8)
    ref = real(x, w)
    split = SimpleNamespace(num_tokens_padded=12)
    for ctx, rows in ((None, 5), (split, 12)):
        monkeypatch.setattr(frl, "current_pcp_context", lambda ctx=ctx: ctx)
        out = torch.ops.vllm.qwen36_pcp_full_rows_linear(x, w, None)
        assert shapes.pop() == (rows, 8)
        assert out.shape == (5, 1) and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
