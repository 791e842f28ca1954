"""Quantised weights off the CPU: dequantised once, on the first call, then multiplied as dense weights
(the CPU keeps its per-call reference and native kernels)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import linear_kernels
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.linear_kernels import QuantizedKernel, dequantizes_once
from tokenmill.kernels.quantized import QuantizedWeight, quantize


def test_off_the_cpu_weights_are_dequantised_once_only_without_product_kernels():
    assert not dequantizes_once(torch.device("cpu"), None)
    assert dequantizes_once(torch.device("cuda", 1), None) and dequantizes_once(torch.device("meta"), None)
    assert not dequantizes_once(torch.device("cuda"), object())  # Triton products multiply it packed


def _counting_dequantize(monkeypatch) -> list[torch.dtype]:
    """The dtypes of every dequantisation of a whole weight (`dequantize` and the reference's stored-order
    one both go through `dequantize_stored`)."""
    calls: list[torch.dtype] = []
    original = QuantizedWeight.dequantize_stored

    def counted(self, dtype=torch.float32):
        calls.append(dtype)
        return original(self, dtype)

    monkeypatch.setattr(QuantizedWeight, "dequantize_stored", counted)
    return calls


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_off_cpu_quantised_linear_dequantises_once(monkeypatch, caplog, fmt):
    monkeypatch.setattr(linear_kernels, "dequantizes_once", lambda device, native: True)  # as on CUDA
    monkeypatch.setattr(QuantizedKernel, "_dequantized_logged", False)
    torch.manual_seed(0)
    weights = [quantize(torch.randn(48, 96), fmt) for _ in range(2)]
    bias = torch.randn(48).to(torch.bfloat16)
    expected = [w.dequantize(torch.bfloat16) for w in weights]
    calls = _counting_dequantize(monkeypatch)
    kernels = [QuantizedKernel(w, bias, native=None) for w in weights]  # no product kernels given
    assert all(k.native is None for k in kernels)
    with caplog.at_level(logging.INFO, logger=linear_kernels.__name__):
        for rows in (1, 5, 40, 3):  # int8-product and dequantising row counts alike
            x = torch.randn(2, rows, 96).to(torch.bfloat16)
            for kernel, weight in zip(kernels, expected):
                torch.testing.assert_close(kernel(x), F.linear(x, weight, bias), rtol=0, atol=0)
    assert calls == [torch.bfloat16] * 2 and all(k.weight is None for k in kernels)
    assert sum("dequantised once to bfloat16 on cpu" in r.message for r in caplog.records) == 1


def test_a_layer_built_for_a_non_cpu_device_multiplies_a_dense_weight(monkeypatch):
    monkeypatch.setattr(linear_kernels, "dequantizes_once", lambda device, native: True)
    torch.manual_seed(1)
    layer = ColumnParallelLinear(64, 32)
    layer.quantized, layer.weight = quantize(torch.randn(32, 64), "int4"), None
    expected = layer.quantized.dequantize(torch.float32)
    calls = _counting_dequantize(monkeypatch)
    layer.use_kernel(packed=False, native=None)
    for rows in (1, 30, 2):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, expected), rtol=0, atol=0)
    assert calls == [torch.float32]


def test_cpu_weights_keep_the_per_call_reference(monkeypatch):
    weight = quantize(torch.randn(16, 32), "int8")
    calls = _counting_dequantize(monkeypatch)
    kernel = QuantizedKernel(weight, None, native=None)
    for _ in range(3):
        kernel(torch.randn(30, 32))
    assert len(calls) == 3 and kernel.dense is None


def test_cuda_multiplies_on_tritons_products_unless_dense_is_asked():
    """Under auto, a CUDA model on the Triton backend gets Triton's products (quantised weights stay packed,
    experts fused); --linear-kernel dense keeps the references (dequantised once, experts one by one)."""
    from types import SimpleNamespace

    from tokenmill.config import ModelConfig
    from tokenmill.layers.triton_products import TritonProducts
    from tokenmill.worker.model_setup import choose_kernels

    cuda, triton_backend = torch.device("cuda"), SimpleNamespace(on_triton=True)
    for asked, expected in (("auto", TritonProducts), ("triton", TritonProducts), ("dense", type(None))):
        choice = choose_kernels(ModelConfig(linear_kernel=asked), cuda, torch.bfloat16, triton_backend, None,
                                False, True, True)
        assert type(choice.native) is expected and not choice.packed and not choice.fused_decode
