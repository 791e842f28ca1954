"""scripts/train_eagle3.py end to end at a tiny size: it trains a head for a tiny target on a tiny repository's
text, writes it (outside the repository) in the layout tokenmill loads, and measures it on held-out text in
tokenmill's engine: greedy output identical to no speculation, and an acceptance the head earned.

Cost (~15 s alone on the 2-core machine, ~8 of them the script): one tiny target (tests/helpers/agreeing_drafts.py's
4-layer Llama whose next token is mostly a bigram of the current one, written without transformers), two engines on
it (the script's plain one and the one with the head), ~3 s of training on 16 short sequences (fewer updates leave
too few held-out proposals accepted for the engine-against-replay comparison to mean much)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.agreeing_drafts import write_bigram_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import train_eagle3  # noqa: E402  (scripts/ is not a package)

K = 3


def _tiny_repository(root: Path) -> Path:
    """A README, docs and Python sources, all of the same few sentences (so that what the head learns on the
    training files holds on the held-out ones): enough text for a few dozen 24-token windows."""
    sentences = ["The engine schedules each request. ", "It computes the tokens and frees the blocks. ",
                 "A request ends at its stop token. "]
    (root / "docs").mkdir(parents=True)
    (root / "src" / "pkg").mkdir(parents=True)
    files = [root / "README.md"] + [root / "docs" / f"page{i}.md" for i in range(6)] + \
        [root / "src" / "pkg" / f"module{i}.py" for i in range(6)]
    for index, path in enumerate(files):
        path.write_text("".join(sentences[(index + j) % 3] for j in range(24)))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_eagle3")
    target = write_bigram_llama(root / "target")
    repo = _tiny_repository(root / "repo")
    out = root / "head"
    report = train_eagle3.main([
        "--model", str(target), "--dtype", "float32", "--quantization", "none", "--repo", str(repo),
        "--out", str(out), "--layers", "1", "2", "3", "--held-out-fraction", "0.4", "--window", "24",
        "--continuation", "6", "--train-sequences", "16", "--collect-batch", "16", "--draft-vocab", "1024",
        "--ttt-steps", "2", "--epochs", "10", "--batch-size", "4", "--lr", "0.003", "--eval-sequences", "4",
        "--eval-output-len", "20", "--num-speculative-tokens", str(K)])
    return report, out, repo


def test_the_script_writes_a_head_tokenmill_serves_with_greedy_output_unchanged(trained):
    report, out, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 1024 and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= set(tensors)
    assert int(tensors["t2d"].sum()) == 1024 and tensors["lm_head.weight"].shape == (1024, 64)
    assert (out / "held_out_prompts.jsonl").read_text().count("\n") == report["held_out_windows"] == 4
    assert json.loads((out / "training_report.json").read_text()) == report
    assert report["identical_to_no_speculation"]


def test_the_acceptance_is_measured_earned_and_what_training_predicted(trained):
    report, _, _ = trained
    per_position = report["acceptance_per_position"]
    assert report["rounds"] > 0 and len(per_position) == K
    assert all(0 <= rate <= 1 for rate in per_position)
    # the head learned some of the target's next tokens (an untrained head proposes them almost never: ~1/1024)
    assert report["mean_acceptance_length"] > 1.1 and per_position[0] > 0.05, report
    # the engine played exactly the rounds the training-time head predicts (float32 on both sides): the head
    # tokenmill loads computes what was trained, chained proposals, RoPE positions, d2t and the taps included
    assert (report["predicted_rounds"], report["predicted_acceptance_per_position"]) == (report["rounds"], per_position)


def test_the_head_is_never_written_into_the_repository(trained):
    _, _, repo = trained
    with pytest.raises(ValueError, match="lies inside the repository"):
        train_eagle3.main(["--repo", str(repo), "--out", str(repo / "head")])
