"""README's support table (tokenmill/support_table.py): README holds exactly the generated block, every architecture
the loader accepts has a record whose representative config the loader reads as that architecture, and the checks
the table asks are the ones the engine applies at start. No model is built: the cost is the imports (~0.1 s past
them)."""

import dataclasses
from pathlib import Path

import pytest

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.config_checks import for_model
from tokenmill.models.loader.hf_config import SUPPORTED_ARCHITECTURES
from tokenmill.models.registry import supported_architectures
from tokenmill.models.support import ARCHITECTURE_SUPPORT
from tokenmill.models.vision.config import VISION_ARCHITECTURES
from tokenmill.support_table import (END, START, WRITE_COMMAND, readme_block, representative_arch,
                                     support_table_markdown, with_generated_block)
from tokenmill.worker.worker import check_divisible

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_holds_the_generated_table():
    generated = support_table_markdown()
    assert readme_block(README.read_text(encoding="utf-8")) == generated, (
        f"README's support table is stale: run `{WRITE_COMMAND}` and commit README.md")


def test_every_architecture_has_a_record_whose_config_is_read_as_it():
    assert set(ARCHITECTURE_SUPPORT) == {*SUPPORTED_ARCHITECTURES, *VISION_ARCHITECTURES}
    assert set(supported_architectures()) == set(SUPPORTED_ARCHITECTURES)  # the registry builds every one
    for name in SUPPORTED_ARCHITECTURES:
        assert representative_arch(name).architecture == name
    for name in VISION_ARCHITECTURES:
        decoder = ARCHITECTURE_SUPPORT[name].decoder
        assert ARCHITECTURE_SUPPORT[name].vision and (decoder is None or decoder in SUPPORTED_ARCHITECTURES)


def test_mamba_layers_refuse_tensor_parallelism_at_start():
    # said by check_divisible before any worker starts (the layers also refuse, inside the workers)
    for name in ("Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM"):
        with pytest.raises(ValueError, match=f"{name} runs at tensor_parallel_size 1 .*Mamba2 mixers are not sharded"):
            check_divisible(representative_arch(name), 2)
        check_divisible(representative_arch(name), 1, pp_size=2)
    check_divisible(representative_arch("LlamaForCausalLM"), 2)


def test_recurrent_models_lose_prefix_caching_and_speculate_on_one_rank():
    mamba, llama = representative_arch("Mamba2ForCausalLM"), representative_arch("LlamaForCausalLM")
    assert not for_model(EngineConfig(), mamba).cache.prefix_caching
    assert for_model(EngineConfig(), llama).cache.prefix_caching
    ngram = EngineConfig(speculative=SpeculativeConfig(speculative_method="ngram"))
    assert for_model(ngram, mamba).speculative.enabled and for_model(ngram, llama).speculative.enabled
    two_stages = dataclasses.replace(ngram, parallel=dataclasses.replace(ngram.parallel, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="speculative decoding: Mamba2ForCausalLM keeps a recurrent state .* one rank"):
        for_model(two_stages, mamba)
    eagle3 = EngineConfig(speculative=SpeculativeConfig(speculative_method="eagle3", draft_model="head"))
    for name in ("NemotronHForCausalLM", "FalconH1ForCausalLM"):  # decoder layers that are not the checkpoint's
        with pytest.raises(ValueError, match=f"eagle3: {name} runs its checkpoint's layers as decoder layers"):
            for_model(eagle3, representative_arch(name))


def test_the_block_is_rewritten_between_the_markers_only():
    readme = f"intro\n{START}\nold table\n{END}\noutro\n"
    assert with_generated_block(readme) == f"intro\n{START}\n{support_table_markdown()}{END}\noutro\n"
    with pytest.raises(ValueError, match="support-table:end"):
        with_generated_block(f"intro\n{START}\nold table\n")
