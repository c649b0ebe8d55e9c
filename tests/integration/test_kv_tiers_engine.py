"""Document KV below the pool through the engine (the bundled model, ``full_reuse``): evicted
documents come back from the CPU tier, a restarted process finds them on disk, replicas share them
through Redis, and a damaged entry or a dead Redis costs a recompute, never a request."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port

from redknot import LLM, SamplingParams
from redknot.serve.metrics import ServerMetrics
from redknot.testbed.records import generate_records

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(max_tokens=3, temperature=0, return_first_logits=True)


@pytest.fixture(scope="module")
def requests():
    """Two questions over two disjoint sets of generated documents."""
    records = generate_records(11, 2, context_tokens=160, questions_per_context=1, types=("single_hop",))
    return [(r["question"], r["documents"]) for r in records]


def run(llm, request):
    out = llm.generate(request[0], PARAMS, documents=request[1], method="full_reuse")[0]
    return out.outputs[0].token_ids, out.metrics["cached_tokens"], out.first_token_logits


@pytest.fixture(scope="module")
def cold(requests):
    """Tokens and first-token logits of each request computed from scratch, no tiers."""
    llm = LLM()
    return [run(llm, r) for r in requests]


def tier_stats(llm):
    return llm.chunk_cache.stats()["tiers"]


def test_an_evicted_document_comes_back_from_the_cpu_tier(requests, cold):
    llm = LLM(kv_offload={"cpu_bytes": 256 << 20, "write_policy": "write_back"})  # written down at eviction
    first = run(llm, requests[0])
    assert first[0] == cold[0][0] and first[1] == 0
    llm.chunk_cache.evict(llm.pool.num_pages)  # the pool lets every document go
    assert len(llm.chunk_cache) == 0
    again = run(llm, requests[0])
    assert again[0] == cold[0][0] and again[1] > 0
    assert torch.equal(again[2], cold[0][2])  # the same KV bytes: the same logits, bit for bit
    stats = tier_stats(llm)
    assert stats["hits"]["cpu"] == len(requests[0][1]) + 1  # every document and the prompt prefix
    assert stats["cpu"]["rejected"] == 0 and stats["write_errors"] == 0
    metrics = ServerMetrics(_Front(llm), MODEL_NAME).render().decode()
    assert f'redknot:kv_tier_loads_total{{model_name="{MODEL_NAME}",tier="cpu"}} {len(requests[0][1]) + 1}.0' in metrics
    assert f'redknot:kv_tier_rejected_total{{model_name="{MODEL_NAME}",tier="cpu"}} 0.0' in metrics


def test_a_small_pool_evicts_into_the_tiers_and_a_small_tier_evicts_without_errors(requests, cold, tmp_path):
    """The engine's own eviction (a pool that holds one request's documents) writes down; a CPU tier
    smaller than both requests' documents spills to disk; answers stay the cold ones."""
    llm = LLM(kv_offload={"cpu_bytes": 6 << 20, "disk_dir": str(tmp_path), "disk_bytes": 64 << 20,
                          "write_policy": "write_back"})
    seqs = [llm.make_sequence(q, PARAMS, d, "full_reuse") for q, d in requests]
    llm.engine.resize_pool(max(llm.engine.pages_for(s) for s in seqs) + 8)
    for r, ref in zip(requests + requests, cold + cold):
        assert run(llm, r)[0] == ref[0]
    stats = tier_stats(llm)
    assert llm.chunk_cache.evictions > 0 and sum(stats["hits"].values()) > 0
    assert stats["cpu"]["evictions"] > 0 and stats["cpu"]["bytes"] <= 6 << 20
    assert stats["disk"]["puts"] > 0 and stats["write_errors"] == 0


