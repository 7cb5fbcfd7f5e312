"""The request parser under arbitrary bodies: a typed request or an ApiError with a 4xx, nothing else."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, ApiError, parse_chat, parse_completion, parse_json

# JSON values with the awkward cases in reach: deep nesting, huge integers, surrogates, floats past finite
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(sorted(COMPLETION_FIELDS | CHAT_FIELDS)) | st.text(max_size=8)
bodies = st.dictionaries(field_names, values, max_size=8)


def _parse(raw: bytes, chat: bool):
    try:
        return (parse_chat if chat else parse_completion)(parse_json(raw))
    except ApiError as e:
        assert 400 <= e.status < 500 and e.body()["error"]["message"]
        return e


@settings(max_examples=400, deadline=None)
@given(bodies, st.booleans())
def test_any_object_is_parsed_or_refused_with_a_4xx(body, chat):
    try:
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
    except (ValueError, OverflowError):
        return
    _parse(raw, chat)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")), st.booleans())
def test_any_bytes_are_parsed_or_refused_with_a_4xx(raw, chat):
    _parse(raw, chat)


def test_the_awkward_bodies_by_name():
    for raw in (
        b"[" * 100_000,
        b'{"prompt": ' + b"9" * 5000 + b"}",
        b'{"prompt": "\\ud800"}',
        b'{"\\udfff": 1}',
        b'{"prompt": "x", "temperature": 1e999}',
    ):
        assert isinstance(_parse(raw, False), ApiError)
