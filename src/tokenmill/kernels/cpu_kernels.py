"""Load and call the C kernels: cpu_kernels.c, decode_attention.c, decode_attention_q8.c, prefill_attention.c,
quant_kernels.c, amx_kernels.c, decode_step.c and dense_kernels.c.

The library of this process's instruction-set level (kernels/isa.py) is built on first use
(kernels/build.py) and loaded with ctypes; ctypes drops the GIL during each call. When it cannot be
built or loaded, `cpu_kernels()` says why in a warning and returns None, and the engine keeps the
PyTorch reference ops (TOKENMILL_KERNELS=required makes that an error, =off skips the kernels). Every
wrapper checks what the C code relies on (dtype, device, layout) and raises ValueError otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from tokenmill import envs
from tokenmill.core.kv_spec import QUANTIZED_SCALE_BYTES
from tokenmill.kernels.build import KernelBuildError, built_library
from tokenmill.kernels.isa import IsaLevel, chosen_level, level_has
from tokenmill.kernels import quantized

if TYPE_CHECKING:
    from tokenmill.kernels.quantized import QuantizedWeight

logger = logging.getLogger(__name__)

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "tm_decode_attention": [_P] * 7 + [_I64] * 9 + [_F, _I64, _I64, _F, _P, _INT],
    "tm_decode_attention_q8": [_P] * 7 + [_I64] * 9 + [_F, _I64, _I64, _F, _P, _INT, _INT],
    "tm_cache_write": [_P] * 5 + [_I64] * 6 + [_INT],
    "tm_cache_write_q8": [_P] * 5 + [_I64] * 6 + [_INT, _INT],
    "tm_add_rms_norm": [_P] * 4 + [_I64, _I64, _F, _INT],
    "tm_silu_mul": [_P, _P, _I64, _I64, _INT],
    "tm_gelu_tanh_mul": [_P, _P, _I64, _I64, _INT],
    "tm_rope": [_P] * 4 + [_I64] * 4 + [_INT],
    "tm_qcells_pack": [_P] * 5 + [_I64] * 2 + [_INT] * 2,
    "tm_qlinear": [_P] * 4 + [_I64] * 5 + [_INT] * 3,
    "tm_quantize_activations": [_P] * 4 + [_I64] * 3 + [_INT],
    "tm_dequantize": [_P, _P, _I64, _P] + [_I64] * 3 + [_INT] * 3,
    "tm_decode_step": [_P, _P, _I64, _P],
    "tm_amx_pack": [_P, _P, _I64, _I64],
    "tm_amx_linear": [_P] * 4 + [_I64] * 5,
    "tm_amx_qlinear": [_P] * 4 + [_I64] * 5 + [_INT, _INT],
    "tm_prefill_attention": [_P] * 8 + [_I64] * 7 + [_F],
    "tm_dense_pack": [_P, _P, _I64, _I64, _INT],
    "tm_dense_linear": [_P] * 4 + [_I64] * 5 + [_INT],
}
# The features a library was compiled with (tm_compiled_features' bits), as cpuinfo names them.
COMPILED_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")
_lock = threading.Lock()
_loaded: dict[str, "CpuKernels"] = {}
_failed: dict[str, Exception] = {}
# Bounds the scratch matrix of the many-row quantised product. Whole SmolLM2 projections (up to
# 3.5 MB) in one matmul measured 0.69 ms against 1.46 ms in 1 MB tiles (oneDNN reorders per call).
_DEQUANTIZED_TILE_BYTES = 8 << 20
# QLinearOp.int8_below where the int8 products take every row count
ALWAYS_INT8 = 1 << 62
# amx_kernels.c multiplies 32 input features per tile step
AMX_FEATURE_TILE = 32
# The shapes prefill_attention.c takes (it returns -1 on others): head_dim a multiple of 32 up to 256,
# block_size a multiple of 16.
PREFILL_HEAD_DIM_STEP, PREFILL_MAX_HEAD_DIM, PREFILL_BLOCK_STEP = 32, 256, 16


def prefill_attention_fits(head_dim: Optional[int] = None, block_size: Optional[int] = None) -> bool:
    """Whether the AMX prefill attention takes this head size and/or cache block size."""
    return ((head_dim is None or (head_dim % PREFILL_HEAD_DIM_STEP == 0 and head_dim <= PREFILL_MAX_HEAD_DIM))
            and (block_size is None or block_size % PREFILL_BLOCK_STEP == 0))


def int8_rows_below(level: IsaLevel, amx: bool, dtype: torch.dtype) -> int:
    """Input rows below which a quantised product of `dtype` inputs takes the int8 dot products, for
    kernels of `level` (`amx`: their AMX tiles are usable): `quantized.int8_product_below`, except
    every row count for bfloat16 where the level has no native bfloat16 matmul (there the int8 products
    measured 4-7x faster than dequantising for PyTorch's emulated one at 24-1024 rows,
    docs/benchmarks.md)."""
    if dtype == torch.bfloat16 and not level_has(level, "avx512_bf16"):
        return ALWAYS_INT8
    return quantized.int8_product_below(amx and dtype == torch.bfloat16)


def load_kernels(level: IsaLevel) -> "CpuKernels":
    """The kernels built for `level` (built on first use, then kept for the process). Raises
    KernelBuildError or OSError when they cannot be built or loaded."""
    with _lock:
        if level.name not in _loaded:
            _loaded[level.name] = CpuKernels(ctypes.CDLL(str(built_library(level))), level)
        return _loaded[level.name]


def cpu_kernels() -> Optional["CpuKernels"]:
    """The kernels of this process's level (`isa.chosen_level()`), or None: with TOKENMILL_KERNELS=off,
    or, with a warning carrying the compiler's or loader's message, when they cannot be built or loaded
    (TOKENMILL_KERNELS=required makes that a RuntimeError)."""
    mode = envs.kernels_mode()
    if mode == "off":
        return None
    level = chosen_level()
    failure = _failed.get(level.name)
    if failure is None:
        try:
            return load_kernels(level)
        except (OSError, KernelBuildError) as exc:
            failure = _failed[level.name] = exc  # not retried: a failed build costs seconds each time
            if mode != "required":
                logger.warning("native CPU kernels unavailable, running on the PyTorch ops instead (slower: "
                               "quantised weights are dequantised per product, attention takes the reference "
                               "backend): %s", exc)
    if mode == "required":
        raise RuntimeError(f"TOKENMILL_KERNELS=required, but the {level.name} kernels failed: {failure}") from failure
    return None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _planes(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of a [planes, blocks, kv_heads, block_size, head_dim] cache's keys and values: the first
    and the last plane (one plane: the keys are the values)."""
    return _ptr(kv_cache), _ptr(kv_cache[-1])


