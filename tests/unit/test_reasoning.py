"""Reasoning blocks split out of a reply, whole and in every split of the stream."""

import pytest

from engine.server.reasoning import ReasoningParser, opened, thinks

CASES = [
    (False, "<think>\nweighing it</think>\n\nThe answer.", "\nweighing it", "The answer."),  # the model opens it
    (True, "weighing it</think>\n\nThe answer.", "weighing it", "The answer."),  # the prompt opened it
    (False, "  A plain answer, <think> in passing", "", "  A plain answer, <think> in passing"),
    (True, "never closed <thi", "never closed <thi", ""),
]


@pytest.mark.parametrize("inside, text, reasoning, content", CASES)
def test_every_split_gives_the_same_reasoning_and_content(inside, text, reasoning, content):
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            p = ReasoningParser(inside)
            parts = [p.push(text[:a]), p.push(text[a:b]), p.push(text[b:]), p.flush()]
            assert "".join(x.reasoning for x in parts) == reasoning, (a, b)
            assert "".join(x.content for x in parts) == content, (a, b)


def test_the_template_and_the_prompt_say_where_a_reply_starts():
    assert thinks("{{ '<think>' }}") and not thinks("{{ messages }}") and not thinks(None)
    assert opened("<|im_start|>assistant\n<think>\n") and not opened("<think>\n\n</think>\n\n")
