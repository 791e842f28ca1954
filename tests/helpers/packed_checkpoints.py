"""Quantised checkpoints for tests, written as the formats' own tools write them: GPTQ and AWQ from known
integer weights exactly as their reference packers lay them out (AutoGPTQ's QuantLinear.pack, AutoAWQ's
WQLinear_GEMM.from_linear), `quant_method: fp8` in DeepSeek's block layout, compressed-tensors by the
compressed-tensors library itself."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fused projections of one input
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def known_integers(shape_in_out, groups, bits, rng, act_order):
    """Integer weights [in, out], zero points and scales [groups, out], and each input row's group."""
    rows, cols = shape_in_out
    q = rng.integers(0, 2 ** bits, size=(rows, cols), dtype=np.int64)
    zeros = rng.integers(1, 2 ** bits - 1, size=(groups, cols), dtype=np.int64)
    scales = (rng.random((groups, cols)) * 0.003 + 0.001).astype(np.float16)  # weights of a trained model's size
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
    """(folder of the packed checkpoint, folder of the same weights as floats). In activation order the
    projections of one input (q/k/v, gate/up) share one g_idx, as GPTQ orders a layer's inputs by the
    activations they see."""
    rng = np.random.default_rng(7)
    state = load_file(str(base / "model.safetensors"))
    packed, floats, orders = {}, {}, {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            packed[name] = floats[name] = tensor
            continue
        rows, cols = tensor.shape[1], tensor.shape[0]  # [in, out]
        q, zeros, scales, g = known_integers((rows, cols), rows // group_size, bits, rng, act_order)
        parent, _, projection = prefix.rpartition(".")
        g = orders.setdefault((parent, "input" if projection in SHARED_INPUT else projection), g)
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


def write_compressed(base, folder, preset, group_size=32, ignore=("lm_head",)):
    """The tiny model in bfloat16 (as llm-compressor saves models: bfloat16 scales) quantised with the preset
    scheme (min/max scales from compressed-tensors' own calculate_qparams), compressed and saved by
    ModelCompressor; returns the float32 folder of the weights the library decompresses it to."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, "quantization_scheme"):
            args, weight = module.quantization_scheme.weights, module.weight.data
            if args.strategy == "group":
                blocks = weight.view(weight.shape[0], -1, args.group_size)
                low, high = blocks.amin(-1), blocks.amax(-1)
            elif args.strategy == "block":
                low, high = _block_extremes(weight, *args.block_structure)
            elif args.strategy == "channel":
                low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
            else:
                low, high = weight.amin().view(1), weight.amax().view(1)
            scale, zero = calculate_qparams(low.clamp(max=0), high.clamp(min=0), args)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    shutil.copytree(base, folder)  # the tokenizer; the weights and config.json are written over
    model.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    compressor.decompress_model(model.float())  # in float32: (v - zp) s exactly, as the oracle needs
    floats = folder.parent / f"{folder.name}-floats"
    shutil.copytree(base, floats)
    state = {name: tensor.float() for name, tensor in load_file(str(base / "model.safetensors")).items()}
    for name, tensor in model.named_parameters():  # the saved embedding and norms, and decompressed linears
        if name in state:
            state[name] = tensor.data.float().contiguous()
    save_file(state, str(floats / "model.safetensors"))
    return floats


def _block_extremes(weight, rows, cols):
    """Per rows x cols block of a [out, in] weight (edge blocks partial): the min and the max."""
    out, width = weight.shape
    low = torch.empty(-(-out // rows), -(-width // cols), dtype=weight.dtype)
    high = torch.empty_like(low)
    for i in range(low.shape[0]):
        for j in range(low.shape[1]):
            block = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            low[i, j], high[i, j] = block.min(), block.max()
    return low, high


def write_fp8_checkpoint(base, folder, block=(128, 128)):
    """The tiny model's projections as a `quant_method: fp8` checkpoint laid out as DeepSeek-V3 and
    Qwen3-FP8 ship theirs (transformers' fine-grained FP8): per `block` of the weight, scale = max |w| / 448,
    `weight` = e4m3(w / scale) and `weight_scale_inv` = the scales [ceil(out / rows), ceil(in / cols)]
    (float32; w = weight * weight_scale_inv). Returns the float32 folder of the weights it dequantises to."""
    state = load_file(str(base / "model.safetensors"))
    packed, floats = {}, {}
    rows, cols = block
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            packed[name] = floats[name] = tensor
            continue
        w = tensor.float()
        low, high = _block_extremes(w, rows, cols)
        scale = torch.maximum(low.abs(), high.abs()) / 448
        expanded = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
        values = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
        packed[name], packed[f"{prefix}.weight_scale_inv"] = values, scale
        floats[name] = values.float() * expanded
    shutil.copytree(base, folder)
    save_file(packed, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    float_folder = folder.parent / f"{folder.name}-floats"
    shutil.copytree(base, float_folder)
    save_file(floats, str(float_folder / "model.safetensors"))
    return float_folder


def hf_with_quantised_inputs(floats, group, values=None):
    """HF float32 on the float checkpoint in `floats`, every decoder projection fed its input quantised per
    token (per `group` columns when set) to `values` (kernels/w8a8.py's FP8 by default, or INT8) and
    dequantised, as the W8A8 products quantise theirs."""
    from transformers import AutoModelForCausalLM

    from tokenmill.kernels import w8a8

    values = values or w8a8.FP8
    hf = AutoModelForCausalLM.from_pretrained(str(floats), dtype=torch.float32).eval()

    def quantised(module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        return (w8a8.dequantize_activations(*w8a8.quantize_activations(flat, group, values), group).view_as(x),)

    for module in hf.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(quantised)
    return hf


def assert_layers_loaded_as(packed, floats, kept) -> None:
    """Loaded with packed layers kept (the default), each of the tiny model's 14 projections of the
    checkpoint in `packed` is a `QuantizedWeight` of format `kept` (a `W8A8Weight` for "fp8" and "int8_w8a8";
    None: a float tensor) and dequantises to exactly the weight of the float checkpoint in `floats`."""
    from tokenmill.kernels.w8a8 import W8A8Weight
    from tokenmill.kernels.quantized import QuantizedWeight
    from tokenmill.models.loader import load_model_source

    expected = load_file(str(floats / "model.safetensors"))
    seen = 0
    for name, weight in load_model_source(str(packed), with_tokenizer=False).iter_weights(keep_quantized=True):
        if name.rpartition(".")[0].rpartition(".")[2] not in LINEARS:
            continue
        seen += 1
        if kept is None:
            assert isinstance(weight, torch.Tensor), name
        else:
            kind = W8A8Weight if kept in ("fp8", "int8_w8a8") else QuantizedWeight
            assert isinstance(weight, kind) and weight.format == kept, name
            weight = weight.dequantize()
        assert torch.equal(weight, expected[name]), name
    assert seen == 7 * 2  # two layers of seven projections
