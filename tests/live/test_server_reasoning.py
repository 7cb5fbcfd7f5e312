"""A template that thinks: the reply's reasoning in reasoning_content, streaming and not, switched by
chat_template_kwargs, kept in content with --reasoning-parser none."""

from pathlib import Path

import openai
import pytest
from live_server import LiveServer

MODEL = "tiny-qwen3"
TEMPLATE = Path(__file__).parent.parent / "fixtures" / "think_template.jinja"
ASK = dict(
    model=MODEL, messages=[{"role": "user", "content": "Think first."}], max_tokens=12, extra_body={"ignore_eos": True}
)


def serve(*extra):
    return LiveServer("--model", MODEL, "--chat-template", str(TEMPLATE), *extra)


@pytest.fixture(scope="module")
def client():
    srv = serve()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    assert srv.stop()[0] == 0


def test_a_thinking_reply_goes_to_reasoning_content(client):
    # the prompt opens the block and a random model never closes it: all of the reply is reasoning
    message = client.chat.completions.create(**ASK).choices[0].message
    assert message.reasoning_content and message.content is None  # OpenAI: no content is null
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or ""
        for c in client.chat.completions.create(**ASK, stream=True)
        if c.choices
    )
    assert streamed == message.reasoning_content


def test_thinking_off_leaves_the_reply_in_content(client):
    off = {**ASK, "extra_body": {**ASK["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}}
    message = client.chat.completions.create(**off).choices[0].message
    assert message.content and not getattr(message, "reasoning_content", None)


def test_the_parser_can_be_turned_off():
    srv = serve("--reasoning-parser", "none")
    try:
        message = (
            openai.OpenAI(base_url=srv.url + "/v1", api_key="none").chat.completions.create(**ASK).choices[0].message
        )
        assert message.content and not getattr(message, "reasoning_content", None)
    finally:
        assert srv.stop()[0] == 0
