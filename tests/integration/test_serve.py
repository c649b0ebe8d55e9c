"""The OpenAI-compatible server, end to end: a real uvicorn server on a free port, the official
``openai`` client, answers checked against ``LLM.generate`` on a second copy of the model."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from redknot import LLM, HeadConfig, SamplingParams  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
# 128 pages of 16 tokens over 2 layers x 2 KV heads: one request holds at most 512 tokens.
LLM_KW = dict(method="headsparse", device="cpu", page_size=16, kv_pages=128)
DOCS = ["The quick brown fox jumps over the lazy dog. A river flows past the old mill at dawn.",
        "Question: who founded the city of Varna? Answer: the merchant Ilsa Torv founded it in 1120.",
        "Attention heads differ: some look far back, most look at recent tokens and a few sinks."]


def head_config():
    return HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(model=path, head_config=head_config(), **LLM_KW)
    server = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=16), MODEL)
    base, engine = server.base, server.engine
    ref = LLM(model=path, head_config=head_config(), **LLM_KW)  # same weights, its own caches
    ns = type("Server", (), {})()
    ns.base, ns.engine, ns.llm, ns.ref = base, engine, llm, ref
    ns.pool = llm.pool
    ns.client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    yield ns
    server.stop()


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def expected(ref, prompt, n, documents=None, method=None, **kw):
    out = ref.generate(prompt, greedy(n, **kw), documents=documents, method=method)[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


def chat_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


def wait_pool_free(llm, timeout=5.0) -> bool:
    """Every page is free or held by the prefix and chunk caches (no request holds any)."""
    def idle():
        return llm.engine.idle()

    deadline = time.time() + timeout
    while not idle() and time.time() < deadline:
        time.sleep(0.02)
    return idle()


def test_health_and_models(server):
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_completions_match_llm(server):
    c, greedy_kw = server.client, dict(temperature=0, extra_body={"ignore_eos": True})
    text, n_prompt = expected(server.ref, "The quick brown fox", 12)
    r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, **greedy_kw)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)
    # token ids as the prompt, streamed, with usage in a last chunk without choices
    ids = server.ref.tokenizer.encode("The quick brown fox")
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **greedy_kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # a stop string cuts the text the same way, streamed or not
    stop = text[6:8]
    want, _ = expected(server.ref, "The quick brown fox", 12, stop=[stop])
    r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, stop=stop, **greedy_kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    stream = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, stop=stop,
                                  stream=True, **greedy_kw)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want


def test_chat_matches_llm(server):
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Who founded Varna?"},
                {"role": "assistant", "content": "Ilsa Torv."}, {"role": "user", "content": "When?"}]
    text, n_prompt = expected(server.ref, chat_ids(server.ref.tokenizer, messages), 10)
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = server.client.chat.completions.create(**kw)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + 10
    chunks = list(server.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_system_message_with_documents(server):
    """A system message (and earlier turns) render before the documents, in the same place for every
    method; the answer equals LLM.generate with the same conversation, and the chunks are reused."""
    from redknot.reuse.prompt import build_prompt

    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Who founded Varna?"}]
    docs = DOCS[:2]
    cp = build_prompt(server.ref.tokenizer, messages, docs)
    sys_ids = server.ref.tokenizer.encode("You answer briefly.", add_special_tokens=False)
    assert any(cp.prefix[i:i + len(sys_ids)] == tuple(sys_ids) for i in range(len(cp.prefix)))  # before the documents
    for attempt in range(2):
        text, n_prompt = expected(server.ref, messages, 8, documents=docs, method="full_reuse")
        r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  extra_body={"documents": docs, "method": "full_reuse",
                                                              "ignore_eos": True})
        assert r.choices[0].message.content == text and r.usage.prompt_tokens == n_prompt == len(cp.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # second request: chunks from the store


def test_documents_reuse_chunks(server):
    docs = [d + " (reuse test)" for d in DOCS]  # not cached by any other test
    c, cached = server.client, []
    for method, pair in [("full_reuse", docs[:2]), ("full_reuse", docs[1:]), ("dense", docs[1:])]:
        text, n_prompt = expected(server.ref, "Who founded Varna?", 8, documents=pair, method=method)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who founded Varna?"}],
                                      max_tokens=8, temperature=0,
                                      extra_body={"documents": pair, "method": method, "ignore_eos": True})
        assert r.choices[0].message.content == text and r.usage.prompt_tokens == n_prompt
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    # the second request shares docs[1] with the first; dense reuses only exact full pages of its prefix
    assert cached[1] > 0 and cached[2] % LLM_KW["page_size"] == 0 and cached[2] < cached[1]
    # completions take documents too, streamed
    text, _ = expected(server.ref, "Who founded Varna?", 8, documents=docs[::-1], method="full_reuse")
    chunks = list(c.completions.create(model=MODEL, prompt="Who founded Varna?", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"documents": docs[::-1], "method": "full_reuse",
                                                   "ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_concurrent_streams_return_every_page(server):
    prompts = [f"{i} 1 2 3 the quick brown fox" for i in range(16)]

    def one(i):
        stream = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=16, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"method": "headsparse", "ignore_eos": True})
        chunks = list(stream)
        return chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(16) as ex:
        futures = [ex.submit(one, i) for i in range(16)]
        results = [f.exception() or f.result() for f in futures]
    assert results == [16] * 16
    assert wait_pool_free(server.llm), server.pool.occupancy()


def test_disconnect_aborts_and_frees_pages(server, monkeypatch):
    forward = server.llm.engine.runner.forward

    def slow_forward(*args, **kwargs):  # 10 ms a step: 480 tokens take ~5 s, well past the disconnects
        time.sleep(0.01)
        return forward(*args, **kwargs)

    monkeypatch.setattr(server.llm.engine.runner, "forward", slow_forward)
    stats = server.engine.stats()
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=480)
    extra = {"method": "headsparse", "ignore_eos": True}
    with server.client.chat.completions.create(stream=True, extra_body=extra, **body) as stream:
        next(iter(stream))
        next(iter(stream))
        assert server.pool.num_free_pages < server.pool.num_pages  # the request holds pages
    # a non-streamed request whose client times out is aborted as well
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base}/v1/chat/completions", json=body | extra, timeout=0.5)
    assert wait_pool_free(server.llm, timeout=5), server.pool.occupancy()
    after = server.engine.stats()
    assert after["requests_finished"] == stats["requests_finished"]  # both aborted, neither ran out
    assert after["generated_tokens"] - stats["generated_tokens"] < 2 * 480


def test_bad_requests_get_openai_errors(server):
    url = f"{server.base}/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    long_prompt = list(range(3, 103)) * 11  # 1100 tokens > max_position_embeddings 1024
    cases = [
        (400, dict(content=b'{"model": "tiny-llama", "messages": [')),  # malformed JSON
        (400, dict(json={**good, "max_tokens": "4"})),
        (400, dict(json={**good, "messages": "Hello"})),
        (400, dict(json={**good, "temperature": "hot"})),
        (400, dict(json={**good, "messages": [{"role": "user", "content": 5}]})),
        (404, dict(json={**good, "model": "gpt-4"})),
        (400, dict(json={**good, "messages": []})),
        (400, dict(json={**good, "messages": [{"role": "user", "content": "fox " * 2000}]})),
        (400, dict(json={**good, "max_tokens": 0})),
        (400, dict(json={**good, "max_tokens": 5000})),
        (400, dict(json={**good, "method": "magic"})),
        (400, dict(json={**good, "n": 0})),
        (400, dict(json={**good, "stream": True, "n": 17})),
        (400, dict(json={**good, "frequency_penalty": 0.5})),
        (400, dict(json={**good, "documents": ["a doc"],
                         "messages": good["messages"] + [{"role": "assistant", "content": "Hi."}]})),
        (400, dict(json={**good, "documents": "a doc"})),
        (400, dict(json={**good, "temperature": -1})),
        (400, dict(json={**good, "seed": -1})),  # would alias a large seed
        (400, dict(json={**good, "seed": 2**63})),
        (400, dict(json={**good, "max_tokens": 700, "method": "headsparse"})),  # needs > 128 pages: never fits
        (400, dict(json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4}, url="/v1/completions")),
        (400, dict(json={"model": MODEL, "prompt": [], "max_tokens": 4}, url="/v1/completions")),
        (400, dict(json={"model": MODEL, "prompt": ["a", []], "max_tokens": 4}, url="/v1/completions")),
        (400, dict(json={"model": MODEL, "prompt": "a", "suffix": "b", "max_tokens": 4}, url="/v1/completions")),
        (400, dict(json={"model": MODEL, "prompt": "a", "best_of": 3, "max_tokens": 4}, url="/v1/completions")),
    ]
    for status, kw in cases:
        target = server.base + kw.pop("url") if "url" in kw else url
        r = httpx.post(target, headers={"content-type": "application/json"}, **kw)
        assert r.status_code == status, (kw, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              presence_penalty=1.0)
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(url, json=good)  # the server keeps serving
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(url, json={**good, "seed": 2**63 - 1, "n": 2, "temperature": 1.0})  # choice 1's seed wraps
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert wait_pool_free(server.llm)


def test_out_of_memory_is_a_503_and_the_server_keeps_serving(server, monkeypatch):
    url = f"{server.base}/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
            "method": "headsparse"}

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB (simulated)")

    monkeypatch.setattr(server.llm.engine.runner, "forward", oom)
    r = httpx.post(url, json=good)
    assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory", r.text
    monkeypatch.undo()
    r = httpx.post(url, json=good)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert wait_pool_free(server.llm)


def test_metrics(server):
    server.client.completions.create(model=MODEL, prompt="Who founded Varna?", max_tokens=3,
                                     extra_body={"documents": DOCS[:2], "method": "full_reuse"})
    server.client.completions.create(model=MODEL, prompt="Who founded Varna?", max_tokens=3,
                                     extra_body={"documents": DOCS[1:], "method": "full_reuse"})
    r = httpx.get(f"{server.base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    lab = 'model_name="tiny-llama"'
    for name in [f'redknot:time_to_first_token_seconds_bucket{{le="0.1",{lab}}}',
                 f'redknot:time_to_first_token_seconds_bucket{{le="+Inf",{lab}}}',
                 "redknot:time_to_first_token_seconds_sum", "redknot:inter_token_latency_seconds_count",
                 "redknot:request_time_per_output_token_seconds_count", "redknot:e2e_request_latency_seconds_count",
                 "redknot:request_queue_time_seconds_count", "redknot:prompt_tokens_total",
                 "redknot:generation_tokens_total", f'redknot:request_success_total{{finished_reason="length",{lab}}}',
                 "redknot:num_requests_running", "redknot:num_requests_waiting", "redknot:kv_cache_usage_perc",
                 "redknot:prefix_cache_queries_total", "redknot:prefix_cache_hits_total",
                 "redknot:chunk_cache_queries_total", "redknot:chunk_cache_hits_total", "redknot:request_errors_total",
                 f'redknot:kv_pool_pages{{head_class="global",{lab}}}']:
        assert name in text, name
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}

    def v(name, **labels):
        key = name + "{" + ",".join(f'{k}="{x}"' for k, x in sorted({**labels, "model_name": "tiny-llama"}.items())) + "}"
        return values[key]
    assert v("redknot:time_to_first_token_seconds_count") >= 2
    assert v("redknot:time_to_first_token_seconds_bucket", le="+Inf") == v("redknot:time_to_first_token_seconds_count")
    assert v("redknot:e2e_request_latency_seconds_count") >= 2
    assert v("redknot:request_success_total", finished_reason="length") >= 2
    assert v("redknot:generation_tokens_total") >= 6 and v("redknot:chunk_reused_tokens_total") > 0
    assert v("redknot:num_requests_running") == 0 and v("redknot:num_requests_waiting") == 0
    assert v("redknot:chunk_cache_hits_total") >= 1  # the second request found DOCS[1] cached
    assert 0 < v("redknot:kv_cache_usage_perc") <= 1
    # the two requests' documents stay cached in pool pages, counted in bytes by head class
    assert v("redknot:chunk_cache_pages") > 0 and v("redknot:num_preemptions_total") == 0
    used = v("redknot:kv_pool_pages", head_class="global") + v("redknot:kv_pool_pages", head_class="local")
    assert v("redknot:kv_pool_bytes", head_class="global") + v("redknot:kv_pool_bytes", head_class="local") \
        == used * server.llm.pool.bytes_per_page


def test_a_default_server_reuses_documents(tiny_checkpoint):
    """`redknot serve` with no --method: the second request with the same documents is served
    from the chunk cache (cached_tokens > 0), in any order."""
    from redknot.serve.cli import set_default_method

    llm = LLM(model=tiny_checkpoint("llama"), head_config=head_config(), device="cpu", page_size=16)
    assert set_default_method(llm) == "redknot"
    server = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=4), MODEL)
    try:
        body = {"model": MODEL, "prompt": "Who founded Varna?", "max_tokens": 4, "documents": DOCS}
        first = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
        body["documents"] = DOCS[::-1]
        second = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["completion_tokens"] == 4 and cached > 0
    llm_plain = LLM(model=tiny_checkpoint("llama"), device="cpu")
    assert set_default_method(llm_plain) == "cacheblend"  # no head config: still a reuse method


def test_a_consumer_that_does_not_read_holds_one_merged_delta(tiny_checkpoint):
    """What a slow consumer has not taken is merged into one pending delta (never a queue of them);
    taking it later gives every token and the whole text, in order, as reading along would."""
    import asyncio

    llm = LLM(model=tiny_checkpoint("llama"), head_config=head_config(), **LLM_KW)
    engine = AsyncLLMEngine(llm, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = llm.generate("Who founded Varna?", params)[0].outputs[0]

    async def slow():
        gen = engine.generate("Who founded Varna?", params)
        first = await gen.__anext__()  # the first token, then nothing read while the rest is generated
        while engine._live:  # the engine finishes the request meanwhile
            await asyncio.sleep(0.05)
        rest = [d async for d in gen]
        return first, rest

    try:
        first, rest = asyncio.run(slow())
    finally:
        engine.shutdown()
    assert len(rest) == 1 and rest[0].finish_reason == "length"  # eleven tokens, one delta
    assert first.token_ids + rest[0].token_ids == want.token_ids
    assert first.text + rest[0].text == want.text and rest[0].completion_tokens == 12
