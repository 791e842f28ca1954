"""The fused mixture of experts (layers/fused_moe.py), in Triton's interpreter on CPU tensors: its routing is
layers/moe.py's `route`, its sort puts every slot once in its expert's blocks with sizes fixed by the token
count, and a MoEBlock on the fused path gives the Python loop's output, for float and int8/int4 experts, and
a token the same bits alone and in a batch. Shapes are tiny (8 experts of width 64, hidden 64): the
interpreter runs each program in numpy."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.quantized import quantize
from tokenmill.layers.fused_moe import plan, route as fused_route
from tokenmill.layers.moe import MoEBlock, route, route_grouped_sigmoid
from tokenmill.layers.triton_products import TritonProducts
from tokenmill.models.arch import MoEConfig
from tokenmill.models.decoder import GatedMLP
from tokenmill.parallel.group import TPGroup

HIDDEN, WIDTH, EXPERTS = 64, 96, 8  # width 96: quantised rows padded to 128 columns


@pytest.mark.parametrize("normalize, scale", [(True, 1.0), (False, 2.5)], ids=["renormalised", "scaled"])
def test_routing_kernel_picks_routes_top_k_and_weights(normalize, scale):
    logits = torch.randn(37, 12, generator=torch.Generator().manual_seed(0))  # 12 experts: padded to 16
    weights, ids = fused_route(logits, 3, normalize, scale)
    expected_weights, expected_ids = route(logits, 3, normalize, scale)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("normalize, scale, groups, topk_groups", [(True, 2.5, 4, 2), (False, 1.0, 1, 1)],
                         ids=["grouped-renormalised-scaled", "one-group-unnormalised"])
def test_sigmoid_grouped_routing_kernel_picks_as_the_pytorch_routing(normalize, scale, groups, topk_groups):
    """DeepSeek-V3's noaux_tc routing: 24 experts (padded to 32) in `groups` groups; the correction bias is
    as large as the scores' spread, so it changes which groups and experts are picked (checked below)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(41, 24, generator=generator)
    bias = torch.randn(24, generator=generator) * 0.3
    weights, ids = fused_route(logits, 3, normalize, scale, bias, groups, topk_groups)
    expected_weights, expected_ids = route_grouped_sigmoid(logits, bias, 3, groups, topk_groups, normalize, scale)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)
    unbiased = route_grouped_sigmoid(logits, torch.zeros(24), 3, groups, topk_groups, normalize, scale)[1]
    assert not torch.equal(unbiased, ids)  # the bias matters here
    if groups > 1:  # every token's experts lie in at most topk_groups groups
        assert all(len(set((row // (24 // groups)).tolist())) <= topk_groups for row in ids)


def test_sort_puts_each_local_slot_once_in_its_experts_blocks_in_token_order():
    ids = torch.randint(0, EXPERTS, (21, 2), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 3  # expert 3 gets more than a block of 16; experts 0, 1 and 6, 7 are another rank's
    ids[ids == 5] = 4  # expert 5 gets nothing
    sorted_slots = plan(ids, 2, 4, 16)  # this rank: experts 2-5
    other = plan(torch.zeros(21, 2, dtype=torch.int64), 2, 4, 16)
    assert sorted_slots.sorted_slots.shape == other.sorted_slots.shape  # sizes from the token count only
    rows = sorted_slots.sorted_slots.view(-1, 16)
    found = {e: [] for e in range(2, 6)}
    for block, expert in enumerate(sorted_slots.block_expert.tolist()):
        slots = [s for s in rows[block].tolist() if s < 42]
        if expert < 0:
            assert not slots
            continue
        assert slots, "a block of an expert holds at least one slot"
        found[expert + 2] += slots
    flat = ids.reshape(-1)
    for expert, slots in found.items():
        assert slots == [s for s in range(42) if flat[s] == expert], f"expert {expert}"
    assert len(found[3]) > 16 and not found[5]


def make_block(top_k: int, normalize: bool, fmt: str = "float", shared: int = 0) -> MoEBlock:
    """A block with seeded weights; quantised experts hold their weights as QuantizedWeights (as loading
    leaves them) and the loop's copy of them the same weights dequantised."""
    moe = MoEConfig(num_experts=EXPERTS, top_k=top_k, intermediate_size=WIDTH, norm_topk_prob=normalize,
                    routed_scaling_factor=1.0 if normalize else 2.5, shared_intermediate_size=shared)
    block = MoEBlock(moe, HIDDEN, lambda width: GatedMLP(HIDDEN, width, "silu", TPGroup.single()), TPGroup.single())
    generator = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.2
    if fmt != "float":
        for expert in block.experts:
            for layer in (expert.gate_up_proj, expert.down_proj):
                layer.quantized = quantize(layer.weight.data, fmt)
                layer.weight.data = layer.quantized.dequantize()
    return block


def fused_and_looped(top_k: int, normalize: bool, fmt: str = "float", shared: int = 0,
                     batch_invariant: bool = True) -> tuple[MoEBlock, MoEBlock]:
    """The same block twice: on the fused path (its router and shared experts on F.linear, as the loop's),
    and looping over experts that hold the dequantised weights (the fused product's arithmetic)."""
    fused, looped = make_block(top_k, normalize, fmt, shared), make_block(top_k, normalize, fmt, shared)
    fused.use_kernel(False, TritonProducts(), batch_invariant)
    for expert in looped.experts:
        for layer in (expert.gate_up_proj, expert.down_proj):
            layer.quantized = None
    assert fused.fused is not None and fused.fused.format == fmt and not fused.experts
    return fused, looped


@pytest.mark.parametrize("fmt, normalize", [("float", True), ("float", False), ("int8", False), ("int4", True)])
def test_fused_block_equals_the_loop_over_experts(fmt, normalize):
    """40 tokens (an expert gets more than one 16-row block) and 2 (at least 2 of the 8 experts get none), top 3."""
    fused, looped = fused_and_looped(3, normalize, fmt, shared=32 if fmt == "float" and normalize else 0)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        counts = torch.bincount(route(looped.gate(x), 3, normalize)[1].flatten(), minlength=EXPERTS)
        assert counts.max() > 16
        for rows in (x, x[:2]):
            torch.testing.assert_close(fused(rows), looped(rows), atol=2e-5, rtol=1e-5)
        assert fused(x[:0]).shape == (0, HIDDEN)


def test_fused_experts_give_a_slot_the_same_bits_alone_and_in_a_batch():
    """Batch invariance: the blocks are 16 rows whatever the step, so a token's expert outputs do not depend
    on how many rows its experts got (here up to 20)."""
    fused, _ = fused_and_looped(2, True)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ids = route(fused.gate(x), 2, True)[1]
        assert torch.bincount(ids.flatten(), minlength=EXPERTS).max() > 16
        full = fused.fused_slot_outputs(x, ids).view(40, 2, HIDDEN)
        for i in (0, 17, 39):
            assert torch.equal(fused.fused_slot_outputs(x[i:i + 1], ids[i:i + 1])[:, None].view(1, 2, HIDDEN)[0],
                               full[i]), f"row {i}"
        assert torch.equal(fused.fused_slot_outputs(x[5:14], ids[5:14]).view(9, 2, HIDDEN), full[5:14])
