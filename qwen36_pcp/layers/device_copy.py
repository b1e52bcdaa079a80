# SPDX-License-Identifier: Apache-2.0
"""Host indices on the device in one copy (``to_device_all``), and sequences packed back to back with
the kernels' launch metadata computed once per step (``Varlen``): what every PCP layer's per-step
indices travel in."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.utils.platform_utils import is_pin_memory_available

_ALIGN = 16  # bytes: each array's start in the packed copy (Triton specialises pointers on 16-byte alignment)


def to_device_all(device: torch.device | str, *arrays) -> list[torch.Tensor]:
    """Host indices on the device, in stream order, without the host waiting, in one copy.

    From pinned memory on a GPU: a copy from pageable memory waits for the GPU's queued work, so an
    index first needed after the model call was launched (the output gather's) would hold the host
    until the model finished. In one copy: each pinned copy costs the host tens of microseconds
    whatever its size, and a step has several indices. The arrays are packed with numpy, and each
    result is at most two tensor calls (a slice and its dtype), because every tensor call is host
    time a step pays. Each item is an array (sent as int64) or ``(array, dtype)``; the results are
    views of one device buffer, each starting 16-byte aligned. The pinned buffer comes from PyTorch's
    caching host allocator, which hands a freed block out again once the copies that read it have
    completed: no page-locking per call, and no buffer reused while a copy still reads it."""
    hosts = [np.ascontiguousarray(a, dtype=_NUMPY_DTYPES[dtype])
             for a, dtype in (item if isinstance(item, tuple) else (item, torch.int64) for item in arrays)]
    starts, total = [], 0
    for h in hosts:
        starts.append(total)
        total += -(-h.nbytes // _ALIGN) * _ALIGN
    pinned = torch.device(device).type == "cuda" and is_pin_memory_available()
    packed = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    packed_np = packed.numpy()
    for h, start in zip(hosts, starts):
        packed_np[start:start + h.nbytes] = h.reshape(-1).view(np.uint8)
    packed = packed.to(device, non_blocking=True)
    out = []
    for h, start in zip(hosts, starts):
        t = packed[start:start + h.nbytes].view(_TORCH_DTYPES[h.dtype])
        out.append(t if h.ndim == 1 else t.view(h.shape))
    return out


_TORCH_DTYPES = {np.dtype(n): t for n, t in (("int64", torch.int64), ("int32", torch.int32), ("bool", torch.bool),
                                              ("uint8", torch.uint8), ("float32", torch.float32))}


_NUMPY_DTYPES = {t: n for n, t in _TORCH_DTYPES.items()}


@dataclass
class Varlen:
    """Sequences packed back to back (``cu_seqlens``), on the device and on the host.

    The kernels' launch metadata for these sequences (fla's chunk indices and offsets, the causal
    conv's) is computed on the host from ``cu_cpu`` the first time a kernel needs it and kept here,
    so a step computes it once for all its layers.
    """

    cu: torch.Tensor  # [S+1] int32, device
    cu_cpu: torch.Tensor  # [S+1] int32, host
    chunk_meta: tuple | None = field(default=None, repr=False)  # (chunk_indices, chunk_offsets)
    conv_meta: object | None = field(default=None, repr=False)

    @classmethod
    def of(cls, bounds: np.ndarray, device: torch.device) -> Varlen:
        return cls.of_all([bounds], device)[0]

    @classmethod
    def of_all(cls, bounds: list[np.ndarray], device: torch.device, *others) -> list:
        """One ``Varlen`` per array of ``bounds``, then ``others`` on the device (``to_device_all``'s
        items), with one copy."""
        hosts = [torch.from_numpy(np.ascontiguousarray(b, dtype=np.int32)) for b in bounds]
        moved = to_device_all(device, *((h.numpy(), torch.int32) for h in hosts), *others)
        return [cls(cu, h) for cu, h in zip(moved, hosts)] + moved[len(hosts):]
