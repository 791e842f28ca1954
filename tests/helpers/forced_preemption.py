"""Greedy runs of several requests together on one engine, with a preemption forced at a chosen step (the models with
a recurrent state: their requests never grow once admitted, so a small pool makes them wait rather than be
preempted; this preempts one as the scheduler does when short of blocks, by recompute or swap as its
preemption_mode and swap space decide)."""

from __future__ import annotations

from tokenmill import LLM, SamplingParams

# the prompts the recurrent-state tests run: one of 23 tokens (three scan chunks of 8 in the tiny models) and others
# of other lengths to batch it with
PROMPT = list(range(300, 100, -9))
OTHERS = [list(range(1000, 1030)), [7, 8, 9] * 9, [2, 3]]


def greedy_runs(llm: LLM, prompts: list[list[int]], preempt_at_step: int = 0, max_tokens: int = 12) -> list[tuple]:
    """Each prompt's (greedy ids, top-1 logprobs) run together; with `preempt_at_step`, the last-admitted running
    request is preempted (recompute: its blocks and state freed; swap: copied out to be copied back) after that many
    steps."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), None, params, prompt_token_ids=ids)
    done, steps, preempted = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
        steps += 1
        if steps == preempt_at_step:
            scheduler = engine.scheduler
            victim = scheduler.running.pop()
            assert victim.num_computed_tokens > 0
            scheduler._preempt(victim)
            preempted += 1
    assert preempted == (1 if preempt_at_step else 0)
    return [(tuple(done[str(i)].token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                                   for step in done[str(i)].logprobs)) for i in range(len(prompts))]
