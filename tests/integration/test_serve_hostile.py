"""The server against hostile and careless clients (loopback only, bounded): per-request isolation,
request limits, the API key, connection limits, and a schema that matches what the server does."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from redknot import LLM, HeadConfig, SamplingParams  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.app import ServerLimits, build_app  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
KEYS = ("key-one", "key-two")
LLM_KW = dict(method="headsparse", device="cpu", page_size=16, kv_pages=128)
LIMITS = ServerLimits(max_body_bytes=64 << 10, max_documents=4, max_document_bytes=4 << 10, max_stop_strings=4,
                      max_stop_string_chars=32)
READ_TIMEOUT, MAX_CONNECTIONS = 1.5, 64


def head_config():
    return HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), head_config=head_config(), **LLM_KW)
    srv = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=16), MODEL,
                           app_kw=dict(api_keys=KEYS, limits=LIMITS, share_cache_across_keys=True),
                           server_kw=dict(read_timeout=READ_TIMEOUT, max_connections=MAX_CONNECTIONS))
    srv.llm = llm
    srv.auth = {"Authorization": f"Bearer {KEYS[0]}"}
    srv.http = httpx.Client(base_url=srv.base, headers=srv.auth, timeout=60)
    yield srv
    srv.http.close()
    srv.stop()


def chat(messages="Hello", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": messages}], "max_tokens": 6, **kw}


def stream_text(server, body) -> str:
    text = ""
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                text += "".join(ch["delta"].get("content") or "" for ch in obj["choices"])
    return text


def slow_engine(server, monkeypatch, seconds):
    """Every forward sleeps ``seconds`` first; returns the seq ids each forward ran."""
    runner = server.llm.engine.runner
    forward, seen = runner.forward, []

    def slow(plan, seq_ids, *args, **kwargs):
        seen.extend(seq_ids)
        time.sleep(seconds)
        return forward(plan, seq_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", slow)
    return seen


# ---- 1. one request never kills its batch; values that cannot be sampled are 400 -------------------

@pytest.mark.parametrize("raw", [
    '"temperature": NaN', '"temperature": Infinity', '"temperature": 5e-324', '"top_p": NaN', '"top_p": 5e-324',
    '"top_p": -Infinity', '"seed": 100000000000000000000000', '"top_k": 1000000000000000000000000000000',
    '"presence_penalty": 5e-324', '"max_tokens": 100000000000000000000000'])
def test_unsamplable_values_are_400(server, raw):
    body = json.dumps(chat())[:-1] + ", " + raw + "}"
    r = server.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and raw.split('"')[1] in err["message"]


def test_an_attackers_sampling_values_leave_neighbours_unchanged(server, monkeypatch):
    """Tiny temperatures sample as greedy and a top_p that rounds to 0 keeps the top token, so
    the hostile rows decode alongside greedy neighbours and nobody's answer changes."""
    prompts = [f"neighbour {i}: the quick brown fox" for i in range(4)]
    solo = [stream_text(server, chat(p, max_tokens=16, temperature=0, ignore_eos=True)) for p in prompts]
    attacker = chat("attacker", max_tokens=16, ignore_eos=True)
    attacks = [dict(temperature=3e-38), dict(temperature=1e-45), dict(temperature=1.0, top_p=1e-300),
               dict(temperature=1e-300, top_p=1e-300, top_k=2 ** 62)]
    slow_engine(server, monkeypatch, 0.005)  # every request is in flight at once
    with ThreadPoolExecutor(8) as ex:
        hostile = [ex.submit(stream_text, server, {**attacker, **a}) for a in attacks]
        friendly = [ex.submit(stream_text, server, chat(p, max_tokens=16, temperature=0, ignore_eos=True))
                    for p in prompts]
        assert [f.result() for f in friendly] == solo
        greedy = stream_text(server, {**attacker, "temperature": 0})
        assert [f.result() for f in hostile] == [greedy] * len(attacks)


def test_errors_keep_the_connection_usable(server, monkeypatch):
    """400s keep the keep-alive connection; an unexpected 500 has a clean body (no internal text)
    and says Connection: close, so the client's next request opens a fresh connection."""
    bad = ['"temperature": NaN', '"top_p": 5e-324', '"logit_bias": {"5": 10}', '"n": 17']
    with httpx.Client(base_url=server.base, headers=server.auth, timeout=60) as c:
        for i in range(12):
            body = json.dumps(chat(max_tokens=2))[:-1] + ", " + bad[i % len(bad)] + "}"
            assert c.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}).status_code == 400
            assert c.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200

        def broken(*args, **kwargs):
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(server.llm, "make_sequence", broken)
        r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert "secret" not in r.text and "error id" in r.json()["error"]["message"]
        monkeypatch.undo()
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200


