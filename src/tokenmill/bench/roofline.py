"""The roofline columns of `tokenmill bench throughput`: how near the run's decode steps came to this machine's
measured read bandwidth, and its prefill steps to its measured arithmetic peak.

- `peak_read_gbps`: the best of five sums of a float32 buffer of four times the last-level cache (at least
  512 MiB; the caches hold little of it) on the engine's thread count: what the cores can read from memory.
- `achieved_read_gbps`: the bytes of weights a one-token decode step reads (`weight_bytes_per_step`: each weight as
  its product reads it, packed; an untied embedding table counts only for the rows looked up, so not at all) over the median
  wall time of the run's decode-only steps (the engine's whole step, Python included: what a token costs).
- `peak_gflops`: the best of five 2,048-square products in the compute dtype (torch.mm: oneDNN, on AMX tiles
  where the CPU has them): the machine's practical arithmetic peak.
- `achieved_gflops`: the arithmetic of the steps with prefill chunks (2 x the projections' multiply-adds per token,
  experts counted top_k / num_experts; the LM head's for the rows sampled; attention's QK and PV products,
  4 x heads x head_dim per query-key pair) over their wall time. Counted for attention-only decoders of full
  attention; for other layers (recurrent mixers, MLA, windows) the column is null and `roofline_note` says why.

Measured on CPU only (elsewhere the columns are absent and the note says so).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tokenmill.models.weight_update import held_tensors

_MIN_READ_BUFFER_BYTES = 512 << 20
_PRODUCT_SIZE = 2048


@dataclass
class StepLog:
    """Every engine step of a run: its wall time and its chunks, (start position, tokens, sampled) each."""

    steps: list[tuple[float, list[tuple[int, int, bool]]]] = field(default_factory=list)

    @staticmethod
    def attach(engine: Any) -> "StepLog":
        """A log that `engine`'s steps fill from now on (its `step` and its executor's `submit`, wrapped)."""
        log, submitted = StepLog(), []
        submit, step = engine.executor.submit, engine.step

        def logged_submit(schedule: Any) -> Any:
            submitted.append([(chunk.start, chunk.num_tokens, chunk.sample) for chunk in schedule.scheduled])
            return submit(schedule)

        def logged_step() -> Any:
            submitted.clear()
            started = time.perf_counter()
            outputs = step()
            seconds = time.perf_counter() - started
            if submitted:
                log.steps.append((seconds, [chunk for chunks in submitted for chunk in chunks]))
            return outputs

        engine.executor.submit, engine.step = logged_submit, logged_step
        return log

    def decode_seconds(self) -> list[float]:
        """Wall times of the steps that computed one token for every request and no prefill."""
        return [seconds for seconds, chunks in self.steps if all(tokens == 1 for _, tokens, _ in chunks)]

    def prefill_steps(self) -> list[tuple[float, list[tuple[int, int, bool]]]]:
        """The steps with at least one chunk of several tokens."""
        return [(seconds, chunks) for seconds, chunks in self.steps if any(tokens > 1 for _, tokens, _ in chunks)]


def measure_peak_read_gbps(repeats: int = 5) -> float:
    """GB/s of the best of `repeats` sums of a buffer four times the last-level cache (see the module
    docstring)."""
    size = max(_MIN_READ_BUFFER_BYTES, 4 * last_level_cache_bytes()) // 4 * 4
    buffer = torch.ones(size // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return size / min(times) / 1e9


def last_level_cache_bytes() -> int:
    """The largest cache Linux lists for CPU 0 (sysfs), 0 where it lists none."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes)


