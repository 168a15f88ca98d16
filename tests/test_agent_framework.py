"""An agent framework from PyPI against a live server, as an application uses it:
pydantic-ai's Agent over its OpenAI chat model, pointed at our base URL (loopback
only: nothing leaves the machine). A structured result is the framework's own
tool call (tool_choice required), which the server holds to the schema with a
grammar, so even the 135M default model answers in a shape the framework accepts."""
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
