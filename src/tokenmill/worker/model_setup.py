"""Building a loaded, ready-to-run model from a model source: backend, weights, kernels."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
from typing import Any, Iterator, Optional

import torch

from tokenmill.attention import AttentionBackend, get_attention_backend
from tokenmill.config import ModelConfig
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.kernels.isa import native_bf16
from tokenmill.kernels.report import describe_model_paths
from tokenmill.layers.linear_kernels import packing_applies
from tokenmill.models.kernel_choice import KernelChoice
from tokenmill.models.loader import ModelSource
from tokenmill.models.loader.quantized_checkpoints import resolve_quantization
from tokenmill.models.registry import build_model
from tokenmill.parallel.group import PipelineStage, TPGroup

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """'auto' -> on CPU, bfloat16 where the kernels' level computes it natively (`isa.native_bf16`), else
    float32 (exact); on CUDA the
    checkpoint's half dtype, bfloat16 for float32 checkpoints."""
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if native_bf16() else torch.float32
        return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("bfloat16", "float16") else torch.bfloat16
    return _DTYPES[name]


def load_model(source: ModelSource, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_model_len: int, num_layers: Optional[int] = None,
               tp: TPGroup = TPGroup.single(), stage: PipelineStage = PipelineStage(),
               kv_rows: Optional[str] = None) -> tuple[Any, AttentionBackend]:
    """The model of `source` (rank `tp.rank`'s shard of pipeline stage `stage`'s layers) with its weights loaded and the kernels `config`
    asks for, and its attention backend. `num_layers` keeps only the first layers (with the final norm
    and head): a shallow draft. `kv_rows`: the KV cache's one-byte row format ("int8", "fp8"; None: the
    compute dtype), which the native one-call step must write and read alike."""
    arch = source.arch
    quantization = resolve_quantization(config.quantization, source.quant_method, source.path)
    if num_layers is not None:
        if num_layers > arch.num_hidden_layers:
            raise ValueError(f"draft_num_layers {num_layers} is more than the model's {arch.num_hidden_layers} layers")
        arch = dataclasses.replace(arch, num_hidden_layers=num_layers)
    invariant = resolve_batch_invariant(config.batch_invariant, device)
    backend, kernels = get_attention_backend(config.attention_backend, device, dtype, invariant)
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = build_model(arch, backend, max_model_len, tp, stage)
        finally:
            torch.set_default_dtype(previous)
    weights = source.iter_weights(keep_quantized=quantization != "none")
    if num_layers is not None:
        weights = _first_layers(weights, num_layers)
    model.load_weights(weights, quantize_to=quantization if quantization in ("int8", "int4", "fp8") else None)
    choice = choose_kernels(config, device, dtype, backend, kernels, invariant, model.has_quantized_weights(),
                            tp.size == 1 and stage.size == 1, kv_rows)
    model.apply_kernels(choice)
    if config.enable_lora and num_layers is None:  # a draft model runs without adapters
        from tokenmill.lora.layers import ModelLoRA
        model.lora = ModelLoRA(model, dtype, choice.native, invariant, config.max_lora_rank)
    if model.rotary is not None:  # (none without attention: Mamba2)
        model.rotary.to_device(device)
    model.eval()
    if device.type == "cuda":  # what the weights hold on the device, kept as loaded (packed where quantised)
        logger.info("weights take %.2f GiB on %s (%s)", (torch.cuda.memory_allocated(device) - allocated_before)
                    / (1 << 30), device, model.describe_weights())
    on_triton = getattr(choice.native, "on_device", False)
    logger.info("kernels: %s", describe_model_paths(model, kernels if on_triton else choice.native or kernels, dtype,
                                                     backend, invariant, device.type, on_triton))
    return model, backend