def test_an_engine_failure_fails_only_its_request_with_a_clean_message(server, monkeypatch):
    runner = server.llm.engine.runner
    forward = runner.forward

    def flaky(plan, seq_ids, tokens, *args, **kwargs):
        if any(len(t) > 1 and 333 in t for t in tokens):  # this prompt's prefill only
            raise RuntimeError("secret internal detail")
        return forward(plan, seq_ids, tokens, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", flaky)
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 333, 7, 9], "max_tokens": 3,
                                                   "method": "dense"})
    assert r.status_code == 500 and "secret" not in r.text and "error id" in r.json()["error"]["message"]
    assert server.http.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200


# ---- 2. limits, and tokenisation off the event loop -------------------------------------------------

def test_a_huge_body_is_413_before_it_is_read(server):
    r = server.http.post("/v1/chat/completions", json=chat("fox " * 40_000))  # ~160 KB > 64 KiB
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: cut off once past the limit
        for _ in range(100):
            yield b" " * 4096
    r = server.http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    with socket.create_connection(_addr(server), timeout=5) as s:  # 200 MB announced: answered before any is read
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 200000000\r\n\r\n".encode())
        head = s.recv(4096).decode()
        assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower()


@pytest.mark.parametrize("extra, param", [
    (dict(documents=["a short document"] * 5), "documents"),
    (dict(documents=["x" * (5 << 10)]), "documents"),
    (dict(documents=["é" * (3 << 10)]), "documents"),  # 6 KiB of UTF-8 in 3K characters
    (dict(stop=[f"s{i}" for i in range(5)]), "stop"),
    (dict(stop=["y" * 33]), "stop"),
    (dict(stop_token_ids=list(range(5))), "stop_token_ids"),
])
def test_request_limits_are_400(server, extra, param):
    r = server.http.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.http.post("/v1/chat/completions", json=chat(documents=["a short document"] * 4,
                                                               stop=["s1", "y" * 32])).status_code == 200


def test_tokenisation_never_blocks_the_event_loop(server, monkeypatch):
    make = server.llm.make_sequence

    def slow_make(*args, **kwargs):  # a tokenisation that takes 2 s (a huge document's, say)
        time.sleep(2)
        return make(*args, **kwargs)

    monkeypatch.setattr(server.llm, "make_sequence", slow_make)
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(server.http.post, "/v1/chat/completions", json=chat(max_tokens=2))
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
        assert time.perf_counter() - t0 < 0.5
        assert pending.result().status_code == 200


def test_requests_abandoned_in_the_queue_are_never_prefilled(server, monkeypatch):
    seen = slow_engine(server, monkeypatch, 1.5)
    before = server.engine.stats()["abandoned_before_prefill"]
    with ThreadPoolExecutor(4) as ex:
        busy = ex.submit(server.http.post, "/v1/completions",
                         json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1, "method": "dense"})
        time.sleep(0.2)  # the engine is inside its one 1.5 s step; the others' clients leave before it ends
        gone = [ex.submit(httpx.post, f"{server.base}/v1/completions", headers=server.auth, timeout=0.3,
                          json={"model": MODEL, "prompt": [9, 10 + i] * 200, "max_tokens": 4, "method": "dense"})
                for i in range(3)]
        for f in gone:
            assert isinstance(f.exception(), httpx.TimeoutException)
        assert busy.result().status_code == 200
    deadline = time.time() + 5
    while server.engine.stats()["abandoned_before_prefill"] < before + 3 and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.stats()["abandoned_before_prefill"] == before + 3
    assert len(set(seen)) == 1  # only the busy request ever reached a forward


# ---- 3. the API key ------------------------------------------------------------------------------

def test_api_key_on_every_v1_route(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]},
                    {"Authorization": f"Basic {KEYS[0]}"}):
        for method, path in [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/nope")]:
            r = httpx.request(method, f"{server.base}{path}", headers=headers, json=chat(), timeout=10)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    for key in KEYS:
        assert httpx.get(f"{server.base}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{server.base}/health").status_code == 200  # open, as in vLLM
    assert httpx.get(f"{server.base}/metrics").status_code == 401  # it shows every tenant's numbers
    assert httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEYS[1], max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2).usage.completion_tokens >= 1


def test_api_key_from_the_environment(monkeypatch):
    import argparse

    from redknot.serve.cli import add_arguments, api_keys_of

    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.setenv("REDKNOT_API_KEY", "from-env")
    assert api_keys_of(p.parse_args([])) == ["from-env"]
    assert api_keys_of(p.parse_args(["--api-key", "a", "--api-key", "b"])) == ["a", "b"]
    monkeypatch.delenv("REDKNOT_API_KEY")
    assert api_keys_of(p.parse_args([])) == []


