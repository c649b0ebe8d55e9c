"""Tool-call parsing (Hermes/Qwen and Llama 3 JSON), the schema that forces a valid call, and the
streamed chunks of a choice whose text turns out to hold calls."""

import json
from types import SimpleNamespace

import pytest

from redknot.serve import tools as tl
from redknot.serve.choices import ChatStream, TokenText, ToolMode
from redknot.serve.protocol import ChatCompletionRequest


def test_hermes():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Varna"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    content, calls = tl.parse("hermes", text, {"get_weather", "get_time"})
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Varna"}),
                                                                   ("get_time", {"zone": "utc"})]
    assert calls[0].id != calls[1].id
    assert tl.parse("hermes", "no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert tl.parse("hermes", broken) == (broken, [])
    assert tl.parse("hermes", '<tool_call>{"name": "other", "arguments": {}}</tool_call>', {"get_weather"})[1] == []


def test_llama3_json():
    content, calls = tl.parse("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                                             '{"name": "b", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert tl.parse("llama3_json", "The answer is 4.") == ("The answer is 4.", [])
    assert tl.parse("llama3_json", '{"name": "a", "parameters": ')[1] == []


def test_where_calls_may_start():
    assert tl.may_start_calls("hermes", "Hello <tool") == len("Hello ")
    assert tl.may_start_calls("hermes", "Hello <tool_call>{") == len("Hello ")
    assert tl.may_start_calls("hermes", "Hello there") == len("Hello there")
    assert tl.may_start_calls("llama3_json", '  {"na') == 0
    assert tl.may_start_calls("llama3_json", "Sure") == 4


def _req(**kw):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "g"}}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, **kw})


def test_forced_schema():
    jsonschema = pytest.importorskip("jsonschema")
    req = _req(tool_choice="required", parallel_tool_calls=False)
    schema = tl.forced_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
    jsonschema.validate([{"name": "f", "parameters": {"x": 3}}], schema)
    jsonschema.validate([{"name": "g", "parameters": {}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {}}],
                [{"name": "g", "parameters": {}}, {"name": "g", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = tl.forced_calls('[{"name": "f", "parameters": {"x": 3}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 3})]
    named = _req(tool_choice={"type": "function", "function": {"name": "f"}})
    assert tl.forced_schema(named.tools, named.tool_choice, None)["required"] == ["x"]


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def _delta(text, finish=None):
    return SimpleNamespace(text=text, token_ids=[1], logprobs=None, finish_reason=finish, prompt_tokens=3,
                           completion_tokens=1, cached_tokens=0)


def test_streamed_hermes_calls_hold_back_the_tag():
    st = ChatStream(0, ToolMode(parser="hermes", names=frozenset({"f"})), TokenText(_Tok()), False)
    pieces = ["Sure. <to", "ol_call>{\"name\": \"f\", ", "\"arguments\": {\"x\": 2}}</tool_call>"]
    chunks = [c for i, p in enumerate(pieces) for c in st.feed(_delta(p, "stop" if i == 2 else None))]
    content = "".join(c.delta.content or "" for c in chunks)
    assert content.strip() == "Sure."
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("f", {"x": 2})]
    assert chunks[-1].finish_reason == "tool_calls"
    # text that never becomes a call is all sent, the held-back part at the end
    st = ChatStream(0, ToolMode(parser="hermes"), TokenText(_Tok()), False)
    chunks = st.feed(_delta("a <to")) + st.feed(_delta("y", "stop"))
    assert "".join(c.delta.content or "" for c in chunks) == "a <toy" and chunks[-1].finish_reason == "stop"


def test_required_calls_stream_as_they_are_written():
    from redknot.serve.protocol import ChatCompletionRequest as Req

    req = Req.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]})
    text = '[{"name": "f", "parameters": {"x": "a}\\"b", "y": [1, {"z": 2}]}}, {"name": "g", "parameters": {}}]'
    st = ChatStream(0, ToolMode(choice=req.tool_choice), TokenText(_Tok()), False)
    chunks = []
    for i in range(0, len(text), 3):  # three characters at a time: names and arguments split anywhere
        piece = text[i:i + 3]
        chunks += st.feed(_delta(piece, "stop" if i + 3 >= len(text) else None))
    calls = {}
    for tc in (tc for c in chunks for tc in (c.delta.tool_calls or [])):
        if tc.id:
            calls[tc.index] = [tc.function.name, ""]
        calls[tc.index][1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("f", {"x": 'a}"b', "y": [1, {"z": 2}]}), ("g", {})]
    assert chunks[-1].finish_reason == "tool_calls"
    assert tl.scan_forced('[{"name": "f", "param') == [] and tl.scan_forced('[{"na') == []
