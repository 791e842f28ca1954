"""A GGUF file's tokenizer, converted without AutoTokenizer's full parse of the file (models/loader/gguf_tokenizer.py),
is AutoTokenizer's own: on the packaged SmolLM2 file, and on tiny files of the architectures whose class or
model type the choice has to get right. Gemma 3 270M's real file was compared once by hand (its AutoTokenizer
conversion takes a minute; docs/architecture.md gives the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tiny_gguf import write_tiny_gguf
from helpers.tokenizer_equality import assert_same_tokenizer
from tokenmill.models.loader.gguf_tokenizer import UnsupportedGGUFTokenizer, load_gguf_tokenizer_directly
from tokenmill.models.loader.resolve import resolve_model_path
from tokenmill.models.loader.tokenizer import gguf_tokenizer_cache_dir, load_gguf_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n\tfriend 😀"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "def f(): pass"}]


def tiny_gguf(tmp_path: Path, architecture: str) -> Path:
    """A tiny file of `architecture` with 512 of SmolLM2's tokens, alone in its folder."""
    (tmp_path / "model").mkdir()
    return write_tiny_gguf(tmp_path / "model" / f"{architecture}.gguf", "F32", architecture=architecture)


def auto_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def refuse_slow_path(monkeypatch) -> None:
    """Make transformers' full parse of a GGUF file (and AutoTokenizer) fail, so a conversion that works took the
    fast path."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    def refused(*args, **kwargs):
        raise AssertionError("the slow path was taken")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", refused)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refused)


def test_smollm2_tokenizer_is_auto_tokenizers(tmp_path, monkeypatch):
    # the real 49k-token file, the one users load by default, against AutoTokenizer's conversion of it: ~7 s of CPU
    # for the oracle and ~3 s for ours, the test's cost (~13 s); the fast path saves the suite more than that in
    # its first loads of this file and Gemma 3's (4 s and 21 s of CPU)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = Path(resolve_model_path(None))
    reference = auto_tokenizer(path)
    with monkeypatch.context() as patched:
        refuse_slow_path(patched)
        ours = load_gguf_tokenizer(path)
    assert (gguf_tokenizer_cache_dir(path) / "tokenizer.json").exists()
    assert_same_tokenizer(ours, reference, tmp_path, MESSAGES)


# llama: TokenizersBackend; qwen2: its own class; qwen2moe: a renamed model type; gemma3: the text config's class;
# olmoe: no transformers config, where tokenmill builds a PreTrainedTokenizerFast (as before)
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen2moe", "gemma3", "olmoe"])
def test_tiny_gguf_tokenizer_is_auto_tokenizers(architecture, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path, architecture)
    try:
        reference = auto_tokenizer(path)
    except ValueError as exc:
        assert architecture == "olmoe" and "is not supported" in str(exc)
        reference = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    with monkeypatch.context() as patched:
        refuse_slow_path(patched)
        ours = load_gguf_tokenizer(path)
    assert_same_tokenizer(ours, reference, tmp_path, MESSAGES)


def test_a_tokenizer_config_beside_the_file_is_left_to_auto_tokenizer(tmp_path, monkeypatch):
    # AutoTokenizer reads a tokenizer_config.json in the file's folder (its tokenizer_class, auto_map): the fast
    # path refuses, and the conversion honours the file as AutoTokenizer does
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path, "llama")
    (path.parent / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(UnsupportedGGUFTokenizer, match="tokenizer_config.json"):
        load_gguf_tokenizer_directly(path)
    assert type(load_gguf_tokenizer(path)) is type(auto_tokenizer(path))
    assert type(auto_tokenizer(path)).__name__ == "GPT2Tokenizer"


def test_another_transformers_release_is_left_to_auto_tokenizer(tmp_path, monkeypatch):
    # the fast path follows the rules of the release it was compared with; another release's AutoTokenizer may
    # pick otherwise, so its files are converted by AutoTokenizer
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    with pytest.raises(UnsupportedGGUFTokenizer, match="5.24"):
        load_gguf_tokenizer_directly(tiny_gguf(tmp_path, "llama"))
