"""Cache isolation choices (--cache-isolation) and per-tenant /metrics that never show another
tenant's sizes."""

import httpx
import pytest

from redknot import LLM, HeadConfig
from redknot.engine.async_engine import AsyncLLMEngine
from redknot.serve.app import build_app, tenant_label
from redknot.serve.background import BackgroundServer

MODEL = "tiny-llama"
DOC = "The merchant Ilsa Torv founded the city of Varna in 1120. " * 4


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), head_config=HeadConfig.synthetic(2, 2, 0.5, window=16, sink=4),
               method="dense", device="cpu", page_size=16, kv_pages=256)


def _chat(key=None, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": DOC + " Who founded Varna?"}],
            "max_tokens": 2, "temperature": 0, **extra}
    return body, ({"Authorization": f"Bearer {key}"} if key else {})


def _post(srv, key=None, **extra):
    body, headers = _chat(key, **extra)
    return httpx.post(f"{srv.base}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _spy_salts(engine):
    salts, generate = [], engine.generate

    def spy(*args, sequence=None, **kwargs):
        salts.append(sequence.cache_salt)
        return generate(*args, sequence=sequence, **kwargs)
    engine.generate = spy
    return salts


def test_shared_isolation_lets_keys_share_and_per_key_keeps_them_apart(llm):
    for isolation, shared in (("shared", True), ("per-key", False)):
        llm.engine.clear_caches()
        engine = AsyncLLMEngine(llm)
        salts = _spy_salts(engine)
        srv = BackgroundServer(engine, MODEL, app_kw=dict(api_keys=("a", "b"), cache_isolation=isolation))
        try:
            first = _post(srv, "a")
            second = _post(srv, "b")
            assert first.status_code == second.status_code == 200
            cached = second.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        finally:
            srv.stop()
        assert (salts[0] == salts[1]) == shared
        assert (cached > 0) == shared, (isolation, cached)


def test_per_salt_isolation_requires_a_salt_and_scopes_it_by_key(llm):
    engine = AsyncLLMEngine(llm)
    salts = _spy_salts(engine)
    srv = BackgroundServer(engine, MODEL, app_kw=dict(api_keys=("a", "b"), cache_isolation="per-salt"))
    try:
        r = _post(srv, "a")
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert _post(srv, "a", cache_salt="team").status_code == 200
        assert _post(srv, "b", cache_salt="team").status_code == 200
        assert _post(srv, "a", cache_salt="team").status_code == 200
    finally:
        srv.stop()
    assert salts[0] != salts[1] and salts[0] == salts[2]  # the same salt under another key: another namespace


def test_bad_isolation_choices_are_refused(llm):
    with pytest.raises(ValueError, match="cache_isolation"):
        build_app(AsyncLLMEngine(llm), MODEL, cache_isolation="everyone")
    with pytest.raises(ValueError, match="contradicts"):
        build_app(AsyncLLMEngine(llm), MODEL, share_cache_across_keys=True, cache_isolation="per-key")


def _metrics(srv, key):
    r = httpx.get(f"{srv.base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200
    return r.text


def test_each_key_sees_its_own_tenant_series_and_no_other_sizes(llm):
    srv = BackgroundServer(AsyncLLMEngine(llm), MODEL, app_kw=dict(api_keys=("alpha", "beta")))
    try:
        assert _post(srv, "alpha").status_code == 200
        assert _post(srv, "alpha").status_code == 200
        assert _post(srv, "beta").status_code == 200
        a, b = tenant_label("alpha"), tenant_label("beta")
        mine = _metrics(srv, "alpha")
        assert f'redknot:tenant_requests_total{{model_name="{MODEL}",tenant="{a}"}} 2.0' in mine
        for kind in ("prompt", "generation", "cached"):
            assert f'kind="{kind}",model_name="{MODEL}",tenant="{a}"' in mine
        assert b not in mine and "beta" not in mine and "alpha" not in mine  # no key, no other tenant
        for size in ("generation_tokens_total", "chunk_reused_tokens", "prefix_cache_pages", "kv_pool",
                     "time_to_first_token", "host_resident_bytes"):
            assert size not in mine
        assert "redknot:num_requests_running" in mine and "redknot:num_requests_waiting" in mine
        theirs = _metrics(srv, "beta")
        assert f'tenant="{b}"' in theirs and a not in theirs
    finally:
        srv.stop()


def test_the_metrics_key_sees_every_tenant(llm):
    srv = BackgroundServer(AsyncLLMEngine(llm), MODEL, app_kw=dict(api_keys=("alpha", "beta"), metrics_key="ops"))
    try:
        assert _post(srv, "alpha").status_code == 200
        assert _post(srv, "beta").status_code == 200
        every = _metrics(srv, "ops")
        assert tenant_label("alpha") in every and tenant_label("beta") in every
        assert "redknot:generation_tokens_total" in every and "redknot:prefix_cache_pages" in every
    finally:
        srv.stop()
