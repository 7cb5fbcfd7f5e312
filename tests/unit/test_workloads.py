"""Frozen workloads: deterministic, hashed, tamper-evident, and the committed ones still match."""

import json
from dataclasses import replace

import pytest

from harness.run.workloads import STANDARD, Workload, WorkloadSettings, build, golden_path, load_or_build, tokenizer_for

SMALL = WorkloadSettings(decode_prompt_tokens=40, cold_prompt_tokens=200, concurrency=(2,), concurrent_prompt_tokens=30)


@pytest.fixture(scope="module")
def tok(tiny_path):
    return tokenizer_for(tiny_path("tiny-qwen3"))


def test_same_seed_same_ids_and_hash(tok):
    a, b = build("m", *tok, SMALL), build("m", *tok, SMALL)
    assert a.phases == b.phases and a.sha256 == b.sha256
    c = build("m", *tok, replace(SMALL, seed=1))
    assert c.phases["cold"] != a.phases["cold"] and c.sha256 != a.sha256


def test_prompts_have_the_asked_lengths_and_unique_nonces(tok):
    w = build("m", *tok, SMALL)
    assert [len(p) for p in w.prompts("cold", 0)] == [200]
    assert [len(p) for p in w.prompts("concurrency-2", 0)] == [30, 30]
    firsts = [tuple(p[:12]) for phase in ("probe", "decode", "cold") for a in (0, 1) for p in w.prompts(phase, a)]
    assert len(set(firsts)) == len(firsts)  # every phase and attempt opens differently
    assert w.prompts("warm", 0) == w.prompts("cold", 0)  # warm repeats cold


def test_a_hand_edited_workload_is_refused(tok):
    obj = build("m", *tok, SMALL).to_json()
    obj["phases"]["cold"][0][0][5] += 1
    with pytest.raises(ValueError, match="sha256"):
        Workload.from_json(obj)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen35", "small-qwen3"])
def test_committed_workloads_match_a_fresh_build(tiny_path, name):
    path = tiny_path(name)
    settings = STANDARD
    stored = Workload.from_json(json.loads(golden_path(name, settings).read_text()))
    assert stored == build(name, *tokenizer_for(path), settings)
    used, where = load_or_build(name, path, replace(settings, concurrency=(4,), context_tokens=None))
    assert where == golden_path(name, settings) and used.sha256 == stored.sha256


def test_the_staggered_and_chat_cells_leave_the_other_prompts_as_they_were(tok):
    plain = build("m", *tok, SMALL)
    more = build("m", *tok, replace(SMALL, staggered=2, staggered_tokens=120, chat_requests=3))
    assert all(more.phases[p] == plain.phases[p] for p in plain.phases)
    assert [len(p) for p in more.prompts("staggered", 0)] == [120, 120]
    chats = more.prompts("chat", 0)
    assert len(chats) == 3 and all([m["role"] for m in c["messages"]] == ["system", "user"] for c in chats)
    assert len({c["messages"][0]["content"][:12] for c in chats + more.prompts("chat", 1)}) == 6  # nonces
    assert more.settings.covers(replace(SMALL, staggered=2, staggered_tokens=120))
    assert not more.settings.covers(replace(SMALL, staggered=2, staggered_tokens=100))


@pytest.mark.parametrize(
    "a, b, same",
    [(" x", "x", True), ("x", " x", True), ("   x", "    x", True), ("  x", "x", False), ("x", "y", False)],
)
def test_probe_texts_forgive_one_leading_space(a, b, same):
    from harness.run.runner import _same_text

    assert _same_text(a, b) is same
