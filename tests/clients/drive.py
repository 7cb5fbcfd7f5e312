"""Drives one third-party client library against an OpenAI-compatible server: runs in the clients' venv.

    python drive.py SCENARIO --base-url http://127.0.0.1:8000 --model trained-qwen3

Each scenario uses the library as its documentation does, small settings, and prints one JSON line: what the
client returned, for the test to check. A client error is a traceback and a non-zero exit.
"""

import argparse
import json
from typing import Literal

from pydantic import BaseModel, Field

QUESTION = "What is the weather in Oslo for the next 3 days?"


class Forecast(BaseModel):
    """A bounded schema, so that a grammar-constrained reply of a small model completes within max_tokens."""

    city: Literal["Oslo", "Paris"]
    days: int = Field(ge=1, le=7)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"4 C and rain in {city}"


def openai_agents_reasoning(base_url: str, model: str) -> dict:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)  # traces go to OpenAI's platform otherwise
    chat = OpenAIChatCompletionsModel(
        model=model, openai_client=AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    )
    settings = ModelSettings(reasoning=Reasoning(effort="low"), max_tokens=24)
    agent = Agent(name="assistant", instructions="Answer briefly.", model=chat, model_settings=settings)
    result = Runner.run_sync(agent, "Say hello.", max_turns=1)
    return {"final_output": result.final_output}


def openai_agents_forced_tool(base_url: str, model: str) -> dict:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    chat = OpenAIChatCompletionsModel(
        model=model, openai_client=AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    )
    settings = ModelSettings(tool_choice="get_weather", max_tokens=48)
    agent = Agent(
        name="assistant",
        instructions="Use the tool.",
        model=chat,
        model_settings=settings,
        tools=[function_tool(get_weather)],
    )
    # The SDK resets tool_choice after the call, so the second turn answers from the tool's result.
    result = Runner.run_sync(agent, QUESTION, max_turns=3)
    calls = [item.raw_item.name for item in result.new_items if isinstance(item, ToolCallItem)]
    return {"final_output": result.final_output, "tool_calls": calls}


def instructor_mode(base_url: str, model: str, mode_name: str) -> dict:
    import instructor
    from openai import OpenAI

    openai_client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode_name))
    forecast = client.chat.completions.create(
        model=model,
        response_model=Forecast,
        max_retries=0,
        max_tokens=64,
        messages=[{"role": "user", "content": QUESTION}],
    )
    return {"forecast": forecast.model_dump()}


def instructor_json_schema(base_url: str, model: str) -> dict:
    return instructor_mode(base_url, model, "JSON_SCHEMA")


def instructor_tools(base_url: str, model: str) -> dict:
    return instructor_mode(base_url, model, "TOOLS")


def pydantic_ai_native_output_tool(base_url: str, model: str) -> dict:
    from pydantic_ai import Agent, NativeOutput, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def first_step_only(ctx, tool_def):
        # A small model offered the tool calls it on every step (the reply may be a call or the schema's JSON), so
        # the tool is offered on the first request only: its second answers from the result under the schema.
        return tool_def if ctx.run_step <= 1 else None

    chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url + "/v1", api_key="none"))
    agent = Agent(
        chat,
        output_type=NativeOutput(Forecast),
        tools=[Tool(get_weather, prepare=first_step_only)],
        model_settings={"max_tokens": 64},
    )
    result = agent.run_sync(QUESTION)
    return {"output": result.output.model_dump()}


def langchain_forced_tool(base_url: str, model: str) -> dict:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base_url + "/v1", api_key="none", max_retries=0, max_tokens=64)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    return {"tool_calls": [{"name": c["name"], "args": c["args"]} for c in message.tool_calls]}


SCENARIOS = {
    f.__name__: f
    for f in [
        openai_agents_reasoning,
        openai_agents_forced_tool,
        instructor_json_schema,
        instructor_tools,
        pydantic_ai_native_output_tool,
        langchain_forced_tool,
    ]
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--base-url", required=True, help="the server's root, without /v1")
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    print(json.dumps(SCENARIOS[args.scenario](args.base_url.rstrip("/"), args.model)))


if __name__ == "__main__":
    main()