def test_cache_salt_reaches_the_sequence_and_namespaces_the_caches(server, tiny_checkpoint):
    r = server.http.post("/v1/chat/completions", json=chat(cache_salt="tenant-a"))
    assert r.status_code == 200, r.text
    llm = LLM(model=tiny_checkpoint("llama"), **{**LLM_KW, "method": "dense"})
    assert llm.engine.honours_cache_salt
    # each key gets its own namespace, and a request's salt one inside it
    engine = AsyncLLMEngine(llm)
    salts, generate = [], engine.generate

    def spy(*args, sequence=None, **kwargs):
        salts.append(sequence.cache_salt)
        return generate(*args, sequence=sequence, **kwargs)

    engine.generate = spy
    srv = BackgroundServer(engine, MODEL, app_kw=dict(api_keys=KEYS))
    try:
        for key, salt in [(KEYS[0], None), (KEYS[1], None), (KEYS[0], "s"), (KEYS[0], None)]:
            body = chat(max_tokens=1) | ({} if salt is None else {"cache_salt": salt})
            assert httpx.post(f"{srv.base}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code == 200
    finally:
        srv.stop()
    assert salts[0] == salts[3] and len({salts[0], salts[1], salts[2]}) == 3 and None not in salts
    assert KEYS[0] not in salts[0] and salts[2].startswith(salts[0])


def test_requests_past_the_concurrency_limit_get_a_json_503_and_health_stays_up(server):
    """--limit-concurrency: past the limit an OpenAI-style JSON 503 with Retry-After (a client
    can parse and retry it); /health is never refused; the request in flight finishes."""
    srv = BackgroundServer(AsyncLLMEngine(server.llm), MODEL, server_kw=dict(limit_concurrency=1))
    try:
        with httpx.Client(base_url=srv.base, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions",
                          json={**chat(max_tokens=64, ignore_eos=True), "stream": True}) as first:
                assert first.status_code == 200
                busy = c.post("/v1/chat/completions", json=chat())
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
                assert busy.json()["error"]["type"] == "server_busy" and "limit-concurrency" in busy.json()["error"]["message"]
                assert c.get("/health").status_code == 200
                assert sum(line == "data: [DONE]" for line in first.iter_lines()) == 1
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200  # the slot came back
    finally:
        srv.stop()


# ---- 4. fields, lengths and the schema -----------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 10}), ("response_format", {"type": "json_schema"}), ("repetition_penalty", 1.2),
    ("top_logprobs", 2), ("min_p", 0.1), ("best_of", 3), ("tool_choice", "auto"), ("guided_regex", "[a-"),
    ("use_beam_search", True), ("min_tokens", 2)])
def test_unimplemented_fields_are_400_naming_them(server, field, value):
    r = server.http.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_no_op_values_of_unimplemented_fields_pass(server):
    r = server.http.post("/v1/chat/completions", json=chat(logit_bias={}, response_format={"type": "text"},
                                                           repetition_penalty=1.0, top_logprobs=None, user="u1"))
    assert r.status_code == 200, r.text


