"""One native call per step for Llama-family models whose projections all run natively.

`FusedDecode` gathers, once, each layer's packed weights and norm weights into the structures that
kernels/decode_step.c reads, and per step hands it the step's metadata and KV caches. It applies to a
step only where the module path would run the very same kernels in the same order: the native
element-wise kernels (the cpu_paged backend), every projection either quantised with the native
product or bfloat16 in AMX tiles (`AmxPackedKernel`), no q/k norm, fewer rows than the products'
thresholds for their few-row paths (each product takes the path, int8 or AMX, its kernel would for
that many rows), and decode rows only unless the model and its cache are bfloat16 and the prefill chunks
run on the AMX prefill attention. One-byte caches (int8, fp8) are written and read by their own kernels.
Where the native step finds that attention does not take the chunks, it says so before touching the
hidden states and the step runs layer by layer.
There its output is bit-identical to the module path's (tests/models/test_quantized_models.py,
tests/models/test_fast_paths.py); what it removes is the Python between some 300 kernel calls per step.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int32, c_int64, c_void_p
from typing import Any, Optional, Union

import torch

from tokenmill.attention.cpu_paged import CpuPagedBackend, CpuPagedMetadata
from tokenmill.kernels.cpu_kernels import ALWAYS_INT8, QLinearOp, prefill_attention_fits
from tokenmill.kernels import quantized
from tokenmill.layers.linear_kernels import AmxPackedKernel, QuantizedKernel


class _Projection(ctypes.Structure):
    _fields_ = [("amx_packed", c_void_p), ("cells", c_void_p), ("bias", c_void_p), ("amx_bias", c_void_p),
                ("rows", c_int64), ("cols", c_int64), ("bits", c_int32), ("scales", c_int32), ("amx", c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("kv_cache", c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", c_int64), ("hidden", c_int64), ("num_heads", c_int64), ("num_kv_heads", c_int64),
                ("head_dim", c_int64), ("intermediate", c_int64), ("num_blocks", c_int64), ("block_size", c_int64),
                ("max_blocks", c_int64), ("eps", c_float), ("scale", c_float), ("bf16", c_int32),
                ("positions", c_void_p), ("slots", c_void_p), ("num_decodes", c_int64), ("token_index", c_void_p),
                ("block_tables", c_void_p), ("context_lens", c_void_p), ("num_prefills", c_int64),
                ("prefill_chunks", c_void_p), ("prefill_tables", c_void_p), ("prefill_max_blocks", c_int64),
                ("cos", c_void_p), ("sin", c_void_p), ("final_norm", c_void_p), ("amx_from_rows", c_int64),
                ("kv_rows", c_int32), ("num_taps", c_int64), ("tap_layers", c_void_p), ("taps", c_void_p)]

# tm_step.kv_rows of each cache row format (attention/kv_quant.py; None: the compute dtype)
_KV_ROWS = {None: 0, "int8": 1, "fp8": 2}


def _llama_shaped(arch: Any) -> bool:
    """Whether every layer is the one tm_decode_step runs: full attention at the default scale (no window or
    attention chunk), SwiGLU, pre-norms only, dense MLPs, no q/k norm (nor Llama 4's L2 one), no score soft cap or
    attention sinks (tm_decode_step passes none), RoPE over whole heads on every layer (tm_decode_step rotates
    each)."""
    return (arch.attn_logit_softcap is None and not arch.attention_sinks and not arch.no_rope_layers
            and not arch.post_norms and not arch.has_chunked_layers and not arch.qk_l2_norm
            and not arch.qk_norm and not arch.has_sliding_layers and not arch.sandwich_norms
            and arch.hidden_act == "silu" and arch.attention_scale is None and arch.moe is None
            and arch.mla is None and not arch.attention_out_bias and arch.rotary_dim is None and arch.mamba is None
            and arch.gated_deltanet is None and not arch.attention_output_gate)


def _native_product(linear: Any) -> Union[QLinearOp, AmxPackedKernel, None]:
    kernel = getattr(linear, "kernel", None)
    if isinstance(kernel, AmxPackedKernel):
        return kernel
    if isinstance(kernel, QuantizedKernel) and getattr(kernel.native, "input_order", None) is None:
        return kernel.native  # the one-call step reads the cells as they are: no weight in activation order
    return None


def _projection(op: Union[QLinearOp, AmxPackedKernel]) -> _Projection:
    if isinstance(op, AmxPackedKernel):
        return _Projection(amx_packed=op.amx_weight.data_ptr(), amx_bias=op.amx_bias_pointer, rows=op.out_features,
                           cols=op.in_features, amx=1)
    return _Projection(None, op.cells_pointer, op.bias_pointer, op.amx_bias_pointer, op.rows, op.cols, op.bits,
                       op.scales, int(op.amx))


class FusedDecode:
    """The whole decoder stack of a decode step as one call of `tm_decode_step`."""

    def __init__(self, model: Any, kernels: Any, kv_rows: Optional[str] = None) -> None:
        self.model, self.lib = model, kernels.lib
        self.kv_rows = _KV_ROWS[kv_rows]
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.eps = first.input_layernorm.eps
        self.layers = (_Layer * len(model.layers))()
        self.all_amx = True
        # every product computes its rows alike at any row count: the step applies at any row count
        self.batch_invariant = True
        for struct, layer in zip(self.layers, model.layers):
            struct.input_norm = layer.input_layernorm.weight.data_ptr()
            struct.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for field, linear in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                  ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                op = _native_product(linear)
                setattr(struct, field, _projection(op))
                self.all_amx = self.all_amx and op.amx
                self.batch_invariant = self.batch_invariant and op.batch_invariant
        self.shape = dict(hidden=model.arch.hidden_size, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                          head_dim=attn.head_dim, intermediate=mlp.down_proj.in_features)
        self.cache_pointers: Optional[list[int]] = None
        self.tap_layers: tuple[int, ...] = ()
        self.tap_index: Optional[torch.Tensor] = None  # tap_layers as the native step reads them
        # the AMX prefill attention is bfloat16 only, caches included; the metadata has prefill chunks for it
        # only with AMX and a block size it takes
        self.prefills = (model.norm.weight.dtype == torch.bfloat16 and kv_rows is None
                         and prefill_attention_fits(head_dim=attn.head_dim))

    @staticmethod
    def build(model: Any, kv_rows: Optional[str] = None) -> Optional["FusedDecode"]:
        """A FusedDecode for `model` (a DecoderForCausalLM whose products and element-wise ops already run
        the kernels of its KernelChoice) over caches of `kv_rows` ("int8"/"fp8" one-byte rows, None: the
        compute dtype), or None where the conditions in the module docstring do not hold."""
        kernels = model.kernels
        if kernels is None or not _llama_shaped(model.arch) or not model.layers:
            return None
        for layer in model.layers:
            if not isinstance(layer.self_attn.backend, CpuPagedBackend):
                return None
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(_native_product(linear) is None for linear in linears):
                return None
            if layer.input_layernorm.eps != model.layers[0].input_layernorm.eps:
                return None
        return FusedDecode(model, kernels, kv_rows)

    def applies(self, metadata: Any, num_tokens: int) -> bool:
        """True for a step of fewer rows than the products' dequantising threshold (none when every product
        is batch-invariant) whose prefill chunks, if any, the AMX prefill attention takes (bfloat16;
        `prefill_chunks` are built only with AMX, where a batch-invariant backend puts every chunk in them;
        without AMX it makes every query a decode)."""
        below = (ALWAYS_INT8 if self.batch_invariant else
                 quantized.AMX_BELOW_ROWS if self.all_amx else quantized.DEQUANTIZE_FROM_ROWS)
        if not isinstance(metadata, CpuPagedMetadata) or num_tokens >= below:
            return False
        if metadata.every_chunk is not None and not self.prefills:
            CpuPagedBackend.add_query_decodes(metadata)  # as the module path's layers attend them
        elif metadata.prefills or metadata.every_chunk is not None:
            return self.prefills and metadata.prefill_chunks is not None
        return metadata.decode_token_index is not None and metadata.decode_token_index.numel() == num_tokens

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: CpuPagedMetadata, tap_layers: tuple[int, ...] = ()
                 ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Embeddings [T, hidden] -> (final-normed hidden states [T, hidden], computed in place; EAGLE-3's taps
        [T, len(tap_layers) x hidden], the residual stream entering each of `tap_layers` (ascending), as the
        module path concatenates them; None without tap_layers), or None where the native step did not take
        the step's prefill chunks (the caller runs the module path)."""
        pointers = [cache.data_ptr() for cache in kv_caches]
        if pointers != self.cache_pointers:
            for struct, pointer in zip(self.layers, pointers):
                struct.kv_cache = pointer
            self.cache_pointers = pointers
        _, num_blocks, _, block_size, _ = kv_caches[0].shape
        (rotary,) = self.model.rotary.tables.values()
        step = _Step(num_tokens=hidden.shape[0], num_blocks=num_blocks, block_size=block_size, eps=self.eps,
                     scale=self.shape["head_dim"] ** -0.5, bf16=int(hidden.dtype == torch.bfloat16),
                     positions=positions.data_ptr(), slots=metadata.slots.data_ptr(),
                     cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(),
                     final_norm=self.model.norm.weight.data_ptr(),
                     amx_from_rows=quantized.AMX_FROM_ROWS if hidden.dtype == torch.bfloat16 else 0,
                     kv_rows=self.kv_rows, **self.shape)
        if metadata.decode_token_index is not None:
            tables = metadata.decode_tables_i32
            step.num_decodes, step.token_index = metadata.decode_token_index.numel(), metadata.decode_token_index.data_ptr()
            step.block_tables, step.context_lens, step.max_blocks = tables.data_ptr(), metadata.decode_lens.data_ptr(), tables.shape[1]
        if metadata.prefill_chunks is not None and (metadata.prefills or self.prefills):
            step.num_prefills, step.prefill_chunks = metadata.prefill_chunks.shape[1], metadata.prefill_chunks.data_ptr()
            step.prefill_tables, step.prefill_max_blocks = metadata.prefill_tables.data_ptr(), metadata.prefill_tables.shape[1]
        taps = None
        if tap_layers:
            if tap_layers != self.tap_layers:
                self.tap_layers, self.tap_index = tap_layers, torch.tensor(tap_layers, dtype=torch.int64)
            taps = hidden.new_empty(hidden.shape[0], len(tap_layers) * hidden.shape[1])
            step.num_taps, step.tap_layers, step.taps = len(tap_layers), self.tap_index.data_ptr(), taps.data_ptr()
        hidden = hidden.contiguous()
        if self.lib.tm_decode_step(hidden.data_ptr(), self.layers, len(self.layers), ctypes.byref(step)):
            return None
        return hidden, taps
