"""GPT-OSS (GptOssForCausalLM): a tiny random checkpoint (a sliding layer then a full one, attention sinks, biased
q/k/v/o, YaRN, 8 biased experts with the clamped SwiGLU, routed top-k-then-softmax by a biased router) gives HF
float32's greedy ids and logprobs in every mode the engine schedules a request in, on the CPU default (native
kernels) and on the reference and Triton backends; a request's output in the default dtype does not depend on its
batch; its MXFP4 experts as shipped load dequantised to what transformers dequantises them to.

Cost: check_family about 4 s, the batch-invariance run 1 s, the two other backends 3 prompts x 4 tokens (Triton's
interpreter runs every kernel program in Python), the MXFP4 checkpoint one engine run of 3 prompts x 8 tokens; the
checkpoint and the HF model are built once per module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_sample_matches_hf
from helpers.family_check import check_alone_equals_batched, check_family
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_kernels import cpu_kernels
from tokenmill.models.loader.hf_config import arch_config_from_hf
from tokenmill.models.loader.mxfp4 import E2M1_VALUES, dequantize_mxfp4

SHORT_PROMPTS = [list(range(300, 100, -9)), [2, 3], [7, 8, 9] * 4]  # the first past the window of 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss")


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_gpt_oss_equals_hf(folder, hf):
    check_family(folder, hf)


@pytest.mark.skipif(cpu_kernels() is None, reason="batch invariance comes from the native kernels' products")
def test_gpt_oss_request_alone_equals_it_in_a_batch_in_the_default_dtype(folder):
    check_alone_equals_batched(folder)


def assert_short_runs_equal_hf(path, hf, count, **engine):
    """SHORT_PROMPTS together, prefilled in 16-token chunks beside the others' decodes: HF's greedy ids, logprobs
    within 1e-4."""
    params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=64,
              max_num_batched_tokens=16, **engine)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in SHORT_PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    for ids, output in zip(SHORT_PROMPTS, outputs):
        assert_sample_matches_hf(hf, ids, output.outputs[0], mode=str(engine))


@pytest.mark.parametrize("backend", ["torch_ref", "triton_paged"])
def test_gpt_oss_equals_hf_on_the_reference_and_triton_backends(folder, hf, backend):
    # the backends check_family's CPU default does not run; with Triton's products, as a GPU runs them (its
    # experts one by one: the fused MoE kernels do not take them yet)
    options = dict(linear_kernel="triton", batch_invariant=False) if backend == "triton_paged" else {}
    assert_short_runs_equal_hf(folder, hf, 4, attention_backend=backend, **options)


def test_gpt_oss_config(folder):
    arch = arch_config_from_hf(folder)
    assert arch.attention_sinks and arch.attention_bias and arch.attention_out_bias
    assert arch.layer_types == ("sliding_attention", "full_attention") and arch.sliding_window == 16
    moe = arch.moe
    assert (moe.scoring, moe.router_bias, moe.swiglu_limit, moe.swiglu_alpha, moe.top_k) == \
        ("topk_softmax", True, 0.6, 1.702, 2)
    assert arch.rope_scaling.kind == "yarn" and not arch.rope_scaling.truncate


def test_gpt_oss_unsupported_activation_is_refused_by_name(folder, tmp_path):
    copy = tmp_path / "model"
    copy.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        arch_config_from_hf(copy)


def quantize_mxfp4(weight):
    """MXFP4 (blocks, scales) of `weight` [..., rows, cols] (cols a multiple of 32), the reference way: per group of
    32, the e8m0 exponent floor(log2(max |x|)) - 2 (e2m1's largest magnitude is 6 = 1.5 * 2^2), each value the
    nearest e2m1 code of x / 2^exponent (clamped to +-6); two codes a byte, the first in the low nibble."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100))) - 2
    scaled = (groups / torch.exp2(exponent).unsqueeze(-1)).clamp(-6, 6)
    codes = (scaled.unsqueeze(-1) - torch.tensor(E2M1_VALUES)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_mxfp4_equals_transformers(folder):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (3, 5, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 5]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(-1, -2), theirs)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_mxfp4_experts_load_dequantised_as_transformers_dequantises_them(folder, tmp_path):
    # the checkpoint as OpenAI ships it: experts' gate_up_proj and down_proj as *_blocks / *_scales (rows the output
    # features), quant_method mxfp4; HF's oracle runs on a float copy holding transformers' dequantisation of them
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "float"
    for path in (quantized, dequantized):
        shutil.copytree(folder, path)
    tensors = load_file(folder / "model.safetensors")
    packed, floats = {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(-1, -2))  # [E, out, in]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            floats[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert not torch.equal(floats[name], tensor)  # 4-bit: not the float weights
        else:
            packed[name] = tensor
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    assert_short_runs_equal_hf(quantized, hf, 8)
