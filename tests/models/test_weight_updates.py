"""Weight updates in place, as an RL trainer drives them (LLMEngine.update_weights_from_disk): generate, load a
second checkpoint of the same model, generate again: the outputs are a fresh engine's on the new weights (ids and
logprobs, bit for bit, in float32 and with int8-packed products), nothing the old weights cached is found again,
and a checkpoint of another shape or format is refused before anything changes, the served weights untouched.

Cost: tiny checkpoints written without transformers; six engines of ~0.3 s."""

from __future__ import annotations

import shutil

import pytest

from helpers.rl_checkpoints import write_rl_checkpoints
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [900, 901, 902, 903, 904, 905, 906, 907, 908, 909]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
ENGINE = dict(num_kv_blocks=32, block_size=4)


def _ids_and_logprobs(outputs) -> list:
    return [(tuple(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in step.items())
                                             for step in o.outputs[0].logprobs]) for o in outputs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_rl_checkpoints(tmp_path_factory.mktemp("rl"), seed=5)


@pytest.mark.parametrize("options", [dict(dtype="float32", quantization="none"), dict(quantization="int8")],
                         ids=["float32", "int8"])
def test_generate_update_generate_gives_a_fresh_engines_output_on_the_new_weights(checkpoints, options):
    old, new, narrower = checkpoints
    llm = LLM(old, **ENGINE, **options)
    before = _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    assert llm.llm_engine.kv_cache.pool.cached  # the prompts' blocks are cached: the old weights' K/V
    assert llm.update_weights_from_disk(new) > 0
    hits = llm.llm_engine.stats().prefix_cache_hits
    after = _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    assert llm.llm_engine.stats().prefix_cache_hits == hits  # nothing the old weights computed was found
    fresh = _ids_and_logprobs(LLM(new, **ENGINE, **options).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                     PARAMS, use_tqdm=False))
    assert after == fresh and after != before
    # a checkpoint of another shape: refused before anything is copied, the new weights go on serving
    with pytest.raises(ValueError, match="served ones are unchanged: weight shape mismatch: checkpoint .49151, 64."):
        llm.update_weights_from_disk(narrower)
    again = _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    assert again == fresh


def test_two_tensor_parallel_ranks_each_load_their_shard_of_the_new_weights(checkpoints):
    """update_weights_from_disk on two ranks in worker processes: each loads its own shard of the new checkpoint, and
    the outputs are the one-rank engine's on the new weights (float32: the ranks' partial sums add up exactly); then
    the old checkpoint's tensors, as update_weights_from_distributed hands what a trainer sent to every rank, give
    the old weights' outputs back."""
    from safetensors.torch import load_file

    old, new, _ = checkpoints
    options = dict(ENGINE, dtype="float32", quantization="none")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(old, **options, tensor_parallel_size=2)
    try:
        assert llm.update_weights_from_disk(new) > 0
        after = _ids_and_logprobs(llm.generate(prompts, PARAMS, use_tqdm=False))
        llm.llm_engine.executor.call("load_weights_from_tensors", (load_file(f"{old}/model.safetensors"),))
        assert llm.reset_prefix_cache()  # (as update_weights_from_distributed does after the ranks' loads)
        back = _ids_and_logprobs(llm.generate(prompts, PARAMS, use_tqdm=False))
    finally:
        llm.shutdown()
    assert after == _ids_and_logprobs(LLM(new, **options).generate(prompts, PARAMS, use_tqdm=False))
    assert back == _ids_and_logprobs(LLM(old, **options).generate(prompts, PARAMS, use_tqdm=False)) != after


def test_a_checkpoint_of_another_config_is_refused_naming_the_setting(checkpoints, tmp_path):
    import json

    old, _, _ = checkpoints
    other = tmp_path / "other"
    shutil.copytree(old, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 5e5}))
    llm = LLM(old, **ENGINE, dtype="float32", quantization="none")
    with pytest.raises(ValueError, match=r"served ones are unchanged: .* not of the model being served: rope_theta"):
        llm.update_weights_from_disk(str(other))


