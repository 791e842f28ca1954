"""Engine configuration as data: frozen dataclasses, validated once, that the CLI is generated from.

Every field carries a one-line help in its metadata; `EngineConfig.from_kwargs` takes the flat
keyword form (`LLM(dtype=..., block_size=...)`) and routes each keyword to its section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill import envs
from tokenmill.speculative_json import speculative_json, speculative_settings

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LINEAR_KERNELS = ("auto", "dense", "triton")
ATTENTION_BACKENDS = ("auto", "torch_ref", "cpu_paged", "triton_paged")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8",
                 # vLLM's names for a checkpoint's own method (models/loader/quantized_checkpoints.py)
                 "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "gguf")
SCHEDULE_POLICIES = ("fcfs", "priority", "lpm")
RUNNERS = ("auto", "generate", "pooling")
PREEMPTION_MODES = ("auto", "recompute", "swap")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# the row format (attention/kv_quant.py) of each quantised --kv-cache-dtype
KV_CACHE_FORMATS = {"int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8"}


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def image_limit(text: str) -> int:
    """--limit-mm-per-prompt: a number of images, or vLLM's JSON '{"image": N}' (other kinds of input must be
    absent or 0: images are the only kind served)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or JSON like '{{\"image\": 4}}', got {text!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and isinstance(value.get("image"), int):
        others = {kind: count for kind, count in value.items() if kind != "image" and count}
        if not others:
            return value["image"]
        raise argparse.ArgumentTypeError(f"only images are served; {sorted(others)} must be 0 or absent")
    raise argparse.ArgumentTypeError(f"expected a number or JSON like '{{\"image\": 4}}', got {text!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    model: Optional[str] = _opt(None, "HF folder, .gguf file, alias, or Hugging Face Hub id ORG/NAME (a safetensors "
                                "model) or ORG/NAME:QUANT (that GGUF file of the repository), downloaded once "
                                "into the Hub cache (default: smollm2-135m-instruct)")
    revision: Optional[str] = _opt(None, "Hub models: the branch, tag or commit to download (default: main); the "
                                   "commit it resolves to is logged")
    download_dir: Optional[str] = _opt(None, "Hub models: download into this folder instead of the Hub cache "
                                       "(HF_HOME)")
    gguf_file: Optional[str] = _opt(None, "Hub models: the GGUF file of the repository to serve (instead of "
                                    "ORG/NAME:QUANT)")
    dtype: str = _opt("auto", "compute dtype; auto = bfloat16 on CPUs with AVX512-BF16/AMX, else float32 "
                      "(exact); on CUDA the checkpoint's half dtype (bfloat16 for float32 checkpoints)",
                      choices=DTYPES)
    max_model_len: Optional[int] = _opt(None, "longest sequence (prompt + output) in tokens; "
                                        "default: the model's context length")
    device: str = _opt("auto", "where to run: cuda if available when auto", choices=DEVICES)
    runner: str = _opt("auto", "what the model does: generate (text), pooling (embeddings, score and rerank: "
                       "/v1/embeddings, /v1/score, /v1/rerank; float32 unless --dtype says otherwise); auto = "
                       "pooling for encoders (BertModel, XLMRobertaModel, ...) and folders with "
                       "sentence-transformers modules, else generate", choices=RUNNERS)
    seed: int = _opt(0, "seed of the global sampling generator (requests without their own seed)")
    linear_kernel: str = _opt("auto", "how linear layers multiply; auto = on CPU weights packed once for "
                              "oneDNN when computing in bfloat16 and native kernels for quantised weights, on "
                              "CUDA (Triton backend) the triton products; dense = plain F.linear, the PyTorch "
                              "quantised product and experts one by one (the references; on CUDA quantised "
                              "weights are then dequantised once); triton = tokenmill's Triton products: "
                              "quantised weights kept packed, float weights batch-invariant where asked, the "
                              "fused mixture of experts (on CPU Triton's interpreter: tests only)",
                              choices=LINEAR_KERNELS)
    attention_backend: str = _opt("auto", "paged attention implementation; auto = cpu_paged (native kernels, "
                                  "built on first use; bfloat16 also fuses RMSNorm, RoPE and SiLU) on CPU "
                                  "when a C compiler is available, triton_paged (Triton kernels; 16-bit dtypes "
                                  "also fuse RMSNorm and the gated activations) on CUDA when Triton is installed, "
                                  "else torch_ref (the PyTorch reference); triton_paged on CPU runs Triton's "
                                  "interpreter (tests only: slow)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = _opt(False, "CUDA: run every step eagerly instead of replaying the CUDA graphs captured "
                               "at start (vLLM's flag)")
    cuda_graph_sizes: Optional[list[int]] = _opt(
        None, "CUDA: the sizes the graphs are captured for: decode-only steps by batch size (those up to "
        "max_num_seqs), steps with prefill chunks or speculative proposals by token count (those up to "
        "max_num_batched_tokens); a step replays the smallest size that holds it, a larger one runs eagerly. "
        "Default: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, then 384 ... 8192 for token counts "
        "(the start-up log lists them and the capture time)", nargs="+")
    fused_decode: bool = _opt(True, "run each step as one native call where every projection runs natively "
                              "(quantised, or bfloat16 in AMX tiles; cpu_paged): decode steps, and prefill chunks "
                              "in bfloat16 on AMX; its output is identical to the per-layer path")
    batch_invariant: Optional[bool] = _opt(
        None, "compute every token the same way whatever else shares its step, so a request's output ids and "
        "logprobs do not depend on the batch, chunk size, prefix-cache hits, preemption or speculation (same "
        "machine, version and flags): quantised products take int8 dot products at every row count, every query "
        "attends as a decode query; --no-batch-invariant lets many-row products dequantise and prefill use "
        "SDPA/AMX attention (gain: docs/benchmarks.md). Default: on for CPU; off on CUDA, where the matrix "
        "products then run on cuBLAS, whose reduction order depends on the row count (said in the log); "
        "--batch-invariant on CUDA runs every product on Triton's invariant matmul, the norms and logprobs on "
        "Triton row kernels (needs Triton and the triton_paged backend; slower than cuBLAS)")
    quantization: str = _opt("auto", "weight quantisation; auto = keep a GGUF file's Q8_0, Q5_0/Q5_1/Q5_K, "
                             "Q6_K (as int8, Q6_K with its 16-weight scales) and Q4_0/Q4_1/Q4_K (as int4) weights "
                             "packed exactly (other encodings are dequantised), none = dequantise everything "
                             "to --dtype (the float reference), int8/int4 = also quantise float weights per "
                             "32-weight block at load time (the embedding and LM head to int8), fp8 = quantise "
                             "the projections' float weights to float8 e4m3 per output channel (scale = max |w| / "
                             "448; the embedding and LM head stay in --dtype) and multiply them W8A8, activations "
                             "quantised per token (TOKENMILL_FP8_WEIGHT_ONLY=1: unquantised). auto also keeps FP8 "
                             "checkpoints (compressed-tensors float-quantized, quant_method fp8) in FP8, and "
                             "compressed-tensors int8 W8A8 ones in int8, multiplied W8A8 (int8 activations per "
                             "token) where Triton's products run (--linear-kernel triton); awq, "
                             "awq_marlin, gptq, gptq_marlin, compressed-tensors, gguf (vLLM's names) = as auto, "
                             "after checking the checkpoint is of that method",
                             choices=QUANTIZATIONS)

    worker_extension_cls: Optional[str] = _opt(
        None, "module:Class whose methods join each worker's (vLLM's flag): LLM.collective_rpc and the server's POST "
        "/collective_rpc call them by name, with the worker as self (its model, runner and device), as RL "
        "frameworks do to load weights their own way; no other method is reachable. One rank in the engine's "
        "process (distributed_executor_backend uni)")
    logits_processors: Optional[list[str]] = _opt(
        None, "third-party logits processors, applied to every step's logits after the built-in controls: "
        "module:Class, or a name in the 'tokenmill.logits_processors' entry-point group; each request passes them "
        "arguments in extra_args (the server's vllm_xargs). Not with speculative decoding "
        "(sampling/logits_processors.py)", nargs="+")
    enable_prompt_embeds: bool = _opt(False, "take prompts given as input embeddings (vLLM's flag): the server's "
                                      "completions field prompt_embeds (base64 of a torch.save'd [tokens, hidden] "
                                      "tensor, loaded with weights_only=True), LLM.generate's {'prompt_embeds': "
                                      "tensor}; the rows the model's embedding layer would give, its scaling "
                                      "included. Decoder models on one pipeline stage; not with speculative "
                                      "decoding")
    enable_lora: bool = _opt(False, "serve LoRA adapters (PEFT folders) next to the base model: requests pick "
                             "one by its name as `model` (server) or with lora_request (LLM.generate)")
    max_loras: int = _opt(1, "most LoRA adapters one step runs; requests of further adapters wait for a "
                          "running adapter's requests to finish")
    max_lora_rank: int = _opt(16, "largest LoRA rank an adapter may have (a larger one is refused)")
    max_cpu_loras: Optional[int] = _opt(None, "most LoRA adapters loaded at once (default: 4 x max_loras, at "
                                        "least 8); loading one more is refused until one is unloaded")

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or any(
                not isinstance(size, int) or isinstance(size, bool) or size < 1 for size in self.cuda_graph_sizes)):
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {self.cuda_graph_sizes!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {self.linear_kernel!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Size and shape of the paged KV cache."""

    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_memory_gb: Optional[float] = _opt(None, "memory budget of the KV cache in GiB (default: 1 on CPU; "
                                               "on CUDA, what --gpu-memory-utilization leaves after the weights "
                                               "and a profiling forward pass)")
    gpu_memory_utilization: float = _opt(0.9, "CUDA: the share of the GPU's memory this engine may use (weights, "
                                         "activations and KV cache); the KV cache gets what the weights and a "
                                         "profiling forward pass of a full step leave (vLLM's flag and default)")
    num_kv_blocks: Optional[int] = _opt(None, "explicit number of KV blocks (overrides the memory budget)")
    prefix_caching: bool = _opt(True, "reuse the KV blocks of earlier requests that share a prompt prefix")
    secondary_kv_gb: float = _opt(0.0, "size in GiB of the second KV tier, where evicted prefix blocks wait "
                                  "(a memory-mapped file on CPU; host memory on GPU, copied through a 64 MiB "
                                  "pinned staging buffer); 0 = off")
    kv_cache_dtype: str = _opt("auto", "what the KV cache stores: auto = the compute dtype; int8 = per token and "
                               "head symmetric int8 with a float32 scale (about half the bytes of bfloat16, so "
                               "the pool holds ~2x the tokens; quality: docs/benchmarks.md); fp8 (= fp8_e4m3) = "
                               "per token and head float8 e4m3 with a float32 scale (max |x| / 448: the scales "
                               "are calculated for every row as it is written; a checkpoint's per-tensor "
                               "k_scale/v_scale are read and not used). On every attention backend "
                               "(triton_paged: head_dim a multiple of 4); MLA latent caches stay unquantised",
                               choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _opt(False, "vLLM's flag, taken for its command lines: a one-byte KV cache always "
                                     "calculates its scales, per token and head as rows are written (finer than "
                                     "vLLM's per-tensor scales), so it changes nothing; refused without "
                                     "--kv-cache-dtype int8/fp8")
    swap_space_gb: float = _opt(4.0, "host memory in GiB for the KV blocks of preempted requests (a memory-mapped "
                                "file on CPU; host memory on GPU, copied through a 64 MiB pinned staging buffer; "
                                "see --preemption-mode); 0 = always recompute")
    secondary_kv_folder: Optional[str] = _opt(None, "folder for the second tier's file (default: the temp folder)")
    prefix_caching_hash_seed: Optional[str] = _opt(
        None, "seed of the prefix cache's block hashes, which are vLLM's sha256_cbor hashes (the same in every "
        "process and restart given the same seed; docs/scale-out.md); default: $PYTHONHASHSEED if set, else "
        "vLLM's default 'vllm-none-hash'")
    kv_events_config: Optional[str] = _opt(
        None, "publish KV-cache events (blocks stored and removed) for prefix-aware routers, as vLLM does: JSON "
        "with vLLM's keys, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}' (docs/scale-out.md)")

    kv_transfer_config: Optional[str] = _opt(
        None, "prefill/decode disaggregation with vLLM's keys: through files on one host, "
        "'{\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": \"kv_both\", "
        "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/tmp/tokenmill-kv\"}}', or over TCP "
        "between hosts, '{\"kv_connector\": \"TCPConnector\", \"kv_role\": \"kv_producer\", \"kv_ip\": "
        "\"0.0.0.0\", \"kv_port\": 14579}' (docs/scale-out.md; `tokenmill disagg-proxy` pairs a prefill and "
        "a decode server)")

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        from tokenmill.kv_events_config import KVEventsConfig
        from tokenmill.kv_transfer_config import KVTransferConfig
        KVEventsConfig.parse(self.kv_events_config)
        KVTransferConfig.parse(self.kv_transfer_config)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales applies to a one-byte KV cache: set kv_cache_dtype to int8 or fp8 "
                             "(its scales are always calculated, per token and head)")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.secondary_kv_gb < 0:
            raise ValueError(f"secondary_kv_gb must be >= 0, got {self.secondary_kv_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching."""

    max_num_batched_tokens: int = _opt(2048, "token budget of one step (prefill chunks + decode tokens)")
    max_num_seqs: int = _opt(128, "most sequences in the running batch")
    max_num_prompt_tokens: int = _opt(0, "most prompt tokens one step computes (chunks of several tokens: prompts "
                                      "and recomputed outputs; decodes come on top), within max_num_batched_tokens: a "
                                      "shorter step for the requests that wait for it. 0: no cap of its own (a server "
                                      "with two or more tenants sets --tenant-step-tokens)")
    preemption_mode: str = _opt("auto", "how a request preempted for KV blocks comes back: recompute its tokens, "
                                "swap its blocks out to host memory (--swap-space-gb) and back, or auto = whichever "
                                "is estimated cheaper for it (copy bytes against recompute FLOPs: swap on CPU)",
                                choices=PREEMPTION_MODES)
    schedule_policy: str = _opt("fcfs", "order of admission: fcfs (arrival), priority (a request's priority, "
                                "lower first, then arrival; requests may set it only under this policy) or lpm "
                                "(longest cached prefix first, never starving others)", choices=SCHEDULE_POLICIES)
    async_scheduling: Optional[bool] = _opt(
        None, "schedule and prepare step n+1 while step n runs on the device: a request's next step takes a "
        "placeholder for the token being sampled, filled in on the device, and its stops are found one step "
        "late (the surplus token dropped); requests whose next step needs that token on the host (structured "
        "output, penalties, min_tokens, n>1 before forking, speculative decoding) wait for it. Default: on for "
        "CUDA with one rank (the in-process executor), off on CPU, where a paired benchmark showed no gain; "
        "--no-async-scheduling runs one step at a time")
    max_num_encoder_input_tokens: int = _opt(0, "vision-language models: image positions the vision encoder "
                                             "computes per step (0: max_num_batched_tokens); a chunk that would "
                                             "start more images waits for the next step at the first that does not "
                                             "fit, and an image larger than this is encoded alone in its step")

    @property
    def encoder_budget(self) -> int:
        """Image positions the vision encoder computes per step."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_prompt_tokens < 0:
            raise ValueError(f"max_num_prompt_tokens must be >= 0, got {self.max_num_prompt_tokens}")
        if self.max_num_encoder_input_tokens < 0:
            raise ValueError(f"max_num_encoder_input_tokens must be >= 0, got {self.max_num_encoder_input_tokens}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")


SPECULATIVE_METHODS = ("none", "ngram", "draft", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens, how many, and when speculation stands aside."""

    speculative_method: str = _opt("none", "propose tokens for the target to verify in one pass: ngram = "
                                   "continue the latest earlier occurrence of the sequence's last tokens "
                                   "(prompt lookup, no extra model), draft = a second model (--draft-model), "
                                   "eagle3 = an EAGLE-3 head (--draft-model) fed three of the target's layers' "
                                   "hidden states, mtp = the target's own multi-token prediction layer "
                                   "(DeepSeek-V3's num_nextn_predict_layers)",
                                   choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _opt(4, "tokens proposed per request and step")
    prompt_lookup_min: int = _opt(2, "ngram: shortest suffix of the sequence to look up")
    prompt_lookup_max: int = _opt(5, "ngram: longest suffix of the sequence to look up (longest match wins)")
    draft_model: Optional[str] = _opt(None, "draft: HF folder, .gguf file or alias of a model with the target's "
                                      "tokenizer; it gets its own paged KV cache with as many blocks as the "
                                      "target's. eagle3: the EAGLE-3 head's folder (LlamaForCausalLMEagle3, e.g. "
                                      "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)")
    draft_num_layers: Optional[int] = _opt(None, "draft: run only the draft model's first N layers (with its "
                                           "final norm and head); the target's own first layers make a "
                                           "self-speculative draft")
    draft_quantization: str = _opt("auto", "draft: weight quantisation of the draft, as --quantization (auto keeps a "
                                   "GGUF draft's weights packed: a quantised copy of the target's own weights "
                                   "makes a fast draft for a target run with --quantization none)",
                                   choices=QUANTIZATIONS)
    speculative_max_batch: int = _opt(4, "no speculation while more sequences than this run (larger batches "
                                      "leave no idle compute to spend on proposals)")
    speculative_min_acceptance: float = _opt(0.25, "a request whose recent acceptance rate falls below this "
                                             "stops speculating for a while (then tries again)")
    speculative_config: Optional[Any] = _opt(
        None, "vLLM's form of the settings above, as JSON (a dict in LLM(...)): '{\"method\": \"eagle3\" | \"mtp\" | "
        "\"ngram\" | \"draft_model\", \"model\": ..., \"num_speculative_tokens\": k}' (also prompt_lookup_min, "
        "prompt_lookup_max, quantization); a flag given too must agree with it", parse=speculative_json)

    def __post_init__(self) -> None:
        # the JSON form sets the flag fields it names (frozen: through object.__setattr__, once, at construction)
        if self.speculative_config is not None:
            settings, canonical = speculative_settings(self.speculative_config)
            for name, value in settings.items():
                given, default = getattr(self, name), SPECULATIVE_DEFAULTS[name]
                if given != default and given != value:
                    raise ValueError(f"speculative_config sets {name} to {value!r} but {name} is {given!r}: give "
                                     f"one of speculative_config and {name}, or the same value in both")
                object.__setattr__(self, name, value)
            object.__setattr__(self, "speculative_config", canonical)  # a string keeps the config hashable

    @property
    def enabled(self) -> bool:
        """True when a proposer is configured."""
        return self.speculative_method != "none"

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method 'draft' needs draft_model (a model with the target's tokenizer)")
        if self.speculative_method == "eagle3" and not self.draft_model:
            raise ValueError("speculative_method 'eagle3' needs draft_model (the EAGLE-3 head's folder)")
        # (mtp takes a draft_model only when it names the target itself: checked where the target is known)
        if self.speculative_method not in ("draft", "eagle3", "mtp") and self.draft_model:
            raise ValueError("draft_model applies only with speculative_method 'draft', 'eagle3' or 'mtp'")
        if self.speculative_method != "draft" and self.draft_num_layers is not None:
            raise ValueError("draft_num_layers applies only with speculative_method 'draft'")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.draft_quantization!r}")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {self.speculative_min_acceptance}")


# the defaults of the fields speculative_config may set (a field still at its default yields to the JSON form)
SPECULATIVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}

EXECUTOR_BACKENDS = ("auto", "uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model, and how they split it (docs/parallel.md)."""

    tensor_parallel_size: int = _opt(1, "ranks each layer's matrices are split across (a MoE layer's experts each "
                                     "split along their intermediate, or sharded whole with "
                                     "--enable-expert-parallel)")
    pipeline_parallel_size: int = _opt(1, "contiguous stages the layers are split into, one rank each (times "
                                       "tensor_parallel_size); a step passes through the stages in turn")
    tensor_parallel_exact: bool = _opt(
        True, "row-parallel projections (attention output, MLP down) gather their whole input and each rank "
        "computes whole dot products for its share of the outputs, so every tensor-parallel size gives the "
        "single-rank tokens and logprobs bit for bit; --no-tensor-parallel-exact sums partial products with an "
        "all-reduce instead (Megatron's way: fewer bytes per layer, results differ across sizes)")
    enable_expert_parallel: bool = _opt(
        False, "shard each MoE layer's routed experts whole across the tensor-parallel ranks (router and shared "
        "experts replicated, attention and dense MLPs tensor-parallel as usual); output identical to one rank")
    distributed_executor_backend: str = _opt(
        "auto", "where the model runs: uni = in the engine's process (no overhead; one rank only), mp = one "
        "worker process per rank started with spawn, each owning its shard and KV pool; auto = uni for one "
        "rank, else mp", choices=EXECUTOR_BACKENDS)
    nnodes: int = _opt(1, "hosts the ranks are spread over (torchrun's convention): each runs "
                       "tensor_parallel_size x pipeline_parallel_size / nnodes consecutive ranks; node 0 runs "
                       "the engine (and the server), every other node only its workers. Needs "
                       "TOKENMILL_DIST_KEY, the same secret on every node")
    node_rank: int = _opt(0, "this host's index among the nnodes (0 = the one that serves)")
    master_addr: str = _opt("127.0.0.1", "address of node 0, which every node can reach (with nnodes > 1)")
    master_port: int = _opt(29500, "node 0's port for the torch.distributed rendezvous; master_port + 1 carries "
                            "the steps to the other nodes' workers (with nnodes > 1)")
    distributed_timeout: float = _opt(120.0, "seconds a rank waits for the others (rendezvous, workers of "
                                      "other nodes connecting) before it fails saying which did not come")
    threads: Optional[int] = _opt(None, "threads each rank's native kernels and PyTorch run (vLLM-CPU sizes them "
                                  "from VLLM_CPU_OMP_THREADS_BIND, llama.cpp takes -t); default: the CPUs "
                                  "--cpu-bind gives the rank, else PyTorch's default (this process's CPUs), shared "
                                  "out between a node's ranks")
    cpu_bind: str = _opt("none", "CPUs each rank's threads are pinned to, thread i on the i-th: none = the OS "
                         "schedules them; auto = this process's CPUs split into equal contiguous parts, one per rank "
                         "of the node; or CPU lists as vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND, '0-3,8', with several "
                         "ranks on a node '0-3|4-7' (the node's i-th rank takes the i-th list). A rank pinned to "
                         "one NUMA node's CPUs keeps its weights and KV pool in that node's memory")
    worker_step_timeout: float = _opt(300.0, "seconds a step may take before its worker group is taken for hung "
                                      "(a rank stopped, or stuck in a collective) and replaced as a dead one is "
                                      "(multiprocess executor; 0: never)")
    max_worker_restarts: int = _opt(1, "times the worker group of one node is replaced within "
                                    "--worker-restart-window after a rank died or hung: the requests in flight "
                                    "resume by recompute, the clients see a pause; one failure more ends them with "
                                    "503 and the server exits 3 (0: never replace)")
    worker_restart_window: float = _opt(600.0, "seconds over which --max-worker-restarts counts replacements")
    data_parallel_rank: int = _opt(0, "this engine's index among data-parallel replicas (`serve "
                                   "--data-parallel-size` sets it): its KV events say it, and their tcp ports "
                                   "are offset by it as vLLM does")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        """The executor backend after resolving auto."""
        if self.distributed_executor_backend == "auto":
            return "uni" if self.world_size == 1 else "mp"
        return self.distributed_executor_backend

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError(f"enable_expert_parallel shards the experts across the tensor-parallel ranks: it needs "
                             f"tensor_parallel_size > 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.world_size}: use 'mp'")
        if self.worker_step_timeout < 0 or self.max_worker_restarts < 0 or self.worker_restart_window <= 0:
            raise ValueError(f"worker_step_timeout and max_worker_restarts must be >= 0 and worker_restart_window "
                             f"> 0, got {self.worker_step_timeout}, {self.max_worker_restarts} and "
                             f"{self.worker_restart_window}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank {self.node_rank} of nnodes "
                             f"{self.nnodes}")
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ValueError(f"nnodes {self.nnodes} does not divide tensor_parallel_size x "
                                 f"pipeline_parallel_size ({self.world_size}): every node runs as many ranks")
            if self.backend != "mp":
                raise ValueError("nnodes > 1 runs workers in processes: distributed_executor_backend must be mp")
            if not 0 < self.master_port < 65535:
                raise ValueError(f"master_port must be in [1, 65534] (master_port + 1 is used too), "
                                 f"got {self.master_port}")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        from tokenmill.cpu_threads import check_cpu_bind

        check_cpu_bind(self.cpu_bind)
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")

    @property
    def ranks_per_node(self) -> int:
        """Ranks each node runs."""
        return self.world_size // self.nnodes


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "speculative": SpeculativeConfig, "parallel": ParallelConfig}


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings, composed from the sections above."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for section in (self.model, self.cache, self.scheduler, self.speculative, self.parallel):
            section.validate()
        if self.model.logits_processors and self.speculative.enabled:
            raise ValueError("logits_processors: third-party logits processors and speculative decoding do not "
                             "combine (a verification scores every proposed position at once); use one of them")
        if self.model.enable_prompt_embeds and self.speculative.enabled:
            raise ValueError("enable_prompt_embeds: prompts given as embeddings and speculative decoding do not "
                             "combine (a draft reads the prompt's token ids); use one of them")
        if self.model.enable_prompt_embeds and self.parallel.pipeline_parallel_size > 1:
            raise ValueError("enable_prompt_embeds: the first pipeline stage alone embeds; run one stage")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keywords (`dtype="float32", block_size=16, ...`); unknown ones raise."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in kwargs.items():
            section = field_section(key)
            if section is None:
                known = ", ".join(sorted(all_field_names()))
                raise ValueError(f"unknown engine option {key!r}; known options: {known}")
            parts[section][key] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in parts.items()})


