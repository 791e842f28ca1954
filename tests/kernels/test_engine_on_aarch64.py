"""The engine on the aarch64 kernels (`make test-arm` only: tests/kernels/conftest.py collects this file under
TOKENMILL_TEST_AARCH64=1), served as an ARM machine serves it: the `generic` level chosen, float32 by default (no
native bfloat16 there), every native product, norm, RoPE, KV write and attention call run by the aarch64 build
under qemu.

- A tiny Llama in float32 gives HF float32's greedy ids and logprobs, plain, chunked, preempted and after a
  prefix hit (helpers/family_check.py).
- With int8 weights the fused decode step (tm_decode_step, whose structures the call server rebuilds there) gives
  the module path's bits, and a request's bits do not depend on its batch.

About a minute under qemu (a few thousand kernel calls, each a round trip to the aarch64 process)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine_probe import EIGHT_PROMPTS
from helpers.family_check import check_alone_equals_batched, check_family

from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels, isa
from tokenmill.models.fused_decode import FusedDecode


@pytest.fixture
def aarch64_process(aarch64_kernels):
    """This process as an aarch64 machine's: the generic level chosen, its kernels the aarch64 build."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(isa, "chosen_level", lambda: isa.GENERIC)
        patch.setattr(cpu_kernels, "chosen_level", lambda: isa.GENERIC)
        patch.setitem(cpu_kernels._loaded, isa.GENERIC.name, aarch64_kernels)
        yield aarch64_kernels


def test_a_tiny_llama_on_the_aarch64_kernels_gives_hf_float32s_greedy_ids(aarch64_process, tmp_path):
    from transformers import AutoModelForCausalLM

    assert not isa.native_bf16() and cpu_kernels.cpu_kernels() is aarch64_process
    path = make_tiny_hf_model(tmp_path / "llama", arch="llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    check_family(path, hf, count=16)


def test_the_fused_decode_step_on_the_aarch64_kernels_gives_the_module_paths_bits(aarch64_process, tmp_path,
                                                                                   monkeypatch):
    path = make_tiny_hf_model(tmp_path / "llama", arch="llama")
    steps = []
    fused_step = FusedDecode.__call__

    def counted(self, *args):
        result = fused_step(self, *args)
        steps.append(result is not None)  # None: the step fell back to the module path
        return result

    monkeypatch.setattr(FusedDecode, "__call__", counted)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for fused in (True, False):
        llm = LLM(str(path), block_size=8, num_kv_blocks=64, quantization="int8", fused_decode=fused)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in EIGHT_PROMPTS], params, use_tqdm=False)
        results[fused] = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                                    for step in o.outputs[0].logprobs]) for o in outputs]
        llm.shutdown()
    assert steps and all(steps), "the fused step ran every step of the fused engine"
    assert results[True] == results[False]
    check_alone_equals_batched(path, quantization="int8")
