"""Prompts with images in the torch-free core: the vision encoder's budget per step, and block keys that carry
the images' content hashes, so the prefix cache never gives one image's KV to another."""

from __future__ import annotations

from fake_runner import make_request, make_scheduler, run_to_completion
from tokenmill.core.block_keys import BlockKeys
from tokenmill.core.scheduling import SchedulingLimits
from tokenmill.multimodal.inputs import ImageFeature, image_keys
from tokenmill.request import Request

IMAGE_TOKEN = 999


def with_images(rid: str, prompt_len: int, images: list[tuple[int, int, str]], max_tokens: int = 4) -> Request:
    """A request whose prompt holds placeholder runs (offset, length, content hash)."""
    request = make_request(rid, prompt_len, max_tokens=max_tokens)
    for offset, length, _ in images:
        request.prompt_token_ids[offset:offset + length] = [IMAGE_TOKEN] * length
    request.images = tuple(ImageFeature(offset, length, digest, None) for offset, length, digest in images)
    return request


def encoder_scheduler(budget: int, encoder: int, **options):
    scheduler, runner = make_scheduler(budget=budget, **options)
    scheduler.limits = SchedulingLimits(budget, 8, 256, max_num_encoder_input_tokens=encoder)
    return scheduler, runner


def chunks(schedule) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start, s.num_tokens) for s in schedule.scheduled]


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take():
    scheduler, runner = encoder_scheduler(budget=32, encoder=16)
    scheduler.add_request(with_images("a", 40, [(2, 10, "x"), (14, 10, "y")]))
    first = scheduler.schedule()
    assert chunks(first) == [("a", 0, 14)]  # image x (10 positions) fits; y would need 20 of 16
    scheduler.update_from_output(first, runner.execute(first))
    second = scheduler.schedule()
    assert chunks(second) == [("a", 14, 26)]  # y starts this chunk; nothing else is encoded here
    scheduler.update_from_output(second, runner.execute(second))
    assert len(run_to_completion(scheduler, runner)["a"]) == 3


def test_an_image_begun_in_an_earlier_chunk_costs_nothing_and_a_larger_one_is_encoded_alone():
    scheduler, runner = encoder_scheduler(budget=8, encoder=6)
    scheduler.add_request(with_images("a", 20, [(0, 12, "big")]))  # larger than the encoder budget
    scheduler.add_request(with_images("b", 10, [(1, 4, "small")]))
    first = scheduler.schedule()
    assert chunks(first) == [("a", 0, 8)]  # the big image alone: b's image waits (and so does b, fcfs)
    scheduler.update_from_output(first, runner.execute(first))
    second = scheduler.schedule()
    # a's image was begun: its rest costs nothing, so b's image fits beside it
    assert chunks(second) == [("a", 8, 8)]
    scheduler.update_from_output(second, runner.execute(second))
    third = scheduler.schedule()
    assert chunks(third) == [("a", 16, 4), ("b", 0, 4)]
    scheduler.update_from_output(third, runner.execute(third))
    outputs = run_to_completion(scheduler, runner)
    assert set(outputs) == {"a", "b"}


def test_without_images_the_encoder_budget_changes_nothing():
    scheduler, runner = encoder_scheduler(budget=16, encoder=1)
    scheduler.add_request(make_request("a", 40, max_tokens=2))
    assert chunks(scheduler.schedule()) == [("a", 0, 16)]


class _Seq:
    def __init__(self, tokens, images):
        self.request_id, self.tokens, self.images = "s", tokens, images
        self.num_computed_tokens, self.num_tokens = 0, len(tokens)
        from tokenmill.sampling_params import SamplingParams
        self.sampling_params = SamplingParams()

    def token_ids_range(self, start, end):
        return self.tokens[start:end]


def test_block_keys_carry_the_hashes_of_the_images_they_hold():
    tokens = [1, 2, 3, 4] + [IMAGE_TOKEN] * 6 + [5, 6, 7, 8, 9, 10]
    keys = BlockKeys(block_size=4)
    first = keys.first(_Seq(tokens, (ImageFeature(4, 6, "aaa", None),)), 4)
    other = keys.first(_Seq(tokens, (ImageFeature(4, 6, "aab", None),)), 4)
    plain = keys.first(_Seq(tokens, ()), 4)
    assert first[0] == other[0] == plain[0]  # the block before the image
    assert first[1] != other[1] and first[2] != other[2]  # the blocks that hold its placeholders
    assert first[3] != other[3]  # and every block after them, chained
    assert first[1] != plain[1]
    assert image_keys((ImageFeature(4, 6, "aaa", None),), 8, 12) == ("aaa",)
    assert image_keys((ImageFeature(4, 6, "aaa", None),), 10, 14) == ()


def test_the_prefix_cache_gives_an_image_its_own_blocks_only():
    scheduler, runner = make_scheduler(budget=64, prefix_caching=True)
    scheduler.add_request(with_images("a", 24, [(4, 8, "cat")]))
    run_to_completion(scheduler, runner)
    scheduler.add_request(with_images("b", 24, [(4, 8, "cat")]))
    scheduler.add_request(with_images("c", 24, [(4, 8, "dog")]))  # same tokens, another image
    first = scheduler.schedule()
    assert {s.request_id: s.start for s in first.scheduled} == {"b": 20, "c": 4}