WRITER = """
import json, sys
from redknot import LLM, SamplingParams
from redknot.serve.metrics import ServerMetrics
question, docs, disk = json.loads(sys.argv[1])
llm = LLM(kv_offload={"disk_dir": disk, "disk_bytes": 256 << 20})
out = llm.generate(question, SamplingParams(max_tokens=3, temperature=0), documents=docs, method="full_reuse")[0]
print(json.dumps(out.outputs[0].token_ids))
"""  # exits without flushing by hand: the tiers' exit hook finishes the writes


def test_a_restarted_process_reuses_documents_from_disk(requests, cold, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", WRITER, json.dumps([*requests[0], str(tmp_path)])], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == cold[0][0]
    llm = LLM(kv_offload={"disk_dir": str(tmp_path), "disk_bytes": 256 << 20})
    tokens, cached, logits = run(llm, requests[0])
    assert cached > 0 and tokens == cold[0][0] and torch.equal(logits, cold[0][2])
    assert tier_stats(llm)["hits"] == {"disk": len(requests[0][1]) + 1}


def test_a_flipped_byte_on_disk_is_detected_and_recomputed(requests, cold, tmp_path):
    llm = LLM(kv_offload={"disk_dir": str(tmp_path), "disk_bytes": 256 << 20, "write_behind": False})
    run(llm, requests[0])
    llm.chunk_cache.evict(llm.pool.num_pages)
    victim = sorted(tmp_path.rglob("*.rkv"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x04
    victim.write_bytes(data)
    tokens, cached, logits = run(llm, requests[0])
    assert tokens == cold[0][0] and torch.equal(logits, cold[0][2])
    stats = tier_stats(llm)
    assert stats["disk"]["rejected"] == 1 and stats["hits"]["disk"] == len(requests[0][1])  # the rest came back
    assert not victim.exists() or victim.read_bytes() != bytes(data)  # dropped, then written again


def test_two_replicas_share_documents_through_redis(requests, cold, redis_server):
    offload = {"redis_url": redis_server, "write_behind": False}
    a, b = LLM(kv_offload=offload), LLM(kv_offload=offload)
    a.engine.kv_tiers.redis.prefix = b.engine.kv_tiers.redis.prefix = f"replicas:{time.monotonic_ns()}:"
    assert run(a, requests[1])[0] == cold[1][0]
    tokens, cached, logits = run(b, requests[1])  # replica b never saw these documents
    assert cached > 0 and tokens == cold[1][0] and torch.equal(logits, cold[1][2])
    assert tier_stats(b)["hits"] == {"redis": len(requests[1][1]) + 1}


def test_a_dead_redis_never_fails_a_request(requests, cold, dead_redis_url):
    llm = LLM(kv_offload={"cpu_bytes": 64 << 20, "redis_url": dead_redis_url, "write_behind": False})
    for r, ref in zip(requests, cold):
        assert run(llm, r)[0] == ref[0]
    llm.chunk_cache.evict(llm.pool.num_pages)
    assert run(llm, requests[0])[1] > 0  # the CPU tier still serves
    redis = tier_stats(llm)["redis"]
    assert redis["errors"] >= 1 and redis["skipped"] > 0 and redis["puts"] == 0


def test_redis_killed_mid_run_fails_no_request(requests, cold, tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir",
                               str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        llm = LLM(kv_offload={"redis_url": f"redis://127.0.0.1:{port}/0", "write_behind": False})
        assert run(llm, requests[0])[0] == cold[0][0]
        assert tier_stats(llm)["redis"]["puts"] > 0
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        llm.chunk_cache.evict(llm.pool.num_pages)
        for r, ref in zip(requests, cold):  # its documents were in Redis only: recomputed as cold
            tokens, cached, _ = run(llm, r)
            assert tokens == ref[0] and cached == ref[1]
        assert tier_stats(llm)["redis"]["errors"] >= 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)


MODEL_NAME = "tiered"


class _Front:
    """What the server's metrics read of the serving front: its stats and its engine."""

    def __init__(self, llm):
        self.engine = llm.engine

    def stats(self) -> dict:
        return self.engine.stats()
