"""Decoding constrained to a JSON schema or a forced tool call, on the serial lane and in the batch."""

import json

import jsonschema
import pytest

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.engine import Engine
from engine.grammar import GrammarError, Grammars
from engine.loading import vocab_size
from engine.request import GenerationRequest, SamplingParams, StopCriteria
from engine.server.strict_schema import strict_schema
from engine.server.tool_calls import split
from engine.sinks import CollectingSink

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days", "rain"],
    "properties": {
        "city": {"enum": ["Oslo", "Paris", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "rain": {"type": "boolean"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]


@pytest.fixture(scope="module")
def engine(tiny_path):
    return Engine.load(model_path=tiny_path("tiny-qwen3"))


@pytest.fixture(scope="module")
def grammars(engine):
    return Grammars(engine.tokenizer.backend, sorted(engine.tokenizer.eos_ids), vocab_size(engine.config))


def text_of(engine, prompt, sampling, max_tokens=120):
    tokens = list(engine.generate(prompt, max_tokens=max_tokens, sampling=sampling))
    return engine.tokenizer.decode([t.token_id for t in tokens if not t.is_stop])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_random_model_writes_json_valid_under_the_schema(engine, grammars, temperature):
    sampling = SamplingParams(temperature=temperature, seed=3, constraint=grammars.json_schema(SCHEMA))
    reply = json.loads(text_of(engine, list(range(20, 40)), sampling))
    jsonschema.validate(reply, SCHEMA)


def test_a_forced_call_is_a_valid_call(engine, grammars):
    sampling = SamplingParams(temperature=1.0, seed=5, constraint=grammars.tool_calls(TOOLS, several=False))
    parsed = split(text_of(engine, list(range(50, 70)), sampling, max_tokens=160))
    assert len(parsed.calls) == 1 and parsed.content.strip() == ""
    call = parsed.calls[0]
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), params)


def allowed_after(grammars, constraint, text, tokenizer):
    """The token ids the grammar allows once `text` is written (None: it does not allow the text)."""
    import llguidance
    import llguidance.numpy as lnp
    import numpy as np

    matcher = llguidance.LLMatcher(grammars.tokenizer, constraint.grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return None
    matcher.consume_tokens(ids)
    bitmask = lnp.allocate_token_bitmask(1, grammars.vocab_size)
    lnp.fill_next_token_bitmask(matcher, bitmask, 0)
    return set(np.nonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))[0].tolist())


CALL = '<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>'


def test_a_forced_call_is_one_call_unless_several_are_asked_for(engine, grammars):
    eos = set(engine.tokenizer.eos_ids)
    once = allowed_after(grammars, grammars.tool_calls(TOOLS), CALL, engine.tokenizer)
    assert once == eos  # the call written, the reply can only end
    several = allowed_after(grammars, grammars.tool_calls(TOOLS, several=True), CALL, engine.tokenizer)
    assert eos < several  # it may end after each call, or open another
    assert allowed_after(grammars, grammars.tool_calls(TOOLS, several=True), CALL * 2, engine.tokenizer) == several


def test_a_reply_offered_tools_under_a_schema_is_a_call_or_the_schemas_json(engine, grammars):
    tok, eos = engine.tokenizer, set(engine.tokenizer.eos_ids)
    either = grammars.call_or_json(TOOLS, SCHEMA)
    assert allowed_after(grammars, either, CALL, tok) == eos
    assert allowed_after(grammars, either, '{"city":"Oslo","days":3,"rain":true}', tok) == eos
    assert allowed_after(grammars, either, "Sunny", tok) is None
    assert allowed_after(grammars, either, '{"name":"ping","arguments":{}}', tok) is None  # a call outside a block
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed, constraint=either)
        parsed = split(text_of(engine, list(range(30, 50)), sampling, max_tokens=160))
        if parsed.calls:
            assert len(parsed.calls) == 1 and parsed.content.strip() == ""
        else:
            jsonschema.validate(json.loads(parsed.content), SCHEMA)


def test_a_strict_schema_takes_no_key_it_does_not_list(engine, grammars):
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    extra = '{"name":"a","age":1,"myl":"}}}'
    assert allowed_after(grammars, grammars.json_schema(person), extra, engine.tokenizer) is not None  # JSON Schema's
    assert allowed_after(grammars, grammars.json_schema(strict_schema(person)), extra, engine.tokenizer) is None
    done = allowed_after(grammars, grammars.json_schema(strict_schema(person)), '{"name":"a","age":1', engine.tokenizer)
    assert done is not None and not done & set(engine.tokenizer.encode(',"', add_special_tokens=False))


def test_constrained_rows_in_the_batch_leave_the_others_alone(engine, grammars):
    def run(constrained):
        b = ContinuousBatcher(engine.model, SchedulerConfig(max_rows=4))
        sinks = {}
        for i in range(3):
            c = grammars.json_schema(SCHEMA) if constrained and i == 1 else None
            sinks[i] = CollectingSink()
            b.submit(
                GenerationRequest(
                    f"r{i}",
                    tuple(range(10 + i, 30 + i)),
                    SamplingParams(constraint=c),
                    StopCriteria(max_tokens=60, eos_ids=engine.tokenizer.eos_ids),
                ),
                sinks[i],
            )
        b.run_until_idle()
        return {i: [t for t in s.token_ids] for i, s in sinks.items()}

    plain, mixed = run(False), run(True)
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    stop = set(engine.tokenizer.eos_ids)
    jsonschema.validate(json.loads(engine.tokenizer.decode([t for t in mixed[1] if t not in stop])), SCHEMA)


def test_a_schema_llguidance_cannot_compile_says_why(grammars):
    with pytest.raises(GrammarError, match="nonsense"):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})
