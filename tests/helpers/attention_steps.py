"""One attention step of every kind a kernel must get right, on random tensors: for the kernel tests that
check a change to the softmax (a score soft cap, sinks) on every backend against a formula."""

from __future__ import annotations

import torch

from tokenmill.attention.base import SequenceChunk


def mixed_attention_step(heads: int, kv_heads: int, head_dim: int, seed: int, block_size: int = 8) -> tuple:
    """(cache, chunks, slots, q, k, v, generator): a random float32 cache [2, 40, kv_heads, block_size,
    head_dim] and one step of 13 query rows: a decode after 69 cached tokens, a 6-token chunk from position 0,
    a 5-token chunk after 25 cached tokens and a decode at position 1; each row's K/V slot in `slots`. The
    generator, seeded with `seed`, has drawn the cache, q, k and v in that order; draw more from it after."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 40, kv_heads, block_size, head_dim, generator=gen)
    chunks = [SequenceChunk(0, 1, 70, list(range(0, 9))), SequenceChunk(1, 6, 6, [9]),
              SequenceChunk(7, 5, 30, [10, 11, 12, 13]), SequenceChunk(12, 1, 2, [14])]
    slots = torch.tensor([8 * block_size + 5] + [9 * block_size + i for i in range(6)]
                         + [13 * block_size + i for i in range(1, 6)] + [14 * block_size + 1])
    q = torch.randn(13, heads, head_dim, generator=gen)
    k, v = torch.randn(2, 13, kv_heads, head_dim, generator=gen)
    return cache, chunks, slots, q, k, v, gen


def reference_and_backend(backend, cache: torch.Tensor, chunks: list, slots: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, layer, block_size: int) -> tuple:
    """(reference output, reference cache, backend output, backend cache): the step attended by the reference
    backend and by `backend`, each over its own copy of `cache`."""
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    cpu = torch.device("cpu")
    ref = TorchReferenceBackend()
    ref_cache, got_cache = cache.clone(), cache.clone()
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(chunks, slots, block_size, cpu), layer)
    got = backend.forward(q, k, v, got_cache, backend.build_metadata(chunks, slots, block_size, cpu), layer)
    return expected, ref_cache, got, got_cache


def assert_split_kv_decode_matches_reference(layer, seed: int = 6) -> None:
    """Three decodes after 300, 129 and 5 cached tokens (heads 8, kv heads 2, head_dim 32, blocks of 16) through the
    Triton backend without batch invariance, where long decodes split their keys across programs, equal the
    reference backend's within 1e-5. `layer`: the AttentionLayer under test (its window, chunk or sinks)."""
    from tokenmill.attention.torch_ref import TorchReferenceBackend
    from tokenmill.attention.triton_paged import TritonPagedBackend

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block = 8, 2, 32, 16
    cache = torch.randn(2, 64, kv_heads, block, head_dim, generator=gen)
    chunks, slots = [], []
    for i, length in enumerate((300, 129, 5)):
        blocks = list(range(i * 20, i * 20 + -(-length // block)))
        chunks.append(SequenceChunk(i, 1, length, blocks))
        slots.append(blocks[(length - 1) // block] * block + (length - 1) % block)
    slots = torch.tensor(slots)
    q = torch.randn(3, heads, head_dim, generator=gen)
    k, v = torch.randn(2, 3, kv_heads, head_dim, generator=gen)
    backend = TritonPagedBackend(False, cpu)
    meta = backend.build_metadata(chunks, slots, block, cpu)
    assert backend._splits(meta, kv_heads) > 1, "this step must take the split-KV kernel"
    ref = TorchReferenceBackend()
    expected = ref.forward(q, k, v, cache.clone(), ref.build_metadata(chunks, slots, block, cpu), layer)
    got = backend.forward(q, k, v, cache.clone(), meta, layer)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
