"""`python -m redknot.bench.hostile`: how a server answers while hostile clients push on it.

Starts ``redknot serve``'s app on loopback (the bundled model on the CPU unless ``--model`` says
otherwise) and measures, against its idle latency, the latency of ``/health`` (worst of 5) and of
a small chat request (median of 3) while (1) 1,000 slowloris connections hold request heads open,
(2) a 50 MB document is being sent, and (3) 4 requests of 256 tiny documents each (1,024
documents, ``method: prefix``) are in flight. Prints and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time


def run(model=None, device: str = "cpu", slowloris: int = 1000) -> dict:
    import httpx

    from ..engine import LLM
    from ..engine.async_engine import AsyncLLMEngine
    from ..serve.background import BackgroundServer

    llm = LLM(model=model, device=device)
    srv = BackgroundServer(AsyncLLMEngine(llm), "m", server_kw=dict(max_connections=slowloris + 1024))
    body = {"model": "m", "messages": [{"role": "user", "content": "Who founded Varna?"}], "max_tokens": 8,
            "temperature": 0}
    client = httpx.Client(base_url=srv.base, timeout=300, trust_env=False)

    def small() -> float:
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"small request answered {r.status_code}: {r.text[:200]}")
        return time.perf_counter() - t

    def health() -> float:
        t = time.perf_counter()
        if client.get("/health").status_code != 200:
            raise RuntimeError("/health did not answer 200")
        return time.perf_counter() - t

    def under_load() -> dict:
        return {"health_s": max(health() for _ in range(5)), "small_s": statistics.median(small() for _ in range(3))}

    out: dict = {}
    try:
        small()
        out["idle_small_s"] = statistics.median(small() for _ in range(5))
        host, port = srv.base.split("//")[1].split(":")
        socks = []
        for _ in range(slowloris):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        out["slowloris"] = {"connections": slowloris, **under_load()}
        for s in socks:
            s.close()

        statuses = []

        def post(doc_body):
            try:
                statuses.append(httpx.post(f"{srv.base}/v1/chat/completions", json=doc_body, timeout=300,
                                           trust_env=False).status_code)
            except httpx.HTTPError as e:
                statuses.append(type(e).__name__)

        for name, bodies in (("document_50mb", [{**body, "documents": ["x " * (25 << 20)]}]),
                             ("tiny_documents_1024", [{**body, "documents": [f"d{i}" for i in range(256)],
                                                       "method": "prefix"}] * 4)):
            statuses.clear()
            threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
            for t in threads:
                t.start()
            time.sleep(0.3)
            out[name] = under_load()
            for t in threads:
                t.join()
            out[name]["statuses"] = sorted({str(s) for s in statuses})
    finally:
        client.close()
        srv.stop()
    for key in ("slowloris", "document_50mb", "tiny_documents_1024"):
        out[key]["small_vs_idle"] = out[key]["small_s"] / out["idle_small_s"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--slowloris", type=int, default=1000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = run(args.model, args.device, args.slowloris)
    print(f"idle small request {out['idle_small_s']:.3f} s")
    for key in ("slowloris", "document_50mb", "tiny_documents_1024"):
        r = out[key]
        print(f"{key:<20} /health {r['health_s']:.3f} s  small {r['small_s']:.3f} s ({r['small_vs_idle']:.2f}x idle)"
              + (f"  statuses {r['statuses']}" if "statuses" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
