from tokenmill.engine.stop_strings import find_stop_string, partial_stop_suffix


def test_stop_string_split_across_tokens_is_found():
    text = "hello wor"
    assert find_stop_string(text, 3, ["world"]) is None
    text += "ld!"
    assert find_stop_string(text, 3, ["world"]) == (6, "world")


def test_earliest_stop_wins():
    assert find_stop_string("abcSTOPxyEND", 12, ["END", "STOP"]) == (3, "STOP")


def test_partial_suffix_is_held_back():
    assert partial_stop_suffix("the answer is </an", ["</answer>"]) == 4
    assert partial_stop_suffix("nothing here", ["</answer>"]) == 0
    assert partial_stop_suffix("ab", ["abc", "bx"]) == 2
