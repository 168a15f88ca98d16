"""Agent frameworks from PyPI against a live server, as an application uses them:
pydantic-ai's Agent over its OpenAI chat model, and langchain-openai's ChatOpenAI
with bound tools, pointed at our base URL (loopback only: nothing leaves the
machine). A structured result is the framework's own tool call (tool_choice
required), which the server holds to the schema with a grammar, so even the 135M
default model answers in a shape the framework accepts."""
from __future__ import annotations

import pytest
from background_server import BackgroundServer
from pydantic import BaseModel

from dreamstage.server.settings import ServerSettings


class Capital(BaseModel):
    country: str
    city: str


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerSettings(ctx=2048, parallel=1, threads=1, max_queue=4)) as srv:
        yield srv


def test_a_pydantic_ai_agent_gets_a_structured_answer_and_calls_our_tool(server):
    import httpx
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    # an app names a model the server lists, as it must with vLLM (an unknown name is a 404)
    model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    model = OpenAIChatModel(model_id, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused"))
    agent = Agent(model, output_type=Capital, model_settings={"temperature": 0.0, "max_tokens": 128})
    result = agent.run_sync("What is the capital of France? Answer with the country and its capital city.")
    assert isinstance(result.output, Capital) and result.output.city and result.output.country
    # every request the framework made was answered as it expects: a tool call it could parse
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", ()) if p.part_kind == "tool-call"]
    assert calls and calls[-1].tool_name.startswith("final_result")
    assert result.usage.requests >= 1 and result.usage.input_tokens > 0


def test_a_langchain_chat_model_binds_tools_and_loops(server):
    """langchain-openai's ChatOpenAI with bind_tools: a forced call parsed into
    AIMessage.tool_calls, streamed chunks that merge into the same call, and the
    tool's result sent back for a final answer."""
    import httpx
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"clear, 21 degrees in {city}"

    model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    chat = ChatOpenAI(model=model_id, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=64,
                      max_retries=0)
    ask = [HumanMessage("What is the weather like in Paris today?")]
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    called = bound.invoke(ask)
    assert [c["name"] for c in called.tool_calls] == ["get_weather"] and not called.invalid_tool_calls
    call = called.tool_calls[0]
    assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str) and call["id"]
    merged = None
    for chunk in bound.stream(ask):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather",
                                                                                         call["args"])]
    final = chat.bind_tools([get_weather]).invoke(
        [*ask, called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])
    assert final.content or final.tool_calls
    assert final.usage_metadata["input_tokens"] > 0
