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