def test_stop_token_ids(server, tiny_checkpoint):
    from redknot import SamplingParams

    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "method": "dense"}
    ref = LLM(model=tiny_checkpoint("llama"), **{**LLM_KW, "method": "dense"})  # the server's engine is its worker's
    ids = ref.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       method="dense")[0].outputs[0].token_ids
    stop_at = ids.index(ids[2])
    r = server.http.post("/v1/completions", json={**body, "stop_token_ids": [ids[2]]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == stop_at + 1


def test_completions_without_documents_are_raw_prompts(server):
    """/v1/completions with no documents (or an empty list) serves the prompt as it is, with every
    method: the chat template is for /v1/chat/completions and for documents."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "method": "dense",
            "ignore_eos": True}
    raw = len(server.llm.tokenizer.encode(body["prompt"]))
    plain = server.http.post("/v1/completions", json=body).json()
    assert plain["usage"]["prompt_tokens"] == raw
    for extra in ({"documents": []}, {"method": "full_reuse"}, {"method": "cacheblend", "documents": []}):
        other = server.http.post("/v1/completions", json={**body, **extra}).json()
        assert other["usage"]["prompt_tokens"] == raw, extra
        assert other["choices"][0]["text"] == plain["choices"][0]["text"], extra


def test_models_advertise_what_fits_and_larger_is_400_with_numbers(server):
    card = server.http.get("/v1/models").json()["data"][0]
    total, most_prompt = server.llm.context_limits("headsparse")
    assert card["max_model_len"] == min(total, most_prompt) < server.llm.max_model_len  # 128 pages < 1024 tokens
    prompt = [5 + i % 50 for i in range(most_prompt)]
    body = {"model": MODEL, "prompt": prompt, "ignore_eos": True, "method": "headsparse"}
    ok = server.http.post("/v1/completions", json={**body, "max_tokens": total - most_prompt})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == total - most_prompt
    # max_tokens left out: the most this prompt can generate, by the arithmetic that admits it
    most_new = server.llm.max_new_tokens(server.llm.make_sequence(prompt, SamplingParams(max_tokens=1),
                                                                  method="headsparse"))
    no_max = server.http.post("/v1/completions", json=body)
    assert no_max.status_code == 200 and no_max.json()["usage"]["completion_tokens"] == most_new
    assert most_new >= total - most_prompt
    r = server.http.post("/v1/completions", json={**body, "max_tokens": most_new + 1})
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]
    # a prompt past what admission can ever find pages for is 400 at once, never queued for good
    r = server.http.post("/v1/completions", json={**body, "prompt": prompt + [7], "max_tokens": 1})
    assert r.status_code == 400 and f"prompt has {most_prompt + 1} tokens" in r.json()["error"]["message"]


def test_openapi_matches_the_server(server):
    spec = server.http.get("/openapi.json").json()
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert spec["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert spec["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/health"]["get"]


# ---- connections ---------------------------------------------------------------------------------

def _addr(server):
    host, port = server.base.split("//")[1].rsplit(":", 1)
    return host, int(port)


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_senders_are_closed_and_health_stays_fast(server):
    socks = []
    try:
        for _ in range(40):  # slowloris: a request head that never ends
            s = socket.create_connection(_addr(server), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t0 = time.perf_counter()
        assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
        assert time.perf_counter() - t0 < 1.0
        time.sleep(0.5)
        for s in socks:  # trickle a header byte now and then: it does not buy more time
            s.sendall(b"X")
        assert all(_closed_by_server(s, READ_TIMEOUT + 2) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_connections_past_the_cap_are_closed_at_once(server):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):
            socks.append(socket.create_connection(_addr(server), timeout=5))
        time.sleep(0.3)
        refused = sum(_closed_by_server(s, 0.05) for s in socks)
        assert refused >= 8
    finally:
        for s in socks:
            s.close()
    deadline = time.time() + 5
    while time.time() < deadline:  # the held ones are gone: the server serves again
        try:
            if httpx.get(f"{server.base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    assert httpx.get(f"{server.base}/health", timeout=1).status_code == 200


# ---- the sampler itself --------------------------------------------------------------------------

def test_sampler_rows_with_extreme_values_never_fail_or_change_their_neighbours():
    """Any value SamplingParams accepts samples a valid token; greedy rows are the argmax whatever
    shares their batch; a top_p that rounds to 0 in float32 keeps the top token."""
    import torch
    from hypothesis import given, settings, strategies as st

    from redknot.engine.sampling import SamplingParams, sample

    values = st.fixed_dictionaries({
        "temperature": st.one_of(st.just(0.0), st.floats(min_value=1e-300, max_value=1e300)),
        "top_p": st.one_of(st.just(1.0), st.floats(min_value=1e-300, max_value=1.0, exclude_min=False)),
        "top_k": st.one_of(st.just(0), st.integers(min_value=-1, max_value=2 ** 62))})

    @given(rows=st.lists(values, min_size=1, max_size=6), seed=st.integers(0, 2 ** 32))
    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    def check(rows, seed):
        torch.manual_seed(seed)
        logits = torch.randn(len(rows) + 1, 50) * 30
        params = [SamplingParams(max_tokens=1, **r) for r in rows] + [SamplingParams(max_tokens=1, temperature=0)]
        tokens = sample(logits, params, [None] * len(params))
        assert tokens.shape == (len(params),) and bool(((tokens >= 0) & (tokens < 50)).all())
        top = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if p.greedy or (p.top_p < 1e-38 and p.top_k != 1) or p.top_k == 1:
                assert tokens[i] == top[i], (p, i)

    check()


def test_sampler_tiny_top_p_and_huge_top_k():
    """A top_p that is 0 in float32 still keeps the top token (dropping every token would make a NaN
    draw: token 0), and a top_k past int64 does not raise inside the batched sampler (which would
    fail every request in the batch)."""
    import torch

    from redknot.engine.sampling import SamplingParams, sample

    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    for top_p in (1e-300, 1e-45, 1e-40):
        assert sample(logits[:1], [SamplingParams(temperature=1.0, top_p=top_p)], [None]).item() == 1
    rows = [SamplingParams(temperature=1.0, top_k=10 ** 30, top_p=0.5), SamplingParams(temperature=0)]
    assert sample(logits, rows, [None, None]).tolist() == [1, 0]
