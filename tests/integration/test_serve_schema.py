"""schemathesis against the server's own OpenAPI schema (bounded: a few hundred generated cases on
loopback): no 5xx, every status code, content type and JSON body as the schema documents them,
and schema-invalid input refused."""

import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode, checks  # noqa: E402

from redknot import LLM  # noqa: E402
from redknot.engine.async_engine import AsyncLLMEngine  # noqa: E402
from redknot.serve.background import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
KEY = "schema-key"
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.negative_data_rejection]


@pytest.fixture(scope="module")
def running(tiny_checkpoint):
    # a 64-token context keeps every generated request cheap (prompt + max_tokens <= 64)
    llm = LLM(model=tiny_checkpoint("llama"), method="dense", device="cpu", page_size=16, kv_pages=64,
              max_model_len=64)
    srv = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=8), MODEL, app_kw=dict(api_keys=[KEY]))
    yield srv
    srv.stop()


# per operation and mode: ~200 cases in all by default; REDKNOT_SCHEMA_EXAMPLES=1500 runs ~10,000
EXAMPLES = int(os.environ.get("REDKNOT_SCHEMA_EXAMPLES", "30"))


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_server_behaves_as_its_schema_says(running, mode):
    schema = schemathesis.openapi.from_url(f"{running.base}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics"}
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses = {}
    for op in ops:
        if mode == "negative" and not (list(op.body) or list(op.path_parameters)):
            continue  # nothing to make invalid
        @given(case=op.as_strategy(GenerationMode(mode)))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def conforms(case):
            if mode == "positive" and isinstance(case.body, dict):
                case.body["model"] = MODEL  # past the model check, into tokenising and the engine
            if mode == "positive" and "model" in (case.path_parameters or {}):
                case.path_parameters["model"] = MODEL
            r = case.call_and_validate(base_url=running.base, headers=headers, checks=CHECKS, timeout=30)
            statuses.setdefault(op.path, []).append(r.status_code)

        t0 = time.perf_counter()
        conforms()
        print(op.path, round(time.perf_counter() - t0, 1))
    ran = {path: len(codes) for path, codes in statuses.items()}
    print(mode, ran, {path: sorted(set(codes)) for path, codes in statuses.items()})
    assert ran["/v1/chat/completions"] >= EXAMPLES // 2 and ran["/v1/completions"] >= EXAMPLES // 2
