"""`redknot demo`: load an HF checkpoint, check the forward against transformers, and compare
dense attention with per-head SegPaged attention (time to first token, greedy agreement, KV bytes).

Without --model it writes a tiny random Llama checkpoint to a temporary directory, so it runs
offline on any CPU in seconds.
"""

from __future__ import annotations

import tempfile
import time

import torch


def run(args) -> int:
    from .config import HeadConfig
    from .engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from .tiny import make_tiny_checkpoint

            model = make_tiny_checkpoint(tmp, "llama", num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
            print(f"wrote a tiny random Llama checkpoint to {model}")
        dense = LLM(model=model, device=args.device)
        cfg = dense.config
        heads = HeadConfig.synthetic(cfg.num_hidden_layers, cfg.num_key_value_heads, 0.25, window=128, sink=4)
        sparse = LLM(model=model, device=args.device, method="headsparse", head_config=heads, page_size=16)
        print(f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query / "
              f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, device {dense.device}")
        print(f"head plan: {heads.class_counts()['global']} global / {heads.class_counts()['local']} local KV heads, "
              f"window 128, sink 4\n")

        prompt = ("Documents are split into chunks; each chunk is cached once and reused at any position. " * 40)
        _check_against_transformers(dense, model, prompt)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        rows = []
        for name, llm in (("dense", dense), ("headsparse", sparse)):
            llm.first_token_logits(prompt)  # warm up
            t0 = time.perf_counter()
            logits = llm.first_token_logits(prompt)
            ttft = time.perf_counter() - t0
            backend = llm.backend(llm.method)
            peak = _peak_kv_bytes(llm, backend, prompt, params)
            rows.append((name, ttft, logits, peak, llm.generate(prompt, params)[0].outputs[0].token_ids))
        n_prompt = len(dense.tokenizer.encode(prompt))
        print(f"prompt: {n_prompt} tokens, 32 greedy tokens generated")
        print(f"{'method':<11} {'TTFT ms':>8} {'KV bytes held':>14} {'vs dense':>9} {'top-1 = dense':>13} "
              f"{'same 32 tokens':>14}")
        ref = rows[0]
        for name, ttft, logits, peak, tokens in rows:
            print(f"{name:<11} {1e3 * ttft:>8.1f} {peak:>14,} {peak / ref[3]:>9.2f} "
                  f"{str(logits.argmax().item() == ref[2].argmax().item()):>13} {str(tokens == ref[4]):>14}")
        kernel = sparse.backend("headsparse").kernel
        print(f"\nheadsparse ran the {'Triton' if kernel == 'triton' else 'torch reference'} SegPaged kernel; "
              "KV bytes are what the pool holds after the last step.\n"
              "A random model spreads attention over the whole context, so per-head windows change its "
              "answers;\nhead configs are meant for trained models, whose local heads do not look far back.")
    return 0


def _check_against_transformers(llm, model, prompt) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    ours = llm.first_token_logits(prompt).cpu()
    err = ((ours - ref).norm() / ref.norm()).item()
    print(f"redknot forward vs transformers: relative logit error {err:.1e}, "
          f"same top-1: {ours.argmax().item() == ref.argmax().item()}\n")


def _peak_kv_bytes(llm, backend, prompt, params) -> int:
    """KV bytes held after the last decode step of a generation (what a long-running request keeps)."""
    held = []
    end = backend.end

    def spy(ctx):
        end(ctx)
        held.append(backend.kv_bytes())

    backend.end = spy
    try:
        llm.generate(prompt, params)
    finally:
        backend.end = end
    return held[-1]
