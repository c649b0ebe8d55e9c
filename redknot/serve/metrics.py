"""Prometheus metrics through ``prometheus-client``, with vLLM's series under a ``redknot:`` prefix
(``vllm:time_to_first_token_seconds`` is ``redknot:time_to_first_token_seconds``, ...), each with
a ``model_name`` label, plus redknot's own (chunk reuse, SegPaged pool pages by head class).

Request timings are observed on the engine's worker thread as each delivery goes out
(``AsyncLLMEngine.observer``); gauges and cache counters are read from ``stats()`` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ..engine.host_memory import resident_bytes

# vLLM's bucket edges (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
P = "redknot:"
_MAX_TRACKED = 1 << 16  # timing entries kept (two per request in flight)


class ServerMetrics:
    """Every series of one server; ``observer`` goes on ``AsyncLLMEngine.observer``."""

    def __init__(self, engine, model_name: str, errors=lambda: 0):
        self.engine, self.model_name, self.errors = engine, model_name, errors
        self.pd = None  # serve.pd.PDService, when the server disaggregates prefill and decode
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                              lab, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between successive output tokens.",
                             lab, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(P + "request_time_per_output_token_seconds",
                              "Per request: decode time over its output tokens after the first.",
                              lab, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from a request's arrival to its end.",
                             lab, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time a request waited before it was first scheduled.",
                               lab, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prefill = Histogram(P + "request_prefill_time_seconds", "From first scheduled to the first token.",
                                 lab, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.decode = Histogram(P + "request_decode_time_seconds", "From the first token to the last.",
                                lab, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_hist = Histogram(P + "request_prompt_tokens", "Prompt tokens per finished request.",
                                     lab, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.gen_hist = Histogram(P + "request_generation_tokens", "Generated tokens per finished request.",
                                  lab, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of requests that started generating.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab, registry=r).labels(model_name)
        self.reused_tokens = Counter(P + "chunk_reused_tokens", "Prompt tokens served from the chunk or prefix cache.",
                                     lab, registry=r).labels(model_name)
        self.success = Counter(P + "request_success", "Requests that finished, by finish reason.",
                               lab + ["finished_reason"], registry=r)
        self._last: dict[int, float] = {}  # seq_id -> time of its last delivery
        r.register(_StatsCollector(self))

    # ---- on the worker thread ------------------------------------------------------------------
    def delivered(self, seq, arrival: float, new_tokens: int, now: float) -> None:
        if new_tokens <= 0 and seq.finish_reason is None:
            return
        last = self._last.get(seq.seq_id)
        if last is None and new_tokens > 0:
            self.ttft.observe(now - arrival)
            self.prompt_tokens.inc(seq.num_prompt)
            self.reused_tokens.inc(seq.cached_tokens)
            if seq.scheduled_time is not None:
                self.queue.observe(max(0.0, seq.scheduled_time - arrival))
                self.prefill.observe(max(0.0, now - seq.scheduled_time))
            if new_tokens > 1:  # a step that delivers several tokens at once
                self.itl.observe(0.0)
        elif last is not None and new_tokens > 0:
            gap = (now - last) / new_tokens
            for _ in range(new_tokens):
                self.itl.observe(gap)
        self.generation_tokens.inc(max(new_tokens, 0))
        if new_tokens > 0:
            self._last.setdefault(-seq.seq_id - 1, now)  # the first token's time, under a key of its own
            self._last[seq.seq_id] = now
            while len(self._last) > _MAX_TRACKED:  # aborted requests never finish here: drop the oldest
                del self._last[next(iter(self._last))]
        if seq.finish_reason is not None:
            first = self._last.pop(-seq.seq_id - 1, now)
            self._last.pop(seq.seq_id, None)
            out = len(seq.output_token_ids)
            self.e2e.observe(now - arrival)
            self.decode.observe(now - first)
            if out > 1:
                self.tpot.observe((now - first) / (out - 1))
            self.prompt_hist.observe(seq.num_prompt)
            self.gen_hist.observe(out)
            self.success.labels(self.model_name, seq.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatsCollector:
    """Series read from the engine's stats at scrape time."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        m = self.m
        st = m.engine.stats()
        name = [m.model_name]

        def gauge(n, help_, value, extra=None):
            g = GaugeMetricFamily(P + n, help_, labels=["model_name"] + list(extra or {}))
            g.add_metric(name + list((extra or {}).values()), value)
            return g

        def counter(n, help_, value):
            c = CounterMetricFamily(P + n, help_, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("num_requests_running", "Requests running (prefilled, decoding).", st.get("running", 0))
        yield gauge("num_requests_waiting", "Requests waiting for admission.", st.get("waiting", 0))
        pool = st.get("pool_pages") or {}
        total = pool.get("total", 0)
        used = total - pool.get("free", 0)
        yield gauge("kv_cache_usage_perc", "Share of KV pool pages in use (1 = full), cached content included.",
                    used / total if total else 0.0)
        g = GaugeMetricFamily(P + "kv_pool_pages", "SegPaged KV pool pages in use, by the owner head's class.",
                              labels=["model_name", "head_class"])
        b = GaugeMetricFamily(P + "kv_pool_bytes", "SegPaged KV pool bytes in use, by the owner head's class.",
                              labels=["model_name", "head_class"])
        for c in ("global", "local"):
            g.add_metric(name + [c], pool.get(c, 0))
            b.add_metric(name + [c], pool.get(c, 0) * st.get("page_bytes", 0))
        yield g
        yield b
        yield gauge("kv_pool_total_pages", "SegPaged KV pool size in pages.", total)
        yield gauge("kv_request_bytes", "Bytes of KV pages in use, cached prefixes and chunks included.",
                    st.get("kv_bytes", 0))
        yield counter("num_preemptions", "Requests preempted (pages freed, re-queued).", st.get("preemptions", 0))
        # prefix cache: vLLM's queries/hits counters in tokens (hit rate = hits / queries)
        pc = getattr(m.engine.engine, "prefix_cache", None)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", pc.queries if pc else 0)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      st.get("prefix_cache_hit_tokens", 0))
        chunk = st.get("chunk_cache") or {}
        yield counter("chunk_cache_queries", "Document chunks looked up in the chunk cache.",
                      chunk.get("hits", 0) + chunk.get("misses", 0))
        yield counter("chunk_cache_hits", "Document chunks found in the chunk cache.", chunk.get("hits", 0))
        yield gauge("chunk_cache_pages", "Pool pages cached document KV holds.", chunk.get("pages", 0))
        yield gauge("prefix_cache_pages", "Pool pages the prefix cache references.", st.get("prefix_cache_pages", 0))
        yield from _tier_series(name, chunk.get("tiers"))
        yield from _pd_series(name, st, m.pd)
        yield counter("request_errors", "Requests that failed inside the server (5xx).", m.errors())
        yield counter("requests_abandoned_before_prefill", "Requests whose client left while they were queued.",
                      st.get("abandoned_before_prefill", 0))
        yield counter("host_heap_trims", "Times freed host memory went back to the OS as the engine went idle.",
                      st.get("heap_trims", 0))
        yield gauge("host_resident_bytes", "The server process's resident set size.", resident_bytes())


_TIER_COUNTERS = (("hits", "Document KV reads a tier served (whole or per head)."),
                  ("misses", "Document KV reads a tier did not hold."),
                  ("rejected", "Tier entries read back corrupt or mismatched: dropped and recomputed."),
                  ("errors", "Tier operations that failed (I/O, connection)."),
                  ("skipped", "Tier operations not tried (tier disabled or unreachable)."),
                  ("bytes_read", "Payload bytes read from a tier."),
                  ("bytes_written", "Payload bytes written to a tier."))


def _tier_series(name: list, tiers: dict | None):
    """The document-KV tiers' counters and sizes (``kv_tier_*{tier=...}``), when tiers are configured."""
    if not tiers:
        return
    names = [t for t in ("cpu", "disk", "redis") if t in tiers]
    for key, help_ in _TIER_COUNTERS:
        c = CounterMetricFamily(P + f"kv_tier_{key}", help_, labels=["model_name", "tier"])
        for t in names:
            c.add_metric(name + [t], tiers[t].get(key, 0))
        yield c
    g = GaugeMetricFamily(P + "kv_tier_bytes", "Bytes a tier holds (this process's view).", labels=["model_name", "tier"])
    for t in names:
        if "bytes" in tiers[t]:
            g.add_metric(name + [t], tiers[t]["bytes"])
    yield g
    loads = CounterMetricFamily(P + "kv_tier_loads", "Pool misses served by loading document KV from a tier.",
                                labels=["model_name", "tier"])
    for t, n in (tiers.get("hits") or {}).items():
        loads.add_metric(name + [t], n)
    yield loads
    for key, help_ in (("downs_dropped", "Write-downs dropped because their queue was full."),):
        c = CounterMetricFamily(P + f"kv_tier_{key}", help_, labels=["model_name"])
        c.add_metric(name, tiers.get(key, 0))
        yield c
    loader = tiers.get("loader")
    if loader:  # asynchronous loads: what per-head fetches read against what the entries hold
        for key, help_ in (("bytes_fetched", "Payload bytes asynchronous loads read (only heads the request sees)."),
                           ("bytes_whole", "Payload bytes of the same entries, every head counted."),
                           ("timed_out", "Asynchronous loads given up (the documents were computed).")):
            c = CounterMetricFamily(P + f"kv_tier_load_{key}", help_, labels=["model_name"])
            c.add_metric(name, loader.get(key, 0))
            yield c


def _pd_series(name: list, st: dict, pd):
    """Pages held by requests and leases, and prefill/decode disaggregation's handoffs (``pd_*``)."""
    g = GaugeMetricFamily(P + "kv_pool_held_pages", "Pool pages held by requests and PD leases (not the caches).",
                          labels=["model_name"])
    g.add_metric(name, st.get("held_pages", 0))
    yield g
    leases = st.get("leases") or {}
    for key, help_ in (("active", "Prefilled requests whose pages wait for a decode instance's pull."),
                       ("pages", "Pool pages those leases hold.")):
        g = GaugeMetricFamily(P + ("pd_leases" if key == "active" else "pd_lease_pages"), help_, labels=["model_name"])
        g.add_metric(name, leases.get(key, 0))
        yield g
    for key, help_ in (("pulled", "Leases a decode instance pulled."),
                       ("expired", "Leases that expired unpulled (their pages freed).")):
        c = CounterMetricFamily(P + f"pd_leases_{key}", help_, labels=["model_name"])
        c.add_metric(name, leases.get(key, 0))
        yield c
    if pd is None:
        return
    s = pd.stats()
    for side, key in (("sent", "bytes_sent"), ("received", "bytes_received")):
        c = CounterMetricFamily(P + f"pd_kv_bytes_{side}", f"KV handoff bytes {side}, by head class.",
                                labels=["model_name", "head_class"])
        for cls in ("global", "local", "retrieval"):
            c.add_metric(name + [cls], (s.get(side) or {}).get(f"bytes_{cls}", 0))
        yield c
    c = CounterMetricFamily(P + "pd_transfers", "KV handoffs, by side and result.",
                            labels=["model_name", "side", "result"])
    sent, got = s.get("sent") or {}, s.get("received") or {}
    c.add_metric(name + ["sent", "ok"], sent.get("transfers", 0))
    c.add_metric(name + ["sent", "failed"], sent.get("failed", 0))
    c.add_metric(name + ["received", "ok"], got.get("transfers", 0))
    c.add_metric(name + ["received", "failed"], got.get("failed", 0) - got.get("rejected", 0))
    c.add_metric(name + ["received", "rejected"], got.get("rejected", 0))
    yield c
    for key, help_ in (("recomputed", "Decode legs computed here after their handoff failed (policy recompute)."),
                       ("refused", "Decode legs answered 503 after their handoff failed (policy fail).")):
        c = CounterMetricFamily(P + f"pd_{key}", help_, labels=["model_name"])
        c.add_metric(name, s.get(key, 0))
        yield c
