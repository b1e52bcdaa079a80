# SPDX-License-Identifier: Apache-2.0
"""fp32 torch GDN kernels for the CPU tests, with the chunk structure of fla's chunked kernels.

Same contracts as ``qwen36_pcp.layers.gdn_kernels.VllmGDNKernels``. What makes them a stand-in worth
having is the 64-token chunk grid: like vLLM's bundled fla, ``chunk_local`` cuts every sequence of its
``cu`` into 64-token chunks from the sequence start and computes, per chunk, the cumulative log decay,
``A = beta K K^T`` weighted by the decay, its inverse ``(I + A)^-1`` and the WY factors ``w, u``;
``chunk_states`` and ``chunk_outputs`` then walk the chunks of THEIR ``cu`` and read those per-token
factors, a chunk's decay from its last token. When the two grids disagree (a piece scanned as part of
a longer sequence that is not a whole number of chunks), the result is wrong here as it is on the GPU;
a token-by-token scan would not notice. ``recurrent`` is that token-by-token scan, the reference the
chunked form is checked against (and fla's naive recurrent scan against it).

State layout is vLLM's (V-first): a value head's state X is [V, K]; internally the chunk form works on
S = X^T [K, V]:  S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,  o_t = scale S_t^T q_t.
In a chunk with cumulative log decay G (from the chunk start) and state S_0 before it:
  A_ij = b_i (k_i . k_j) exp(G_i - G_j) (j < i),  T = (I + A)^-1,  u = T (b v),  w = T (b exp(G) k),
  v_new = u - w S_0,  S_end = exp(G_L) S_0 + sum_j exp(G_L - G_j) k_j v_new_j^T,
  o_i = scale [exp(G_i) q_i^T S_0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) v_new_j].
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from qwen36_pcp.config import GDN_CHUNK
from qwen36_pcp.layers.device_copy import Varlen
from qwen36_pcp.layers.gdn_kernels import GDNWeights


def chunk_grid(cu_cpu, offset: int = 0) -> list[list[tuple[int, int]]]:
    """Per sequence of ``cu_cpu``: its 64-token chunks [c0, c1) from the sequence start (+ offset)."""
    bounds = [int(x) for x in cu_cpu.tolist()]
    return [[(offset + c, offset + min(c + GDN_CHUNK, b)) for c in range(a, b, GDN_CHUNK)]
            for a, b in zip(bounds, bounds[1:])]


def _heads_first(x):
    return x.transpose(0, 1)


def _causal_decay(G, strict: bool):
    """exp(G_i - G_j) for j < i (``strict``) or j <= i, else 0; G [HV, L]."""
    L = G.shape[-1]
    mask = torch.ones(L, L, dtype=torch.bool).tril(-1 if strict else 0)
    diff = G[:, :, None] - G[:, None, :]
    return torch.where(mask, diff, float("-inf")).exp()


class TorchGDNKernels:
    """fp32 torch kernels (CPU), same contracts as ``VllmGDNKernels`` and the same chunk grid."""

    @staticmethod
    def conv(x, weight, bias, init_states, seqs: Varlen, activation="silu"):
        """x [T, D]; init_states [S, D, W-1] (the W-1 inputs before each segment) -> [T, D]."""
        out = torch.empty_like(x)
        bounds = seqs.cu_cpu.tolist()
        w = weight.float()
        for s in range(len(bounds) - 1):
            a, b = bounds[s], bounds[s + 1]
            if b == a:
                continue
            xx = torch.cat([init_states[s].float().transpose(0, 1), x[a:b].float()], 0)  # [W-1+L, D]
            y = F.conv1d(xx.transpose(0, 1)[None], w[:, None, :], groups=w.shape[0])[0]  # [D, L]
            y = y.transpose(0, 1)
            if bias is not None:
                y = y + bias.float()
            if activation in ("silu", "swish"):
                y = F.silu(y)
            out[a:b] = y.to(x.dtype)
        return out

    @staticmethod
    def prep(y, a, b, w: GDNWeights):
        """Split q/k/v, L2-normalise q/k, gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
        T = y.shape[0]
        hk, dk, dv = w.num_k_heads, w.head_k_dim, w.head_v_dim
        q, k, v = torch.split(y, [hk * dk, hk * dk, y.shape[1] - 2 * hk * dk], dim=-1)
        q = F.normalize(q.float().view(T, hk, dk), dim=-1, eps=1e-6).to(y.dtype)
        k = F.normalize(k.float().view(T, hk, dk), dim=-1, eps=1e-6).to(y.dtype)
        v = v.reshape(T, -1, dv)
        g = -torch.exp(w.A_log.float()) * F.softplus(a.float() + w.dt_bias.float())
        beta = torch.sigmoid(b.float())
        return q, k, v, g, beta

    # the three stages of fla's chunked forward (the relay calls them separately)
    @staticmethod
    def chunk_local(q, k, v, g, beta, seqs: Varlen):
        """Per chunk of ``cu``'s grid: cumulative log decay G, and the WY factors w, u."""
        rep = v.shape[1] // q.shape[1]
        kf = k.float().repeat_interleave(rep, 1)
        vf, gf, bf = v.float(), g.float(), beta.float()
        T, HV = gf.shape
        G = torch.zeros(T, HV)
        w = torch.zeros(T, HV, kf.shape[-1])
        u = torch.zeros(T, HV, vf.shape[-1])
        for seq in chunk_grid(seqs.cu_cpu):
            for c0, c1 in seq:
                Gc = _heads_first(gf[c0:c1].cumsum(0))  # [HV, L]
                kc, bc = _heads_first(kf[c0:c1]), _heads_first(bf[c0:c1])[..., None]
                A = (kc @ kc.transpose(1, 2)) * _causal_decay(Gc, strict=True) * bc
                eye = torch.eye(c1 - c0).expand_as(A)
                inv = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
                G[c0:c1] = Gc.T
                u[c0:c1] = _heads_first(inv @ (bc * _heads_first(vf[c0:c1])))
                w[c0:c1] = _heads_first(inv @ (bc * Gc.exp()[..., None] * kc))
        return SimpleNamespace(q=q.float().repeat_interleave(rep, 1), k=kf, G=G, w=w, u=u, dtype=v.dtype)

    @staticmethod
    def chunk_states(prep, lo, hi, init, seqs: Varlen):
        """Rows [lo, hi) as sequences ``seqs`` (relative to lo) from ``init`` [S, HV, V, K] -> (final fp32,
        pending: the state before each chunk and v_new, for ``chunk_outputs``)."""
        final = torch.empty(init.shape, dtype=torch.float32)
        h, v_new = [], torch.zeros(hi - lo, *prep.u.shape[1:])
        for s, seq in enumerate(chunk_grid(seqs.cu_cpu, offset=lo)):
            S = init[s].float().transpose(-1, -2)  # [HV, K, V]
            for c0, c1 in seq:
                h.append(S)
                vn = _heads_first(prep.u[c0:c1]) - _heads_first(prep.w[c0:c1]) @ S  # [HV, L, V]
                Gc = _heads_first(prep.G[c0:c1])
                last = Gc[:, -1:]  # a chunk's decay is read at its last token
                kd = _heads_first(prep.k[c0:c1]) * (last - Gc).exp()[..., None]
                S = last.exp()[..., None] * S + kd.transpose(1, 2) @ vn
                v_new[c0 - lo : c1 - lo] = _heads_first(vn)
            final[s] = S.transpose(-1, -2)
        return final, (h, v_new)

    @staticmethod
    def chunk_outputs(prep, lo, hi, pending, seqs: Varlen):
        h, v_new = pending
        scale = prep.k.shape[-1] ** -0.5
        o = torch.zeros(hi - lo, *v_new.shape[1:])
        chunks = [c for seq in chunk_grid(seqs.cu_cpu, offset=lo) for c in seq]
        for (c0, c1), S in zip(chunks, h, strict=True):
            qc, kc, Gc = (_heads_first(x[c0:c1]) for x in (prep.q, prep.k, prep.G))
            vn = _heads_first(v_new[c0 - lo : c1 - lo])
            inter = (qc * Gc.exp()[..., None]) @ S
            intra = ((qc @ kc.transpose(1, 2)) * _causal_decay(Gc, strict=False)) @ vn
            o[c0 - lo : c1 - lo] = _heads_first(scale * (inter + intra))
        return o.to(prep.dtype)

    @classmethod
    def chunk(cls, q, k, v, g, beta, init, seqs: Varlen, scale=None):
        """The whole chunked scan of ``seqs`` -> (o in v's dtype, final states fp32)."""
        assert scale is None or scale == q.shape[-1] ** -0.5
        prep = cls.chunk_local(q, k, v, g, beta, seqs)
        final, pending = cls.chunk_states(prep, 0, q.shape[0], init, seqs)
        return cls.chunk_outputs(prep, 0, q.shape[0], pending, seqs), final

    @staticmethod
    def recurrent(q, k, v, g, beta, init, cu_cpu):
        """Token-by-token scan (no chunks): q,k [T,H,K]; v [T,HV,V]; init [S,HV,V,K] -> (o fp32, final)."""
        rep = v.shape[1] // q.shape[1]
        scale = q.shape[-1] ** -0.5
        qf, kf = (x.float().repeat_interleave(rep, 1) for x in (q, k))
        o = torch.empty(v.shape, dtype=torch.float32)
        final = torch.empty(init.shape, dtype=torch.float32)
        bounds = cu_cpu.tolist()
        for s in range(len(bounds) - 1):
            X = init[s].float().clone()  # [HV, V, K]
            for t in range(bounds[s], bounds[s + 1]):
                kt = kf[t]
                X = g[t].exp()[:, None, None] * (X - beta[t][:, None, None] * (X @ kt[:, :, None]) * kt[:, None, :])
                X = X + beta[t][:, None, None] * v[t].float()[:, :, None] * kt[:, None, :]
                o[t] = (X @ (scale * qf[t])[:, :, None])[..., 0]
            final[s] = X
        return o, final
