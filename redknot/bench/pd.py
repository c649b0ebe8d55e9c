"""``redknot bench pd``: what prefill/decode disaggregation moves and what it buys.

Bytes (any device; the CPU test runs it on the tiny arch): for each head plan (dense, then each
``--head-configs`` entry as headsparse) and prompt length, one random-weight engine prefills a
prompt of random tokens as a prefill leg, a KV client pulls the lease over the real transport
(TCP, loopback) and the same engine adopts it as a decode leg and generates ``--decode-tokens``.
Reported: the bytes the KV server actually sent (its counters, by head class), their share of
the dense plan's bytes at the same length, the pages the decode side holds, the pull's seconds,
and whether the decode leg's tokens equal a colocated run's (``--check``).

Load (``--load``; GPU, two processes): a prefill and a decode server process of this benchmark
(``--serve ROLE``, random weights seeded alike) and, separately, one colocated server. While
``--streams`` clients stream short requests (their inter-token latency is measured at the
client), ``--long-prompts`` prompts of ``--long-tokens`` tokens arrive every ``--interval`` s,
through the PD flow (prefill leg, then decode leg with the response's kv_transfer_params, as
vllm-router does) or to the colocated server. Reported: TTFT of the long prompts and the transfer's
share of it (the decode leg's usage.kv_transfer.seconds), and the streams' inter-token latency
p50/p99 in both set-ups.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import torch

from .percentile import percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="mistral-7b", help="random-weight architecture (bench/common.py ARCHS)")
    p.add_argument("--head-configs", default="g15-w1024",
                   help="comma list: gPERCENT-wWINDOW synthetic plans, or 'anchor' (--anchor-head-config)")
    p.add_argument("--anchor-head-config", default=None, help="the anchor head config JSON")
    p.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths (tokens)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--retrieval-heads", action="store_true",
                   help="serve a head config's retrieval heads with selected sets (else as global heads)")
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--check", action="store_true", help="compare the decode leg's tokens with a colocated run")
    p.add_argument("--kv-pages", type=int, default=None, help="pool pages (default: sized from the device)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load (two server processes on the device, then one colocated)")
    g.add_argument("--load", action="store_true", help="also run the load comparison")
    g.add_argument("--load-plan", default=None, help="the head config of the load run (default: the first)")
    g.add_argument("--transport", default="tcp", choices=("tcp", "cuda_ipc", "nixl"), help="PD data path of the load run")
    g.add_argument("--streams", type=int, default=8, help="clients streaming short requests")
    g.add_argument("--stream-prompt", type=int, default=512)
    g.add_argument("--stream-tokens", type=int, default=256)
    g.add_argument("--long-tokens", type=int, default=32768)
    g.add_argument("--long-prompts", type=int, default=6)
    g.add_argument("--interval", type=float, default=4.0, help="seconds between long prompts")
    g.add_argument("--ttft-lengths", default="8192,32768", help="TTFT through the PD path, one at a time, idle")
    g.add_argument("--serve", default=None, choices=("prefill", "decode", "both"), help=argparse.SUPPRESS)
    g.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results JSON (default: $OUT/pd.json or ./pd.json)")


def _llm(args, head: str | None):
    from ..engine import LLM
    from ..models.config import ModelConfig
    from .common import ARCHS, head_config

    cfg = ModelConfig.from_dict(ARCHS[args.arch])
    torch.manual_seed(args.seed)  # two processes build the same random weights (and fingerprint)
    hc = head_config(head, cfg, args.anchor_head_config) if head else None
    longest = max(int(x) for x in args.lengths.split(",")) + args.decode_tokens + 64
    return LLM(model=cfg, head_config=hc, device=args.device, page_size=args.page_size, kv_pages=args.kv_pages,
               max_model_len=min(cfg.max_position_embeddings, max(longest, args.long_tokens + 1024)),
               gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(16, args.streams + 4),
               retrieval_heads=args.retrieval_heads)


def _sp(n: int, first_logits: bool = False):
    from ..engine.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, return_first_logits=first_logits)


def _handoff(llm, server, client, ids: list[int], method: str, n: int):
    """One prompt through export -> pull -> adopt in one engine; (transfer report, decode tokens)."""
    from ..engine import handoff

    eng = llm.engine
    seq = llm.make_sequence(ids, _sp(1, True), method=method)
    seq.kv_export = uuid.uuid4().hex
    eng.add_request(seq)
    while eng.has_unfinished():
        eng.step()
    dec = llm.make_sequence(ids, _sp(n), method=method)
    before = dict(server.stats)
    got = client.pull({"remote_host": "127.0.0.1", "remote_port": server.port, "remote_request_id": seq.kv_export},
                      handoff.expectation(eng, dec))
    # what the KV server counted as it sent (its counters, by the class of each page's head)
    sent = {k: server.stats[k] - before[k] for k in before}
    report = dict(got.transfer, bytes_sent=sent["bytes_sent"], pool_plan=got.header.plan,
                  bytes_by_head_class={c: sent[f"bytes_{c}"] for c in ("global", "local", "retrieval")},
                  dense_pages=eng.pool.num_layers * eng.pool.num_kv_heads * got.held.shape[2])
    dec.kv_import = got
    del got
    eng.add_request(dec)
    while eng.has_unfinished():
        eng.step()
    eng.collect_leases()
    report["decode_pages_held"] = dec.pages_at_finish
    return report, dec.output_token_ids


def run_bytes(args) -> list[dict]:
    from ..pd.transfer import KVClient, KVServer

    rows = []
    lengths = [int(x) for x in args.lengths.split(",")]
    plans = [(None, "dense")] + [(h, "headsparse") for h in args.head_configs.split(",") if h]
    rng = random.Random(args.seed)
    dense_bytes: dict[int, int] = {}
    for head, method in plans:
        llm = _llm(args, head or (plans[1][0] if len(plans) > 1 else None))
        server, client = KVServer(llm.engine.leases), KVClient(device=llm.engine.device)
        try:
            for n in lengths:
                ids = [rng.randrange(3, llm.config.vocab_size) for _ in range(n)]
                report, tokens = _handoff(llm, server, client, ids, method, args.decode_tokens)
                row = {"plan": head or "dense", "method": method, "tokens": n, **report}
                if method == "dense":
                    dense_bytes[n] = report["bytes_sent"]
                row["ratio_to_dense"] = report["bytes_sent"] / dense_bytes[n] if n in dense_bytes else None
                if args.check:
                    ref = llm.generate(ids, _sp(args.decode_tokens), method=method)[0].outputs[0].token_ids
                    row["equals_colocated"] = ref == tokens
                rows.append(row)
                by = report["bytes_by_head_class"]
                print(f"{row['plan']:>12} {n:>7} tokens: sent {report['bytes_sent'] / 2**20:10.1f} MiB "
                      f"(global {by['global'] / 2**20:.1f}, local {by['local'] / 2**20:.1f}, retrieval "
                      f"{by['retrieval'] / 2**20:.1f}) = {row['ratio_to_dense'] or 1:.3f} x dense; pull "
                      f"{report['seconds'] * 1e3:.1f} ms; decode holds {report['decode_pages_held']} pages"
                      + (f"; equals colocated: {row['equals_colocated']}" if args.check else ""), flush=True)
        finally:
            server.close()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- load: server processes

def serve(args) -> int:
    """A server process of this benchmark: random weights, ``--serve`` role, prints its base URL."""
    from ..engine.async_engine import AsyncLLMEngine
    from ..serve.background import BackgroundServer
    from ..serve.pd import PDOptions

    head = args.load_plan or args.head_configs.split(",")[0]
    llm = _llm(args, head)
    pd = PDOptions(role=args.serve, transport=args.transport, lease_s=120, pull_timeout_s=120)
    srv = BackgroundServer(AsyncLLMEngine(llm, max_num_seqs=max(16, args.streams + 4)), "bench", app_kw={"pd": pd})
    print(json.dumps({"base": srv.base}), flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        srv.app.state.pd.close()
        srv.stop()
    return 0


def _spawn(args, role: str, util: float) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "redknot.cli", "bench", "pd", "--serve", role, "--arch", args.arch,
            "--head-configs", args.head_configs, "--lengths", args.lengths, "--page-size", str(args.page_size),
            "--gpu-memory-utilization", str(util), "--transport", args.transport, "--streams", str(args.streams),
            "--long-tokens", str(args.long_tokens), "--seed", str(args.seed)]
    argv += ["--retrieval-heads"] if args.retrieval_heads else []
    for flag in ("anchor_head_config", "load_plan", "device", "kv_pages"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the {role} server process exited ({proc.wait()})")
    return proc, json.loads(line)["base"]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _stream(url: str, body: dict, timeout: float = 600) -> tuple[list[float], dict | None]:
    """Arrival times of a streamed completion's tokens (a chunk of k tokens: k arrivals spread over
    the gap since the previous one; ``logprobs: 0`` makes every token's chunk go out, whatever its
    text, which random weights often leave empty), and its usage."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True, "logprobs": 0,
                                                  "stream_options": {"include_usage": True}}).encode(),
                                 {"content-type": "application/json"})
    times, usage = [], None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            k = sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in chunk.get("choices", []))
            if k:
                now = time.perf_counter()
                last = times[-1] if times else now
                times.extend(last + (now - last) * (i + 1) / k for i in range(k))
    return times, usage


