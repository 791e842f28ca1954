"""GPTQ and AWQ checkpoints, written from known integer weights exactly as the formats' reference packers
(AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear) lay them out: loaded with
`--quantization none --dtype float32`, the engine's greedy ids and logprobs equal HF transformers float32
on the same weights as floats; schemes it cannot read are refused at load, by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.engine_probe import assert_greedy_matches_hf
from helpers.tiny_models import make_tiny_hf_model
from tokenmill import LLM

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def known_integers(shape_in_out, groups, bits, rng, act_order):
    """Integer weights [in, out], zero points and scales [groups, out], and each input row's group."""
    rows, cols = shape_in_out
    q = rng.integers(0, 2 ** bits, size=(rows, cols), dtype=np.int64)
    zeros = rng.integers(1, 2 ** bits - 1, size=(groups, cols), dtype=np.int64)
    scales = (rng.random((groups, cols)) * 0.02 + 0.005).astype(np.float16)
    g = np.arange(rows) // (rows // groups)
    if act_order:
        g = rng.permutation(g)
    return q, zeros, scales, g


def gptq_pack(q, zeros, scales, g, bits, act_order):
    """AutoGPTQ's layout (checkpoint_format gptq): rows of qweight and columns of qzeros packed low bits
    first, zeros stored minus one."""
    per = 32 // bits
    qweight = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= (q[row * per + j].astype(np.uint32) << (bits * j))
    stored = zeros - 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= (stored[:, col * per + j].astype(np.uint32) << (bits * j))
    parts = {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32), "scales": scales}
    if act_order:
        parts["g_idx"] = g.astype(np.int32)
    return parts


def awq_pack(q, zeros, scales):
    """AutoAWQ's GEMM layout: columns of qweight and qzeros packed in the order 0 2 4 6 1 3 5 7."""
    def pack(values):
        packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
        for col in range(packed.shape[1]):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
        return packed.view(np.int32)
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}


def write_pair(base, tmp_path, method, bits=4, group_size=32, act_order=False):
    """(folder of the packed checkpoint, folder of the same weights as floats)."""
    rng = np.random.default_rng(7)
    state = load_file(str(base / "model.safetensors"))
    packed, floats = {}, {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            packed[name] = floats[name] = tensor
            continue
        rows, cols = tensor.shape[1], tensor.shape[0]  # [in, out]
        q, zeros, scales, g = known_integers((rows, cols), rows // group_size, bits, rng, act_order)
        weight = (torch.from_numpy(q - zeros[g]).float() * torch.from_numpy(scales[g]).float()).t().contiguous()
        floats[name] = weight
        parts = gptq_pack(q, zeros, scales, g, bits, act_order) if method == "gptq" else awq_pack(q, zeros, scales)
        packed.update({f"{prefix}.{part}": torch.from_numpy(np.ascontiguousarray(value))
                       for part, value in parts.items()})
    folders = []
    for kind, tensors in (("packed", packed), ("float", floats)):
        folder = tmp_path / kind
        shutil.copytree(base, folder)
        save_file(tensors, str(folder / "model.safetensors"))
        if kind == "packed":
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = (
                {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                 "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True})
            (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.mark.parametrize("method, bits, act_order", [("gptq", 4, False), ("gptq", 4, True), ("gptq", 8, False),
                                                     ("awq", 4, False)])
def test_a_packed_checkpoint_runs_as_hf_on_its_float_weights(base, tmp_path, method, bits, act_order):
    packed, floats = write_pair(base, tmp_path, method, bits, act_order=act_order)
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()
    llm = LLM(str(packed), quantization="none", dtype="float32", num_kv_blocks=256)
    assert_greedy_matches_hf(llm, hf)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits 3: only 4- and 8-bit GPTQ"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "only 4-bit AWQ in the GEMM layout"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq' is not supported"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
])
def test_a_scheme_it_cannot_read_is_refused_by_name(base, tmp_path, config, message):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


@pytest.mark.parametrize("method, bits, group_size, act_order, kept", [
    ("gptq", 4, 32, False, "int4"), ("gptq", 8, 64, False, "int8"), ("awq", 4, 64, False, "int4"),
    ("gptq", 4, 32, True, None),  # activation order shuffles rows across groups: dequantised
    ("gptq", 4, 16, False, None),  # groups of 16 inputs: no 32-input run has one scale
])
def test_layers_stay_packed_where_the_format_maps_exactly(base, tmp_path, method, bits, group_size, act_order,
                                                          kept):
    """By default each packed layer becomes the native products' layout (int4 for 4 bits, int8 for 8) and
    dequantises to exactly the float weights; layers whose groups do not map come as those floats."""
    from tokenmill.kernels.quantized import QuantizedWeight
    from tokenmill.models.loader import load_model_source

    packed, floats = write_pair(base, tmp_path, method, bits, group_size, act_order)
    expected = load_file(str(floats / "model.safetensors"))
    seen = 0
    for name, weight in load_model_source(str(packed), with_tokenizer=False).iter_weights(keep_quantized=True):
        if name.rpartition(".")[0].rpartition(".")[2] not in LINEARS:
            continue
        seen += 1
        if kept is None:
            assert isinstance(weight, torch.Tensor)
        else:
            assert isinstance(weight, QuantizedWeight) and weight.format == kept
            weight = weight.dequantize()
        assert torch.equal(weight, expected[name]), name
    assert seen == 7 * 2  # two layers of seven projections


@pytest.mark.parametrize("method, bits", [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_served_packed_its_products_follow_the_float_weights(base, tmp_path, method, bits):
    """Served packed (the default), the products take int8 activations against the checkpoint's own
    integers: perplexity within 3% of the same weights served as floats, and the logprobs close."""
    from helpers.engine_probe import EIGHT_PROMPTS, perplexity

    packed, floats = write_pair(base, tmp_path, method, bits, group_size=64)
    served = LLM(str(packed), dtype="float32", num_kv_blocks=256)
    reference = LLM(str(floats), quantization="none", dtype="float32", num_kv_blocks=256)
    text = [token for prompt in EIGHT_PROMPTS for token in prompt]
    ratio = perplexity(served, text) / perplexity(reference, text)
    assert abs(ratio - 1) <= 0.03, ratio


LAYER = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({f"{LAYER}.qweight": s[f"{LAYER}.qweight"].float()}),
     f"model.safetensors: {LAYER}.qweight is torch.float32 \\[8, 64\\]; the gptq format stores int32"),
    (lambda s: s.update({f"{LAYER}.scales": s[f"{LAYER}.scales"][:1]}),
     f"model.safetensors: {LAYER}: the gptq tensors do not agree: qweight unpacks to \\[64, 64\\]"),
    (lambda s: s.update({f"{LAYER}.qweight": s[f"{LAYER}.qweight"][:4]}),
     f"model.safetensors: {LAYER}: the gptq tensors do not agree: qweight unpacks to \\[32, 64\\]"),
])
def test_tensors_that_contradict_the_format_are_refused_naming_file_and_tensor(base, tmp_path, change, message):
    packed, _ = write_pair(base, tmp_path, "gptq", 4)
    state = load_file(str(packed / "model.safetensors"))
    change(state)
    save_file(state, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(packed), num_kv_blocks=64)


def test_a_truncated_file_is_refused_naming_it(base, tmp_path):
    packed, _ = write_pair(base, tmp_path, "awq", 4)
    path = packed / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file .*download it again"):
        LLM(str(packed), num_kv_blocks=64)
