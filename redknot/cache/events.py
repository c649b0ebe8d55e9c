"""KV cache events for routers, in vLLM's wire format: ZeroMQ PUB of msgpack ``KVEventBatch``es.

What a KV-aware router (vllm-router's ``kv_aware`` policy, Dynamo, llm-d) subscribes to, so it can
follow which replica holds which prompt prefix. Each message is three frames: topic, an 8-byte
big-endian sequence number, and the msgpack batch as vLLM's msgspec structs encode it: the batch
an array, each event a map tagged by its ``type`` (the form vllm-router's KV index decodes)::

    [ts, [event, ...], data_parallel_rank]
    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": int | None, "token_ids": [...],
     "block_size": int, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

A block is a full page of prompt tokens in the prefix cache; its hash is the first 8 bytes of the
cache's own chained sha256 key as an unsigned integer (the chain covers every earlier block, so
``parent_block_hash`` links them). With ``documents=True`` each document the chunk cache holds is
also announced as one block of its own length (``block_size`` = its tokens, no parent), so a
router can place requests by the documents they name, not only by prefix.

A ROUTER socket (``replay_endpoint``) answers a request of a starting sequence number (8 bytes,
big-endian) with every buffered batch from there on, then sequence -1, as vLLM's does.
Publishing runs on its own thread; the engine only appends to a list.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(key: bytes | str) -> int:
    """A cache key (sha256 digest or its hex) as the 64-bit integer events carry."""
    raw = bytes.fromhex(key) if isinstance(key, str) else key
    return int.from_bytes(raw[:8], "big")


def block_stored(hashes, parent, token_ids, block_size: int, medium: str = MEDIUM_GPU) -> dict:
    return {"type": "BlockStored", "block_hashes": [int(h) for h in hashes],
            "parent_block_hash": None if parent is None else int(parent), "token_ids": [int(t) for t in token_ids],
            "block_size": int(block_size), "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(hashes, medium: str = MEDIUM_GPU) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [int(h) for h in hashes], "medium": medium}


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


@dataclass
class KVEventsConfig:
    """``endpoint``: where the PUB socket binds (``tcp://*:5557``) or, without a wildcard, connects;
    ``replay_endpoint``: a ROUTER for missed batches (None: none); ``documents``: announce
    documents too; ``interval_s``: how often pending events go out as one batch."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    documents: bool = False
    buffer_batches: int = 10_000
    interval_s: float = 0.01

    def build(self) -> "ZmqEventPublisher":
        return ZmqEventPublisher(self)

    @classmethod
    def from_vllm(cls, options: dict) -> "KVEventsConfig | None":
        """From vLLM's ``--kv-events-config`` JSON fields (None when events are off); ``documents``
        is redknot's own."""
        known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps",
                 "documents"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown kv-events option(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        if not options.get("enable_kv_cache_events", False) or options.get("publisher", "zmq") == "null":
            return None
        if options.get("publisher", "zmq") != "zmq":
            raise ValueError(f"kv-events publisher {options['publisher']!r}: only 'zmq' (or 'null')")
        out = cls(documents=bool(options.get("documents", False)))
        for src, dst in (("endpoint", "endpoint"), ("replay_endpoint", "replay_endpoint"), ("topic", "topic"),
                         ("buffer_steps", "buffer_batches")):
            if options.get(src) is not None:
                setattr(out, dst, options[src])
        return out


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        import zmq

        self.config = config
        self.documents = config.documents
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        if "*" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(config.endpoint)  # vLLM's rule: a wildcard binds, an address connects
        else:
            self._pub.connect(config.endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode() or config.endpoint
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._pending: list[dict] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.recorded = self.published = 0  # events queued / sent
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def record(self, event: dict) -> None:
        """Queue one event (the engine's thread; never blocks on the network)."""
        with self._lock:
            self._pending.append(event)
            self.recorded += 1

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every recorded event has been sent."""
        deadline = time.monotonic() + timeout_s
        while self.published < self.recorded and time.monotonic() < deadline:
            time.sleep(self.config.interval_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception as e:  # a bad replay request must not stop publishing
                    log.warning("kv events: replay failed: %s", e)
            with self._lock:
                events, self._pending = self._pending, []
            if events:
                try:
                    self._send(events)
                except Exception as e:  # counted as published: flush must not wait for them forever
                    self.published += len(events)
                    log.warning("kv events: could not publish %d events: %s", len(events), e)
            self._stop.wait(self.config.interval_s)

    def _send(self, events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: replay request of %d frames, 3 expected", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
