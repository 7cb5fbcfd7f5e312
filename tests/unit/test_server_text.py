"""Streaming text pieces: the detokenizer never splits a character; stop strings cut the text exactly."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.server.detokenizer import StreamingDetokenizer
from engine.server.stop_text import TextStopper
from engine.tokenizer import Tokenizer

TEXTS = [
    "plain ascii words",
    "héllo wörld ñandú",
    "数学 と 日本語 のテキスト",
    "emoji 🎉🚀 mixed 👩‍👩‍👧 end",
    "a\u0301e\u0301",
]


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path("tiny-qwen35"))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_the_text_and_never_end_mid_character(tok, text):
    ids = tok.encode(text)
    d = StreamingDetokenizer(tok.decode)
    deltas = [d.add(i) for i in ids]
    rest = d.flush()
    assert "".join(deltas) + rest == tok.decode(ids) == d.text
    assert not any(x.endswith("\ufffd") for x in deltas)


def test_a_truncated_character_is_flushed_at_the_end(tok):
    ids = tok.encode("🎉")
    d = StreamingDetokenizer(tok.decode)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.flush() == tok.decode(ids[:-1])


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abcXYZ", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abcXYZ", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_strings_cut_at_the_first_occurrence(pieces, stops):
    s = TextStopper(stops)
    shown = "".join(s.push(p) for p in pieces) + s.flush()
    # Generation stops at the first piece after which the text holds a stop string, cut where the earliest
    # of those begins; later pieces never come (pieces ['a', 'Z', 'a'], stops ['Z', 'aZa']: 'Z' completes
    # first, so the text is 'a', though 'aZa' would have begun earlier).
    text, hits = "", []
    for p in pieces:
        text += p
        hits = [text.find(x) for x in stops if x in text]
        if hits:
            break
    assert shown == (text[: min(hits)] if hits else text)
    assert s.stopped == bool(hits)
