"""Quantise a model's linear layers into the checkpoint formats people download, for the real-size checks
of docs/benchmarks.md ("GPTQ and compressed-tensors checkpoints"):

- `gptq-int4`: GPTQ (Frantar et al.; AutoGPTQ's fasterquant, one pass over the float model's own
  activations), 4 bits, symmetric, groups of 128 inputs, no activation order, written in AutoGPTQ's layout
  (qweight / qzeros / scales / g_idx, checkpoint_format gptq, float16 scales);
- `ct-w8a8`: compressed-tensors' W8A8 preset (int8 weights per output channel, round to nearest from
  min/max, dynamic per-token int8 activations), written by the compressed-tensors library itself.

The source is an HF folder or a GGUF file (default: the SmolLM2-135M-Instruct GGUF, dequantised to
float32 by transformers). The calibration text is the repository's docs/ (never the passages the
perplexity is measured on). Other tensors (embedding, norms) are saved as float16 (GPTQ, as AutoGPTQ
saves them) or bfloat16 (compressed-tensors, as llm-compressor saves them).

    .venv/bin/python scripts/quantize_checkpoint.py OUT_DIR --scheme gptq-int4 [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_float_model(model: str | None):
    """(HF model in float32, tokenizer) of an HF folder or a GGUF file (default: the packaged SmolLM2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "src"))
    from tokenmill.models.loader import resolve_model_path

    path = Path(resolve_model_path(model))
    if path.suffix == ".gguf":
        options = dict(gguf_file=path.name)
        folder = str(path.parent)
    else:
        options, folder = {}, str(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **options).eval()
    if hasattr(hf.config, "quantization_config"):  # a GGUF's: its weights are float32 floats by now
        del hf.config.quantization_config
        hf.hf_quantizer, hf.is_quantized = None, False
    return hf, tokenizer


def calibration_ids(tokenizer, sequences: int, length: int) -> torch.Tensor:
    """`sequences` runs of `length` token ids from the repository's docs/."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < sequences * length:
        raise SystemExit(f"docs/ gives {ids.numel()} tokens, fewer than {sequences} x {length}")
    return ids[:sequences * length].view(sequences, length)


def input_hessians(hf, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """2 X^T X / n of each linear layer's inputs over the calibration runs (float64)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEARS:
            def record(module, inputs, output, name=name):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.t() @ x
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for row in range(ids.shape[0]):
            hf(ids[row:row + 1])
            print(f"\rcalibration {row + 1}/{ids.shape[0]}", end="", file=sys.stderr)
    print(file=sys.stderr)
    for hook in hooks:
        hook.remove()
    return {name: 2 * sums[name] / counts[name] for name in sums}


def gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool, bits: int = 4,
         damp: float = 0.01, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of one weight [out, in]: (q [out, in] in 0..2^bits - 1, zero and float16 scale [out, groups]),
    w ~ (q - zero) * scale. Columns in order, each group's scale (and zero, asymmetric: from its min and
    max) from the weight as updated when the group starts (AutoGPTQ's fasterquant without activation
    order). An identity `hessian` makes it round-to-nearest."""
    w = weight.double().clone()
    rows, cols = w.shape
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    top = 2 ** bits - 1
    q = torch.zeros(rows, cols, dtype=torch.int64)
    scales = torch.zeros(rows, -(-cols // group_size), dtype=torch.float16)  # the last group may be short
    zeros = torch.full(scales.shape, (top + 1) // 2, dtype=torch.int64)
    for start in range(0, cols, block):
        end = min(start + block, cols)
        w1, errors = w[:, start:end].clone(), torch.zeros(rows, end - start, dtype=w.dtype)
        h1 = hinv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:
                span = torch.cat((w1[:, i:], w[:, end:]), 1)[:, :group_size]
                group = column // group_size
                if symmetric:
                    scale = (span.abs().amax(1) / ((top - 1) / 2)).clamp(min=1e-8)
                else:
                    low, high = span.amin(1).clamp(max=0), span.amax(1).clamp(min=0)
                    scale = ((high - low) / top).clamp(min=1e-8)
                    zeros[:, group] = torch.round(-low / scale.half().double()).clamp(0, top).long()
                scales[:, group] = scale.half()
                scale, zero_point = scales[:, group].double(), zeros[:, group].double()
            value = torch.clamp(torch.round(w1[:, i] / scale) + zero_point, 0, top)
            q[:, column] = value.long()
            error = (w1[:, i] - (value - zero_point) * scale) / h1[i, i]
            w1[:, i:] -= error.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return q, zeros, scales


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, bits: int = 4
              ) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout (checkpoint_format gptq) of q [out, in], zeros and scales [out, groups]."""
    per = 32 // bits
    rows = q.t().numpy().astype(np.uint32)  # [in, out]
    qweight = np.zeros((rows.shape[0] // per, rows.shape[1]), dtype=np.uint32)
    for j in range(per):
        qweight |= rows[j::per] << np.uint32(bits * j)
    stored = (zeros.t().numpy() - 1).astype(np.uint32)  # [groups, out], minus one
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // per), dtype=np.uint32)
    for j in range(per):
        qzeros |= stored[:, j::per] << np.uint32(bits * j)
    return {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // group_size}


def write_gptq(hf, tokenizer, out: Path, group_size: int, calibration: int, symmetric: bool) -> None:
    if calibration:
        hessians = input_hessians(hf, calibration_ids(tokenizer, calibration, 512))
    else:  # round to nearest
        hessians = {name: torch.eye(module.in_features, dtype=torch.float64) for name, module in hf.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in LINEARS}
    state = {name: tensor.detach().half().contiguous() for name, tensor in hf.state_dict().items()}
    started = time.time()
    for number, (name, hessian) in enumerate(sorted(hessians.items())):
        del state[f"{name}.weight"]
        q, zeros, scales = gptq(hf.get_submodule(name).weight.data, hessian, group_size, symmetric)
        state.update({f"{name}.{part}": value for part, value in pack_gptq(q, zeros, scales, group_size).items()})
        print(f"\rGPTQ {number + 1}/{len(hessians)} ({time.time() - started:.0f} s)", end="", file=sys.stderr)
    print(file=sys.stderr)
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                     "desc_act": False, "sym": symmetric, "checkpoint_format": "gptq"}
    save_folder(hf, tokenizer, out, state)


def write_ct_w8a8(hf, tokenizer, out: Path) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    hf = hf.to(torch.bfloat16)
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear) and hasattr(module, "quantization_scheme"):
            weight = module.weight.data.float()
            scale, zero = calculate_qparams(weight.amin(1, keepdim=True).clamp(max=0),
                                            weight.amax(1, keepdim=True).clamp(min=0), scheme.weights)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    compressor.update_config(str(out))
    tokenizer.save_pretrained(str(out))


def save_folder(hf, tokenizer, out: Path, state: dict[str, torch.Tensor]) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf.config.save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"))
    tokenizer.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    print(f"{out}: {config['quantization_config']}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--scheme", choices=("gptq-int4", "ct-w8a8"), required=True)
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: the packaged SmolLM2)")
    parser.add_argument("--group-size", type=int, default=128, help="GPTQ: inputs per scale")
    parser.add_argument("--calibration", type=int, default=32, help="GPTQ: calibration runs of 512 tokens (0: "
                        "round to nearest)")
    parser.add_argument("--asymmetric", action="store_true", help="GPTQ: zero points from each group's min and max")
    args = parser.parse_args()
    torch.manual_seed(0)
    hf, tokenizer = load_float_model(args.model)
    if args.scheme == "gptq-int4":
        write_gptq(hf, tokenizer, args.out, args.group_size, args.calibration, not args.asymmetric)
    else:
        write_ct_w8a8(hf, tokenizer, args.out)


if __name__ == "__main__":
    main()
