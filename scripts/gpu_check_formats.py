"""Issue 59's sections of the GPU check (scripts/gpu_check.py runs them): the formats GPU users serve, each
against bfloat16 on the same random weights, quantised on the device by the repository's own quantisers.

- w4a16: the 1B-shaped model with `--quantization int4` (kept packed, Triton's weight-only product) against
  `--quantization none`: the decode graph's replay at batch 1 and 64, and the weights' device memory;
- fp8: the same with `--quantization fp8` (W8A8): a 2,048-token prefill and the batch-64 replay;
- fp8_kv: `--kv-cache-dtype fp8` against the bfloat16 cache, the batch-64 replay at 4,096 tokens of context,
  and teacher-forced top-1 agreement on the check's trained 135M model;
- moe: a Qwen3-30B-A3B-shaped model cut to 4 layers, decode at batch 64 inside a graph, against the time to
  read, once at the measured copy bandwidth, the weights a step touches (the experts the routing can reach:
  E (1 - (1 - k/E)^B) of E per layer for B tokens choosing k, as random routers spread them);
- batch_invariant: `--batch-invariant` greedy ids alone against batched at batch sizes 1, 7 and 64, and its
  cost: the served burst's output tok/s with it over without.

The keys the issue reads sit at the top level of the JSON (FORMATS_KEYS); each section's detail beside them.
One device run (9 minutes) holds these sections with `--skip` FORMATS_SKIP (gpu_check.py --help).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

FORMATS_STEPS = ("w4a16", "fp8", "fp8_kv", "moe", "batch_invariant")
FORMATS_KEYS = ("w4a16_bs1_step_ratio", "w4a16_bs64_step_ratio", "w4a16_weight_memory_ratio",
                "fp8_prefill_2048_ratio", "fp8_bs64_step_ratio", "fp8_kv_step_ratio", "fp8_kv_top1_agreement",
                "moe_bs64_over_floor", "batch_invariant_identical", "batch_invariant_cost")
# Qwen3-30B-A3B's shapes, 4 of its 48 layers
QWEN3_30B_A3B_4L = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                        eos_token_id=2, decoder_sparse_step=1, mlp_only_layers=[])
TINY_MOE = dict(QWEN3_30B_A3B_4L, vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_experts=8,
                num_experts_per_tok=2, max_position_embeddings=1024)


def check_module() -> Any:
    """gpu_check's helpers (imported here, not at the top: gpu_check imports this module)."""
    import gpu_check
    return gpu_check


def replays(llm: Any, batch: int, ctx: int, device: str, seed: int) -> Any:
    """The decode graph's replay (ms) at `batch` sequences of `ctx` tokens of context: a few decode steps
    first, so that the graph's buffers hold that step's contexts; None where no graph runs (a dry run)."""
    g = check_module()
    g.timed_generate(llm, g.random_prompts(batch, ctx, seed), 3, device)
    return g.graph_replay_ms(llm, batch, device)


def dry_paths(dry: bool) -> dict[str, str]:
    """A dry run's engines on the CPU's own kernels rather than Triton's interpreter: its figures prove the
    plumbing, not the kernels (each has tests of its own in the interpreter), and the interpreter would take
    minutes for these sections. On a GPU nothing changes: its defaults are Triton's."""
    return {"attention_backend": "auto"} if dry else {}


def ratio(a: Any, b: Any, digits: int = 3) -> Any:
    """a / b rounded, or None where either is missing."""
    return round(a / b, digits) if a and b else None


# module attributes that hold step state or shared kernels, not weights
NOT_WEIGHTS = {"backend", "kernels", "tp", "kernel_choice", "fused_decode"}


