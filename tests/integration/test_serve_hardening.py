"""The server against clients that send bad Unicode, stop reading, trickle bodies or outstay a
shutdown (loopback only, bounded)."""

import json
import socket
import time

import httpx
import pytest
from ports import free_port

pytest.importorskip("uvicorn")

from redknot import LLM, HeadConfig  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
LLM_KW = dict(method="headsparse", device="cpu", page_size=16, kv_pages=128)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), head_config=HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4),
               **LLM_KW)


@pytest.fixture(scope="module")
def server(llm):
    srv = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=16), MODEL)
    yield srv
    srv.stop()


def _addr(server):
    host, port = server.base.split("//")[1].rsplit(":", 1)
    return host, int(port)


def _post_raw(server, path: str, body: str) -> httpx.Response:
    """``body`` as written (JSON escapes such as \\ud800 reach the server as they are)."""
    return httpx.post(f"{server.base}{path}", content=body.encode("ascii"),
                      headers={"content-type": "application/json"}, timeout=30)


# ---- lone surrogates -----------------------------------------------------------------------------

CHAT = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2'
COMPLETION = '{"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2'
S = "\\ud800"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", CHAT.replace('"Hi"', f'"a{S}b"') + "}", "messages[0].content"),
    ("/v1/chat/completions", CHAT.replace('"Hi"', f'[{{"type": "text", "text": "{S}"}}]') + "}",
     "messages[0].content[0].text"),
    ("/v1/chat/completions", CHAT.replace("tiny-llama", S) + "}", "model"),
    ("/v1/chat/completions", CHAT + f', "documents": ["ok", "x{S}"]}}', "documents[1]"),
    ("/v1/chat/completions", CHAT + f', "stop": ["{S}"]}}', "stop[0]"),
    ("/v1/chat/completions", CHAT + f', "chat_template_kwargs": {{"k": "{S}"}}}}', "chat_template_kwargs.k"),
    ("/v1/chat/completions", CHAT + f', "chat_template_kwargs": {{"{S}": 1}}}}', "chat_template_kwargs"),
    ("/v1/completions", COMPLETION.replace('"Hi"', f'"{S}"') + "}", "prompt"),
    ("/v1/completions", COMPLETION.replace('"Hi"', f'["ok", "{S}"]') + "}", "prompt[1]"),
    ("/v1/completions", COMPLETION + f', "documents": [{{"title": "{S}", "text": "t"}}]}}', "documents[0].title"),
    ("/tokenize", f'{{"model": "tiny-llama", "prompt": "{S}"}}', "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    r = _post_raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    assert _post_raw(server, "/v1/chat/completions", CHAT + "}").status_code == 200  # nothing else lost


