"""vLLM's --speculative-config (JSON, or a dict in LLM(...)) read into the speculative flags, and its refusals."""

import argparse

import pytest

from tokenmill.cli.engine_args import add_engine_args, engine_kwargs
from tokenmill.config import EngineConfig


def flags(config: EngineConfig) -> tuple:
    spec = config.speculative
    return spec.speculative_method, spec.draft_model, spec.num_speculative_tokens


@pytest.mark.parametrize("json_form, flag_form", [
    ({"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 3},
     dict(speculative_method="eagle3", draft_model="/heads/e3", num_speculative_tokens=3)),
    ({"method": "mtp", "num_speculative_tokens": 1}, dict(speculative_method="mtp", num_speculative_tokens=1)),
    ({"method": "deepseek_mtp"}, dict(speculative_method="mtp")),
    ({"method": "glm4_moe_mtp"}, dict(speculative_method="mtp")),
    ({"method": "draft_model", "model": "/m/draft"}, dict(speculative_method="draft", draft_model="/m/draft")),
    ({"method": "ngram", "prompt_lookup_max": 3}, dict(speculative_method="ngram", prompt_lookup_max=3)),
])
def test_the_json_form_sets_what_the_flags_set(json_form, flag_form):
    by_flags = EngineConfig.from_kwargs(**flag_form).speculative
    for given in (json_form, __import__("json").dumps(json_form)):
        by_json = EngineConfig.from_kwargs(speculative_config=given).speculative
        for name in ("speculative_method", "draft_model", "num_speculative_tokens", "prompt_lookup_max"):
            assert getattr(by_json, name) == getattr(by_flags, name)


def test_the_flag_agreeing_with_the_json_form_is_accepted():
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                      speculative_method="ngram", num_speculative_tokens=2)
    assert flags(config) == ("ngram", None, 2)


def test_a_flag_conflicting_with_the_json_form_names_both():
    with pytest.raises(ValueError, match="speculative_config.*num_speculative_tokens"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                 num_speculative_tokens=5)
    with pytest.raises(ValueError, match="speculative_config sets speculative_method.*'ngram'"):
        EngineConfig.from_kwargs(speculative_config={"method": "mtp"}, speculative_method="ngram")


@pytest.mark.parametrize("given, message", [
    ({"method": "medusa"}, "method 'medusa' is not supported"),
    ({"model": "x"}, "needs a method"),
    ({"method": "ngram", "temperature": 1}, "key 'temperature' is not supported"),
    ({"method": "eagle3", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
    ({"method": "eagle3"}, "'eagle3' needs draft_model"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not JSON"),
])
def test_bad_speculative_configs_are_refused_by_name(given, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=given)


def test_draft_num_layers_applies_to_draft_models_only():
    with pytest.raises(ValueError, match="draft_num_layers applies only"):
        EngineConfig.from_kwargs(speculative_config={"method": "eagle3", "model": "/h"}, draft_num_layers=2)


def test_the_cli_flag_takes_json():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}'])
    assert flags(EngineConfig.from_kwargs(**engine_kwargs(args))) == ("eagle3", "/h", 2)
    with pytest.raises(SystemExit):  # argparse reports a value that is no JSON object
        parser.parse_args(["--speculative-config", "eagle3"])
