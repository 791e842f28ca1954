"""Prompts given as input embeddings (vLLM's `--enable-prompt-embeds`): a [tokens, hidden] tensor of the rows the
model's embedding layer would give. The engine carries one as an image feature over the whole prompt (its
`inputs` the tensor itself, its content hash the tensor's), so the runner lays its rows in as it lays an image's
(worker/encoder_cache.py) and the prefix cache keys its blocks by the embeddings' hash: the same embeddings hit,
other ones never share K/V. The prompt's token ids are placeholders (0) that nothing reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io

import torch

from tokenmill.multimodal.inputs import ImageFeature

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLACEHOLDER_ID = 0


def decode_prompt_embeds(encoded: str) -> torch.Tensor:
    """The tensor of `encoded` (base64 of `torch.save(tensor)`, as vLLM's clients send it), loaded with
    `weights_only=True`: tensors only, nothing unpickled that could run code. ValueError otherwise."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("prompt_embeds is not valid base64 (of a torch.save'd tensor)") from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # (an unpickling error, a truncated file: whatever torch.load raises)
        raise ValueError(f"prompt_embeds is not a tensor saved with torch.save: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds holds a {type(tensor).__name__}, not a tensor")
    return tensor


def embeds_length(tensor: object) -> int:
    """The tokens a prompt given as embeddings holds, before its checks (0 when it is no tensor of 2 or 3 dims)."""
    return int(tensor.shape[-2]) if isinstance(tensor, torch.Tensor) and tensor.dim() in (2, 3) else 0


def embeds_prompt(tensor: object, hidden_size: int, max_model_len: int) -> tuple[list[int], ImageFeature]:
    """(placeholder prompt token ids, the feature that carries `tensor` over them) for a prompt given as
    embeddings: [tokens, hidden_size] or [1, tokens, hidden_size], floating point, finite. ValueError naming what
    is wrong."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, got {tensor.dtype}")
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[1] != hidden_size or tensor.shape[0] == 0:
        raise ValueError(f"prompt_embeds must have shape [tokens, {hidden_size}] (the model's hidden size), with at "
                         f"least one token; got {list(tensor.shape)}")
    if tensor.shape[0] > max_model_len:
        raise ValueError(f"prompt_embeds has {tensor.shape[0]} tokens, more than the model's maximum context length "
                         f"of {max_model_len}")
    tensor = tensor.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("prompt_embeds holds values that are not finite (inf or nan)")
    digest = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
    digest.update(tensor.view(torch.uint8).numpy().tobytes())
    feature = ImageFeature(0, tensor.shape[0], "embeds:" + digest.hexdigest(), inputs=tensor)
    return [PLACEHOLDER_ID] * tensor.shape[0], feature
