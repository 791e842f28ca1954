"""The engine on the aarch64 kernels (`make test-arm` only: tests/kernels/conftest.py collects this file under
TOKENMILL_TEST_AARCH64=1): a tiny Llama served as an ARM machine serves it — the `generic` level chosen, float32 by
default (no native bfloat16 there), every native product, norm, RoPE, KV write and attention call run by the
aarch64 build under qemu — gives HF float32's greedy ids and logprobs, plain, chunked, preempted and after a
prefix hit (helpers/family_check.py).

The fused decode step (tm_decode_step) is off: its structures carry raw addresses, which the call server cannot
map into the aarch64 process; it runs the kernels tested here in the same order (kernels/decode_step.c).
About 30 s under qemu (a few thousand kernel calls, each a round trip to the aarch64 process)."""

from __future__ import annotations

import pytest
import torch

from helpers.family_check import check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.kernels import cpu_kernels, isa


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
    check_family(path, hf, count=16, fused_decode=False)
