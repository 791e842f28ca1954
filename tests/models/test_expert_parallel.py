"""Expert parallelism: MoE layers' experts sharded whole across the tensor-parallel ranks (worker processes over
gloo) give the single-rank tokens and logprobs bit for bit; each rank holds and loads only its experts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from helpers.tiny_models import make_tiny_hf_model
from tokenmill.cli.main import build_parser
from tokenmill.config import ModelConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.model_setup import load_model
from tokenmill.layers.moe import MoEBlock, combine, route
from tokenmill.models.arch import MoEConfig
from tokenmill.models.decoder import GatedMLP
from tokenmill.models.loader import load_model_source
from tokenmill.parallel.group import TPGroup
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.worker import check_divisible

PROMPT_IDS = [[1, 5, 9, 13, 2, 7, 5, 9, 13], [3, 3, 8], list(range(20, 57)), [400, 12, 77, 5], [7, 8, 9] * 10]


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def ids_and_logprobs(outputs):
    ids = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return ids, logprobs


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Mixtral (every layer MoE) and Qwen3-MoE (a dense middle layer); 8 experts, top 2; 2 KV heads."""
    return {arch: str(make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch))
            for arch in ("mixtral", "qwen3_moe")}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_over_2_ranks_equal_one_rank_bit_for_bit_in_bfloat16(folders, arch):
    single = ids_and_logprobs(LLM(folders[arch], dtype="bfloat16").generate(PROMPT_IDS, greedy(), use_tqdm=False))
    llm = LLM(folders[arch], dtype="bfloat16", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        ranks = llm.llm_engine.executor.rank_descriptions
        split = ids_and_logprobs(llm.generate(PROMPT_IDS, greedy(), use_tqdm=False))
    finally:
        llm.shutdown()
    assert [("experts 0-3 of 8 on this rank" in d, "experts 4-7 of 8 on this rank" in d) for d in ranks] == \
        [(True, False), (False, True)], ranks
    assert split == single


@dataclass(frozen=True)
class CapturingGroup(TPGroup):
    """A rank of an expert-parallel group without torch.distributed: all_reduce hands its buffer to `seen`."""

    seen: list = field(default_factory=list, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return x


def test_ranks_buffers_sum_exactly_to_the_one_rank_slots_and_output():
    """Blocks of 4 ranks (top 3, shared experts, bfloat16): each rank's buffer holds its slots and -0.0 elsewhere;
    their sum in rank order is the one-rank slots bit for bit (signed zeros included), and so is the output."""
    moe = MoEConfig(num_experts=8, top_k=3, intermediate_size=48, norm_topk_prob=False, routed_scaling_factor=2.5,
                    shared_intermediate_size=32)
    expert = lambda width: GatedMLP(64, width, "silu", TPGroup.single())  # noqa: E731
    whole = MoEBlock(moe, 64, expert, TPGroup.single())
    generator = torch.Generator().manual_seed(0)
    for param in whole.parameters():
        param.data = (torch.randn(param.shape, generator=generator) * 0.2).to(torch.bfloat16)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[3] = 0  # a token whose experts' outputs are all zeros
    groups = [CapturingGroup(rank, 4, expert_parallel=True) for rank in range(4)]
    blocks = []
    for group in groups:
        block = MoEBlock(moe, 64, expert, group)
        assert list(block.local) == list(range(2 * group.rank, 2 * group.rank + 2)) and len(block.experts) == 2
        reference = dict(whole.named_parameters())
        for name, param in block.named_parameters():
            if name.startswith("experts."):  # local index -> global
                index, rest = name[len("experts."):].split(".", 1)
                name = f"experts.{block.local.start + int(index)}.{rest}"
            param.data = reference[name].data
        blocks.append(block)
    with torch.inference_mode():
        weights, ids = route(whole.gate(x), 3, False, 2.5)
        expected = whole.expert_outputs(x, ids).float()
        parts = [block.expert_outputs(x, ids) for block in blocks]  # each returns its own (un-reduced) buffer
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        assert torch.equal(total.view(torch.int32), expected.view(torch.int32))
        owners = sum((p != 0) | (p.view(torch.int32) == 0) for p in parts)  # written slots (+0.0 included)
        assert owners.max() == 1
        out = (combine(total, weights).to(x.dtype) + whole.shared_experts(x))
        assert torch.equal(out.view(torch.int16), whole(x).view(torch.int16))
        assert [len(g.seen) for g in groups] == [1] * 4


def test_each_rank_loads_only_its_experts(folders):
    source = load_model_source(folders["qwen3_moe"], with_tokenizer=False)
    config = ModelConfig(linear_kernel="dense", attention_backend="torch_ref")
    whole, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64)
    counts = {}
    for rank in range(2):
        model, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64,
                              tp=TPGroup(rank, 2, expert_parallel=True))
        for layer in (0, 2):
            block, reference = model.layers[layer].mlp, whole.layers[layer].mlp
            assert isinstance(block, MoEBlock) and len(block.experts) == 4
            for index, expert in enumerate(block.experts):
                theirs = reference.experts[4 * rank + index]
                assert torch.equal(expert.gate_up_proj.weight, theirs.gate_up_proj.weight)
                assert torch.equal(expert.down_proj.weight, theirs.down_proj.weight)
            assert torch.equal(block.gate.weight, reference.gate.weight)
        counts[rank] = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        assert model.describe_weights().endswith(f"experts {4 * rank}-{4 * rank + 3} of 8 on this rank")
    assert counts[0] == counts[1] == sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n) // 2

    # the completeness check still holds for this rank's experts
    def without(name):
        return ((n, t) for n, t in source.iter_weights() if n != name)
    model, _ = load_model(source, config, torch.device("cpu"), torch.float32, 64,
                          tp=TPGroup(1, 2, expert_parallel=True))
    model.load_weights(without("model.layers.0.mlp.experts.2.up_proj.weight"))  # rank 0's: not missed
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.0\.mlp\.experts\.1\.gate_up_proj\.weight:1"):
        model.load_weights(without("model.layers.0.mlp.experts.5.up_proj.weight"))


def test_flag_is_in_serve_help_and_refused_where_it_does_not_apply(folders, tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--enable-expert-parallel" in capsys.readouterr().out
    assert build_parser().parse_args(["serve", "--enable-expert-parallel"]).enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel.*needs tensor_parallel_size > 1, got 1"):
        LLM(folders["mixtral"], enable_expert_parallel=True)
    llama = str(make_tiny_hf_model(tmp_path, arch="llama"))
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no mixture-of-experts layers"):
        LLM(llama, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="mixture-of-experts .* --enable-expert-parallel"):
        LLM(folders["mixtral"], tensor_parallel_size=2)
    arch = load_model_source(folders["mixtral"], with_tokenizer=False).arch
    six = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, num_experts=6))
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 experts"):
        check_divisible(six, 4, expert_parallel=True)
    check_divisible(arch, 2, expert_parallel=True)
