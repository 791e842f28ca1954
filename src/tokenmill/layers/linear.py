"""Linear layers written for tensor-parallel sharding.

Each layer holds only its rank's shard (`TPGroup`) and knows how to cut that shard out of a full
checkpoint tensor (`weight_loader`). Column-parallel layers split output features (no communication);
row-parallel layers split input features and all-reduce their partial outputs. At one rank the shard
is the whole tensor and nothing is communicated.

A layer's weight may instead be kept quantised (kernels/quantized.py): when a checkpoint part arrives
quantised, or `quantize_to` names a format, the parts are gathered until every row is there and then
packed into one `QuantizedWeight`; the float parameter is dropped without ever being written. Parts in
activation order whose input orders differ (no GPTQ tool writes fused projections so: they share one
input) cannot share one packed weight and are dequantised into the float parameter instead, with a log line;
so are the row-parallel shards (several ranks) of a weight in activation order. W8A8 weights
(kernels/w8a8.py: an FP8 checkpoint's parts, or `quantize_to` "fp8"; a compressed-tensors int8 W8A8
checkpoint's parts) are gathered the same way into one `W8A8Weight`, multiplied by `W8A8Kernel`
(layers/w8a8_linear.py) where it takes them, else (int8 on the CPU's products) as the packed int8 weight
the checkpoint would have loaded as before.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear_kernels import DenseKernel, LinearKernel, QuantizedKernel, make_kernel
from tokenmill.kernels import w8a8
from tokenmill.kernels.w8a8 import W8A8Weight
from tokenmill.kernels.quantized import QuantizedWeight, cat_rows, quantize
from tokenmill.layers.w8a8_linear import W8A8Kernel, multiplies_w8a8
from tokenmill.parallel.group import TPGroup

logger = logging.getLogger(__name__)

_SINGLE = TPGroup.single()


class _ShardedLinear(nn.Module):
    """y = x W^T (+ b) over this rank's shard of W."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel: Optional[LinearKernel] = None
        self.quantize_to: Optional[str] = None  # set before loading: quantise float parts to this format
        self.quantized: Optional[QuantizedWeight | W8A8Weight] = None
        self._parts: dict[int, Any] = {}  # first row -> loaded part, until all rows have arrived
        self.lora: Any = None  # LoRADeltas (lora/layers.py) when the engine serves LoRA adapters

    @property
    def quantized_format(self) -> Optional[str]:
        """'int8', 'int4', 'fp8' or 'int8_w8a8' for a weight kept quantised (before or after `use_kernel`),
        else None."""
        if self.quantized is not None:
            return self.quantized.format
        return self.kernel.format if isinstance(self.kernel, (QuantizedKernel, W8A8Kernel)) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to the last dimension of x (plus the step's LoRA deltas, if any)."""
        y = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self._local_bias())
        if self.lora is not None and self.lora.state.active:
            y = self.lora.apply(x, y)
        return y

    def _local_bias(self) -> Optional[torch.Tensor]:
        """The bias this rank adds (all of it; a row-parallel layer adds it on rank 0 only, before the sum)."""
        return None if self.bias is None else self.bias.data

    def use_kernel(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: multiply through a kernel from now on. A packed kernel keeps its own copy
        of the weight, so the layer's is dropped (no more weights can be loaded into it). Quantised
        weights use `native` (CpuKernels) when given, else the PyTorch reference. `batch_invariant`: a
        row's result may not depend on the other rows of the product (layers/linear_kernels.py)."""
        bias = self._local_bias()
        if isinstance(self.quantized, W8A8Weight) and not multiplies_w8a8(self.quantized, native):
            self.quantized = self.quantized.to_packed_int8()  # int8 on the CPU's products: as before W8A8
        if isinstance(self.quantized, W8A8Weight):
            self.kernel, self.quantized = W8A8Kernel(self.quantized, bias, native, batch_invariant), None
            return
        if self.quantized is not None:
            self.kernel = QuantizedKernel(self.quantized, bias, native, batch_invariant)
            if self.kernel.native is not None or self.kernel.dequantize_once:
                self.quantized = None  # the kernel keeps its own copy (native, or dense once dequantised)
            return
        self.kernel = make_kernel(self.weight.data, bias, packed, native, batch_invariant)
        if not isinstance(self.kernel, DenseKernel):  # the kernel keeps its own copy
            self.weight = None

    def _place(self, param: nn.Parameter, first_row: int, part: Any) -> None:
        """Put a loaded part (float tensor or QuantizedWeight) at rows [first_row, ...) of `param`."""
        if param is not self.weight:  # the bias
            self._copy(param.data.narrow(0, first_row, part.shape[0]), part)
            return
        if part.shape[1] != self.in_features:
            raise ValueError(f"weight shape mismatch: checkpoint part {tuple(part.shape)}, "
                             f"model expects {self.in_features} input features")
        self._parts[first_row] = part
        # invariant: the parts never overlap, so a full row count means every row has arrived
        if sum(p.shape[0] for p in self._parts.values()) == self.out_features:
            parts = [self._parts[row] for row in sorted(self._parts)]
            self._parts = {}
            self._assemble(parts)

    def _assemble(self, parts: list) -> None:
        if self.quantize_to == "fp8" or (self.quantize_to is None and any(
                isinstance(p, W8A8Weight) and p.values is w8a8.FP8 for p in parts)):
            self.quantized = w8a8.cat_rows([w8a8.as_fp8(p) for p in parts]).to(self.weight.device)
            self.weight = None
            return
        if self.quantize_to is None and all(isinstance(p, W8A8Weight) for p in parts):  # int8 W8A8 parts
            self.quantized = w8a8.cat_rows(parts).to(self.weight.device)
            self.weight = None
            return
        # int8 W8A8 parts beside float ones, or asked in another format: the packed int8 weight (as before W8A8)
        parts = [p.to_packed_int8() if isinstance(p, W8A8Weight) and p.values is w8a8.INT8
                 else p.dequantize() if isinstance(p, W8A8Weight) else p for p in parts]  # requantised below
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        orders = [p.input_order for p in quantized if p.input_order is not None]
        if orders and (len(orders) < len(parts) or any(not torch.equal(o, orders[0]) for o in orders)):
            logger.info("fused projections whose input features come in different orders (GPTQ desc_act) are "
                        "dequantised to floats: one packed weight has one input order")
            parts = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
            quantized = []
        if not quantized and self.quantize_to is None:
            row = 0
            for part in parts:
                self._copy(self.weight.data.narrow(0, row, part.shape[0]), part)
                row += part.shape[0]
            return
        fmt = self.quantize_to
        if fmt is None:  # a quantised checkpoint: int4 only if every part is int4, else int8
            fmt = "int4" if len(quantized) == len(parts) and all(p.format == "int4" for p in quantized) else "int8"
        packed = cat_rows([p.to_format(fmt) if isinstance(p, QuantizedWeight) else quantize(p, fmt) for p in parts])
        self.quantized = packed.to(self.weight.device)
        self.weight = None

    @staticmethod
    def _copy(dest: torch.Tensor, source: Any) -> None:
        """Copy a float tensor, or a QuantizedWeight or W8A8Weight dequantised, into `dest`."""
        if tuple(dest.shape) != tuple(source.shape):
            raise ValueError(f"weight shape mismatch: checkpoint {tuple(source.shape)}, "
                             f"model expects {tuple(dest.shape)}")
        if isinstance(source, (QuantizedWeight, W8A8Weight)):
            source = source.dequantize(dest.dtype)
        dest.copy_(source)


class ColumnParallelLinear(_ShardedLinear):
    """Output features split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = _SINGLE) -> None:
        super().__init__(in_features, tp.shard(out_features, "output features"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of a full checkpoint tensor into `param`."""
        rows = param.shape[0]
        self._place(param, 0, loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate+up)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False, tp: TPGroup = _SINGLE) -> None:
        self.local_sizes = [tp.shard(size, "intermediate size") for size in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of projection number `shard_id` into its slice of `param`."""
        index = int(shard_id)  # type: ignore[arg-type]
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        self._place(param, offset, loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; query and KV heads split across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = _SINGLE) -> None:
        self.num_local_heads = tp.shard(num_heads, "attention heads")
        self.num_local_kv_heads = tp.shard(num_kv_heads, "KV heads")
        self.head_dim = head_dim
        out = (self.num_local_heads + 2 * self.num_local_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, bias, tp)
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's heads of the q, k or v checkpoint tensor (`shard_id`) into `param`."""
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        self._place(param, offset, loaded.narrow(0, rank * size, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused output into q, k, v."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_ShardedLinear):
    """The projection whose input is split across ranks (attention heads, intermediate features).

    Two ways to finish it (`tp.exact`):
    - exact (the default): gather the whole input on every rank, compute this rank's output features
      from whole rows of W, and gather the outputs. Every output element is the same dot product as
      at one rank, so any tensor-parallel size gives the single-rank result bit for bit.
    - partial sums (Megatron's): each rank multiplies its input features by its columns of W and the
      partial outputs are summed (all-reduce): fewer bytes, but a row's sum is split differently per
      size, and quantised activations turn those last-bit differences into visible ones.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = _SINGLE) -> None:
        self.gathers = tp.size > 1 and tp.exact
        if self.gathers:
            super().__init__(in_features, tp.shard(out_features, "hidden size"), bias, tp)
        else:
            super().__init__(tp.shard(in_features, "input features of a row-parallel projection"), out_features,
                             bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output on every rank."""
        if self.gathers:
            return self.tp.all_gather_last_dim(super().forward(self.tp.all_gather_last_dim(x)))
        return self.tp.all_reduce(super().forward(x))

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product alone, without the collective that finishes it: its output features of the
        whole input x (exact) or its partial sums of its slice of x. A MoE layer's split experts finish all
        their products with one collective (layers/moe.py)."""
        return super().forward(x)

    def _local_bias(self) -> Optional[torch.Tensor]:
        if self.tp.size > 1 and not self.gathers and not self.tp.is_driver:
            return None  # partial sums: the bias is added once, by rank 0
        return super()._local_bias()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's share of a full checkpoint tensor into `param`: its rows (exact), or its columns
        and the whole bias (partial sums)."""
        if self.gathers:
            rows = param.shape[0]
            self._place(param, 0, loaded.narrow(0, self.tp_rank * rows, rows))
            return
        if param.dim() == 1:
            self._copy(param.data, loaded)
            return
        cols = param.shape[1]
        if isinstance(loaded, QuantizedWeight) and loaded.input_order is not None and self.tp.size > 1:
            # activation order scatters a rank's input features over the stored groups, which then rarely
            # keep runs of 32 (QuantizedWeight.narrow refuses those): the shard is its exact float weight
            logger.info("a row-parallel shard of a weight in activation order (GPTQ desc_act) is dequantised "
                        "to floats")
            loaded = loaded.dequantize()
        self._place(param, 0, loaded.narrow(1, self.tp_rank * cols, cols))


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Optional[object] = None) -> None:
    """Copy a whole checkpoint tensor (a QuantizedWeight dequantised) into a replicated parameter."""
    _ShardedLinear._copy(param.data, loaded)