def _request(base: str, decode: str | None, ids: list[int], n: int) -> tuple[list[float], dict | None, float]:
    """One completion, through the PD flow when ``decode`` is given; (token times, usage, start)."""
    body = {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "method": "headsparse"}
    t0 = time.perf_counter()
    if decode is None:
        return (*_stream(base + "/v1/completions", body), t0)
    first = _post(base + "/v1/completions", {**body, "max_tokens": 1, "logprobs": 0,
                                             "kv_transfer_params": {"do_remote_decode": True}})
    return (*_stream(decode + "/v1/completions", {**body, "kv_transfer_params": first["kv_transfer_params"]}), t0)


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None  # JSON null when nothing was timed


def _load(args, prefill: str, decode: str | None, vocab: int) -> dict:
    rng = random.Random(args.seed + 1)
    gaps, ttfts, shares, stop = [], [], [], threading.Event()

    def streamer():
        while not stop.is_set():
            ids = [rng.randrange(3, vocab) for _ in range(args.stream_prompt)]
            times, _, _ = _request(prefill, decode, ids, args.stream_tokens)
            gaps.extend(b - a for a, b in zip(times, times[1:]))

    def long_one(i):
        ids = [rng.randrange(3, vocab) for _ in range(args.long_tokens)]
        times, usage, t0 = _request(prefill, decode, ids, 16)
        if times:
            ttfts.append(times[0] - t0)
            moved = (usage or {}).get("kv_transfer")
            if moved:
                shares.append(moved["seconds"] / (times[0] - t0))

    threads = [threading.Thread(target=streamer, daemon=True) for _ in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.interval)  # the streams settle into decoding
    gaps.clear()
    longs = []
    for i in range(args.long_prompts):
        t = threading.Thread(target=long_one, args=(i,), daemon=True)
        t.start()
        longs.append(t)
        time.sleep(args.interval)
    for t in longs:
        t.join()
    stop.set()
    for t in threads:
        t.join(timeout=600)
    return {"itl_p50_s": _pct(gaps, 0.5), "itl_p99_s": _pct(gaps, 0.99), "itl_samples": len(gaps),
            "long_ttft_p50_s": _pct(ttfts, 0.5), "long_ttft_max_s": max(ttfts, default=None),
            "transfer_share_of_ttft": statistics.mean(shares) if shares else None}


