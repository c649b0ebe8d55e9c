"""``redknot bench replicas``: repeated-document RAG requests against a router in front of several
``redknot serve`` replicas (or against one server): how often a request over documents seen
before is served with them reused.

Each of ``--sets`` document sets is asked about ``--repeats`` times, in a shuffled order, one
request at a time through the OpenAI chat API (documents in the body). A repeat counts as a hit
when at least half of its prompt tokens were cached (``usage.prompt_tokens_details.cached_tokens``;
the prompt is mostly its documents). With replicas that share nothing, a round-robin router hits
only when a repeat lands where its documents were computed; with a shared Redis tier every
replica finds them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
import urllib.request

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's (or a server's) base URL")
    p.add_argument("--model", default="redknot-testbed", help="the model name clients send")
    p.add_argument("--sets", type=int, default=8, help="document sets")
    p.add_argument("--repeats", type=int, default=4, help="requests per document set")
    p.add_argument("--docs-per-set", type=int, default=3)
    p.add_argument("--doc-words", type=int, default=60)
    p.add_argument("--method", default="full_reuse")
    p.add_argument("--seed", type=int, default=0, help="also names the documents: a new seed, new documents")
    p.add_argument("--timeout", type=float, default=120, help="seconds per request")
    p.add_argument("--out", default=None, help="results JSON (default: $OUT/replicas.json or ./replicas.json)")


def run(args) -> dict:
    if args.sets < 1 or args.repeats < 2:
        raise ValueError("--sets must be >= 1 and --repeats >= 2 (a set's first request computes its documents)")
    rng = random.Random(args.seed)
    docs = [[f"Document {args.seed}.{s}.{d}: " + " ".join(rng.choice(WORDS) for _ in range(args.doc_words))
             for d in range(args.docs_per_set)] for s in range(args.sets)]
    order = [s for s in range(args.sets) for _ in range(args.repeats)]
    rng.shuffle(order)
    seen, rows = set(), []
    start = time.perf_counter()
    for i, s in enumerate(order):
        body = {"model": args.model, "max_tokens": 2, "documents": docs[s], "method": args.method,
                "messages": [{"role": "user", "content": f"Question {i}: what does the document set say?"}]}
        req = urllib.request.Request(args.url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            usage = json.load(r)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rows.append({"set": s, "repeat": s in seen, "cached_tokens": cached, "prompt_tokens": usage["prompt_tokens"],
                     "hit": cached >= 0.5 * usage["prompt_tokens"], "seconds": time.perf_counter() - t0})
        seen.add(s)
    repeats = [r for r in rows if r["repeat"]]
    result = {"benchmark": "replicas", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": ["redknot", "bench", "replicas"] + sys.argv[3:],
              "args": {k: v for k, v in vars(args).items() if not callable(v)},
              "requests": len(rows), "repeats": len(repeats), "repeat_hits": sum(r["hit"] for r in repeats),
              "hit_rate": sum(r["hit"] for r in repeats) / len(repeats), "wall_s": time.perf_counter() - start,
              "rows": rows}
    out = args.out or os.path.join(os.environ.get("OUT", "."), "replicas.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['requests']} requests over {args.sets} document sets at {args.url}: "
          f"{result['repeat_hits']} of {result['repeats']} repeats reused their documents "
          f"(hit rate {result['hit_rate']:.2f}) in {result['wall_s']:.1f} s")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench replicas", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
