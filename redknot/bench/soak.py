"""`redknot bench soak`: a server under mixed, partly hostile clients for minutes on end.

Starts ``redknot serve``'s app on loopback (the bundled model on the CPU unless ``--model``/``--arch``
say otherwise) and the clients in a process of their own, times normal clients alone first, then
runs for ``--minutes`` with, at once: normal streaming clients (chat with two documents from a shared pool of 16, each document sent
once before any timing, so both runs time cached documents), slow readers (a long
stream they stop reading), body tricklers (half a body, then silence), disconnectors (leave after
the first chunk), long prompts, and requests of many small documents; a prober hits ``/health``
every second and a sampler records the process's resident memory and the pool every few seconds.

The mix is a load the server should carry, not an overload: normal clients pause between requests
(``--think-s``, exponential), the long-prompt and many-documents clients send one request every
``--heavy-interval-s`` and the disconnector every ``--disconnect-interval-s``; the hostile kinds
(slow readers, tricklers, disconnectors) keep at the server throughout. Resident memory, the pool
and the running/waiting counts are sampled so an overloaded run shows as one (waiting > 0 throughout).

What it checks (the server-hardening targets): no 5xx, ``/health`` under a second, the normal
clients' TTFT p99 within 2x the unloaded run (reported beside the queueing floor: the p99 an ideal
server would reach at the run's load of two-document requests, ``queue_floor``), every pool page
back to free or cached once the clients stop, and resident memory flat (every sample within 10% of
the middle of its range) over the last two thirds of the run: sampled at an instant every 5 s,
and as each 5-s window's floor (a leak or creep raises the floor; the instant also catches a
forward's live activations).
Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import socket
import threading
import time

from .percentile import percentile as _pct
from .queue_floor import Client, floor_p99

WORDS = ("amber river city founded merchant salt trade north harbour tower bridge market guild winter "
         "summer record ledger captain ship coast island valley mill stone road king queen council").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled testbed model)")
    p.add_argument("--arch", default=None, help="a random-weight architecture of bench decode instead (GPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the engine's token budget per step (the server's flag): a smaller one bounds how long "
                        "a long prompt's chunk holds a step")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="the server's flag: KV pool pages (default: sized by the engine, 256 MiB on the CPU)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="the server's flag: a long prompt's chunk at most this many tokens while other work runs")
    p.add_argument("--normal-clients", type=int, default=4)
    p.add_argument("--think-s", type=float, default=2.0,
                   help="normal clients' mean pause between requests (exponential; 0: back to back)")
    p.add_argument("--heavy-interval-s", type=float, default=60.0,
                   help="pause between the long-prompt client's requests, and between the many-documents client's")
    p.add_argument("--disconnect-interval-s", type=float, default=5.0, help="pause between the disconnector's requests")
    p.add_argument("--method", default="auto", help="the server's default method (redknot serve's --method)")
    p.add_argument("--long-prompt-words", type=int, default=1000, help="words of the long-prompt client's prompt")
    p.add_argument("--small-documents", type=int, default=128, help="documents per small-documents request")
    p.add_argument("--write-timeout", type=float, default=5.0, help="the server's --write-timeout")
    p.add_argument("--read-timeout", type=float, default=5.0, help="the server's --read-timeout")
    p.add_argument("--limit-concurrency", type=int, default=32)
    p.add_argument("--unloaded-requests", type=int, default=100,
                   help="requests the unloaded run times at least (a p99 needs 100), within the run's length "
                        "and 10 minutes")
    p.add_argument("--only-normal", action="store_true",
                   help="the normal clients and the /health prober alone: what the normal load costs itself "
                        "(the control a loaded run's tail is read against)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)


class _Soak:
    """The clients, each a thread looping until ``stop``; what they saw goes into ``self.log``."""

    def __init__(self, base: str, model: str, args, rng: random.Random):
        import httpx

        self.base, self.model, self.args = base, model, args
        self.docs = [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(120)) for i in range(16)]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.log = {"status": {}, "ttft_s": [], "ttft_at": [], "heavy": [], "health_s": [], "errors": []}
        self.t0 = time.time()  # the loaded run's start (ttft_at: each request's start after it)
        self.client = lambda: httpx.Client(base_url=base, timeout=120, trust_env=False)
        self.host, self.port = base.split("//")[1].split(":")

    def _count(self, kind: str, status) -> None:
        with self.lock:
            key = f"{kind}:{status}"
            self.log["status"][key] = self.log["status"].get(key, 0) + 1

    def _heavy(self, kind: str, start: float) -> None:
        """When a heavy request ran (s into the loaded run), to set beside the slowest first tokens."""
        with self.lock:
            self.log["heavy"].append([kind, round(start - self.t0, 2), round(time.time() - start, 2)])

    def _chat(self, rng, max_tokens=8, documents=None, **extra) -> dict:
        docs = documents if documents is not None else rng.sample(self.docs, 2)
        return {"model": self.model, "messages": [{"role": "user", "content": f"Which city is named in doc {rng.randrange(9)}?"}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True, "documents": docs, **extra}

    def _pause(self, rng, mean: float) -> None:
        """Wait a client's think time (exponential around ``mean``; returns early on stop)."""
        if mean > 0:
            self.stop.wait(rng.expovariate(1.0 / mean))

    def normal(self, seed: int, record: bool = True) -> None:
        rng, c = random.Random(seed), self.client()
        while not self.stop.is_set():
            self._pause(rng, self.args.think_s)
            if self.stop.is_set():
                break
            t0 = time.perf_counter()
            try:
                with c.stream("POST", "/v1/chat/completions", json=self._chat(rng)) as r:
                    first = None
                    for line in r.iter_lines():
                        if first is None and line.startswith("data:"):
                            first = time.perf_counter() - t0
                    self._count("normal", r.status_code)
                if record and first is not None and r.status_code == 200:
                    with self.lock:
                        self.log["ttft_s"].append(first)
                        self.log["ttft_at"].append(round(time.time() - first - self.t0, 2))
            except Exception as e:  # noqa: BLE001  (a client-side failure is a finding, not a crash)
                self._count("normal", type(e).__name__)

    def slow_reader(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            body = json.dumps(self._chat(rng, max_tokens=4096, ignore_eos=True)).encode()
            try:
                with socket.create_connection((self.host, int(self.port)), timeout=60) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                    self.stop.wait(self.args.write_timeout * 3)  # reads nothing: the server must cut it off
                self._count("slow_reader", "done")
            except OSError as e:
                self._count("slow_reader", type(e).__name__)

    def trickler(self, seed: int) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection((self.host, int(self.port)), timeout=60) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 400\r\n\r\n{\"model\":")
                    s.settimeout(self.args.read_timeout * 3)
                    closed = s.recv(1) == b""  # the read timeout closes it
                self._count("trickler", "closed" if closed else "answered")
            except OSError as e:
                self._count("trickler", type(e).__name__)

    def disconnector(self, seed: int) -> None:
        rng, c = random.Random(seed), self.client()
        while not self.stop.is_set():
            try:
                with c.stream("POST", "/v1/chat/completions", json=self._chat(rng, max_tokens=256, ignore_eos=True)) as r:
                    self._count("disconnector", r.status_code)
                    next(r.iter_lines(), None)  # the first chunk, then leave
            except Exception as e:  # noqa: BLE001
                self._count("disconnector", type(e).__name__)
            self.stop.wait(self.args.disconnect_interval_s)

    def long_prompt_body(self, rng: random.Random) -> dict:
        prompt = " ".join(rng.choice(WORDS) for _ in range(self.args.long_prompt_words))
        return {"model": self.model, "prompt": prompt, "max_tokens": 4, "method": "dense"}

    def small_documents_body(self, rng: random.Random) -> dict:
        docs = [rng.choice(WORDS) for _ in range(self.args.small_documents)]
        return {**self._chat(rng, documents=docs), "stream": False}

    def long_prompt(self, seed: int) -> None:
        rng, c = random.Random(seed), self.client()
        while not self.stop.is_set():
            try:
                t0 = time.time()
                r = c.post("/v1/completions", json=self.long_prompt_body(rng))
                self._count("long_prompt", r.status_code)
                self._heavy("long_prompt", t0)
            except Exception as e:  # noqa: BLE001
                self._count("long_prompt", type(e).__name__)
            self.stop.wait(self.args.heavy_interval_s)

    def small_documents(self, seed: int) -> None:
        rng, c = random.Random(seed), self.client()
        self.stop.wait(self.args.heavy_interval_s / 2)  # between the long prompts, not with them
        while not self.stop.is_set():
            try:
                t0 = time.time()
                r = c.post("/v1/chat/completions", json=self.small_documents_body(rng))
                self._count("small_documents", r.status_code)
                self._heavy("small_documents", t0)
            except Exception as e:  # noqa: BLE001
                self._count("small_documents", type(e).__name__)
            self.stop.wait(self.args.heavy_interval_s)

    def health(self, seed: int) -> None:
        c = self.client()
        while not self.stop.wait(1.0):
            t0 = time.perf_counter()
            try:
                status = c.get("/health").status_code
            except Exception as e:  # noqa: BLE001
                status = type(e).__name__
            with self.lock:
                self.log["health_s"].append(time.perf_counter() - t0)
            self._count("health", status)


def _warm_documents(soak: _Soak) -> None:
    """One request per pair of the shared documents, unrecorded: the unloaded and the loaded runs
    then both time requests whose documents are cached (a cold document's first use is timed by
    neither)."""
    c = soak.client()
    for i in range(0, len(soak.docs), 2):
        body = {**soak._chat(random.Random(i), documents=soak.docs[i:i + 2]), "stream": False}
        c.post("/v1/chat/completions", json=body).raise_for_status()


def _warm_heavy(soak: _Soak) -> None:
    """One long prompt and one many-documents request, unrecorded: the shapes a server compiles
    (kernels, graphs) on their first use are compiled before any timing, as after a deployment's
    first minutes."""
    c, rng = soak.client(), random.Random(-1)
    c.post("/v1/completions", json=soak.long_prompt_body(rng)).raise_for_status()
    c.post("/v1/chat/completions", json=soak.small_documents_body(rng)).raise_for_status()


def _unloaded_ttft(soak: _Soak, seconds: float, min_requests: int, max_seconds: float) -> list[float]:
    """One normal client alone for ``seconds`` and until it has timed ``min_requests`` requests
    (``max_seconds`` at most): the first-token times the loaded run's are set against."""
    _warm_documents(soak)
    _warm_heavy(soak)
    soak.stop.clear()
    t = threading.Thread(target=soak.normal, args=(10_000,))
    t.start()
    start = time.time()
    while time.time() - start < max_seconds and (
            time.time() - start < seconds or len(soak.log["ttft_s"]) < min_requests):
        time.sleep(0.1)
    soak.stop.set()
    t.join()
    ttft = list(soak.log["ttft_s"])
    soak.log["ttft_s"].clear()
    soak.log["ttft_at"].clear()
    soak.log["status"].clear()
    return ttft


def _llm(args):
    from ..engine import LLM

    if args.arch is None:
        return LLM(model=args.model, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
                   long_prefill_token_threshold=args.long_prefill_token_threshold, kv_pages=args.kv_pages)
    import torch

    from ..models import ModelConfig
    from .common import ARCHS

    cfg = ModelConfig.from_dict(dict(ARCHS[args.arch]))
    dev = torch.device(args.device or "cuda")
    return LLM(model=cfg, device=str(dev), kv_pages=args.kv_pages,
               max_num_batched_tokens=args.max_num_batched_tokens,
               long_prefill_token_threshold=args.long_prefill_token_threshold)


def _clients(base: str, model: str, args, conn) -> None:
    """The clients' process: the unloaded run (its first tokens sent back), then every client from
    "go" to "stop", then what they saw (the log)."""
    soak = _Soak(base, model, args, random.Random(args.seed))
    run_s = args.minutes * 60
    # a minute and --unloaded-requests at least (a p99 over a few requests is one request's time),
    # no longer than the run or 10 minutes
    conn.send(_unloaded_ttft(soak, max(min(60.0, run_s), run_s * 0.05), args.unloaded_requests, min(600.0, run_s)))
    conn.recv()
    soak.stop.clear()
    soak.t0 = time.time()
    hostile = [soak.slow_reader, soak.trickler, soak.trickler, soak.disconnector, soak.long_prompt,
               soak.small_documents]
    roles = [soak.normal] * args.normal_clients + ([] if args.only_normal else hostile) + [soak.health]
    threads = [threading.Thread(target=f, args=(i,), daemon=True) for i, f in enumerate(roles)]
    for t in threads:
        t.start()
    conn.recv()
    soak.stop.set()
    for t in threads:
        t.join(timeout=args.write_timeout * 4 + 60)
    conn.send(soak.log)


def _receive(conn, proc, timeout: float):
    """The clients' next message; raises when their process has died or does not answer in time."""
    end = time.time() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive() or time.time() > end:
            raise RuntimeError(f"the soak's client process {'died' if not proc.is_alive() else 'did not answer'} "
                               f"(exit code {proc.exitcode})")
    return conn.recv()


def run(args: argparse.Namespace) -> dict:
    import multiprocessing

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.host_memory import resident_bytes
    from ..serve.background import BackgroundServer
    from ..serve.cli import set_default_method

    llm = _llm(args)
    set_default_method(llm, args.method)  # as redknot serve does: documents are reused out of the box
    engine = AsyncLLMEngine(llm)
    srv = BackgroundServer(engine, "m", server_kw=dict(limit_concurrency=args.limit_concurrency,
                                                       read_timeout=args.read_timeout,
                                                       write_timeout=args.write_timeout))
    # the clients run in a process of their own, as a deployment's do: their threads never hold
    # the server's interpreter lock while it schedules a step
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # picklable
    proc = ctx.Process(target=_clients, args=(srv.base, "m", plain, child), daemon=True)
    proc.start()
    try:
        unloaded = _receive(conn, proc, 900.0)
        conn.send("go")
        t0 = time.time()
        busy0 = _engine_busy(llm.engine)
        samples = []
        while time.time() - t0 < args.minutes * 60:
            # resident memory every 0.25 s: each sample keeps the window's floor and peak beside the
            # instant (the floor is what the process holds between forwards, the peak adds a
            # forward's live activations)
            window, end = [], time.time() + min(5.0, max(0.5, args.minutes * 60 / 60))
            while time.time() < end:
                window.append(resident_bytes())
                time.sleep(0.25)
            st = engine.stats()
            samples.append({"t_s": round(time.time() - t0, 1), "rss_bytes": window[-1], "rss_floor_bytes": min(window),
                            "rss_peak_bytes": max(window), "loadavg_1m": _loadavg(),
                            "pool_pages": st["pool_pages"], "running": st["running"], "waiting": st["waiting"],
                            "heap_trims": st["heap_trims"], "heap_trim_s": round(st["heap_trim_seconds"], 4),
                            # document lookups so far: a miss after the warm-up is a document evicted
                            "chunk_cache": {k: st["chunk_cache"][k] for k in ("entries", "hits", "misses", "evictions")},
                            "queue": _queue_view(llm.engine)})
        conn.send("stop")
        busy = {k: v - busy0[k] for k, v in _engine_busy(llm.engine).items()}
        busy["wall_s"] = time.time() - t0
        log = _receive(conn, proc, args.write_timeout * 4 * 8 + 120)
        proc.join(timeout=30)
        deadline = time.time() + 60
        while not llm.engine.idle() and time.time() < deadline:
            time.sleep(0.1)
        pages_back = llm.engine.idle()
    finally:
        if proc.is_alive():
            proc.terminate()
        srv.stop()
    return _report(args, log, unloaded, samples, pages_back, busy)


def _queue_view(engine) -> dict:
    """What runs and what heads the queue (method, prompt tokens, computed, max_tokens): read
    from another thread without a lock, for the record only (a race reads an empty view)."""
    def view(s):
        return [s.method, s.num_prompt, s.num_computed, s.params.max_tokens]
    try:
        waiting = list(engine.scheduler.waiting)[:1]
        return {"running": [view(s) for s in list(engine.scheduler.running)], "head": [view(s) for s in waiting],
                "committed_pages": engine.scheduler.committed}
    except Exception:  # noqa: BLE001  (a list changed size under us)
        return {}


def _engine_busy(engine) -> dict:
    """The engine's step count and the seconds its steps took so far (its phases' sum)."""
    t = dict(engine.timings)
    return {"steps": t["steps"], "busy_s": sum(v for k, v in t.items() if k != "steps")}


def _outside_heavy(log) -> list[float]:
    """The normal clients' first-token times whose wait overlapped no long-prompt or many-documents
    request: what the normal traffic costs itself, apart from the heavy requests' steps."""
    windows = [(start, start + seconds) for _, start, seconds in log["heavy"]]
    return [t for t, at in zip(log["ttft_s"], log["ttft_at"])
            if not any(a < at + t and at < b for a, b in windows)]


def _loadavg() -> float:
    """The machine's 1-minute load average (other processes' work shows in it), or -1."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def _command(args) -> str:
    """The run as a command line, every option spelled out (what reproduces it)."""
    own = argparse.ArgumentParser(add_help=False)
    add_arguments(own)
    parts = ["redknot bench soak"]
    for action in own._actions:
        value = getattr(args, action.dest, None)
        if isinstance(value, bool):  # a switch: named when on
            parts += [action.option_strings[0]] if value else []
        elif value is not None:
            parts.append(f"{action.option_strings[0]} {value}")
    return " ".join(parts)


def _environment() -> dict:
    import os
    import platform

    import torch

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "redknot": __version__}


def _spread(xs) -> float:
    """Largest over smallest, less one."""
    return max(xs) / min(xs) - 1 if xs and min(xs) else float("nan")


def _band(xs) -> float:
    """Half the range over its middle: every value lies within this share of the middle."""
    return (max(xs) - min(xs)) / (max(xs) + min(xs)) if xs and max(xs) else float("nan")


def _growth(xs) -> float:
    """The last third's median over the middle third's, less one (a creep, apart from swings)."""
    n = len(xs) // 3
    if n == 0:
        return float("nan")
    middle, last = sorted(xs[n:2 * n]), sorted(xs[2 * n:])
    return last[len(last) // 2] / middle[len(middle) // 2] - 1


def _floor_clients(args) -> list[Client]:
    """The clients whose requests are a normal one's shape (two documents), for the queueing floor:
    the normal clients (timed), and unless ``--only-normal`` the disconnector (a fixed pause after
    its first chunk) and the slow reader (a new request every three write timeouts)."""
    normal = [Client(args.think_s)] * args.normal_clients
    if args.only_normal:
        return normal
    return normal + [Client(args.disconnect_interval_s, exponential=False),
                     Client(args.write_timeout * 3, exponential=False)]


def _report(args, log, unloaded, samples, pages_back, busy) -> dict:
    fivexx = sum(n for k, n in log["status"].items() if k.split(":")[1].isdigit() and int(k.split(":")[1]) >= 500)
    tail = samples[len(samples) // 3:] or samples
    rss = [s["rss_bytes"] for s in tail]
    floor = [s["rss_floor_bytes"] for s in tail]
    rss_spread, floor_spread = _spread(rss), _spread(floor)
    rss_band, floor_band = _band(rss), _band(floor)
    p99_loaded, p99_idle = _pct(log["ttft_s"], 0.99), _pct(unloaded, 0.99)
    quiet = _outside_heavy(log)
    p99_quiet = _pct(quiet, 0.99)
    p99_floor = float("nan")
    if unloaded and args.normal_clients > 0:
        p99_floor = floor_p99(unloaded, _floor_clients(args), args.normal_clients, seed=args.seed)
    out = {
        "date": datetime.date.today().isoformat(), "command": _command(args),
        "environment": _environment(), "minutes": args.minutes, "model": args.model or args.arch or "bundled",
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold, "method": args.method,
        "kv_pages": samples[-1]["pool_pages"]["total"] if samples else None,
        "statuses": log["status"], "server_errors_5xx": fivexx,
        "health_max_s": max(log["health_s"], default=float("nan")),
        "ttft_unloaded_p50_s": _pct(unloaded, 0.5), "ttft_unloaded_p99_s": p99_idle,
        "ttft_loaded_p50_s": _pct(log["ttft_s"], 0.5), "ttft_loaded_p90_s": _pct(log["ttft_s"], 0.9),
        "ttft_loaded_p99_s": p99_loaded, "ttft_unloaded_n": len(unloaded),
        "ttft_unloaded_s": [round(x, 4) for x in unloaded],
        "ttft_floor_p99_s": p99_floor, "ttft_floor_p99_ratio": p99_floor / p99_idle if p99_idle else float("nan"),
        # the slowest first tokens and when (s into the loaded run) their requests started
        "ttft_slowest": sorted(zip(log["ttft_s"], log["ttft_at"]), reverse=True)[:20],
        "heavy_requests": log["heavy"],  # [kind, start s, seconds]
        "ttft_p99_ratio": p99_loaded / p99_idle if p99_idle else float("nan"),
        # the same requests apart from those that waited beside a heavy one: the rest of the tail
        # is the normal traffic queueing behind itself
        "ttft_outside_heavy_n": len(quiet), "ttft_outside_heavy_p99_s": p99_quiet,
        "ttft_outside_heavy_p99_ratio": p99_quiet / p99_idle if p99_idle and quiet else float("nan"),
        # the share of the loaded run the engine spent in steps (1.0: saturated, a request always
        # waits for a step under way), and its mean step
        "engine_busy_share": busy["busy_s"] / busy["wall_s"] if busy["wall_s"] else float("nan"),
        "engine_steps": busy["steps"], "engine_step_mean_ms": 1000 * busy["busy_s"] / max(busy["steps"], 1),
        # the share of the run the normal requests' own work takes (their count times the unloaded
        # median first token, over the run): a request arriving while another's recovery runs waits
        # for it, so the tail grows with this share whatever else the server carries
        "normal_load_share": len(log["ttft_s"]) * _pct(unloaded, 0.5) / busy["wall_s"] if busy["wall_s"] else float("nan"),
        "only_normal": bool(args.only_normal),
        "normal_requests": len(log["ttft_s"]), "pool_pages_back": pages_back,
        "rss_spread_last_two_thirds": rss_spread, "rss_floor_spread_last_two_thirds": floor_spread,
        # "flat (±10%)": every sample within 10% of the middle of its range; the creep: the last
        # third's median over the middle third's
        "rss_band_last_two_thirds": rss_band, "rss_floor_band_last_two_thirds": floor_band,
        "rss_growth_last_third": _growth([s["rss_bytes"] for s in samples]),
        "rss_mib_last_two_thirds": [min(rss) >> 20, max(rss) >> 20] if rss else [],
        "rss_floor_mib_last_two_thirds": [min(floor) >> 20, max(floor) >> 20] if floor else [],
        "waiting_share_of_samples": sum(s["waiting"] > 0 for s in samples) / max(len(samples), 1),
        "loadavg_1m_mean_max": [round(sum(s["loadavg_1m"] for s in samples) / max(len(samples), 1), 2),
                                max((s["loadavg_1m"] for s in samples), default=-1.0)],
        "heap_trims": samples[-1]["heap_trims"] if samples else 0,
        "heap_trim_mean_ms": 1000 * samples[-1]["heap_trim_s"] / max(samples[-1]["heap_trims"], 1) if samples else 0,
        "samples": samples,
    }
    out["checks"] = {"no_5xx": fivexx == 0, "health_under_1s": out["health_max_s"] < 1.0,
                     "ttft_p99_within_2x": out["ttft_p99_ratio"] <= 2.0, "pages_back": pages_back,
                     "rss_flat_10pct": rss_band <= 0.10, "rss_floor_flat_10pct": floor_band <= 0.10}
    print(f"soak {args.minutes:g} min: {out['normal_requests']} normal requests, statuses {log['status']}")
    print(f"requests waiting in {out['waiting_share_of_samples']:.0%} of samples; {out['heap_trims']} heap trims, "
          f"{out['heap_trim_mean_ms']:.1f} ms each")
    print(f"resident memory, last two thirds: {out['rss_mib_last_two_thirds']} MiB (largest over smallest "
          f"{rss_spread:.1%}); last third's median {out['rss_growth_last_third']:+.1%} over the middle third's")
    print(f"engine busy {out['engine_busy_share']:.0%} of the run ({out['engine_steps']} steps, "
          f"{out['engine_step_mean_ms']:.1f} ms each); TTFT p99 outside heavy requests "
          f"{out['ttft_outside_heavy_p99_ratio']:.2f}x unloaded ({out['ttft_outside_heavy_n']} requests); "
          f"the normal requests' own work {out['normal_load_share']:.0%} of the run")
    print(f"queueing floor: the two-document requests one at a time with no other work would reach TTFT p99 "
          f"{p99_floor:.3f} s, {out['ttft_floor_p99_ratio']:.2f}x unloaded (measured {out['ttft_p99_ratio']:.2f}x)")
    print(f"{'check':<22} {'value':>14} {'ok':>4}")
    rows = [("5xx", fivexx, "no_5xx"), ("/health max s", f"{out['health_max_s']:.3f}", "health_under_1s"),
            ("TTFT p99 / unloaded", f"{out['ttft_p99_ratio']:.2f}", "ttft_p99_within_2x"),
            ("pool pages back", pages_back, "pages_back"),
            ("RSS band (last 2/3)", f"±{rss_band:.1%}", "rss_flat_10pct"),
            ("RSS floor band", f"±{floor_band:.1%}", "rss_floor_flat_10pct")]
    for name, value, check in rows:
        print(f"{name:<22} {str(value):>14} {'yes' if out['checks'][check] else 'NO':>4}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out
