"""LangChain's OpenAI chat model against `tercel serve`: `bind_tools` and
`with_structured_output(method="function_calling")`, as LangChain agents use them."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from server_util import LiveServer
from spec.config import EngineConfig

langchain_openai = pytest.importorskip("langchain_openai")


class Weather(BaseModel):
    """The current weather in a city."""
    city: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


@pytest.fixture(scope="module")
def chat():
    server = LiveServer(EngineConfig(max_num_seqs=4, drafter="ngram"), model_name="smol")
    yield langchain_openai.ChatOpenAI(model="smol", base_url=f"{server.url}/v1", api_key="unused", temperature=0,
                                      max_tokens=80, max_retries=0)
    server.close()


def test_bind_tools_gets_a_parsed_call(chat):
    reply = chat.bind_tools([Weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "Weather"
    Weather(**reply.tool_calls[0]["args"])


def test_structured_output_through_function_calling(chat):
    out = chat.with_structured_output(Weather, method="function_calling").invoke("Weather in Oslo, in celsius?")
    assert isinstance(out, Weather)
