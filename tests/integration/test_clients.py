"""Popular OpenAI clients against a real server on the bundled model, unchanged but for their base
URL: the official ``openai`` SDK, LangChain (``ChatOpenAI`` with library defaults,
``with_structured_output`` in json_schema and function-calling modes, ``bind_tools`` with one tool
round trip, ``OpenAI`` completions) and LlamaIndex ``OpenAILike`` (chat, complete,
``structured_predict``). Every call must succeed; structured outputs must validate and tool calls
parse, which on a model this small only guided decoding can give."""

import os

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from pydantic import BaseModel, Field  # noqa: E402

from redknot import LLM  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "redknot-testbed"  # the served name clients send


class City(BaseModel):
    """A city and when it was founded."""
    name: str = Field(max_length=8, description="the city's name")
    founded: int = Field(ge=1000, le=2000)
    capital: bool


class WeatherArgs(BaseModel):
    # bounded, so a small model's guided call always closes within the context
    city: str = Field(max_length=10)
    unit: str = Field(pattern="^[cf]$")


def get_weather(city: str, unit: str) -> str:
    """Weather of a city (unit: c or f)."""
    return f"sunny in {city}, 21 {unit}"


# The bundled testbed model by default (answers in seconds on a CPU); REDKNOT_CLIENT_MODEL names another
# (a shelf name such as smollm2, or a checkpoint), or "tiny" for a tiny random checkpoint.
CLIENT_MODEL = os.environ.get("REDKNOT_CLIENT_MODEL", "bundled")


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    # a 320-token context: a request without max_tokens ends within it, and LangChain's OpenAI
    # default of max_tokens=256 still fits with its prompt
    tiny = CLIENT_MODEL == "tiny"
    model = tiny_checkpoint("llama") if tiny else None if CLIENT_MODEL == "bundled" else CLIENT_MODEL
    llm = LLM(model=model, method="dense", device="cpu", page_size=16, kv_pages=512 if tiny else None,
              max_model_len=320)
    srv = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=16), MODEL)
    yield f"{srv.base}/v1"
    srv.stop()


def test_openai_sdk_defaults(base):
    c = openai.OpenAI(base_url=base, api_key="x")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    r = c.completions.create(model=MODEL, prompt=["Hello", "The quick"], max_tokens=4)
    assert len(r.choices) == 2
    parsed = c.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                      response_format=City)
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_langchain(base):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(model=MODEL, base_url=base, api_key="x")
    assert isinstance(chat.invoke("Hello").content, str)
    assert "".join(ch.content for ch in chat.stream("Hello"))  # streamed, library defaults
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method).invoke("Name a city.")
        assert isinstance(city, City), method
    weather = tool(get_weather, args_schema=WeatherArgs)
    bound = chat.bind_tools([weather], tool_choice="get_weather")
    question = HumanMessage("Weather in Varna?")
    ai = bound.invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    result = weather.invoke(ai.tool_calls[0]["args"])
    answer = chat.bind_tools([weather]).invoke([question, ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])])
    assert isinstance(answer.content, str)
    any_call = chat.bind_tools([weather], tool_choice="any").invoke([question])
    assert any_call.tool_calls[0]["name"] == "get_weather" and set(any_call.tool_calls[0]["args"]) == {"city", "unit"}
    completion = OpenAI(model=MODEL, base_url=base, api_key="x")
    assert isinstance(completion.invoke("The quick brown fox"), str)
    assert len(completion.generate(["The quick", "A river"]).generations) == 2  # a list of prompts, one call


def test_llamaindex(base):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=base, api_key="x", is_chat_model=True, is_function_calling_model=True,
                     context_window=320)
    assert isinstance(llm.chat([ChatMessage(role="user", content="Hello")]).message.content, str)
    assert isinstance(llm.complete("The quick brown fox").text, str)
    city = llm.structured_predict(City, PromptTemplate("Name a city in {country}."), country="Bulgaria")
    assert isinstance(city, City)
    completion = OpenAILike(model=MODEL, api_base=base, api_key="x", is_chat_model=False, max_tokens=8)
    assert isinstance(completion.complete("The quick brown fox").text, str)
