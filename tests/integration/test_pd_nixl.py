"""The nixl data path (where NIXL imports): a handoff READ through two NIXL agents (UCX over shared
memory or TCP) decodes to the colocated engine's greedy tokens and every page and staging buffer
comes back; then a prefill and a decode server as two processes with ``--pd-transport nixl``."""

import importlib.util
import sys
import time

import pytest
from test_pd import LONG, MODEL, Server, idle, post
from test_pd_engine import PROMPT, decode, export

from redknot import LLM, HeadConfig, SamplingParams
from redknot.engine import handoff
from redknot.pd.nixl_transport import NixlPath
from redknot.pd.transfer import KVClient, KVServer, TcpPath, TransferFailed

needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL is not installed")


def test_without_nixl_the_path_names_the_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # import nixl raises ImportError
    monkeypatch.delitem(sys.modules, "nixl._api", raising=False)
    with pytest.raises(RuntimeError, match=r"redknot\[nixl\].*import nixl failed"):
        NixlPath()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), head_config=HeadConfig.synthetic(2, 2, 0.5, window=32, sink=4),
               kv_pages=4000, page_size=16, device="cpu")


@needs_nixl
def test_nixl_handoff_equals_colocated_and_frees_everything(llm):
    eng = llm.engine
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), method="headsparse")
    prefill_path, decode_path = NixlPath(), NixlPath()  # two agents, as two instances have
    server = KVServer(eng.leases, paths={"tcp": TcpPath(), "nixl": prefill_path})
    client = KVClient(paths={"nixl": decode_path})
    try:
        for _ in range(2):  # the second pull reuses the loaded remote agent with a new buffer's keys
            lease = export(llm, "headsparse")
            got = client.pull({"remote_host": "127.0.0.1", "remote_port": server.port, "remote_request_id": lease,
                               "transport": "nixl"},
                              handoff.expectation(eng, llm.make_sequence(PROMPT, SamplingParams(), method="headsparse")))
            assert got.transfer["transport"] == "nixl" and got.transfer["bytes"] == got.header.payload_bytes > 0
            assert got.header.digest_algo == "xxh3-64"
            seq = decode(llm, got, "headsparse", n=12)
            assert seq.output_token_ids == ref[0].outputs[0].token_ids
        # a lease the prefill does not hold: refused over the control channel, nothing staged
        with pytest.raises(TransferFailed, match="unknown"):
            client.pull({"remote_host": "127.0.0.1", "remote_port": server.port, "remote_request_id": "nope",
                         "transport": "nixl"},
                        handoff.expectation(eng, llm.make_sequence(PROMPT, SamplingParams(), method="headsparse")))
        deadline = time.monotonic() + 5
        while (server.awaiting or prefill_path._staged) and time.monotonic() < deadline:
            time.sleep(0.05)  # the "done" crosses the control channel
        assert not server.awaiting and not prefill_path._staged and not decode_path._stuck
        assert server.stats["transfers"] == 2 and client.stats["transfers"] == 2
    finally:
        server.close()
        decode_path.close()
    eng.collect_leases()
    assert eng.idle()


@needs_nixl
def test_nixl_between_two_server_processes(tmp_path):
    prefill = Server(tmp_path, "prefill-nixl", "--role", "prefill", "--pd-transport", "nixl")
    decode_srv = Server(tmp_path, "decode-nixl", "--role", "decode", "--pd-transport", "nixl",
                        "--pd-on-failure", "fail")
    try:
        prefill.wait()
        decode_srv.wait()
        b = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
             "method": "headsparse"}
        status, first = post(prefill.base + "/v1/completions", {**b, "max_tokens": 1,
                                                                "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and first["kv_transfer_params"]["transport"] == "nixl"
        status, out = post(decode_srv.base + "/v1/completions", {**b, "kv_transfer_params": first["kv_transfer_params"]})
        assert status == 200, out
        assert out["usage"]["kv_transfer"]["transport"] == "nixl" and out["usage"]["kv_transfer"]["bytes"] > 0
        _, colocated = post(decode_srv.base + "/v1/completions", b)
        assert out["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert idle(decode_srv.base) and idle(prefill.base)
    finally:
        prefill.stop()
        decode_srv.stop()
