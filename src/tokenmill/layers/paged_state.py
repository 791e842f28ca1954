"""A hybrid model's recurrent states kept in the attention cache's pool blocks (core/kv_spec.py's budget rule).

In a hybrid (Granite 4.0-H) a pool block is an attention block, and a request's state of one recurrent layer
takes `state_blocks` whole blocks of that layer's cache tensor (the tensor at the layer's position in its group,
shared with the attention layers at that position: a block serves one group at a time). The blocks are not
contiguous, so a step gathers the request's blocks into one byte row, reads the SSM state (float32) and the conv
window (compute dtype) out of it, and scatters the new state back: two copies of the state per layer and step.
"""

from __future__ import annotations

import torch

from tokenmill.layers.mamba2_mixer import StateCandidates


class PagedState:
    """One recurrent layer's states, stored in the bytes of K/V cache tensor `cache` ([planes, blocks, ...]: dim 1
    is the block, as every attention backend's `kv_cache_shape` keeps it). A request's state is the first
    ssm_bytes + conv_bytes bytes of its blocks' bytes, in table order: the SSM state [heads, head_dim,
    state_size] in float32, then the conv window [conv_kernel - 1, conv_dim] in the cache's dtype.
    Invariant (the KV manager's): the blocks of a request's state belong to it alone for its life, so nothing
    else writes them between its steps."""

    def __init__(self, cache: torch.Tensor, spec) -> None:
        self.cache = cache
        self.ssm_shape = (spec.num_heads, spec.head_dim, spec.state_size)
        self.conv_shape = (spec.conv_kernel - 1, spec.conv_dim)
        self.ssm_bytes = spec.num_heads * spec.head_dim * spec.state_size * 4
        self.conv_bytes = (spec.conv_kernel - 1) * spec.conv_dim * cache.element_size()
        block_bytes = cache[:, 0].numel() * cache.element_size()
        self.pages = -(-(self.ssm_bytes + self.conv_bytes) // block_bytes)  # blocks per request (kv_spec's)
        self.candidates = StateCandidates()  # a verification step's states per proposal

    def load(self, chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, SSM state) of `chunk`'s request: zeros for a chunk that starts its sequence (its blocks
        hold whatever their last owner left), else what its previous chunk stored."""
        if chunk.fresh:
            return (torch.zeros(self.conv_shape, dtype=self.cache.dtype, device=self.cache.device),
                    torch.zeros(self.ssm_shape, dtype=torch.float32, device=self.cache.device))
        row = self.cache[:, self._index(chunk)].reshape(-1).view(torch.uint8)
        ssm = row[:self.ssm_bytes].view(torch.float32).view(self.ssm_shape)
        conv = row[self.ssm_bytes:self.ssm_bytes + self.conv_bytes].view(self.cache.dtype).view(self.conv_shape)
        return conv, ssm

    def store(self, chunk, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Write `chunk`'s request's new state into its blocks (the tail past the state is zeros)."""
        index = self._index(chunk)
        blocks = self.cache[:, index]
        row = torch.zeros(blocks.numel() * self.cache.element_size(), dtype=torch.uint8, device=self.cache.device)
        row[:self.ssm_bytes] = ssm.to(torch.float32).contiguous().view(-1).view(torch.uint8)
        row[self.ssm_bytes:self.ssm_bytes + self.conv_bytes] = (
            conv.to(self.cache.dtype).contiguous().view(-1).view(torch.uint8))
        self.cache[:, index] = row.view(self.cache.dtype).view(blocks.shape)

    def _index(self, chunk) -> torch.Tensor:
        if len(chunk.pages) != self.pages:
            raise AssertionError(f"a state takes {self.pages} pool blocks, the request holds {len(chunk.pages)}")
        return torch.tensor(chunk.pages, dtype=torch.long, device=self.cache.device)
