"""The server against clients that send bad Unicode, stop reading, trickle bodies or outstay a
shutdown (loopback only, bounded)."""

import json
import socket
import time

import httpx
import pytest

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
