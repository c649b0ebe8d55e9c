"""The PD handoff inside one process: an engine exports a prefilled request, a KV client pulls it
over TCP and the same engine adopts it as a new request. Selected sets and decode budgets' page
mass travel with the pages; a corrupted payload or a dead prefill fails the pull (fast), and every
page comes back."""

import time
import uuid

import pytest
from ports import free_port

from redknot import LLM, HeadConfig, SamplingParams
from redknot.engine import handoff
from redknot.pd.transfer import KVClient, KVServer, TransferFailed

PROMPT = " ".join(["alpha bravo charlie delta echo foxtrot golf hotel"] * 20)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), head_config=HeadConfig.synthetic(2, 2, 0.5, window=32, sink=4),
               kv_pages=4000, page_size=16, decode_kv_budget="global=64", device="cpu")


def export(llm, method, n=1):
    eng = llm.engine
    seq = llm.make_sequence(PROMPT, SamplingParams(max_tokens=1, temperature=0, return_first_logits=True),
                            method=method)
    seq.kv_export = uuid.uuid4().hex
    eng.add_request(seq)
    while eng.has_unfinished():
        eng.step()
    return seq.kv_export


def decode(llm, got, method, n=18):
    eng = llm.engine
    seq = llm.make_sequence(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), method=method)
    seq.kv_import = got
    eng.add_request(seq)
    while eng.has_unfinished():
        eng.step()
    return seq


@pytest.mark.parametrize("method", ["headsparse"])
def test_handoff_with_selected_sets_equals_colocated(llm, method):
    """decode_kv_budget puts the plan's global heads on a budget: the prefill selects their pages and
    accumulates page mass, and the decode goes on with the same sets and mass (budget checks every
    page of decode), so its greedy tokens equal the colocated engine's."""
    eng = llm.engine
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=18, temperature=0, ignore_eos=True), method=method)
    lease = export(llm, method)
    server = KVServer(eng.leases, chunk_bytes=1)  # a page per message: the stream's chunking is exercised
    try:
        got = KVClient().pull({"remote_host": "127.0.0.1", "remote_port": server.port, "remote_request_id": lease},
                              handoff.expectation(eng, llm.make_sequence(PROMPT, SamplingParams(), method=method)))
    finally:
        server.close()
    assert got.header.plan == f"{method}+sel" and got.header.selection() is not None
    assert got.header.page_mass is not None
    dense_pages = eng.pool.num_layers * eng.pool.num_kv_heads * got.held.shape[2]
    assert got.num_pages < dense_pages  # budgets and windows: fewer pages than the whole prompt's
    seq = decode(llm, got, method)
    assert seq.output_token_ids == ref[0].outputs[0].token_ids
    eng.collect_leases()
    assert eng.idle()


def test_corrupt_payload_is_rejected(llm, monkeypatch):
    eng = llm.engine
    lease = export(llm, "headsparse")
    server = KVServer(eng.leases)
    real = KVServer.send

    def on_the_wire(self, ident, kind, data, copy=True):  # one byte of the pages flips in transit
        if kind == b"C":
            data = bytearray(data)
            data[17] ^= 1
            data, copy = bytes(data), True
        real(self, ident, kind, data, copy)
    monkeypatch.setattr(KVServer, "send", on_the_wire)
    try:
        with pytest.raises(TransferFailed, match="checksum") as e:
            KVClient().pull({"remote_host": "127.0.0.1", "remote_port": server.port, "remote_request_id": lease},
                            handoff.expectation(eng, llm.make_sequence(PROMPT, SamplingParams(), method="headsparse")))
        assert e.value.rejected
    finally:
        server.close()
    eng.collect_leases()
    assert eng.idle()


def test_dead_prefill_fails_the_pull_at_once(llm):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="unreachable|went away"):
        KVClient(timeout_s=20).pull({"remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "x"},
                                    handoff.expectation(llm.engine, llm.make_sequence(PROMPT, SamplingParams())))
    assert time.monotonic() - t0 < 5
