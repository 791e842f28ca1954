"""layers/invariant_ops.py: an element-wise gate's bits for an element do not depend on the tensor's size or on where
the element sits in it (PyTorch's scalar tail loop differs from its vector loop in the last bit on AVX2)."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.invariant_ops import elementwise


@pytest.mark.parametrize("function", [torch.sigmoid, F.silu, F.softplus], ids=["sigmoid", "silu", "softplus"])
def test_an_elements_bits_are_the_same_at_any_size_and_place(function):
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    whole = elementwise(function, values)
    torch.testing.assert_close(whole, function(values))
    for count in range(1, 70, 3):
        for start in range(0, 64, 7):
            part = values[start:start + count].clone().view(count, 1)
            assert torch.equal(elementwise(function, part).view(-1), whole[start:start + count]), (count, start)
