"""Mamba2's mixer in pure torch (every attention backend runs it), over per-request recurrent states.

Each request of a step is computed alone from its own state page (`StateChunk.slot`), so its output does not
depend on what else runs (batch invariance): the conv continues from the page's last conv_kernel - 1 inputs, the
scan from its SSM state, and both are written back for the request's next chunk. A chunk from position 0
(`fresh`: a new request, or one preempted and recomputed) starts from zeros, whatever the page held before.
Prefill chunks run the chunked SSD scan (transformers' `mamba2_chunk_scan`, the reference semantics, with an
initial state); a one-token chunk runs the single-step recurrence. No CUDA/Triton kernel (the mamba_ssm or
flash-linear-attention kernels) is used. The families' variants are MambaConfig options: where the gate meets the
output norm (`gate_norm`) and a lower bound on dt (`dt_min`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.zeroed_memory import zeroed
from tokenmill.layers.invariant_ops import elementwise
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class StateChunk:
    """One request's rows [query_start, query_start + query_len) of the step, its state page `slot`, and whether
    the chunk starts the sequence (`fresh`: the state is zero, not the page's); `pages`: all its state's pool
    blocks (a hybrid's state spans several, layers/paged_state.py); `proposals`: how many of its last rows are
    speculative proposals being verified (see `advance_request`)."""

    query_start: int
    query_len: int
    slot: int
    fresh: bool
    pages: tuple[int, ...] = ()
    proposals: int = 0


class StateCandidates:
    """A verification step's states of one recurrent layer: for each request with proposals (by state page), its
    state after its real rows and after each proposal, until the sampler says how many proposals were accepted.
    The page holds the state after every proposal meanwhile (all accepted); `keep` writes the accepted one.
    Bounded by the step: the runner clears what is held after every step."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[StateChunk, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def hold(self, chunk: StateChunk, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `chunk`'s candidate states [(conv window, recurrent state)] until `keep` or `clear`."""
        self.held[chunk.slot] = (chunk, states)

    def keep(self, slot: int, accepted: int, store: Callable[[StateChunk, torch.Tensor, torch.Tensor], None]) -> None:
        """Store, through `store`, the state of page `slot`'s request after `accepted` of its proposals."""
        held = self.held.pop(slot, None)
        if held is not None:
            chunk, states = held
            store(chunk, *states[accepted])

    def clear(self) -> None:
        """Forget every held state (the step is over)."""
        self.held.clear()


def advance_request(state: Any, chunk: StateChunk, advance: Callable[[int, int, torch.Tensor, torch.Tensor], tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]], by_token: bool = False) -> torch.Tensor:
    """One request's chunk through a recurrent mixer: `advance(start, stop, conv, recurrent)` computes the chunk's
    rows [start, stop) from a (conv window, recurrent state) and returns (their output, the new window and state).
    Without proposals the chunk runs at once, or with `by_token` (batch invariance) one row at a time: each token
    then gets the arithmetic of a one-token decode step wherever the scheduler split the prompt (a chunked scan sums
    in an order that depends on where the chunk starts and ends). With proposals (a speculative verification) the
    real rows run as a chunk does and then each proposal alone, as the one-token steps of plain decoding would run
    them (the same arithmetic: output does not depend on speculation), and `state.candidates` holds the state after
    each (the sampler's accepted count picks one). The state after the last row is stored either way -> the output
    rows (concatenated)."""
    conv, recurrent = state.load(chunk)
    real = chunk.query_len - chunk.proposals
    pieces = [(row, row + 1) for row in range(real)] if by_token else [(0, real)] if real else []
    outs, candidates = [], []
    for start, stop in [*pieces, *((row, row + 1) for row in range(real, chunk.query_len))]:
        out, conv, recurrent = advance(start, stop, conv, recurrent)
        outs.append(out)
        if stop >= real:  # (the state after the real rows: none accepted; then after each proposal)
            candidates.append((conv, recurrent))
    state.store(chunk, conv, recurrent)
    if chunk.proposals:
        state.candidates.hold(chunk, candidates)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class RecurrentState:
    """One Mamba2 layer's states of every pool block: conv [blocks, conv_kernel - 1, conv_dim] in the compute dtype
    and ssm [blocks, heads, head_dim, state_size] in float32 (core/kv_spec.py's StateCacheSpec counts these bytes).

    Both are views of one byte tensor `page` [1, blocks, row bytes] (the SSM state, then the conv window, a row per
    block), laid out as an attention cache tensor is, block on dim 1: what swap preemption copies to its host slots
    and back (worker/kv_tier_store.py) is a block's whole state, the same way as an attention block's K/V. The row
    is rounded up to a multiple of 4 bytes (at most 3 bytes a page beyond the budget) so that every row's float32
    SSM state is aligned."""

    def __init__(self, num_blocks: int, spec, dtype: torch.dtype, device: torch.device) -> None:
        ssm_shape = (spec.num_heads, spec.head_dim, spec.state_size)
        conv_shape = (spec.conv_kernel - 1, spec.conv_dim)
        ssm_bytes = spec.num_heads * spec.head_dim * spec.state_size * 4
        conv_bytes = conv_shape[0] * conv_shape[1] * dtype.itemsize
        row = -(-(ssm_bytes + conv_bytes) // 4) * 4
        self.page = zeroed((1, num_blocks, row), torch.uint8, device)
        rows = self.page[0]
        self.ssm = rows[:, :ssm_bytes].view(torch.float32).view(num_blocks, *ssm_shape)
        self.conv = rows[:, ssm_bytes:ssm_bytes + conv_bytes].view(dtype).view(num_blocks, *conv_shape)
        self.candidates = StateCandidates()  # a verification step's states per proposal

    def load(self, chunk: StateChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, SSM state) of `chunk`'s request: zeros for a chunk that starts its sequence, else its page's."""
        if chunk.fresh:
            return torch.zeros_like(self.conv[chunk.slot]), torch.zeros_like(self.ssm[chunk.slot])
        return self.conv[chunk.slot], self.ssm[chunk.slot]

    def store(self, chunk: StateChunk, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Write `chunk`'s request's new state into its page."""
        self.conv[chunk.slot] = conv
        self.ssm[chunk.slot] = ssm


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = sum of x[..., j+1 .. i] for j <= i, -inf above the diagonal
    (transformers' stable form: masked cumulative sums, no subtraction)."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one request in float32: x [T, H, P], dt [T, H] (after softplus), A [H], B and C [T, H, N]
    (already per head), `initial` state [H, P, N] -> (y [T, H, P] without the D skip, final state [H, P, N])."""
    T = x.shape[0]
    pad = (-T) % chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [c, l, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    xd, a, B, C = chunks(x * dt[..., None]), chunks(A * dt), chunks(B), chunks(C)
    a = a.permute(2, 0, 1)  # [H, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)
    # within each chunk: attention-like weights C_l . B_s, decayed from s to l
    decay = torch.exp(segment_sum(a))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, xd)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cumsum[:, :, -1:] - a_cumsum)  # [H, c, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", B * to_end.permute(1, 2, 0)[..., None], xd)
    # the state entering each chunk: the initial state and the chunks before, decayed across chunks
    states = torch.cat([initial[None], chunk_states], dim=0)  # [c + 1, H, P, N]
    across = torch.exp(segment_sum(F.pad(a_cumsum[:, :, -1], (1, 0))))  # [H, c + 1 (to), c + 1 (from)]
    entering = torch.einsum("htz,zhpn->thpn", across, states)
    states, final = entering[:-1], entering[-1]
    y_off = torch.einsum("clhn,chpn->clhp", C, states) * torch.exp(a_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, *x.shape[1:])[:T]
    return y, final


class Mamba2Mixer(nn.Module):
    """Mamba2's token mixer (transformers' Mamba2Mixer) for a flattened batch of requests' chunks; tensor names
    as the checkpoint's (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, hidden_size: int, config) -> None:
        super().__init__()
        self.config = config
        inner, conv_dim, heads = config.intermediate_size, config.conv_dim, config.num_heads
        self.in_proj = ColumnParallelLinear(hidden_size, inner + conv_dim + heads, bias=config.bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.conv_kernel, groups=conv_dim, bias=config.conv_bias)
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.norm = nn.Module()  # the gated RMSNorm's weight, under the checkpoint's name (none without a norm)
        if config.gate_norm != "none":
            self.norm.weight = nn.Parameter(torch.empty(inner), requires_grad=False)
        self.out_proj = RowParallelLinear(inner, hidden_size, bias=config.bias)
        self.by_token = False  # batch invariance: every token runs as a one-token step would (advance_request)

    def use_kernel(self, packed: bool, native: bool, batch_invariant: bool) -> None:
        """The model's kernel choice (models/decoder.py): under batch invariance a prompt runs token by token."""
        self.by_token = batch_invariant

    def forward(self, hidden: torch.Tensor, state: RecurrentState, chunks: Sequence[StateChunk]) -> torch.Tensor:
        """hidden [T, hidden] (the step's chunks, in `chunks` order) -> [T, hidden]; each request's conv and SSM
        states are read from and written back to its page of `state`."""
        c = self.config
        projected = self.in_proj(hidden)
        gate, xbc, dt = projected.split([c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)
        y = torch.empty(hidden.shape[0], c.intermediate_size, dtype=torch.float32, device=hidden.device)
        for chunk in chunks:  # one request at a time: its arithmetic is its own (batch invariance)
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            xbc_rows, dt_rows = xbc[rows], dt[rows]
            y[rows] = advance_request(state, chunk, lambda start, stop, earlier, ssm: self._advance(
                xbc_rows[start:stop], dt_rows[start:stop], earlier, ssm), self.by_token)
        return self.out_proj(self._gated_norm(y, gate).to(hidden.dtype))

    def _advance(self, xbc: torch.Tensor, dt: torch.Tensor, earlier: torch.Tensor, ssm: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of one request from its conv window `earlier` and SSM state: the conv, then the scan -> (y [T, inner]
        float32, the new conv window, the new SSM state)."""
        c = self.config
        weight = self.conv1d.weight
        window = torch.cat([earlier, xbc.to(earlier.dtype)], dim=0)  # [K - 1 + T, conv_dim]
        conv = F.conv1d(window.t().unsqueeze(0).to(weight.dtype), weight, self.conv1d.bias, groups=c.conv_dim)
        conv = F.silu(conv[0].t())
        x, B, C = conv.float().split([c.intermediate_size, c.n_groups * c.state_size, c.n_groups * c.state_size], -1)
        T, heads = x.shape[0], c.num_heads
        x = x.reshape(T, heads, c.head_dim)
        per_group = heads // c.n_groups
        B = B.reshape(T, c.n_groups, c.state_size).repeat_interleave(per_group, dim=1)  # [T, H, N]
        C = C.reshape(T, c.n_groups, c.state_size).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [T, H]
        if c.dt_min > 0.0:  # (Nemotron-H) in every chunk alike, so a prompt's split does not change its states
            dt = dt.clamp(min=c.dt_min)
        A = -torch.exp(self.A_log.float())
        if T == 1:  # the recurrence: h = exp(dt A) h + dt B x; y = C . h
            step = dt[0][:, None, None]
            ssm = ssm * torch.exp(step * A[:, None, None]) + (step * B[0][:, None, :]) * x[0][:, :, None]
            y = (ssm * C[0][:, None, :]).sum(-1)[None]
        else:
            y, ssm = ssd_chunk_scan(x, dt, A, B, C, ssm, c.chunk_size)
        y = y + self.D.float()[:, None] * x
        return y.reshape(T, c.intermediate_size), window[-(c.conv_kernel - 1):], ssm

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gate and the output norm, float32, by `gate_norm`: "after_gate" RMSNorm of y * silu(gate) over each
        of the n_groups groups (transformers' MambaRMSNormGated); "before_gate" the groups' RMSNorm of y, times
        silu(gate) (Falcon-H1's norm_before_gate); "none" y * silu(gate) (Falcon-H1 without mamba_rms_norm)."""
        c = self.config
        gate = elementwise(F.silu, gate.float())
        if c.gate_norm == "none":
            return y * gate
        if c.gate_norm == "after_gate":
            y = y * gate
        grouped = y.reshape(y.shape[0], c.n_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        normed = self.norm.weight.float() * grouped.reshape(y.shape)
        return normed * gate if c.gate_norm == "before_gate" else normed
