"""Two ``redknot serve`` replicas (the bundled model, nothing shared) behind vllm-router: vLLM's
render endpoints answer the prompt's token ids with the documents in them, and with them the
router's ``cache_aware`` policy sends repeated documents where they are cached (hit rate >= 0.8),
measured beside ``round_robin`` on the same workload."""

import argparse
import subprocess
import time
import urllib.request

import pytest

from redknot.bench import replicas
from test_pd import MODEL, ROUTER, Server, free_port, post

DOCS = ["The merchant Ilsa Torv founded the city of Varna in 1120 beside the river.",
        "The old mill at the river's bend grinds barley every spring for the city."]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    servers = [Server(tmp, f"replica{i}") for i in range(2)]
    try:
        for s in servers:
            s.wait()
        yield tmp, servers
    finally:
        for s in servers:
            s.stop()


def test_render_answers_the_token_ids_the_engine_runs(servers):
    base = servers[1][0].base
    question = [{"role": "user", "content": "Who founded Varna?"}]
    status, plain = post(base + "/tokenize", {"model": MODEL, "messages": question})
    assert status == 200
    status, chat = post(base + "/v1/chat/completions/render", {"model": MODEL, "messages": question})
    assert status == 200 and chat["token_ids"] == plain["tokens"] and chat["model"] == MODEL
    status, with_docs = post(base + "/v1/chat/completions/render",
                             {"model": MODEL, "messages": question, "documents": DOCS, "method": "full_reuse"})
    assert status == 200 and len(with_docs["token_ids"]) > len(chat["token_ids"]) + 20  # the documents are in it
    status, done = post(base + "/v1/chat/completions",
                        {"model": MODEL, "messages": question, "documents": DOCS, "method": "full_reuse", "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == len(with_docs["token_ids"])
    status, comp = post(base + "/v1/completions/render", {"model": MODEL, "prompt": ["one two", "three"]})
    assert status == 200 and [len(r["token_ids"]) > 0 for r in comp] == [True, True]
    status, err = post(base + "/v1/chat/completions/render", {"model": "another", "messages": question})
    assert status == 404 and "another" in err["error"]["message"]


def _router(tmp, servers, policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                             "--worker-urls", *[s.base for s in servers]],
                            stdout=open(tmp / f"router-{policy}.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError((tmp / f"router-{policy}.log").read_text()[-2000:])
            time.sleep(0.3)


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the test extra)")
def test_cache_aware_routing_sends_repeated_documents_to_their_replica(servers):
    tmp, procs = servers
    rates = {}
    for i, policy in enumerate(("round_robin", "cache_aware")):
        router, url = _router(tmp, procs, policy)
        try:
            args = argparse.Namespace(url=url, model=MODEL, sets=4, repeats=3, docs_per_set=2, doc_words=40,
                                      method="full_reuse", seed=100 + i, timeout=120, out=str(tmp / f"{policy}.json"))
            rates[policy] = replicas.run(args)["hit_rate"]
        finally:
            router.terminate()
            router.wait(timeout=10)
    assert rates["cache_aware"] >= 0.8, rates
    assert rates["cache_aware"] > rates["round_robin"], rates