def measure_peak_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` square products of _PRODUCT_SIZE in `dtype` (one warm-up first)."""
    a = torch.randn(_PRODUCT_SIZE, _PRODUCT_SIZE).to(dtype)
    b = torch.randn(_PRODUCT_SIZE, _PRODUCT_SIZE).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - started)
    return 2 * _PRODUCT_SIZE ** 3 / min(times) / 1e9


def weight_bytes_per_step(model: Any) -> int:
    """The bytes a one-token decode step reads of the model's weights: each projection's and the LM head's one
    representation of its weight that the product reads (the largest tensor its kernel holds: a packed copy may sit
    beside the original; experts counted top_k / num_experts), the norms' and other layers' tensors, each storage
    once; not the embedding table (a step looks up a few of its rows) unless the LM head reads it (tied), nor an
    image encoder's."""
    moe = model.arch.moe
    share = moe.top_k / moe.num_experts if moe is not None else 1.0
    head = _largest(model.logits_kernel) or _largest(getattr(model, "lm_head", None)) or \
        _largest(getattr(model, "embed_tokens", None))
    total = float(head)
    for name, module in model.named_modules():
        if module is model or name.startswith(("embed_tokens", "vision")):
            continue
        if _is_projection(module):
            read = _largest(getattr(module, "kernel", None)) or _largest(module)
        else:
            read = sum(_bytes(t) for t in held_tensors(module, depth=0))
        total += read * (share if ".experts." in name else 1.0)
    return int(total)


def _largest(owner: Any) -> int:
    """The bytes of the largest tensor `owner` holds (0: none)."""
    return max((_bytes(t) for t in held_tensors(owner)), default=0)


def _is_projection(module: Any) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features")


def _bytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except NotImplementedError:
        return tensor.numel() * tensor.element_size()


def prefill_flops(arch: Any, model: Any, chunks: list[tuple[int, int, bool]]) -> Optional[float]:
    """The arithmetic of one step's chunks (see the module docstring), or None for layers it is not counted for."""
    if _uncounted(arch) is not None:
        return None
    tokens = sum(n for _, n, _ in chunks)
    sampled = sum(1 for _, _, sample in chunks if sample)
    pairs = sum(n * start + n * (n + 1) // 2 for start, n, _ in chunks)  # (query, key) pairs, causal
    attention = 4 * arch.num_attention_heads * arch.head_dim * pairs * arch.num_hidden_layers
    return 2 * (projection_macs_per_token(arch, model) * tokens + arch.hidden_size * arch.vocab_size * sampled) \
        + attention


def projection_macs_per_token(arch: Any, model: Any) -> float:
    """Multiply-adds of the decoder's projections for one token (experts scaled by top_k / num_experts)."""
    share = arch.moe.top_k / arch.moe.num_experts if arch.moe is not None else 1.0
    macs = 0.0
    for name, module in model.named_modules():
        if name.startswith(("lm_head", "vision")) or not _is_projection(module):
            continue
        macs += module.in_features * module.out_features * (share if ".experts." in name else 1.0)
    return macs


def _uncounted(arch: Any) -> Optional[str]:
    """Why prefill arithmetic is not counted for `arch`, or None."""
    if arch.keeps_recurrent_state:
        return "recurrent mixers"
    if arch.mla is not None:
        return "MLA attention"
    if arch.has_sliding_layers or arch.has_chunked_layers:
        return "windowed attention"
    return None


def roofline(engine: Any, log: StepLog) -> dict[str, Any]:
    """The columns for a finished run of `engine` whose steps `log` recorded."""
    if engine.device.type != "cpu":
        return {"roofline_note": "the roofline columns measure CPU runs"}
    model = engine.runner.model
    columns: dict[str, Any] = {"peak_read_gbps": round(measure_peak_read_gbps(), 1),
                               "peak_gflops": round(measure_peak_gflops(engine.dtype), 1),
                               "weight_bytes_per_step": weight_bytes_per_step(model)}
    decode = log.decode_seconds()
    columns["achieved_read_gbps"] = (round(columns["weight_bytes_per_step"] / statistics.median(decode) / 1e9, 1)
                                     if decode else None)
    prefill = log.prefill_steps()
    flops = [prefill_flops(engine.arch, model, chunks) for _, chunks in prefill]
    if prefill and None not in flops:
        columns["achieved_gflops"] = round(sum(flops) / sum(seconds for seconds, _ in prefill) / 1e9, 1)
    else:
        columns["achieved_gflops"] = None
        why = _uncounted(engine.arch) if prefill else "no step had a prefill chunk"
        columns["roofline_note"] = f"prefill arithmetic not counted: {why}"
    if not decode:
        columns["roofline_note"] = "no decode-only step ran"
    return columns
