# SPDX-License-Identifier: Apache-2.0
"""``to_device_all``: a step's host indices reach the device in one copy, each array intact (dtype,
shape, values) and starting 16-byte aligned (Triton specialises its kernels on 16-byte pointer
alignment, which fresh device allocations have)."""

import numpy as np
import torch

from qwen36_pcp.layers.device_copy import Varlen, to_device_all


def test_arrays_of_mixed_dtypes_and_shapes_in_one_buffer():
    rng = np.random.default_rng(0)
    items = [rng.integers(-5, 1 << 40, 7), (rng.integers(0, 1 << 20, (3, 5)), torch.int32),
             (rng.random(9) > 0.5, torch.bool), np.array([], dtype=np.int64), (np.arange(3), torch.int32),
             rng.integers(0, 100, (2, 2))]
    moved = to_device_all("cpu", *items)
    base = moved[0].untyped_storage().data_ptr()
    for item, t in zip(items, moved):
        array, dtype = item if isinstance(item, tuple) else (item, torch.int64)
        assert t.dtype == dtype and tuple(t.shape) == array.shape
        assert np.array_equal(t.numpy(), array.astype(t.numpy().dtype))
        assert t.untyped_storage().data_ptr() == base, "one buffer, one copy"
        assert t.data_ptr() % 16 == 0
    # the copy is the device's own: changing the host array after the call changes nothing
    src = np.arange(4)
    out, = to_device_all("cpu", src)
    src[:] = 0
    assert out.tolist() == [0, 1, 2, 3]


def test_varlens_and_others_together():
    (a, b), (c,) = Varlen.of_all([np.array([0, 3, 7]), np.array([0, 2])], "cpu", np.array([5, 6]))[:2], \
        Varlen.of_all([], "cpu", np.array([5, 6]))
    assert a.cu.dtype == torch.int32 and a.cu.tolist() == [0, 3, 7] and a.cu_cpu.tolist() == [0, 3, 7]
    assert b.cu.tolist() == [0, 2] and c.tolist() == [5, 6]
