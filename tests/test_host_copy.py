"""to_device_many: one packed copy gives back every array with its dtype, shape and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoinfer.host_copy import to_device_many

DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_round_trip(device):
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-2**40, 2**40, size=7),  # int64, odd length: the next array must still be aligned
        rng.integers(0, 1000, size=(3, 5)).astype(np.int32),  # 2-D
        np.zeros(0, dtype=np.int64),  # empty (no pending rows)
        rng.standard_normal(3).astype(np.float32),
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, 1],  # non-contiguous
        np.array([[4, 9]], dtype=np.int64).reshape(-1, 2),
    ]
    out = to_device_many(arrays, torch.device(device))
    assert len(out) == len(arrays)
    for tensor, array in zip(out, arrays):
        assert tensor.device.type == device and tuple(tensor.shape) == array.shape
        assert tensor.dtype == {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}[array.dtype.type]
        assert np.array_equal(tensor.cpu().numpy(), array)


def test_other_dtypes_are_rejected():
    with pytest.raises(TypeError, match="int64, int32 or float32"):
        to_device_many([np.zeros(3, dtype=np.float64)], torch.device("cpu"))
