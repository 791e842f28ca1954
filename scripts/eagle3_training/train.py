"""Training the head on the target's states: at every step of the training-time test (step s weighted 0.8^s, as
EAGLE-3 / SpecForge weight them), the soft cross-entropy against the target's next-token distribution over the
draft vocabulary (renormalised: EAGLE-3's loss) plus `greedy_weight` times the cross-entropy of the target's
greedy token (what a greedy request accepts; it alone teaches a target whose distributions are nearly flat).
Positions whose greedy token lies outside the draft vocabulary count for nothing (the head cannot propose it)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from eagle3_training.collect import TargetStates
from eagle3_training.head import TrainableEagle3Head

STEP_WEIGHT = 0.8


@dataclass
class Batch:
    """B sequences laid out for `TrainableEagle3Head.unrolled` with `steps` steps over rows 0..N-1: embeds
    [B, steps, N, hidden], taps [B, N, 3 x hidden], label_final [B, steps, N, hidden] (the target's final state
    whose logits the step's row must match), label_greedy [B, steps, N] (draft ids, -1 where the row has no
    label or the target's token is outside the draft vocabulary)."""

    embeds: torch.Tensor
    taps: torch.Tensor
    label_final: torch.Tensor
    label_greedy: torch.Tensor


def make_batch(sequences: list[TargetStates], steps: int, embedding: torch.Tensor,
               target_to_draft: torch.Tensor) -> Batch:
    """Row i, step s: fed token i + 1 + s, labelled with the target's prediction at position i + 1 + s (the
    distribution of token i + 2 + s); rows past a sequence's end are unlabelled."""
    n = min(len(s.taps) for s in sequences) - 1
    embeds, taps, finals, greedies = [], [], [], []
    for seq in sequences:
        fed = torch.cat([seq.tokens, seq.tokens.new_zeros(steps)])
        final = torch.cat([seq.final, seq.final.new_zeros(steps, seq.final.shape[1])])
        greedy = torch.cat([target_to_draft[seq.greedy], seq.greedy.new_full((steps,), -1)])
        rows = [torch.arange(n) + 1 + s for s in range(steps)]
        embeds.append(torch.stack([embedding[fed[r]] for r in rows]))
        finals.append(torch.stack([final[r] for r in rows]))
        labels = torch.stack([greedy[r] for r in rows])
        for s, r in enumerate(rows):
            labels[s, r > len(seq.taps) - 1] = -1  # no target prediction there
        greedies.append(labels)
        taps.append(seq.taps[:n])
    return Batch(torch.stack(embeds).float(), torch.stack(taps).float(), torch.stack(finals).float(),
                 torch.stack(greedies))


def step_losses(head: TrainableEagle3Head, batch: Batch, steps: int, target_rows: torch.Tensor,
                greedy_weight: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss and each step's accuracy (the head's argmax equal to the target's greedy token, over
    the labelled rows). `target_rows` [draft vocab, hidden]: the target's LM-head rows of the draft tokens."""
    # the products in bfloat16 (3x float32's speed on AMX), the softmaxes and the loss in float32 (autocast's)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = head.unrolled(batch.embeds, batch.taps, steps)
    loss, accuracies = torch.zeros(()), []
    for s, states in enumerate(outputs):
        labelled = batch.label_greedy[:, s] >= 0
        if not bool(labelled.any()):
            accuracies.append(float("nan"))
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16):
            target_logits = batch.label_final[:, s][labelled] @ target_rows.T
            logits = head.logits(states[labelled])
        target = torch.softmax(target_logits.float(), dim=-1)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        soft = -(target * log_probs).sum(-1).mean()
        greedy = F.nll_loss(log_probs, batch.label_greedy[:, s][labelled])
        loss = loss + STEP_WEIGHT ** s * (soft + greedy_weight * greedy)
        accuracies.append(float((logits.argmax(-1) == batch.label_greedy[:, s][labelled]).float().mean()))
    return loss, accuracies


def train_head(head: TrainableEagle3Head, sequences: list[TargetStates], embedding: torch.Tensor,
               target_rows: torch.Tensor, target_to_draft: torch.Tensor, steps: int, epochs: int,
               batch_size: int, lr: float, greedy_weight: float, seed: int, log=print) -> list[float]:
    """Adam with a linear warm-up (5% of the updates) and a cosine decay to 0, `epochs` passes in seeded order;
    the last epoch's mean accuracy per step."""
    order = list(range(len(sequences)))
    per_epoch = math.ceil(len(order) / batch_size)
    total, warmup = per_epoch * epochs, max(1, per_epoch * epochs // 20)
    optimizer = Adam(list(head.parameters()))
    rng, started, update = random.Random(seed), time.perf_counter(), 0
    target_rows = target_rows.float()
    last: list[list[float]] = []
    for epoch in range(epochs):
        rng.shuffle(order)
        last = []
        for first in range(0, len(order), batch_size):
            batch = make_batch([sequences[i] for i in order[first:first + batch_size]], steps, embedding,
                               target_to_draft)
            loss, accuracies = step_losses(head, batch, steps, target_rows, greedy_weight)
            loss.backward()
            optimizer.step(lr * min((update + 1) / warmup, 0.5 * (1 + math.cos(math.pi * update / total))))
            update += 1
            last.append(accuracies)
            if update % 10 == 0 or update == total:
                shown = " ".join(f"{a:.2f}" for a in accuracies)
                log(f"  epoch {epoch + 1}/{epochs} update {update}/{total}: loss {loss.item():.3f}, "
                    f"accuracy per step {shown}, {time.perf_counter() - started:.0f} s")
    return [sum(a[s] for a in last if not math.isnan(a[s])) / max(1, sum(not math.isnan(a[s]) for a in last))
            for s in range(steps)]


class Adam:
    """Adam (no weight decay) with the gradient clipped to norm 0.5 first. Written out: torch.optim's first
    optimizer imports torch._dynamo, ~5 s, longer than a tiny training run."""

    def __init__(self, params: list[torch.Tensor], betas=(0.9, 0.95), eps: float = 1e-8) -> None:
        self.params, self.betas, self.eps, self.count = params, betas, eps, 0
        self.first = [torch.zeros_like(p) for p in params]
        self.second = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update at learning rate `lr`; the gradients are cleared after it."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
        clip = min(1.0, 0.5 / (float(norm) + 1e-6))
        self.count += 1
        b1, b2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.first, self.second):
            g = g * clip
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denominator = (v / (1 - b2 ** self.count)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denominator, value=-lr / (1 - b1 ** self.count))
            p.grad = None
