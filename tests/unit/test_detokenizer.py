from helpers.tiny_models import smollm2_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Grüße aus Köln — 東京タワー 🚀🎉 naïve café", "  leading spaces\nand\ttabs  ", "emoji only: 👩‍👩‍👧‍👦"]


def test_streamed_deltas_are_whole_characters_and_add_up_to_the_text():
    tokenizer = smollm2_tokenizer()
    prompt = tokenizer("Say:").input_ids
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.push(t) for t in ids]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert any(d == "" for d in deltas) or text.isascii()


def test_the_rust_decode_shortcut_gives_transformers_text_and_is_taken_only_where_it_is_the_same_call():
    import copy
    import random

    from transformers import PreTrainedTokenizerFast

    from tokenmill.engine.detokenizer import rust_decode
    tokenizer = smollm2_tokenizer()
    decode = rust_decode(tokenizer)
    assert decode is not None
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer)) for _ in range(8)]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class OwnDecode(type(tokenizer)):  # a tokenizer class with its own decode keeps transformers' path
        def _decode(self, token_ids, **kwargs):
            return PreTrainedTokenizerFast._decode(self, token_ids, **kwargs).upper()

    own = copy.deepcopy(tokenizer)  # the helper's tokenizer is shared: change a copy's class
    own.__class__ = OwnDecode
    assert rust_decode(own) is None
    detok = IncrementalDetokenizer(own, [])
    assert "".join(detok.push(t) for t in own("hello there", add_special_tokens=False).input_ids) == "HELLO THERE"