def test_an_update_waits_for_no_request(checkpoints):
    old, new, _ = checkpoints
    llm = LLM(old, **ENGINE, dtype="float32", quantization="none")
    llm.llm_engine.add_request("running", None, PARAMS, prompt_token_ids=PROMPTS[0])
    llm.llm_engine.step()
    with pytest.raises(ValueError, match="requests are unfinished"):
        llm.update_weights_from_disk(new)
    assert not llm.reset_prefix_cache()  # its blocks are held
    llm.llm_engine.abort_request("running")
    assert llm.reset_prefix_cache()


def test_collective_rpc_reaches_the_worker_extension_methods_and_nothing_else(checkpoints):
    old, _, _ = checkpoints
    llm = LLM(old, **ENGINE, dtype="float32", quantization="none",
              worker_extension_cls="helpers.worker_extensions:Inspector")
    before = _ids_and_logprobs(llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False))
    assert llm.collective_rpc("num_layers") == [llm.llm_engine.arch.num_hidden_layers]
    llm.collective_rpc("scale_final_norm", args=(2.0,))  # the worker's own model, changed in place
    after = _ids_and_logprobs(llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False))
    assert after != before
    for method in ("_private", "execute", "load_weights_from"):
        with pytest.raises(ValueError, match=f"{method!r} is not a method of the worker extension class"):
            llm.collective_rpc(method)
    with pytest.raises(ValueError, match="worker_extension_cls 'helpers.worker_extensions:Missing' not found"):
        LLM(old, **ENGINE, worker_extension_cls="helpers.worker_extensions:Missing")


def test_weights_streamed_by_a_trainer_process_serve_as_a_fresh_engine_and_a_dead_trainer_changes_nothing(
        checkpoints):
    """SGLang's update_weights_from_distributed over a gloo group whose rank 0 is another process (the trainer): it
    sends every tensor of the new checkpoint, then, in a second group, dies after two (one process: ~3 s to start)."""
    import multiprocessing

    from safetensors import safe_open

    from helpers.weight_trainer import broadcast_checkpoint, free_port
    from tokenmill.engine.engine_errors import WeightTransferError

    old, new, _ = checkpoints
    with safe_open(f"{new}/model.safetensors", "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    names = sorted(shapes)
    sent = (names, ["float32"] * len(names), [shapes[n] for n in names])
    ports = [free_port(), free_port()]
    trainer = multiprocessing.get_context("spawn").Process(target=broadcast_checkpoint,
                                                           args=([(ports[0], -1), (ports[1], 2)], new, names))
    trainer.start()
    llm = LLM(old, **ENGINE, dtype="float32", quantization="none")
    before = _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    llm.init_weights_update_group("127.0.0.1", ports[0], 1, 2, group_name=f"weight_update_group_{ports[0]}")
    assert llm.update_weights_from_distributed(*sent) > 0
    assert llm.destroy_weights_update_group()
    after = _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    fresh = _ids_and_logprobs(LLM(new, **ENGINE, dtype="float32", quantization="none").generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    assert after == fresh and after != before
    llm.init_weights_update_group("127.0.0.1", ports[1], 1, 2, group_name=f"weight_update_group_{ports[1]}")
    with pytest.raises(WeightTransferError, match="served weights are unchanged"):
        llm.update_weights_from_distributed(*sent)
    trainer.join(60)
    assert not llm.destroy_weights_update_group()  # the broken group was left
    assert _ids_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                          use_tqdm=False)) == fresh


def test_tensors_sent_for_no_place_in_the_checkpoint_change_nothing(checkpoints):
    import torch

    from tokenmill.models.loader import load_model_source
    from tokenmill.models.weight_update import overlaid_source

    old, _, _ = checkpoints
    source = load_model_source(old, with_tokenizer=False)
    shape = dict(source.weight_stream(False))["lm_head.weight"].shape
    for tensors, problem in (({"lm_head.weight": torch.zeros(shape[0] - 1, shape[1])}, "shape mismatch for 'lm_head"),
                             ({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, "have no place")):
        with pytest.raises(ValueError, match=problem):
            list(overlaid_source(source, tensors).weight_stream(False))
    llm = LLM(old, **ENGINE, dtype="float32", quantization="none")
    with pytest.raises(ValueError, match="no weight-update group"):
        llm.update_weights_from_distributed(["lm_head.weight"], ["float32"], [list(shape)])
    with pytest.raises(ValueError, match="rank_offset 0 must lie in 1..world_size-1"):
        llm.init_weights_update_group("127.0.0.1", 1, 0, 2)
