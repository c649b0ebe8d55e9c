"""The OpenAI features beyond one plain choice, through the official client on a real server:
n choices, logprobs, echo, completion prompt lists, structured output, forced tool calls, the
chat-template options and vLLM's token endpoints. Answers are checked against ``LLM.generate`` on
a second copy of the model."""

import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from redknot import LLM, SamplingParams  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
LLM_KW = dict(method="dense", device="cpu", page_size=16, kv_pages=256)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "year": {"type": "integer", "minimum": 1000, "maximum": 2000},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "year", "capital"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    srv = BackgroundServer(AsyncLLMEngine(LLM(model=path, **LLM_KW), max_num_seqs=16), MODEL)
    ns = type("Server", (), {})()
    ns.base, ns.ref, ns.engine = srv.base, LLM(model=path, **LLM_KW), srv.engine.engine
    ns.client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0)
    yield ns
    srv.stop()


def greedy_text(ref, prompt, n):
    return ref.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].text


def chat_ids(tok, messages, **kw):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def post(server, path, body):
    return httpx.post(f"{server.base}{path}", json={"model": MODEL, **body}, timeout=60)


def test_completion_prompt_lists_echo_and_n(server):
    c, kw = server.client, dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The quick brown fox", "A river flows"]
    want = [greedy_text(server.ref, p, 6) for p in prompts]
    r = c.completions.create(prompt=prompts, **kw)
    assert [ch.index for ch in r.choices] == [0, 1] and [ch.text for ch in r.choices] == want
    ids = [server.ref.tokenizer.encode(p) for p in prompts]
    r = c.completions.create(prompt=ids, n=2, **kw)  # list of token-id lists, two choices each
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids) and r.usage.completion_tokens == 4 * 6
    r = c.completions.create(prompt=prompts[0], echo=True, **kw)
    assert r.choices[0].text == prompts[0] + want[0]
    chunks = list(c.completions.create(prompt=prompts, echo=True, stream=True, **kw))
    for i, p in enumerate(prompts):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == p + want[i]
    for body, field in [({"prompt": "a", "suffix": "b"}, "suffix"), ({"prompt": "a", "best_of": 2}, "best_of"),
                        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo")]:
        r = post(server, "/v1/completions", {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_n_greedy_choices_and_logprobs_match_the_first_token_logits(server):
    messages = [{"role": "user", "content": "Who founded Varna?"}]
    ids = chat_ids(server.ref.tokenizer, messages, add_generation_prompt=True)
    single = greedy_text(server.ref, ids, 5)
    hits = server.engine.prefix_cache.hits
    r = server.client.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert all(ch.message.content == single for ch in r.choices)
    ref = torch.log_softmax(server.ref.first_token_logits(ids).float(), dim=-1)
    top = ref.topk(3)
    for ch in r.choices:
        first = ch.logprobs.content[0]
        assert len(ch.logprobs.content) == 5
        assert abs(first.logprob - top.values[0].item()) < 1e-4  # greedy: the chosen token is the top one
        assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in first.top_logprobs] == [server.ref.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert "".join(t.token for t in ch.logprobs.content) == single
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 20
    # the first choice prefills; the other three map its full prompt pages from the prefix cache
    page = server.engine.pool.page_size
    assert server.engine.prefix_cache.hits - hits >= 3 * ((len(ids) - 1) // page * page) > 0
    # completions: the legacy shape, streamed the same as not
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=4, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw).choices[0].logprobs
    ref = torch.log_softmax(server.ref.first_token_logits("The quick brown fox").float(), dim=-1)
    assert whole.token_logprobs[0] == pytest.approx(ref.max().item(), abs=1e-4)
    assert len(whole.tokens) == 4 and len(whole.top_logprobs[0]) == 2 and whole.text_offset[0] == 0
    parts = [ch.choices[0].logprobs for ch in server.client.completions.create(stream=True, **kw) if ch.choices]
    assert sum((p.token_logprobs for p in parts if p), []) == pytest.approx(whole.token_logprobs, abs=1e-6)


def test_seeded_choices_use_seed_plus_index(server):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    many = server.client.completions.create(n=3, seed=11, **kw)
    for i, ch in enumerate(many.choices):
        one = server.client.completions.create(seed=11 + i, **kw)
        assert ch.text == one.choices[0].text
    assert len({ch.text for ch in many.choices}) > 1


def test_structured_output_fields(server):
    base = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a city."}], max_tokens=60,
                temperature=1.0, seed=3)
    r = server.client.chat.completions.create(response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}, n=3, **base)
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    r = server.client.chat.completions.create(response_format={"type": "json_object"}, **{**base, "max_tokens": 200})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = server.client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10,
                                         extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert r.choices[0].text in ("yes", "no", "maybe so")
    r = server.client.completions.create(model=MODEL, prompt="Code:", max_tokens=10,
                                         extra_body={"structured_outputs": {"regex": "[A-C]{2}-[0-9]{3}"}})
    import re
    assert re.fullmatch("[A-C]{2}-[0-9]{3}", r.choices[0].text)
    r = server.client.completions.create(model=MODEL, prompt="Obj:", max_tokens=60,
                                         extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    # streamed text is the same constrained output
    chunks = list(server.client.chat.completions.create(stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}, **base))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), SCHEMA)
    bad = [({"guided_regex": "[unclosed"}, "guided_regex"),
           ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
           ({"guided_choice": []}, "guided_choice"),
           ({"response_format": {"type": "json_schema"}}, "response_format"),
           ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")]
    for extra, field in bad:
        r = post(server, "/v1/chat/completions", {"messages": base["messages"], "max_tokens": 4, **extra})
        assert r.status_code == 400 and field in (r.json()["error"]["param"] or r.json()["error"]["message"]), r.text


def test_forced_tool_calls(server):
    messages = [{"role": "user", "content": "Weather in Varna?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=80, temperature=1.0, seed=5)
    r = server.client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = server.client.chat.completions.create(tool_choice=named, **kw)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the named call's arguments arrive as deltas that assemble to the same call
    chunks = list(server.client.chat.completions.create(tool_choice=named, stream=True, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    chunks = list(server.client.chat.completions.create(tool_choice="required", stream=True, **kw))
    calls = {}  # a required call streams too: its name once written, then its arguments in pieces
    for d in (tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])):
        if d.id:
            calls[d.index] = [d.function.name, ""]
        calls[d.index][1] += d.function.arguments or ""
    assert calls
    for name, args in calls.values():
        jsonschema.validate(json.loads(args), {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # the call and its result go back into the conversation (the template renders them)
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = server.client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].message.role == "assistant"
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "tools": [WEATHER],
                                              "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_chat_template_options_and_token_endpoints(server):
    tok = server.ref.tokenizer
    messages = [{"role": "user", "content": "Who founded Varna?"}, {"role": "assistant", "content": "The merchant"}]
    ids = chat_ids(tok, messages, continue_final_message=True)
    want = greedy_text(server.ref, ids, 4)
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              extra_body={"continue_final_message": True, "ignore_eos": True,
                                                          "add_generation_prompt": False, "echo": True})
    assert r.choices[0].message.content == "The merchant" + want
    assert r.usage.prompt_tokens == len(ids)
    template = "{% for m in messages %}[{{ m['role'] }}{{ marker }}] {{ m['content'] }}\n{% endfor %}>"
    r = server.client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2, temperature=0,
                                              extra_body={"chat_template": template, "ignore_eos": True,
                                                          "chat_template_kwargs": {"marker": "!"}})
    assert r.usage.prompt_tokens == len(tok.encode("[user!] Who founded Varna?\n>", add_special_tokens=False))
    t = post(server, "/tokenize", {"messages": messages[:1]}).json()
    assert t["tokens"] == chat_ids(tok, messages[:1], add_generation_prompt=True) and t["count"] == len(t["tokens"])
    t = post(server, "/tokenize", {"prompt": "The quick brown fox"}).json()
    assert t["tokens"] == tok.encode("The quick brown fox") and t["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == tok.decode(t["tokens"])
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400
    assert httpx.get(f"{server.base}/version").json()["version"]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    r = post(server, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 2,
                                              "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    # documents as {"title", "text"} objects: the same prompt as the rendered string
    docs = [{"title": "Varna", "text": "Ilsa Torv founded it."}, "A river flows past the old mill."]
    r1 = post(server, "/v1/completions", {"prompt": "Who?", "max_tokens": 3, "temperature": 0, "documents": docs})
    r2 = post(server, "/v1/completions", {"prompt": "Who?", "max_tokens": 3, "temperature": 0,
                                          "documents": ["Varna\nIlsa Torv founded it.", docs[1]]})
    assert r1.status_code == 200 and r1.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]
    assert r1.json()["usage"]["prompt_tokens"] == r2.json()["usage"]["prompt_tokens"]
    # method "auto": the model's best reuse method (cacheblend without a head config): the documents are reused
    auto = {"prompt": "Who?", "max_tokens": 3, "temperature": 0, "documents": docs, "method": "auto"}
    assert post(server, "/v1/completions", auto).status_code == 200
    r3 = post(server, "/v1/completions", auto)
    assert r3.status_code == 200 and r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r3.text
    r4 = post(server, "/v1/completions", {**auto, "method": "cacheblend@0.5"})  # a budget for this request
    assert r4.status_code == 200 and r4.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r4.text
    r5 = post(server, "/v1/completions", {**auto, "method": "dense@0.5"})
    assert r5.status_code == 400 and r5.json()["error"]["param"] == "method", r5.text


def test_streamed_choices_interleave_and_a_client_that_leaves_frees_them_all(server):
    messages = [{"role": "user", "content": "Who founded Varna?"}]
    ids = chat_ids(server.ref.tokenizer, messages, add_generation_prompt=True)
    single = greedy_text(server.ref, ids, 6)
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for i in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == single
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].usage.prompt_tokens == len(ids)
    with server.client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}) as stream:
        it = iter(stream)
        for _ in range(6):
            next(it)
        assert server.engine.has_unfinished()
    import time
    deadline = time.time() + 10
    while not server.engine.idle() and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.idle(), server.engine.pool.occupancy()
