"""json_scan: where a JSON value being generated ends, and a JSON string's decoded text, for every split of the
text into pieces."""
from __future__ import annotations

import json

import pytest

from appliance.protocol.json_scan import JsonStringDecoder, JsonValueEnd


def value_end(pieces: list[str]) -> tuple[str, bool]:
    """(the characters the scanner claimed for the value, whether it saw its end)."""
    s, claimed = JsonValueEnd(), []
    for p in pieces:
        claimed.append(p[:s.feed(p)])
    return "".join(claimed), s.ended


@pytest.mark.parametrize("value, after", [
    ('{"city": "Paris"}', '}\n</tool_call>'),
    ('{"a": [1, {"b": "]}\\"}"}], "c": {}}', '}'),
    ('[1, [2, [3]]]', ', "x": 1}'),
    ('"a \\" } ] string"', '}'),
    ('-12.5e3', '}'),
    ('true', ', '),
    ('{}', ''),
])
def test_value_end_for_every_split(value, after):
    text = value + after
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(cut + 3, len(text))):
            claimed, ended = value_end([text[:cut], text[cut:cut2], text[cut2:]])
            if after or value[0] in '{["':
                assert (claimed, ended) == (value, True), (cut, cut2)
            else:
                assert claimed == value


def test_value_cut_short_claims_everything_and_never_ends():
    assert value_end(['{"a": "x}', '", "b": [1']) == ('{"a": "x}", "b": [1', False)
    s = JsonValueEnd()
    assert s.feed('{}') == 2 and s.feed("}}") == 0 and s.ended


def decode(pieces: list[str]) -> tuple[str, int, bool]:
    d, out, used = JsonStringDecoder(), [], 0
    for p in pieces:
        text, n = d.feed(p)
        out.append(text)
        used += n
    return "".join(out) + d.flush(), used, d.ended


@pytest.mark.parametrize("value", ["plain", "", "new\nline \"quoted\" back\\slash /", "é 巴黎 \u00e9",
                                   "emoji \U0001F600 and \u2028", "\t\b\f\r"])
def test_string_decodes_as_json_loads_for_every_split(value):
    for ascii_only in (True, False):
        text = json.dumps(value, ensure_ascii=ascii_only)[1:] + "} tail"
        body = len(text) - len("} tail")
        for cut in range(len(text) + 1):
            for cut2 in (cut, min(cut + 5, len(text))):
                assert decode([text[:cut], text[cut:cut2], text[cut2:]]) == (value, body, True), (text, cut)


def test_decoded_text_is_released_as_soon_as_it_is_known():
    d = JsonStringDecoder()
    assert d.feed("ab\\") == ("ab", 3)               # the escape waits for its letter
    assert d.feed("n\\u00") == ("\n", 5)
    assert d.feed("e9\\ud83d") == ("é", 8)           # a high surrogate waits for its low half
    assert d.feed("\\ude00x") == ("\U0001F600x", 7)
    assert d.feed('"rest') == ("", 1) and d.ended
    assert d.feed("more") == ("", 0)


def test_lone_surrogates_and_cut_escapes():
    assert decode(['\\ud83dx"']) == ("\ufffdx", 8, True)
    assert decode(['\\udc00"']) == ("\ufffd", 7, True)
    assert decode(['\\ud83d\\n"']) == ("\ufffd\n", 9, True)
    assert decode(["cut \\u00"]) == ("cut ", 8, False)          # max_tokens inside an escape: dropped
    assert decode(["cut \\ud83d"]) == ("cut \ufffd", 10, False)
