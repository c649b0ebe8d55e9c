"""KV events in vLLM's wire format from the engine: a ZeroMQ subscriber follows the prefix cache's
blocks and the chunk cache's documents; the replay socket returns what it missed."""

import time

import msgpack
import pytest
from ports import free_port

from redknot import LLM, SamplingParams
from redknot.cache.events import KVEventsConfig, block_hash
from redknot.cache.prefix_cache import block_keys

zmq = pytest.importorskip("zmq")


def receive(sub, until, timeout_s=10.0) -> list:
    """Events (decoded) until ``until(events)`` holds."""
    events, deadline = [], time.monotonic() + timeout_s
    while not until(events):
        assert sub.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), f"no more events; got {events}"
        topic, seq, payload = sub.recv_multipart()
        ts, batch, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0 and len(seq) == 8
        events += batch
    return events


def test_the_engine_publishes_blocks_and_documents_and_replays_them():
    port, replay_port = free_port(), free_port()
    llm = LLM(kv_events={"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
                         "documents": True})
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # a PUB drops what it sends before the subscription arrives
    ps = llm.pool.page_size
    prompt = list(range(300, 300 + 2 * ps + 5))  # two full pages of prompt tokens
    llm.generate(prompt, SamplingParams(max_tokens=1), method="dense")
    stored = receive(sub, lambda ev: any(e["type"] == "BlockStored" for e in ev))
    e = next(e for e in stored if e["type"] == "BlockStored")
    keys = block_keys(f"{llm.fingerprint}/dense", prompt, ps)
    assert e["block_hashes"] == [block_hash(k) for k in keys[:2]] and e["parent_block_hash"] is None
    assert e["token_ids"] == prompt[:2 * ps] and e["block_size"] == ps and e["medium"] == "GPU"
    assert e["lora_id"] is None and e["lora_name"] is None

    doc = list(range(900, 940))
    llm.generate([5, 6, 7], SamplingParams(max_tokens=1), documents=[doc], method="full_reuse")
    def is_doc(e):
        return e["type"] == "BlockStored" and e["token_ids"][-len(doc):] == doc

    d = next(e for e in receive(sub, lambda ev: any(is_doc(e) for e in ev)) if is_doc(e))
    assert d["parent_block_hash"] is None and d["block_size"] == len(d["token_ids"])  # one block, its own length
    llm.engine.clear_caches()
    gone = receive(sub, lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))
    assert d["block_hashes"] in [e["block_hashes"] for e in gone if e["type"] == "BlockRemoved"]

    replay = ctx.socket(zmq.DEALER)  # a REQ socket's envelope, but many replies to one request
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert replay.poll(5000), "the replay stream did not end"
        _, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        replayed += msgpack.unpackb(payload)[1]
    assert replayed[:len(stored)] == stored
    sub.close()
    replay.close()
    llm.engine.kv_events.close()


def test_vllm_style_options():
    assert KVEventsConfig.from_vllm({"enable_kv_cache_events": False}) is None
    cfg = KVEventsConfig.from_vllm({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
                                    "topic": "kv", "buffer_steps": 5})
    assert cfg.endpoint == "tcp://*:6000" and cfg.topic == "kv" and cfg.buffer_batches == 5 and not cfg.documents
    with pytest.raises(ValueError, match="unknown kv-events option"):
        KVEventsConfig.from_vllm({"enable_kv_cache_events": True, "hwm": 5})
