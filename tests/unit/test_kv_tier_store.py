"""KVTierStore: the CPU path round-trips blocks exactly; the CUDA path, run against a fake copier that
models asynchronous copies, reads copied data only after waiting for it, never overwrites the staging
buffer while a load still copies out of it, and pins nothing before the first copy."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.worker.kv_tier_store import KVTierStore

LAYERS, POOL_BLOCKS, SLOTS = 3, 12, 10
LAYER_SHAPE = (2, SLOTS, 4, 2, 8)  # (planes, slots, block_size, heads, head_dim)


class FakeCopier:
    """A device whose copies complete only when an event recorded after them is waited on: a copy to
    the host lands in its buffer then; a copy from the host reads its source at any time until then,
    so the source must not change meanwhile. Every operation is logged."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.pending: list[tuple] = []  # (seq, kind, dst or source, value)
        self.seq = 0

    def _next(self) -> int:
        self.seq += 1
        self._check_sources()
        return self.seq

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.log.append(("pin", self._next()))
        return torch.full((numel,), 77, dtype=dtype)  # stale bytes: read too early, they show

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("to_host", self._next()))
        self.pending.append((self.seq, "to_host", dst, src.clone()))

    def to_device(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.log.append(("to_device", self._next()))
        self.pending.append((self.seq, "to_device", src, src.clone()))
        return src.clone()

    def record(self) -> int:
        self.log.append(("record", self._next()))
        return self.seq

    def wait(self, event: int) -> None:
        self.log.append(("wait", self._next(), event))
        for seq, kind, tensor, value in [p for p in self.pending if p[0] < event]:
            if kind == "to_host":
                tensor.copy_(value)
        self.pending = [p for p in self.pending if p[0] >= event]

    def _check_sources(self) -> None:
        for seq, kind, tensor, value in self.pending:
            if kind == "to_device":
                assert torch.equal(tensor, value), f"staging overwritten while copy {seq} still reads it"


def _pool(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    shape = (2, POOL_BLOCKS, *LAYER_SHAPE[2:])
    if dtype == torch.int8:
        return [torch.randint(-128, 128, shape, dtype=dtype) for _ in range(LAYERS)]
    return [torch.randn(shape).to(dtype) for _ in range(LAYERS)]


def _pairs(rng: random.Random, count: int) -> list[tuple[int, int]]:
    return list(zip(rng.sample(range(POOL_BLOCKS), count), rng.sample(range(SLOTS), count)))


def _round_trip(store: KVTierStore, dtype: torch.dtype, seed: int) -> None:
    """Save random blocks to random slots, then load them into other blocks of a fresh pool."""
    rng = random.Random(seed)
    pool = _pool(dtype)
    saves = _pairs(rng, 7)
    store.save(pool, saves)
    for layer, cache in enumerate(pool):  # complete when save returns
        for block, slot in saves:
            assert torch.equal(store.data[layer][:, slot], cache[:, block])
    targets = rng.sample(range(POOL_BLOCKS), len(saves))
    restored = [torch.zeros_like(cache) for cache in pool]
    store.load(restored, [(slot, target) for (_, slot), target in zip(saves, targets)])
    for cache, back in zip(pool, restored):
        for (block, _), target in zip(saves, targets):
            assert torch.equal(back[:, target].view(torch.uint8), cache[:, block].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_cpu_store_round_trips_blocks_exactly(tmp_path, dtype):
    store = KVTierStore(LAYER_SHAPE, LAYERS, dtype, torch.device("cpu"), str(tmp_path))
    for seed in range(3):
        _round_trip(store, dtype, seed)


@pytest.mark.parametrize("staging_blocks", [1, 4, 100])  # a batch per block, several, one for everything
def test_cuda_store_round_trips_through_the_staging_buffer(staging_blocks):
    copier = FakeCopier()
    block_bytes = 2 * 4 * 2 * 8 * 2
    store = KVTierStore(LAYER_SHAPE, LAYERS, torch.bfloat16, torch.device("cuda"), copier=copier,
                        staging_bytes=staging_blocks * block_bytes)
    for seed in range(3):
        _round_trip(store, torch.bfloat16, seed)
    assert [op[0] for op in copier.log].count("pin") == 1


def test_cuda_save_reads_its_copy_only_after_waiting_for_it():
    copier = FakeCopier()
    store = KVTierStore(LAYER_SHAPE, LAYERS, torch.bfloat16, torch.device("cuda"), copier=copier)
    pool = _pool()
    store.save(pool, [(3, 1), (5, 2)])
    kinds = [op[0] for op in copier.log]
    assert kinds == ["pin", "to_host", "record", "wait"]  # one batch; the host reads after the wait
    assert copier.log[3][2] == copier.log[2][1] and not copier.pending
    assert torch.equal(store.data[:, :, 1], torch.stack([c[:, 3] for c in pool]))


def test_cuda_staging_is_not_overwritten_while_a_load_copies_out_of_it():
    copier = FakeCopier()
    store = KVTierStore(LAYER_SHAPE, LAYERS, torch.bfloat16, torch.device("cuda"), copier=copier)
    pool = _pool()
    store.save(pool, [(b, b) for b in range(SLOTS)])
    restored = [torch.zeros_like(cache) for cache in pool]
    store.load(restored, [(0, 0), (1, 1)])
    assert copier.pending  # the load returns with its copy in flight
    load_event = copier.log[-1][1]
    store.load(restored, [(2, 2), (3, 3)])  # rewrites the staging buffer: after waiting for the first load
    store.save(pool, [(4, 4)])  # likewise after the second
    waits = [op for op in copier.log if op[0] == "wait"]
    assert load_event in [op[2] for op in waits]
    second_load = [op for op in copier.log if op[0] == "record"][-2][1]
    assert second_load in [op[2] for op in waits]
    for cache, back in zip(pool, restored):
        assert torch.equal(back[:, :4], cache[:, :4])


def test_cuda_store_pins_nothing_before_its_first_save():
    copier = FakeCopier()
    store = KVTierStore(LAYER_SHAPE, LAYERS, torch.bfloat16, torch.device("cuda"), copier=copier)
    store.save(_pool(), [])
    assert copier.log == [] and store.staging is None and not store.data.is_pinned()
    store.save(_pool(), [(0, 0)])
    assert copier.log[0][0] == "pin"
