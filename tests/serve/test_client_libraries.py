"""The agent frameworks people point at a local OpenAI-compatible server, each completing a tool
round trip and a structured result against a real `colibri serve`: LangChain (bind_tools and
with_structured_output in all three methods), pydantic-ai (an agent with a tool and a typed
result) and openai-agents (the Responses and the Chat Completions model).

The tiny model would rarely choose a tool by itself; where a test needs a call it is forced
(tool_choice named / required), and the server's grammar makes the call valid."""
from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL_ID = "smollm2"
ASK = "What is the weather in Paris?"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=130)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


# ---------------------------------------------------------------------------------- LangChain
@pytest.fixture(scope="module")
def langchain_llm(server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL_ID, temperature=0,
                         max_tokens=64, max_retries=0, timeout=120)


def test_langchain_bind_tools_round_trip(langchain_llm):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"Sunny in {city}"

    bound = langchain_llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    ask = HumanMessage(ASK)
    msg = bound.invoke([ask])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = langchain_llm.bind_tools([get_weather]).invoke([ask, msg, result])
    assert answer.content and not answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(langchain_llm, method):
    structured = langchain_llm.with_structured_output(Person, method=method, include_raw=True)
    out = structured.invoke("Reply with a JSON object with a person's name and age, e.g. "
                            '{"name": "Ann", "age": 31}.')
    if method == "json_mode":  # a JSON object is guaranteed; its keys are the model's choice
        assert isinstance(json.loads(out["raw"].content), dict)
        assert out["parsed"] is not None or "validation" in str(out["parsing_error"]).lower()
    else:                      # the schema itself is enforced
        assert out["parsing_error"] is None and isinstance(out["parsed"], Person)


# ---------------------------------------------------------------------------------- pydantic-ai
def test_pydantic_ai_agent_with_a_tool_and_a_typed_result(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(MODEL_ID, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    calls = []
    # The output is a tool call too (pydantic-ai's default), so every turn must call a tool
    # (pydantic-ai sends tool_choice required): the weather tool, or the final result.
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0, "max_tokens": 64},
                  instructions="Look up the weather, then report it.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    result = agent.run_sync(ASK, usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, Weather)
    kinds = [part.part_kind for m in result.all_messages() for part in m.parts]
    assert "tool-call" in kinds and "tool-return" in kinds


# ---------------------------------------------------------------------------------- openai-agents
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_function_tool_and_output_type(server, api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(MODEL_ID,
                                                                                                        client)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    # tool_choice pins the first turn to the tool; the SDK resets it to auto after a call
    # (reset_tool_choice), and the structured output type then shapes the final answer.
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         output_type=Weather,
                         model_settings=agents.ModelSettings(tool_choice="get_weather", parallel_tool_calls=False,
                                                             temperature=0,
                                                             max_tokens=64))
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, Weather)