def _storage_flag(*tensors: torch.Tensor) -> int:
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"CPU kernels take float32 or bfloat16, got {dtype}")
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError("CPU kernels need CPU tensors of one dtype")
    return int(dtype == torch.bfloat16)


class CpuKernels:
    """Typed wrappers over the C functions."""

    def __init__(self, lib: ctypes.CDLL, level: IsaLevel) -> None:
        self.level = level
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.tm_dequantize.restype = _INT  # how many requested rows were outside the weight
        lib.tm_prefill_attention.restype = _INT  # -1: not supported here, nothing done
        lib.tm_decode_step.restype = _INT  # -1: the prefill attention did not take the chunks, hidden untouched
        lib.tm_qcells_bytes.argtypes, lib.tm_qcells_bytes.restype = [_I64, _I64, _INT, _INT], _I64
        lib.tm_dense_packed_values.argtypes, lib.tm_dense_packed_values.restype = [_I64, _I64, _INT], _I64
        self.lib = lib
        lib.tm_amx_init.argtypes, lib.tm_amx_init.restype = [], _INT
        # AMX bfloat16 tiles: compiled in (the CPU has them) and the OS lets this process use them
        self.amx = lib.tm_amx_init() == 0
        lib.tm_compiled_features.argtypes, lib.tm_compiled_features.restype = [], _INT
        bits = lib.tm_compiled_features()
        self.compiled_features = tuple(name for i, name in enumerate(COMPILED_FEATURES) if bits >> i & 1)
        lib.tm_set_num_threads.argtypes, lib.tm_set_num_threads.restype = [_I64], None
        lib.tm_max_threads.argtypes, lib.tm_max_threads.restype = [], _I64
        lib.tm_bind_threads.argtypes, lib.tm_bind_threads.restype = [_P, _I64], _INT
        lib.tm_thread_cpus.argtypes, lib.tm_thread_cpus.restype = [_P, _I64], _I64

    def bind_threads(self, cpus: Sequence[int]) -> bool:
        """Run len(cpus) threads from the calling thread's next parallel region on, thread i pinned to cpus[i];
        False where the OS refused a CPU (kernels/threads.c)."""
        order = torch.tensor(list(cpus), dtype=torch.int32)
        return self.lib.tm_bind_threads(order.data_ptr(), len(order)) == 0

    def thread_cpus(self) -> list[int]:
        """The calling thread's OpenMP team: for each thread the one CPU it is pinned to, -1 where it floats."""
        out = torch.empty(1024, dtype=torch.int32)
        size = self.lib.tm_thread_cpus(out.data_ptr(), out.numel())
        return out[:min(size, out.numel())].tolist()

    def decode_attention(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                         token_index: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, window: int = 0, softcap: float = 0.0,
                         sinks: Optional[torch.Tensor] = None, chunk: int = 0) -> None:
        """out[token_index[b]] = attention of q[token_index[b]] over sequence b's first context_lens[b]
        cached tokens, or with window > 0 over the last `window` of them only (the blocks before those are
        not read); with chunk > 0 (Llama 4's chunked local attention) from the start of the query's chunk of
        `chunk` positions only. q, out: [T, heads, head_dim] (head_dim contiguous); kv_cache: [planes, blocks,
        kv_heads, block_size, head_dim] contiguous (values in the last plane) of q's dtype, or a one-byte cache (int8,
        or fp8 as uint8) of rows head_dim + 4 (attention/kv_quant.py, read by decode_attention_q8.c);
        block_tables int32 [B, max_blocks]; context_lens int32 [B]. softcap > 0: each score becomes
        softcap * tanh(score / softcap) before the softmax (Gemma 2's attention soft-capping). sinks (GPT-OSS's
        attention sinks): float32 [heads], contiguous; head h's softmax denominator also holds exp(sinks[h])."""
        quantized = kv_cache.dtype in (torch.int8, torch.uint8)
        bf16 = _storage_flag(out, q, *([] if quantized else [kv_cache]))
        _, _, num_kv_heads, block_size, width = kv_cache.shape
        head_dim = width - QUANTIZED_SCALE_BYTES if quantized else width
        if q.shape[2] != head_dim:
            raise ValueError(f"decode_attention: the cache's rows ({width} {kv_cache.dtype}) do not hold "
                             f"head_dim {q.shape[2]}")
        if q.stride(2) != 1 or out.stride(2) != 1 or out.stride(1) != head_dim or not kv_cache.is_contiguous():
            raise ValueError("decode_attention needs contiguous head rows, a contiguous out row and cache")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or token_index.dtype != torch.int64:
            raise ValueError("decode_attention takes int32 block tables and lengths, int64 token indices")
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                  or sinks.shape != (q.shape[1],)):
            raise ValueError(f"decode_attention takes float32 sinks, one per head ({q.shape[1]}), contiguous")
        args = (_ptr(out), _ptr(q), *_planes(kv_cache), _ptr(token_index), _ptr(block_tables),
                _ptr(context_lens), block_tables.shape[0], q.shape[1], num_kv_heads, head_dim, block_size,
                block_tables.shape[1], q.stride(0), q.stride(1), out.stride(0), scale, window, chunk, softcap,
                None if sinks is None else _ptr(sinks), bf16)
        if quantized:
            self.lib.tm_decode_attention_q8(*args, int(kv_cache.dtype == torch.uint8))
        else:
            self.lib.tm_decode_attention(*args)

    def cache_write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                    slots: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] (rows may be strided, heads contiguous) at `slots` (int64);
        v is None for a key-only (one-plane) cache, and only then. A one-byte cache (int8, or fp8 as uint8)
        gets the rows quantised as attention/kv_quant.write_tokens quantises them, bit for bit."""
        if kv_cache.dtype in (torch.int8, torch.uint8):
            self._cache_write_one_byte(kv_cache, k, v, slots)
            return
        _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
        bf16 = _storage_flag(kv_cache, k, *([] if v is None else [v]))
        if (v is None) != (kv_cache.shape[0] == 1):
            raise ValueError("cache_write takes values for a two-plane cache and none for a key-only one")
        if not kv_cache.is_contiguous() or k.stride(1) != head_dim or k.stride(2) != 1 or slots.dtype != torch.int64 \
                or (v is not None and (v.stride(1) != head_dim or v.stride(2) != 1)):
            raise ValueError("cache_write needs a contiguous cache, contiguous heads and int64 slots")
        self.lib.tm_cache_write(*_planes(kv_cache), _ptr(k), None if v is None else _ptr(v), _ptr(slots),
                                k.shape[0], num_kv_heads, block_size, head_dim, k.stride(0),
                                k.stride(0) if v is None else v.stride(0), bf16)

    def _cache_write_one_byte(self, kv_cache: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                              slots: torch.Tensor) -> None:
        planes, _, num_kv_heads, block_size, width = kv_cache.shape
        head_dim = width - QUANTIZED_SCALE_BYTES
        if planes != 2 or v is None:
            raise ValueError("a one-byte cache has a key plane and a value plane")
        if not kv_cache.is_contiguous() or k.stride(1) != head_dim or k.stride(2) != 1 or v.stride(1) != head_dim \
                or v.stride(2) != 1 or slots.dtype != torch.int64 or k.shape[2] != head_dim:
            raise ValueError("cache_write needs a contiguous cache, contiguous heads of its head_dim, int64 slots")
        self.lib.tm_cache_write_q8(*_planes(kv_cache), _ptr(k), _ptr(v), _ptr(slots), k.shape[0], num_kv_heads,
                                   block_size, head_dim, k.stride(0), v.stride(0), _storage_flag(k, v),
                                   int(kv_cache.dtype == torch.uint8))

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """norm(x) or, with a residual, residual += x in place and norm(residual). x: [T, hidden] contiguous."""
        bf16 = _storage_flag(x, weight, *([residual] if residual is not None else []))
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            raise ValueError("add_rms_norm needs contiguous tensors")
        out = torch.empty_like(x)
        self.lib.tm_add_rms_norm(_ptr(out), _ptr(x), None if residual is None else _ptr(residual), _ptr(weight),
                                 x.shape[0], x.shape[1], eps, bf16)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a contiguous [T, 2 * inner] input."""
        return self._gated_mul(self.lib.tm_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (GeGLU) of a contiguous [T, 2 * inner] input."""
        return self._gated_mul(self.lib.tm_gelu_tanh_mul, gate_up)

    @staticmethod
    def _gated_mul(kernel: Any, gate_up: torch.Tensor) -> torch.Tensor:
        bf16 = _storage_flag(gate_up)
        if not gate_up.is_contiguous():
            raise ValueError("a gated activation needs a contiguous input")
        inner = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inner)
        kernel(_ptr(out), _ptr(gate_up), gate_up.shape[0], inner, bf16)
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, head_dim] (heads contiguous, rows strided) in place; cos/sin are the
        float32 [max_positions, head_dim] tables, positions int64."""
        bf16 = _storage_flag(x)
        head_dim = x.shape[2]
        if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim > 512 or positions.dtype != torch.int64 \
                or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            raise ValueError("rope needs contiguous heads (head_dim <= 512), int64 positions, float32 tables")
        self.lib.tm_rope(_ptr(x), _ptr(positions), _ptr(cos), _ptr(sin), x.shape[0], x.shape[1], head_dim,
                         x.stride(0), bf16)

    def prefill_attention(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                          chunks: torch.Tensor, block_tables: torch.Tensor, scale: float) -> bool:
        """Causal attention of prefill chunks on AMX tiles into rows of out [T, heads, head_dim]
        (kernels/prefill_attention.c). q [T, heads, head_dim] (heads contiguous, rows strided) and
        kv_cache [planes, blocks, kv_heads, block_size, head_dim], bfloat16, the chunks' K/V already
        written; chunks int64 [3, P]: query starts, query lengths, context lengths; block_tables
        int32 [P, max_blocks]. False (nothing written) where the kernel does not apply: no AMX,
        head_dim not a multiple of 32 up to 256, block_size not a multiple of 16."""
        if q.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
            raise ValueError("prefill_attention takes bfloat16 q, out and cache")
        _, heads, head_dim = q.shape
        _, _, kv_heads, block_size, cache_dim = kv_cache.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous() or out.shape != q.shape \
                or not kv_cache.is_contiguous() or cache_dim != head_dim:
            raise ValueError("prefill_attention needs contiguous heads, a contiguous output and cache")
        if chunks.dtype != torch.int64 or chunks.dim() != 2 or chunks.shape[0] != 3 or not chunks.is_contiguous() \
                or block_tables.dtype != torch.int32 or not block_tables.is_contiguous() \
                or block_tables.shape[0] != chunks.shape[1]:
            raise ValueError("prefill_attention takes int64 chunks [3, P] and int32 block tables [P, max_blocks]")
        if not self.amx:
            return False
        done = self.lib.tm_prefill_attention(
            _ptr(out), _ptr(q), *_planes(kv_cache), _ptr(chunks[0]), _ptr(chunks[1]), _ptr(chunks[2]),
            _ptr(block_tables), block_tables.shape[1], chunks.shape[1], heads, kv_heads, block_size, head_dim,
            q.stride(0), scale)
        return done == 0

    def amx_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A bfloat16 weight [n, k] (k a multiple of 32) in the AMX tile layout `amx_linear` reads."""
        n, k = weight.shape
        if not self.amx or weight.dtype != torch.bfloat16 or k % AMX_FEATURE_TILE or weight.device.type != "cpu":
            raise ValueError("amx_pack needs AMX and a CPU bfloat16 weight with a multiple of 32 input features")
        weight = weight.contiguous()
        packed = torch.empty(-(-n // 32) * 32 * k, dtype=torch.bfloat16)
        self.lib.tm_amx_pack(_ptr(packed), _ptr(weight), n, k)
        return packed

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [m, k] bfloat16 (contiguous rows) times a weight from `amx_pack`, + bias (float32 [n])."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or packed.numel() != -(-out_features // 32) * 32 * k:
            raise ValueError("amx_linear takes bfloat16 rows and a weight packed for their width")
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        self.lib.tm_amx_linear(_ptr(out), _ptr(x), _ptr(packed), None if bias is None else _ptr(bias),
                               m, k, out_features, x.stride(0), out_features)
        return out

    def dense_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A float32 or bfloat16 weight [n, k] in the panel layout `dense_linear` reads (dense_kernels.c)."""
        _storage_flag(weight)
        n, k = weight.shape
        weight = weight.contiguous()
        bf16 = int(weight.dtype == torch.bfloat16)
        packed = torch.empty(self.lib.tm_dense_packed_values(n, k, bf16), dtype=weight.dtype)
        self.lib.tm_dense_pack(_ptr(packed), _ptr(weight), n, k, bf16)
        return packed

    def dense_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [m, k] (float32 or bfloat16, contiguous rows, the weight's dtype) times a weight from
        `dense_pack` (+ a float32 bias): each output one chain over k in order, whatever m is (fused
        multiply-adds, or bfloat16 pair dot products where the level has them: dense_kernels.c)."""
        bf16 = _storage_flag(x)
        m, k = x.shape
        if x.dtype != packed.dtype:
            raise ValueError(f"dense_linear takes inputs of the weight's dtype ({packed.dtype}), not {x.dtype}")
        if x.stride(1) != 1 or packed.numel() != self.lib.tm_dense_packed_values(out_features, k, bf16):
            raise ValueError("dense_linear takes contiguous rows and a weight packed for their width")
        if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features):
            raise ValueError("dense_linear takes a float32 bias of one value per output")
        out = torch.empty(m, out_features, dtype=x.dtype)
        self.lib.tm_dense_linear(_ptr(out), _ptr(x), _ptr(packed), None if bias is None else _ptr(bias), m, k,
                                 out_features, x.stride(0), out_features, bf16)
        return out

    def qlinear_op(self, weight: "QuantizedWeight", bias: Optional[torch.Tensor],
                   batch_invariant: bool = True) -> "QLinearOp":
        """The native product with a packed weight, its pointers bound once (see QLinearOp)."""
        return QLinearOp(self.lib, weight, bias, self.amx, self.level, batch_invariant)

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's own input quantisation of x [m, cols]: (q int8 [m, padded], dx float32 [m, blocks])."""
        bf16 = _storage_flag(x)
        m, cols = x.shape
        padded = quantized.padded_cols(cols)
        if x.stride(1) != 1:
            raise ValueError("quantize_activations needs contiguous rows")
        q = torch.empty(m, padded, dtype=torch.int8)
        dx = torch.empty(m, padded // 32)
        sums = torch.empty(m, padded // 32)
        self.lib.tm_quantize_activations(_ptr(q), _ptr(dx), _ptr(sums), _ptr(x), m, cols, x.stride(0), bf16)
        return q, dx


class QLinearOp:
    """x [..., cols] (float32 or bfloat16, CPU) -> x W^T + bias for one quantised weight, computed as
    `reference_linear` does (with `int8_below(x.dtype)`). `batch_invariant` (the default): by the int8
    dot-product kernel at every row count, so that a row's result never depends on how many rows share
    the product. Otherwise by the measured fastest path for the row count: with few input rows the int8
    kernel; with bfloat16 input on AMX, from `quantized.AMX_FROM_ROWS` rows by AMX tiles over
    dequantised panels; from there on by dequantising the weight (up to 8 MB of rows at a time) into a
    per-thread scratch buffer and one matmul per such tile. It repacks the weight once into the
    kernels' cell layout (kernels/quant_cells.h: 16 rows x 32 features per cell, so one vector load
    feeds 16 outputs) and keeps only that copy; it holds it and the bias, so the pointers it passes
    stay valid. A weight in activation order (`input_order`) keeps its stored column order: the input's
    features are gathered in that order before the kernels see them, and `dequantize` / `embedding` put
    the columns back in the inputs' order."""

    def __init__(self, lib: ctypes.CDLL, weight: "QuantizedWeight", bias: Optional[torch.Tensor], amx: bool,
                 level: IsaLevel, batch_invariant: bool = True) -> None:
        self.rows, self.cols = weight.shape
        self.level = level
        self.batch_invariant = batch_invariant
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (self.rows,)
                                 or not bias.is_contiguous()):
            raise ValueError("qlinear takes a contiguous float32 bias of one value per output")
        for part in (weight.data, weight.scale, weight.offset):
            if not part.is_contiguous() or part.device.type != "cpu":
                raise ValueError("qlinear needs a contiguous CPU weight")
        if weight.scale.dtype not in (torch.float16, torch.float32) or weight.offset.dtype != weight.scale.dtype:
            raise ValueError("qlinear takes float16 or float32 scales and offsets of one dtype")
        self.lib, self.bias = lib, bias
        # quantised widths are whole blocks of 32, as the tiles need; the tiles take part in no
        # batch-invariant product
        self.amx = amx and not batch_invariant
        self.format = weight.format
        self.bits = 8 if weight.format == "int8" else 4
        sub = weight.sub_scale
        if sub is not None and (self.bits != 8 or sub.dtype != torch.int8 or not sub.is_contiguous()):
            raise ValueError("qlinear takes contiguous int8 sub-scales with int8 weights only")
        # the cells' QS_ flags (kernels/quant_cells.h): 1 float16 scales and offsets, 2 sub-scales
        self.scales = int(weight.scale.dtype == torch.float16) | (2 if sub is not None else 0)
        self.cells = torch.empty(lib.tm_qcells_bytes(self.rows, self.cols, self.bits, self.scales), dtype=torch.uint8)
        lib.tm_qcells_pack(_ptr(self.cells), _ptr(weight.data), _ptr(weight.scale), _ptr(weight.offset),
                           None if sub is None else _ptr(sub), self.rows, self.cols, self.bits, self.scales)
        self.cells_pointer = _ptr(self.cells)
        self.input_order = weight.input_order
        self.bias_pointer = None if bias is None else _ptr(bias)
        self.bias_by_dtype = {} if bias is None else {torch.float32: bias, torch.bfloat16: bias.bfloat16()}
        # the AMX product adds the bias in float32 before rounding, as the matmul does with a bfloat16 bias
        self.amx_bias = None if bias is None else self.bias_by_dtype[torch.bfloat16].float()
        self.amx_bias_pointer = None if bias is None else _ptr(self.amx_bias)

    def int8_below(self, dtype: torch.dtype) -> int:
        """Input rows below which inputs of `dtype` take the int8 path (`int8_rows_below`; every row
        count when batch-invariant)."""
        return ALWAYS_INT8 if self.batch_invariant else int8_rows_below(self.level, self.amx, dtype)

    def dequantize(self, first: int, count: int, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Weight rows [first, first + count) as a [count, cols] matrix of `dtype` (float32 or bfloat16),
        valued as `QuantizedWeight.dequantize` values them."""
        if not (0 <= first and count >= 0 and first + count <= self.rows):
            raise ValueError(f"rows [{first}, {first + count}) are not within the weight's {self.rows}")
        if out is None:
            out = torch.empty(count, self.cols, dtype=dtype)
        self.lib.tm_dequantize(_ptr(out), self.cells_pointer, first, None, count, self.rows, self.cols, self.bits,
                               self.scales, _storage_flag(out))
        return out if self.input_order is None else self._in_input_order(out)

    def _in_input_order(self, stored: torch.Tensor) -> torch.Tensor:
        """Rows of stored columns [..., cols] with their columns in the inputs' order."""
        rows = torch.empty_like(stored)
        rows[..., self.input_order] = stored
        return rows

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64) dequantised to `dtype`: an embedding lookup in the packed table, as
        `QuantizedWeight.embedding` computes it."""
        ids = ids.contiguous()
        if ids.dtype != torch.int64:
            raise ValueError(f"embedding ids must be int64, got {ids.dtype}")
        if dtype not in (torch.float32, torch.bfloat16):
            return self.embedding(ids, torch.float32).to(dtype)
        out = torch.empty(*ids.shape, self.cols, dtype=dtype)
        outside = self.lib.tm_dequantize(_ptr(out), self.cells_pointer, 0, _ptr(ids), ids.numel(), self.rows,
                                         self.cols, self.bits, self.scales, _storage_flag(out))
        if outside:
            raise ValueError(f"{outside} embedding ids are outside [0, {self.rows})")
        return out if self.input_order is None else self._in_input_order(out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply."""
        bf16 = _storage_flag(x)
        rows, cols = self.rows, self.cols
        if x.shape[-1] != cols:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes {cols}")
        flat = x.reshape(-1, cols)
        if self.input_order is not None:
            flat = flat[:, self.input_order]
        m = flat.shape[0]
        if self.amx and bf16 and quantized.AMX_FROM_ROWS <= m < quantized.AMX_BELOW_ROWS:
            if flat.stride(1) != 1:
                flat = flat.contiguous()
            out = torch.empty((m, rows), dtype=x.dtype)
            self.lib.tm_amx_qlinear(_ptr(out), _ptr(flat), self.cells_pointer, self.amx_bias_pointer, m, cols, rows,
                                    flat.stride(0), rows, self.bits, self.scales)
        elif m >= self.int8_below(x.dtype):
            tile = max(1, _DEQUANTIZED_TILE_BYTES // (cols * x.element_size()))
            bias = self.bias_by_dtype.get(x.dtype)
            parts = []
            for first in range(0, rows, tile):
                count = min(tile, rows - first)
                scratch = scratch_buffer(count * cols, x.dtype).view(count, cols)
                weight = self.dequantize(first, count, x.dtype, scratch)
                parts.append(torch.nn.functional.linear(flat, weight, None if bias is None else bias[first:first + count]))
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        else:
            if flat.stride(1) != 1:
                flat = flat.contiguous()
            out = torch.empty((m, rows), dtype=x.dtype)
            self.lib.tm_qlinear(_ptr(out), _ptr(flat), self.cells_pointer, self.bias_pointer, m, cols, rows,
                                flat.stride(0), rows, self.bits, self.scales, bf16)
        return out.view(*x.shape[:-1], rows)


_scratch_space = threading.local()


def scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable buffer of at least `numel` elements of `dtype` for this thread (grown, never shrunk).
    A caller is done with it when it returns: the products that use it do not keep it."""
    buffers = getattr(_scratch_space, "buffers", None)
    if buffers is None:
        buffers = _scratch_space.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]