def field_section(name: str) -> Optional[str]:
    """The section that owns the field `name`, or None."""
    for section, klass in SECTIONS.items():
        if name in {f.name for f in dataclasses.fields(klass)}:
            return section
    return None


def all_field_names() -> list[str]:
    """Every flat engine option name."""
    return [f.name for klass in SECTIONS.values() for f in dataclasses.fields(klass)]


@dataclass(frozen=True)
class ServerConfig:
    """How `tokenmill serve` listens, guards and admits requests (limits: docs/reliability.md)."""

    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: Optional[str] = _opt(None, "require 'Authorization: Bearer KEY' on every route but /health and "
                                  "/metrics (also from $TOKENMILL_API_KEY or --api-key-file, which keep it out "
                                  "of the process list)")
    api_key_file: Optional[str] = _opt(None, "read the API key from this file (its first line)")
    tenants_file: Optional[str] = _opt(None, "serve the tenants of this JSON or YAML file, each with its own key "
                                       "(stored as `tokenmill hash-key` prints its hash), limits (requests and tokens "
                                       "per minute, requests at once), priority, weight in the fair share, models "
                                       "and admin right; reloaded on SIGHUP (docs/tenants.md). Instead of --api-key")
    tenant_step_tokens: int = _opt(512, "with a tenants file of two or more tenants: the most prompt tokens one engine "
                                   "step computes (--max-num-prompt-tokens, unless that is lower already; decodes come "
                                   "on top), so that a tenant's new request waits for at most a short step of another "
                                   "tenant's prompts; 0: no such cap")
    metrics_require_key: bool = _opt(False, "put /metrics behind the API key too (by default Prometheus and "
                                     "routers scrape it without one)")
    enable_sleep_mode: bool = _opt(False, "serve vLLM's sleep routes (POST /sleep?level=1|2, POST /wake_up?tags=, "
                                   "GET /is_sleeping; CPU; they need the API key, as every route that changes what "
                                   "the server serves): level 1 gives the KV pool's memory back, level 2 the weights' "
                                   "too (docs/rl.md)")
    state_dir: Optional[str] = _opt(None, "where the server keeps what outlives a request: the Files API's files "
                                    "(batch inputs and results) and, in state.sqlite3, the stored Responses, so a "
                                    "restarted server continues a previous_response_id conversation. Default: a "
                                    "temporary folder for files, Responses in memory, both gone with the server")
    files_max_mb: int = _opt(1024, "the most the Files API stores in all (MiB); an upload beyond it gets a 413")
    batch_max_concurrency: int = _opt(4, "requests of Batch API batches in the engine at once: batches take this "
                                      "much of the engine and interactive requests the rest")
    served_model_name: Optional[str] = _opt(None, "model name clients use (default: the model argument)")
    max_waiting_requests: int = _opt(256, "answer 429 (with Retry-After) when this many requests already wait; "
                                     "requests from arrival to end are bounded by max_num_seqs plus this")
    max_waiting_tokens: int = _opt(65536, "answer 429 when the waiting requests' prompt tokens plus a new "
                                   "prompt's would pass this (a prompt is always admitted when none waits)")
    max_request_body_mb: float = _opt(8.0, "largest request body in MiB (413 past it)")
    max_prompts_per_request: int = _opt(64, "most prompts in one /v1/completions request")
    max_stop_strings: int = _opt(64, "most stop strings in one request (each at most 1024 characters)")
    max_logit_bias: int = _opt(1024, "most logit_bias entries in one request")
    max_tools: int = _opt(128, "most tools in one chat request")
    max_constraint_kb: float = _opt(64.0, "largest output constraint (JSON schema, regex, grammar, choice list) "
                                    "or tool parameter schema, in KiB of JSON text")
    grammar_compile_timeout: float = _opt(10.0, "seconds an output constraint may take to compile (400 past it; "
                                          "compiled constraints are cached)")
    shutdown_timeout: float = _opt(30.0, "seconds running requests may finish after SIGTERM before abort")
    otlp_traces_endpoint: Optional[str] = _opt(
        None, "send an OpenTelemetry trace of every request (a span from arrival to end with its queue, prefill "
        "and decode phases, continuing the caller's W3C traceparent) to this OTLP/HTTP collector, e.g. "
        "http://localhost:4318 (docs/scale-out.md, Traces)")
    lora_modules: Optional[list[str]] = _opt(
        None, "LoRA adapters to serve from the start (needs --enable-lora), each as name=path or vLLM's JSON "
        "'{\"name\": ..., \"path\": ...}'; requests choose one by its name as `model`", nargs="+")
    reasoning_parser: Optional[str] = _opt(
        None, "split a reasoning model's thinking (<think>...</think>) from its answer: deepseek_r1 (DeepSeek-R1 "
        "and its distills), qwen3 (Qwen3, SmolLM3), glm45 (GLM-4.5/4.6), or openai_gptoss (GPT-OSS: "
        "its analysis channel, read by harmony, as it is with this unset); chat answers carry it as "
        "reasoning_content, Responses as reasoning items, Messages as thinking blocks, and output constraints "
        "apply after it (on GPT-OSS they are refused for now)", choices=["deepseek_r1", "qwen3", "glm45", "openai_gptoss"])
    tool_call_parser: str = _opt(
        "auto", "the syntax tool calls are read in when tool_choice is auto: hermes (<tool_call>{...}</tool_call>; "
        "Qwen), llama3_json, mistral ([TOOL_CALLS]), pythonic ([f(x=1)]), glm45 (<tool_call>f<arg_key>...; "
        "GLM-4.5/4.6), granite (<|tool_call|>[...]), deepseek_v3 (DeepSeek-V3, R1), deepseek_v31 (DeepSeek-V3.1), "
        "openai (GPT-OSS's harmony, as it is with auto), or auto (from the chat template; hermes when it names none)",
        choices=["auto", "hermes", "llama3_json", "mistral", "pythonic", "glm45", "granite", "deepseek_v3",
                 "deepseek_v31", "openai"])
    max_stored_responses: int = _opt(1000, "responses /v1/responses keeps for previous_response_id and GET "
                                     "(store: true); the oldest is dropped past it")
    max_stored_responses_mb: float = _opt(256.0, "the most the stored responses hold in all, each counted as its "
                                          "response's and conversation's JSON (MiB); the oldest are dropped "
                                          "past it")
    data_parallel_size: int = _opt(1, "engine processes (replicas of the whole model) behind this port, each "
                                   "request sent to the one with the least outstanding tokens once its cached "
                                   "prefix is counted (from the replicas' KV events; docs/scale-out.md)")
    allowed_local_media_path: Optional[str] = _opt(
        None, "image inputs: read file:// image URLs, only of files below this folder (symlinks resolved; vLLM's "
        "flag); default: no local files are read")
    allowed_media_domains: Optional[list[str]] = _opt(
        None, "image inputs: fetch http(s):// image URLs from these hosts only (exact names, e.g. "
        "images.example.com); default: nothing is fetched, images come as data:image/...;base64 URLs", nargs="+")
    limit_mm_per_prompt: int = _opt(8, "image inputs: most images one prompt may hold (a 400 past it); a number, or "
                                    "vLLM's JSON form '{\"image\": N}'", parse=image_limit)
    max_image_pixels: int = _opt(4096 * 4096, "image inputs: largest image, in pixels (width x height, read from "
                                 "its header before it is decoded; a 400 past it)")
    media_fetch_timeout: float = _opt(10.0, "image inputs: seconds fetching one http(s) image may take")
    ssl_keyfile: Optional[str] = _opt(None, "serve HTTPS: the server's private key (PEM), with --ssl-certfile")
    ssl_certfile: Optional[str] = _opt(None, "serve HTTPS: the server's certificate chain (PEM), with --ssl-keyfile")
    ssl_ca_certs: Optional[str] = _opt(None, "HTTPS: the CA certificates (PEM) client certificates are checked "
                                       "against (with --ssl-cert-reqs 1 or 2)")
    ssl_cert_reqs: int = _opt(0, "HTTPS: client certificates: 0 not asked for, 1 checked when a client sends one, "
                              "2 required (Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)", choices=[0, 1, 2])
    allowed_origins: Optional[list[str]] = _opt(
        None, "CORS: the browser origins (https://app.example.com, or *) whose pages may call the API; default: "
        "none, no CORS headers are sent (vLLM allows every origin by default)", nargs="+")
    allowed_methods: Optional[list[str]] = _opt(None, "CORS: the methods those origins may use (default: all)",
                                                nargs="+")
    allowed_headers: Optional[list[str]] = _opt(None, "CORS: the request headers those origins may send (default: "
                                                "all)", nargs="+")
    allow_credentials: bool = _opt(False, "CORS: let those origins send cookies and HTTP authentication")

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_prompts_per_request", "max_stop_strings", "max_logit_bias", "max_tools",
                     "max_stored_responses", "limit_mm_per_prompt", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_request_body_mb", "max_constraint_kb", "grammar_compile_timeout", "media_fetch_timeout",
                     "max_stored_responses_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        if self.tenants_file is not None and (self.api_key is not None or self.api_key_file is not None):
            raise ValueError("give tenants_file or an API key, not both (an admin tenant of the file does what "
                             "the API key does)")
        if self.tenants_file is not None and self.data_parallel_size > 1:
            raise ValueError("tenants_file with data_parallel_size > 1 is not supported yet: the front would have "
                             "to keep each tenant's budget across the replicas")
        if self.tenant_step_tokens < 0:
            raise ValueError(f"tenant_step_tokens must be >= 0 (0: no cap on a step's prompt tokens), got "
                             f"{self.tenant_step_tokens}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder")
        for domain in self.allowed_media_domains or ():
            if not domain or "/" in domain:
                raise ValueError(f"allowed_media_domains takes host names (images.example.com), got {domain!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile come together: give both to serve HTTPS")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)!r} is not a file")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if (self.ssl_cert_reqs or self.ssl_ca_certs) and self.ssl_certfile is None:
            raise ValueError("ssl_cert_reqs and ssl_ca_certs check client certificates over HTTPS: give ssl_keyfile "
                             "and ssl_certfile too")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs 1 or 2 checks client certificates against ssl_ca_certs: give it")
        if self.allow_credentials and "*" in (self.allowed_origins or ()):
            raise ValueError("allow_credentials with allowed_origins '*' would let every site's pages call the API "
                             "with a user's credentials: name the origins")

    def resolved_api_key(self) -> Optional[str]:
        """The API key from --api-key, --api-key-file or $TOKENMILL_API_KEY (in that order), or None."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as handle:
                    key = handle.readline().strip()
            except OSError as exc:
                raise ValueError(f"api_key_file {self.api_key_file!r} cannot be read: {exc.strerror}") from None
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file!r} is empty")
            return key
        return envs.api_key()
