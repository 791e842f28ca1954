"""The batch-invariant product of float weights (kernels/dense_kernels.c): as exact as a float32 matmul,
and each row's result the same whatever else is in the product, on every instruction-set level."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.linear_kernels import InvariantDenseKernel, make_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_rest_of_the_product(kernels, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(75, 200).to(dtype), torch.randn(75)  # 75 outputs: a partial panel of 16
    packed = kernels.dense_pack(weight)
    x = torch.randn(200, 200).to(dtype)
    together = kernels.dense_linear(x, packed, 75, bias)
    expected = F.linear(x.float(), weight.float(), bias)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(together.float(), expected, rtol=tolerance, atol=10 * tolerance)
    for rows in (1, 2, 5, 6, 7, 13, 97, 199):
        assert torch.equal(kernels.dense_linear(x[:rows], packed, 75, bias), together[:rows]), rows
    assert torch.equal(kernels.dense_linear(x[150:151], packed, 75, bias), together[150:151])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_gives_the_same_numbers(kernels_of_every_level, dtype):
    """One chain of fused multiply-adds per output in every build: the levels (and, under `make test-arm`, the
    aarch64 build) agree to the bit."""
    if len(kernels_of_every_level) < 2:
        pytest.skip("this CPU runs only one instruction-set level")
    torch.manual_seed(1)
    weight, x = torch.randn(40, 96).to(dtype), torch.randn(9, 96).to(dtype)
    results = {name: k.dense_linear(x, k.dense_pack(weight), 40, None) for name, k in kernels_of_every_level.items()}
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values()), list(results)


def test_batch_invariant_layers_take_it(kernels):
    weight = torch.randn(24, 64)
    kernel = make_kernel(weight, None, packed=False, native=kernels, batch_invariant=True)
    assert isinstance(kernel, InvariantDenseKernel)
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(kernel(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="contiguous rows|packed"):
        kernels.dense_linear(torch.randn(2, 32), kernel.packed, 24, None)