def test_model_not_found_quotes_any_model_name_safely(server):
    r = httpx.get(f"{server.base}/v1/models/%ED%A0%80nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    from redknot.serve.app import _error

    resp = _error(404, "The model `\ud800` does not exist", param="model")  # renders, escaped
    assert json.loads(resp.body)["error"]["message"] == "The model `\\ud800` does not exist"


def test_malformed_http_is_an_openai_json_400(server):
    with socket.create_connection(_addr(server), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    r = _post_raw(server, "/v1/chat/completions", CHAT + ', "max_tokens": }')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


# ---- clients that stop reading -------------------------------------------------------------------

def _stream_request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _non_reader(addr) -> socket.socket:
    """A connection whose receive buffer is tiny and never read: the server's writes back up."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.settimeout(10)
    s.connect(addr)
    return s


# every token's chunk carries 20 alternatives, so a few hundred tokens fill the socket's buffers
BIG_STREAM = {"model": MODEL, "prompt": "the quick brown fox", "stream": True, "logprobs": 20, "ignore_eos": True,
              "method": "dense"}


def slow_engine(llm, monkeypatch, seconds):
    """Every forward sleeps ``seconds`` first (a request runs for longer than the timeouts)."""
    forward = llm.engine.runner.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "forward", slow)


def test_a_client_that_stops_reading_is_cut_off_and_its_pages_come_back(llm, monkeypatch):
    slow_engine(llm, monkeypatch, 0.02)  # its 440 tokens would take 9 s
    engine = AsyncLLMEngine(llm, max_num_seqs=4)
    srv = BackgroundServer(engine, MODEL, server_kw=dict(write_timeout=1.0))
    try:
        # accepted sockets inherit the listener's (locked) send buffer: small, as under memory pressure
        srv._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        finished = engine.stats()["requests_finished"]
        s = _non_reader(_addr(srv))
        s.sendall(_stream_request("/v1/completions", BIG_STREAM))
        deadline = time.time() + 30
        while engine.stats()["running"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert engine.stats()["running"] == 1  # generating into buffers nobody reads
        while not llm.engine.idle() and time.time() < deadline:
            time.sleep(0.05)
        assert llm.engine.idle(), llm.engine.pool.occupancy()  # aborted: every page back
        assert engine.stats()["requests_finished"] == finished  # cut off, not run to its end
        s.settimeout(5)
        try:
            while s.recv(1 << 16):  # what was buffered, then the end: the server has dropped it
                pass
        except ConnectionResetError:
            pass
        s.close()
        r = httpx.post(f"{srv.base}/v1/completions", json={**BIG_STREAM, "stream": False, "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_sigterm_with_a_client_that_never_reads_exits_within_the_shutdown_timeout(tiny_checkpoint):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "redknot.cli", "serve", "--model", str(tiny_checkpoint("llama")),
                             "--device", "cpu", "--kv-pages", "512", "--page-size", "16", "--method", "dense",
                             "--port", str(port), "--served-model-name", MODEL, "--write-timeout", "600",
                             "--shutdown-timeout", "1", "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    socks = []
    try:
        deadline = time.time() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        for _ in range(2):  # 4 choices x ~1000 tokens x 20 alternatives each: more than the buffers hold
            s = _non_reader(("127.0.0.1", port))
            s.sendall(_stream_request("/v1/completions", {**BIG_STREAM, "n": 4}))
            socks.append(s)
        assert socks[0].recv(16).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # generation is over; the responses sit in full buffers
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still up 15 s after SIGTERM")
        assert time.time() - t0 < 1 + 5  # the shutdown timeout, then the engine worker's exit
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- bodies that never finish --------------------------------------------------------------------

def test_trickled_bodies_hold_no_concurrency_slot(llm, monkeypatch):
    """Under --limit-concurrency 4, four connections that sent headers and 1 byte of a 200-byte
    body do not make a fifth, whole request wait or get 503: slots count requests that arrived."""
    srv = BackgroundServer(AsyncLLMEngine(llm), MODEL, server_kw=dict(limit_concurrency=4, read_timeout=30))
    socks = []
    try:
        for _ in range(4):
            s = socket.create_connection(_addr(srv), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 200\r\n\r\n{")
            socks.append(s)
        time.sleep(0.3)  # every trickler is in the app, waiting for the rest of its body
        for _ in range(3):
            r = httpx.post(f"{srv.base}/v1/completions", timeout=10,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "method": "dense"})
            assert r.status_code == 200, r.text
        slow_engine(llm, monkeypatch, 0.05)  # the four streams below stay in flight for seconds
        with httpx.Client(base_url=srv.base, timeout=30) as c:  # the limit itself still holds
            with c.stream("POST", "/v1/completions", json={**BIG_STREAM, "max_tokens": 64}) as first:
                assert first.status_code == 200
                c2 = httpx.Client(base_url=srv.base, timeout=30)
                streams = [c2.stream("POST", "/v1/completions", json={**BIG_STREAM, "max_tokens": 64})
                           for _ in range(3)]
                held = [st.__enter__() for st in streams]
                assert all(h.status_code == 200 for h in held)
                busy = httpx.post(f"{srv.base}/v1/completions", timeout=10,
                                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                assert busy.status_code == 503
                for st in streams:
                    st.__exit__(None, None, None)
                c2.close()
    finally:
        for s in socks:
            s.close()
        srv.stop()


# ---- /metrics behind a key -----------------------------------------------------------------------

def test_metrics_needs_the_metrics_key_or_an_api_key(llm):
    def get(srv, key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{srv.base}/metrics", headers=headers, timeout=10)

    with_keys = BackgroundServer(AsyncLLMEngine(llm), MODEL, app_kw=dict(api_keys=("a", "b"),
                                                                         share_cache_across_keys=True))
    try:
        assert get(with_keys).status_code == 401 and get(with_keys, "wrong").status_code == 401
        assert get(with_keys).json()["error"]["code"] == "invalid_api_key"
        assert get(with_keys, "b").status_code == 200 and "redknot:" in get(with_keys, "a").text
        assert httpx.get(f"{with_keys.base}/health", timeout=10).status_code == 200  # probes stay open
    finally:
        with_keys.stop()
    own = BackgroundServer(AsyncLLMEngine(llm), MODEL, app_kw=dict(api_keys=("a",), metrics_key="scraper"))
    try:
        assert get(own, "a").status_code == 401 and get(own).status_code == 401
        assert get(own, "scraper").status_code == 200
        assert httpx.get(f"{own.base}/v1/models", headers={"Authorization": "Bearer scraper"},
                         timeout=10).status_code == 401  # the metrics key opens nothing else
    finally:
        own.stop()
    open_srv = BackgroundServer(AsyncLLMEngine(llm), MODEL)
    try:
        assert get(open_srv).status_code == 200  # no key anywhere: open, as before
    finally:
        open_srv.stop()


# ---- host memory back to the OS ------------------------------------------------------------------

def test_going_idle_gives_freed_host_memory_back(llm):
    """Each time the engine goes idle after finishing requests it trims the C heap once (the
    counter /metrics shows as redknot:host_heap_trims); an idle engine does not keep trimming."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc malloc_trim is Linux's")
    srv = BackgroundServer(AsyncLLMEngine(llm), MODEL)
    try:
        for _ in range(2):
            r = httpx.post(f"{srv.base}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "method": "dense"})
            assert r.status_code == 200
        deadline = time.time() + 5
        while srv.engine.heap_trims < 2 and time.time() < deadline:
            time.sleep(0.02)
        trims = srv.engine.heap_trims
        assert trims == 2
        time.sleep(0.2)
        assert srv.engine.heap_trims == trims
        text = httpx.get(f"{srv.base}/metrics", timeout=10).text
        assert "redknot:host_heap_trims_total" in text and "redknot:host_resident_bytes" in text
    finally:
        srv.stop()
