"""The gated delta rule of one request (Gated DeltaNet's recurrence, layers/gated_deltanet.py), from a given state.

Per value head h, with a state S [key_head_dim, value_head_dim] and for each token t in order:
    S = exp(g_t) S;  S = S + k_t (beta_t (v_t - k_t S));  o_t = q_t S
q and k come in L2-normed, q scaled by key_head_dim ** -0.5, and with one head per value head (the caller repeats
the key heads). All float32.

On CPU (and wherever the tensors are not CUDA's): a prefill chunk runs the chunked form (transformers'
torch_chunk_gated_delta_rule: the WY / UT transform inside chunks of `chunk_size` tokens, the state carried from
chunk to chunk), a one-token chunk the recurrence itself. On CUDA the same two run as flash-linear-attention's
Triton kernels (`fla`, imported there only: a CPU process never imports triton or fla for this layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# transformers' and fla's chunk length
CHUNK_SIZE = 64


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, Dk], v [T, H, Dv], g and beta [T, H], state [H, Dk, Dv] (float32) -> (out [T, H, Dv], the state
    after the T tokens); see the module docstring for what is computed and by which kernel."""
    if q.is_cuda:
        return fla_gated_delta_rule(q, k, v, g, beta, state, recurrent=q.shape[0] == 1)
    if q.shape[0] == 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token (transformers' torch_recurrent_gated_delta_rule); shapes as `gated_delta_rule`'s."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        remembered = (state * k[t][:, :, None]).sum(-2)  # what the state recalls for k_t: [H, Dv]
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(-2)
    return out, state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in chunks of `chunk_size` tokens (transformers' torch_chunk_gated_delta_rule, one request): inside a
    chunk the delta-rule updates become two unit-lower-triangular solves; across chunks the state is carried.
    Shapes as `gated_delta_rule`'s."""
    T = q.shape[0]
    pad = (-T) % chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, c, L, ...], zero-padded
        x = x.movedim(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(-1)  # [H, c, L]: log of the decay from the chunk's start to each token
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # pair[i, j] = the decay from token j to token i of a chunk (j <= i; nothing above the diagonal)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    within = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, c, 1, 1]
    out = torch.empty_like(new_values)
    for i in range(q.shape[1]):
        corrected = new_values[:, i] - k_decayed[:, i] @ state  # only what the state does not already predict
        out[:, i] = q[:, i] @ state + within[:, i] @ corrected
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :T].movedim(1, 0), state


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, recurrent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule by flash-linear-attention's Triton kernels (fla-core): fused_recurrent_gated_delta_rule when
    `recurrent` (a decode step), else chunk_gated_delta_rule. q arrives scaled (scale 1 here) and normed (no norm
    in the kernel). Shapes as `gated_delta_rule`'s; fla takes a batch of one, [1, T, H, D]."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError as exc:
        raise ValueError("Gated DeltaNet layers (Qwen3-Next) on CUDA run flash-linear-attention's kernels: install "
                         "fla-core (pip install 'tokenmill[gpu]')") from exc

    kernel = fla_recurrent if recurrent else fla_chunk
    out, final = kernel(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g=g[None].contiguous(),
                        beta=beta[None].contiguous(), scale=1.0, initial_state=state[None].contiguous(),
                        output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out[0], final[0]
