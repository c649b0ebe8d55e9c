"""`redknot bench offline`: end-to-end offline generation against HF transformers' eager
``generate`` on the same prompts, in the same run (CPU or GPU, real weights).

Both generate greedily the same number of tokens for every prompt (EOS ignored), prefill
included (short prompts: the run is decode-bound); it prints tokens/s of each and their ratio,
and whether the token ids agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled testbed model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None)


_WORDS = ("the river mill market harbour archive council founded north trade salt bridge winter "
          "ledger surveyor tower school street village merchant museum letter map road").split()


def _prompts(n: int, words: int = 24) -> list[str]:
    """n prompts of different lengths (words .. 2 * words) from a fixed vocabulary, seeded."""
    import random

    rng = random.Random(7)
    return [" ".join(rng.choice(_WORDS) for _ in range(words + i * words // max(n - 1, 1))) + ". Question: why?"
            for i in range(n)]


def run(args) -> dict:
    import statistics

    import transformers

    from ..engine import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=False)
    dev = llm.device
    prompts = _prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=llm.dtype).to(dev).eval()
    tok = llm.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True).to(dev)

    def ours():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    def theirs():
        with torch.inference_mode():
            out = hf.generate(**enc, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id)
        return out[:, enc.input_ids.shape[1]:].tolist()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # The two alternate run by run (after one warm-up each), so a machine whose speed drifts
    # affects both alike; each side's median is reported.
    ts = {ours: [], theirs: []}
    results = {}
    for fn in (ours, theirs):
        fn()
    for _ in range(args.repeats):
        for fn in (ours, theirs):
            sync()
            t0 = time.perf_counter()
            results[fn] = fn()
            sync()
            ts[fn].append(time.perf_counter() - t0)
    t_ours, ids_ours = statistics.median(ts[ours]), results[ours]
    t_hf, ids_hf = statistics.median(ts[theirs]), results[theirs]
    n = args.prompts * args.max_tokens
    # HF's min_new_tokens forbids EOS while ignore_eos only ignores it: compare up to our first EOS
    eos = set(llm.config.eos_token_ids)

    def until_eos(ids):
        return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)

    same = sum(until_eos(a) == b[:len(until_eos(a))] for a, b in zip(ids_ours, ids_hf))
    result = {"benchmark": "offline", "model": str(llm.model_dir), "device": str(dev),
              "dtype": str(llm.dtype).removeprefix("torch."), "torch": torch.__version__,
              "transformers": transformers.__version__, "threads": torch.get_num_threads(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "redknot " + " ".join(sys.argv[1:]), "prompts": args.prompts,
              "max_tokens": args.max_tokens, "redknot_s": t_ours, "hf_s": t_hf, "redknot_tok_s": n / t_ours,
              "hf_tok_s": n / t_hf, "speedup": t_hf / t_ours, "same_tokens": same}
    print(f"{args.prompts} prompts x {args.max_tokens} tokens on {dev} ({result['dtype']}): redknot "
          f"{n / t_ours:.1f} tok/s, HF eager generate {n / t_hf:.1f} tok/s, {t_hf / t_ours:.2f}x; "
          f"identical greedy tokens on {same}/{args.prompts} prompts")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="redknot bench offline", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