def run_load(args) -> dict:
    from ..models.config import ModelConfig
    from .common import ARCHS

    vocab = ModelConfig.from_dict(ARCHS[args.arch]).vocab_size
    out = {}
    procs = []
    try:
        p, prefill = _spawn(args, "prefill", 0.45)
        procs.append(p)
        d, decode = _spawn(args, "decode", 0.9)  # the device's rest: 0.9 of it less what the prefill took
        procs.append(d)
        rng = random.Random(args.seed + 2)
        ttft = {}
        for n in (int(x) for x in args.ttft_lengths.split(",") if x):
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            _request(prefill, decode, ids, 2)  # warm-up at this length
            times, usage, t0 = _request(prefill, decode, ids, 2)
            moved = (usage or {}).get("kv_transfer") or {}
            ttft[n] = {"ttft_s": times[0] - t0, "transfer_s": moved.get("seconds"), "bytes": moved.get("bytes")}
            print(f"PD TTFT at {n} tokens: {ttft[n]['ttft_s'] * 1e3:.0f} ms, of which the pull "
                  f"{(moved.get('seconds') or 0) * 1e3:.0f} ms ({(moved.get('bytes') or 0) / 2**20:.0f} MiB)", flush=True)
        out["pd_ttft"] = ttft
        out["pd"] = _load(args, prefill, decode, vocab)
        print(f"PD under load: {out['pd']}", flush=True)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=120)
    procs = []
    try:
        c, colocated = _spawn(args, "both", 0.9)
        procs.append(c)
        out["colocated"] = _load(args, colocated, None, vocab)
        print(f"colocated under load: {out['colocated']}", flush=True)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=120)
    return out


def run(args) -> dict:
    if args.serve:
        return {"exit": serve(args)}
    result = {"benchmark": "pd", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": ["redknot", "bench", "pd"] + sys.argv[3:], "device": str(args.device or
              ("cuda" if torch.cuda.is_available() else "cpu")),
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    result["bytes"] = run_bytes(args)
    if args.load:
        result["load"] = run_load(args)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "pd.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench pd", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