def weight_memory(llm: Any) -> int:
    """Bytes of the tensors the loaded model holds, each storage once: its parameters and buffers and what its
    layers' kernels keep (packed weights live there, not in parameters)."""
    import torch
    seen: set[int] = set()

    def walk(value: Any, depth: int) -> int:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        if depth == 0 or isinstance(value, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            return 0
        if isinstance(value, dict):
            return sum(walk(v, depth - 1) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(walk(v, depth - 1) for v in value)
        return sum(walk(v, depth - 1) for v in getattr(value, "__dict__", {}).values())

    total = 0
    for module in llm.llm_engine.model.modules():
        total += sum(walk(t, 1) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
        total += sum(walk(v, 4) for name, v in vars(module).items()
                     if not name.startswith("_") and name not in NOT_WEIGHTS)
    return total


def engine_pair(path: Path, device: str, dry: bool, batch: int, baseline: dict[str, Any], other: dict[str, Any],
                measure: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`measure(llm)` on the engine with the `baseline` options and on the one with the `other` options, in
    turn (one engine on the device at a time)."""
    g = check_module()
    found = []
    for options in (baseline, other):
        llm = g.decode_llm(path, device, dry, batch, **options, **dry_paths(dry))
        try:
            found.append(measure(llm))
        finally:
            llm.shutdown()
            del llm
            g.free_memory()
    return found[0], found[1]


BF16 = {"quantization": "none"}  # the float side of a weight format's pair


def w4a16(path: Path, device: str, dry: bool) -> dict[str, Any]:
    """Replay at batch 1 and 64 and the weights' memory, int4 (kept packed) against bfloat16."""
    steps, ctx, batch = check_module().decode_shape(dry)

    def measure(llm: Any) -> dict[str, Any]:
        return {"bs1_ms": replays(llm, 1, ctx, device, 11), f"bs{batch}_ms": replays(llm, batch, ctx, device, 12),
                "weight_bytes": weight_memory(llm), "weights": llm.llm_engine.model.describe_weights()}

    bf16, int4 = engine_pair(path, device, dry, batch, BF16, {"quantization": "int4"}, measure)
    return {"bf16": bf16, "int4": int4, "w4a16_bs1_step_ratio": ratio(int4["bs1_ms"], bf16["bs1_ms"]),
            "w4a16_bs64_step_ratio": ratio(int4[f"bs{batch}_ms"], bf16[f"bs{batch}_ms"]),
            "w4a16_weight_memory_ratio": ratio(int4["weight_bytes"], bf16["weight_bytes"])}


def fp8(path: Path, device: str, dry: bool) -> dict[str, Any]:
    """A 2,048-token prefill (median of distinct prompts: no prefix hits) and the batch-64 replay, FP8 W8A8
    against bfloat16."""
    import torch
    g = check_module()
    steps, ctx, batch = g.decode_shape(dry)
    length, count = (16, 2) if dry else (2048, 4)

    def measure(llm: Any) -> dict[str, Any]:
        prefill = [g.timed_generate(llm, g.random_prompts(1, length, 200 + seed), 1, device) for seed in range(count)]
        return {"prefill_ms": round(statistics.median(prefill[1:]) * 1e3, 2),
                f"bs{batch}_ms": replays(llm, batch, ctx, device, 13), "weights": llm.llm_engine.model.describe_weights()}

    bf16, w8a8 = engine_pair(path, device, dry, batch, BF16, {"quantization": "fp8"}, measure)
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    return {"bf16": bf16, "fp8": w8a8, "device_capability": capability,
            "fp8_prefill_2048_ratio": ratio(w8a8["prefill_ms"], bf16["prefill_ms"]),
            "fp8_bs64_step_ratio": ratio(w8a8[f"bs{batch}_ms"], bf16[f"bs{batch}_ms"])}


def fp8_kv(path_1b: Path, trained_135m: Any, device: str, dry: bool) -> dict[str, Any]:
    """The batch-64 replay at 4,096 tokens of context with an fp8 cache against the bfloat16 cache, and the
    top-1 agreement under teacher forcing (prompt logprobs) of the trained 135M model's fp8 cache with its
    bfloat16 cache over the README's text."""
    batch, ctx = (4, 24) if dry else (64, 4096)

    def measure(llm: Any) -> dict[str, Any]:
        return {f"bs{batch}_ctx{ctx}_ms": replays(llm, batch, ctx, device, 14)}

    room = {} if dry else dict(max_model_len=ctx + 64, kv_cache_memory_gb=24.0)  # 64 x 4,096 tokens of cache
    bf16, fp8 = engine_pair(path_1b, device, dry, batch, dict(room, kv_cache_dtype="auto"),
                            dict(room, kv_cache_dtype="fp8"), measure)
    out: dict[str, Any] = {"bf16_cache": bf16, "fp8_cache": fp8,
                           "fp8_kv_step_ratio": ratio(fp8[f"bs{batch}_ctx{ctx}_ms"], bf16[f"bs{batch}_ctx{ctx}_ms"])}
    if trained_135m:
        out["fp8_kv_top1_agreement"] = cache_agreement(Path(trained_135m), device, dry)
    return out


def cache_agreement(path: Path, device: str, dry: bool) -> float:
    """Teacher-forced top-1 agreement, fp8 cache against bfloat16 cache, over two stretches of the README."""
    from transformers import AutoTokenizer

    from tokenmill import SamplingParams
    g = check_module()
    _, held_out = g.training_text()
    texts = [held_out[i:i + (160 if dry else 6000)] for i in (0, len(held_out) // 2)]
    prompts = [AutoTokenizer.from_pretrained(path)(t).input_ids for t in texts]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops = {}
    for kv in ("auto", "fp8"):
        llm = g.make_llm(path, device, dry, dtype="bfloat16" if not dry else "float32", kv_cache_dtype=kv,
                         enforce_eager=True, **dry_paths(dry))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tops[kv] = [max(entry.items(), key=lambda kv_: kv_[1].logprob)[0]
                    for o in outputs for entry in o.prompt_logprobs[1:]]
        llm.shutdown()
        del llm
        g.free_memory()
    return round(sum(a == b for a, b in zip(tops["fp8"], tops["auto"])) / max(len(tops["auto"]), 1), 4)


def write_moe_model(folder: Path, tokenizer_dir: Path, device: str, dry: bool) -> Path:
    """A random-weight Qwen3-MoE checkpoint of QWEN3_30B_A3B_4L's shapes (TINY_MOE in a dry run), bfloat16
    (float32 for the tiny one), with the tokenizer."""
    import os
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("qwen3_moe", **(TINY_MOE if dry else QWEN3_30B_A3B_4L))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if dry else torch.bfloat16)
    model.save_pretrained(folder)
    del model
    check_module().free_memory()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def moe_step_floor_bytes(config: dict[str, Any], batch: int) -> int:
    """Bytes a decode step of `batch` tokens reads at least (bfloat16): attention and norms, the LM head, and
    per layer the experts the routing can reach, E (1 - (1 - k/E)^batch) of E (each token picks k of E)."""
    hidden, experts, k = config["hidden_size"], config["num_experts"], config["num_experts_per_tok"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    touched = experts * (1 - (1 - k / experts) ** batch)
    expert = 3 * hidden * config["moe_intermediate_size"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + hidden * experts
    per_layer = touched * expert + attention
    return int(2 * (config["num_hidden_layers"] * per_layer + config["vocab_size"] * hidden))


def moe(tokenizer_dir: Path, work: Path, device: str, dry: bool, bandwidth_gbs: float) -> dict[str, Any]:
    """Decode at batch 64 of the Qwen3-30B-A3B-shaped model inside a graph: the replay over the floor of
    `moe_step_floor_bytes` at the measured copy bandwidth."""
    g = check_module()
    path = write_moe_model(work / "moe", tokenizer_dir, device, dry)
    batch, ctx = (4, 24) if dry else (64, 512)
    llm = g.decode_llm(path, device, dry, batch, **dry_paths(dry))
    try:
        replay = replays(llm, batch, ctx, device, 15)
        step = g.decode_step_seconds(llm, g.random_prompts(batch, ctx, 16), 2 if dry else 16, device, 1)
    finally:
        llm.shutdown()
        del llm
        g.free_memory()
    floor_ms = moe_step_floor_bytes(TINY_MOE if dry else QWEN3_30B_A3B_4L, batch) / (bandwidth_gbs * 1e9) * 1e3
    return {f"bs{batch}_replay_ms": replay, f"bs{batch}_step_ms": round(step * 1e3, 3),
            "floor_ms": round(floor_ms, 4), "moe_bs64_over_floor": ratio(replay, floor_ms, 2)}


def batch_invariant(path: Path, device: str, dry: bool, out_dir: Path) -> dict[str, Any]:
    """`--batch-invariant`: each of 8 prompts' greedy ids alone against within batches of 1, 7 and 64
    (the 8 among random others), and the served burst's output tok/s with it over without."""
    g = check_module()
    sizes, tokens = ((1, 3), 4) if dry else ((1, 7, 64), 32)
    prompts = g.DRY_PROMPTS if dry else g.PROMPTS
    llm = g.decode_llm(path, device, dry, max(sizes), batch_invariant=True, **dry_paths(dry))
    try:
        alone = [g.tokenmill_greedy(llm, [p], tokens)[0] for p in prompts]
        identical = {}
        for size in sizes:
            same = 0
            for index, prompt in enumerate(prompts):
                others = [{"prompt_token_ids": ids} for ids in g.random_prompts(size - 1, 48, 300 + index)]
                batch = g.tokenmill_greedy(llm, [prompt] + others, tokens)
                same += batch[0] == alone[index]
            identical[f"bs{size}"] = f"{same}/{len(prompts)}"
    finally:
        llm.shutdown()
        del llm
        g.free_memory()
    all_same = sum(int(v.split("/")[0]) for v in identical.values())
    out: dict[str, Any] = {"identical_by_batch": identical,
                           "batch_invariant_identical": f"{all_same}/{len(prompts) * len(sizes)}"}
    if dry:  # two servers in the interpreter for a figure that means nothing on CPU: the served plumbing
        out["batch_invariant_cost_note"] = "not measured in a dry run"  # is the serve_1b step's
        return out
    burst = (256, 64, 512, 128)
    tok_s = {}
    for flag in ("--no-batch-invariant", "--batch-invariant"):
        with g.tokenmill_server(path, device, dry, out_dir / f"serve-{flag[2:]}.log", extra=(flag,)) as base:
            g.bench_serve(base, 64, 64, 512, 16)  # warm-up
            summary, _ = g.bench_serve(base, *burst)
        tok_s[flag[2:]] = summary["output_tokens_per_s"]
    out["served_output_tok_s"] = tok_s
    out["batch_invariant_cost"] = ratio(tok_s["batch-invariant"], tok_s["no-batch-invariant"])
    return out


def formats_steps(check: Any, skip: list[str], models: tuple[Any, Any, Any], bandwidth: Any, device: str,
                  work: Path, tokenizer_dir: Path) -> None:
    """Issue 59's sections, each a step of its own (FORMATS_STEPS, the names --skip takes), into the check's
    JSON: each section's detail under its name, the issue's keys (FORMATS_KEYS) at the top level.
    `models`: the 135M-shaped, 1B-shaped and trained 135M checkpoints (None where not written)."""
    r, dry = check.result, check.dry_run
    small, big, trained = models
    sections = {
        "w4a16": lambda: w4a16(big, device, dry),
        "fp8": lambda: fp8(big, device, dry),
        "fp8_kv": lambda: fp8_kv(big, trained, device, dry),
        "moe": lambda: moe(tokenizer_dir, work, device, dry, bandwidth),
        "batch_invariant": lambda: batch_invariant(big, device, dry, check.out_dir),
    }
    for name, run in sections.items():
        if name in skip or not big or (name == "moe" and not bandwidth):
            continue
        detail = check.step(name, run)
        r[f"formats_{name}"] = detail
        for key in FORMATS_KEYS:
            if detail and key in detail:
                r[key] = detail[key]
