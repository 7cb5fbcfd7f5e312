from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import GeneratedToken
from engine.stopping import _StopMatcher


def _run(tokens, sequences):
    m = _StopMatcher(sequences)
    out = []
    for t in tokens:
        safe, matched = m.push(GeneratedToken(t))
        out.extend(x.token_id for x in safe)
        if matched:
            return out, True
    out.extend(x.token_id for x in m.flush())
    return out, False


def _reference(tokens, sequences):
    """Cut at the end of the earliest completed stop sequence; drop that sequence."""
    for end in range(1, len(tokens) + 1):
        for s in sequences:
            if end >= len(s) and tuple(tokens[end - len(s) : end]) == tuple(s):
                return list(tokens[: end - len(s)]), True
    return list(tokens), False


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=30),
    sequences=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=3),
)
def test_matches_reference_semantics(tokens, sequences):
    assert _run(tokens, sequences) == _reference(tokens, sequences)


def test_withholds_a_partial_match_until_decided():
    m = _StopMatcher([(5, 6, 7)])
    assert m.push(GeneratedToken(1)) == ([GeneratedToken(1)], False)
    assert m.push(GeneratedToken(5)) == ([], False)
    assert m.push(GeneratedToken(6)) == ([], False)
    safe, matched = m.push(GeneratedToken(9))
    assert [t.token_id for t in safe] == [5, 6, 9] and not matched