def choose_kernels(config: ModelConfig, device: torch.device, dtype: torch.dtype, backend: AttentionBackend,
                   attention_kernels: Any, invariant: bool, quantized_weights: bool, one_rank: bool,
                   kv_rows: Optional[str] = None) -> KernelChoice:
    """The kernels a loaded model runs (models/kernel_choice.py): fast products unless `linear_kernel` is
    dense (Triton's where it is triton, and under auto on CUDA with the Triton backend, which a
    batch-invariant CUDA run needs: layers/triton_products.py); the element-wise ops on Triton's fused
    kernels on CUDA in half precision (and in float32 where batch-invariant), on the native CPU kernels
    where the attention backend has them and the model runs bfloat16 or quantised weights
    (float32 float weights keep PyTorch's ops, whose results the HF comparisons pin down); the one-call
    step where those native kernels run, `fused_decode` is on and the model is whole on one rank
    (`one_rank`), over a cache of `kv_rows` (one-byte rows, or None: the compute dtype). `invariant`:
    whether the products compute every row alike (`resolve_batch_invariant`)."""
    fast_linears = config.linear_kernel != "dense"
    native = attention_kernels
    if invariant and device.type == "cuda":
        _check_invariant_cuda(config, backend)
    if config.linear_kernel == "triton" or (fast_linears and device.type == "cuda" and backend.on_triton):
        from tokenmill.layers.triton_products import TritonProducts

        native = TritonProducts()
    elif native is None and device.type == "cpu" and fast_linears:
        native = cpu_kernels()  # the linears use them whatever the attention backend
    if invariant and device.type == "cpu" and native is None:
        logger.warning("batch invariance without the native CPU kernels (TOKENMILL_KERNELS=off, a failed build, or "
                       "--linear-kernel dense): the products run on PyTorch's F.linear, whose sums can depend on the "
                       "number of rows, so a request's output can depend on its batch and on prefix-cache hits")
    elementwise = None
    # float32 keeps PyTorch's norms (pinned to HF's bits) unless batch-invariant: PyTorch's CUDA reductions
    # may split a row by the tensor's shape, the Triton norm takes one program per row (test_triton_fused.py)
    if device.type == "cuda" and (dtype != torch.float32 or invariant) and backend.on_triton:
        from tokenmill.layers.triton_fused import TritonFusedOps
        elementwise = TritonFusedOps()
    if attention_kernels is not None and (dtype == torch.bfloat16 or quantized_weights):
        elementwise = attention_kernels
    return KernelChoice(packed=config.linear_kernel == "auto" and packing_applies(dtype, device),
                        native=native if fast_linears else None, batch_invariant=invariant,
                        elementwise=elementwise,
                        fused_decode=elementwise is not None and elementwise is attention_kernels
                        and native is attention_kernels and config.fused_decode and one_rank, kv_rows=kv_rows)


def _check_invariant_cuda(config: ModelConfig, backend: AttentionBackend) -> None:
    """Refuse a batch-invariant CUDA run whose products or attention would not be invariant."""
    if config.linear_kernel == "dense":
        raise ValueError("batch_invariant on cuda multiplies on Triton's invariant matmul; --linear-kernel dense "
                         "asks for F.linear (cuBLAS, whose reduction order depends on the batch): use auto or triton")
    if not backend.on_triton:
        raise ValueError(f"batch_invariant on cuda needs the triton_paged attention backend (its unified kernel "
                         f"attends every query alike), not {config.attention_backend}")


def resolve_batch_invariant(asked: Optional[bool], device: torch.device) -> bool:
    """Whether steps run batch-invariant: as asked on CPU (default on); on CUDA as asked, default off (cuBLAS
    products, whose reduction order depends on the number of rows: an output can depend on its batch), on
    meaning Triton's invariant matmul for every product (layers/triton_matmul.py), the unified attention
    kernel and a Triton row log-softmax for logprobs, so it needs Triton. Logged either way."""
    if device.type == "cpu":
        return True if asked is None else asked
    if not asked:
        logger.info("batch invariance is off on %s: cuBLAS products reduce in an order that depends on the batch, "
                    "so outputs can differ with the batch mix (attention alone is invariant; --batch-invariant "
                    "runs every product on Triton's invariant matmul instead)", device.type)
        return False
    if device.type != "cuda":
        raise ValueError(f"batch_invariant on {device.type}: its invariant products are Triton's, for cuda (and "
                         "the CPU's own); use --no-batch-invariant there")
    if importlib.util.find_spec("triton") is None:  # the invariant products and row kernels are Triton's
        raise ValueError("batch_invariant on cuda needs Triton for its invariant matmul, which is not installed: "
                         "pip install triton, or use --no-batch-invariant")
    logger.info("batch invariance on cuda: every product on Triton's invariant matmul (tiles fixed per weight "
                "shape, one sequential reduction), the unified attention kernel for every query, logprobs from "
                "a Triton row log-softmax: a request's output does not depend on its batch (slower than cuBLAS)")
    return True


def _first_layers(weights: Iterator[tuple[str, Any]], num_layers: int) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        match = _LAYER_INDEX.search(name)
        if match is None or int(match.group(1)) < num_layers:
            yield name, tensor
