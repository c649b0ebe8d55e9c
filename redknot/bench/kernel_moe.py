"""Mixture-of-experts shapes of `redknot bench kernel --moe`: one MoE block (router + experts) at
a real architecture's shape, bf16, for T tokens.

Methods (same weights, same input; each failure recorded in the JSON, never fatal):
  fused        redknot's block as served (``kernels/fused_moe.fused_experts``, path ``auto``): the
               few-token GEMV path at T*k <= SMALL_PAIRS, the grouped GEMM above
  grouped      the Triton grouped GEMM at every T: device-side alignment, gate_up with the
               activation fused, down with the routing weight
  gemv         the few-token path at every T*k <= GEMV_MAX_PAIRS (the crossover with grouped): a
               matrix-vector program per (token-expert pair, N tile), activation and routing weight
               fused, down's K split when the pairs are too few to fill the card
  loop         the same routing, then the torch reference: pairs sorted by expert, one GEMM
               pair per expert that has tokens (``kernels/moe_reference.py``)
  hf_grouped   transformers' own MoE block, its default experts implementation (grouped_mm)
  hf_eager     transformers' MoE block, its eager per-expert loop

Times are medians of CUDA events with L2 flushed before each call; a method that can be captured
(fused, hf_grouped) is timed as CUDA-graph replays, as a serving engine's decode runs it.
Correctness: each method's output against the float32 torch reference of the same routing (cos).
Also reported: the experts the T tokens touch and the fused kernel's weight bandwidth.

Run:  redknot bench kernel --moe [--moe-arch qwen3-30b-a3b] [--moe-tokens 1,2,4,8,16,32,64,512,8192]
      redknot bench kernel --moe --quick --device cpu     (CPU smoke: a tiny block)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

from ..kernels.moe_reference import experts_reference
from ..models.config import MoEConfig
from ..models.moe import SparseMoeBlock
from . import kernel as kb

# The MoE layers of the architectures `redknot bench decode` runs (bench/common.py ARCHS)
ARCHS = {
    "qwen3-30b-a3b": dict(hidden=2048, moe=dict(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True)),
    "gpt-oss-20b": dict(hidden=2880, moe=dict(num_experts=32, top_k=4, intermediate_size=2880, routing="topk_softmax",
                                              activation="swiglu_clamped", router_bias=True, expert_bias=True,
                                              router_name="router")),
    "tiny": dict(hidden=64, moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True)),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 512, 8192)
QUICK_TOKENS = (1, 9)
METHODS = ("fused", "grouped", "gemv", "loop", "hf_grouped", "hf_eager")
GEMV_MAX_PAIRS = 512  # the GEMV path re-reads an expert per pair: past this it only loses


def make_block(arch: dict, device, dtype) -> SparseMoeBlock:
    moe = MoEConfig(layers=[True], **arch["moe"])
    with torch.device(device):
        block = SparseMoeBlock(arch["hidden"], moe)
    with torch.no_grad():  # a router wide enough that the picks are decisive, as in a trained model
        getattr(block, moe.router_name).weight.normal_(0, arch["hidden"] ** -0.5)
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    return block.to(dtype).eval()


def hf_block(block: SparseMoeBlock, arch: dict, implementation: str):
    """transformers' MoE block of the architecture with ``block``'s weights, ``implementation`` its
    experts implementation ("grouped_mm" or "eager")."""
    import transformers

    m = arch["moe"]
    if m.get("activation") == "swiglu_clamped":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as cls
        cfg = transformers.GptOssConfig(hidden_size=arch["hidden"], intermediate_size=m["intermediate_size"],
                                        num_local_experts=m["num_experts"], num_experts_per_tok=m["top_k"])
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as cls
        cfg = transformers.Qwen3MoeConfig(hidden_size=arch["hidden"], moe_intermediate_size=m["intermediate_size"],
                                          num_experts=m["num_experts"], num_experts_per_tok=m["top_k"],
                                          norm_topk_prob=m.get("norm_topk_prob", False))
    cfg._experts_implementation = implementation
    dev, dtype = block.experts.gate_up_proj.device, block.experts.gate_up_proj.dtype
    with torch.device("meta"):
        hf = cls(cfg)
    hf = hf.to_empty(device=dev).to(dtype).eval()
    e, r = block.experts, getattr(block, block.router_name)
    with torch.no_grad():
        if m.get("activation") == "swiglu_clamped":  # gpt-oss: [E, H, 2I] interleaved, down [E, I, H]
            gu = torch.stack((e.gate_up_proj[:, :m["intermediate_size"]], e.gate_up_proj[:, m["intermediate_size"]:]),
                             dim=2).flatten(1, 2)
            b = e.gate_up_proj_bias
            hf.experts.gate_up_proj.copy_(gu.transpose(1, 2))
            hf.experts.gate_up_proj_bias.copy_(torch.stack((b[:, :m["intermediate_size"]],
                                                            b[:, m["intermediate_size"]:]), dim=2).flatten(1))
            hf.experts.down_proj.copy_(e.down_proj.transpose(1, 2))
            hf.experts.down_proj_bias.copy_(e.down_proj_bias)
            hf.router.weight.copy_(r.weight)
            hf.router.bias.copy_(r.bias)
        else:
            hf.experts.gate_up_proj.copy_(e.gate_up_proj)
            hf.experts.down_proj.copy_(e.down_proj)
            hf.gate.weight.copy_(r.weight)
    return hf


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def run_tokens(block: SparseMoeBlock, hf: dict, arch: dict, t: int, env, seed: int) -> dict:
    from ..kernels import fused_moe

    dev = block.experts.gate_up_proj.device
    x = torch.randn(t, arch["hidden"], generator=torch.Generator().manual_seed(seed)).to(dev, block.experts.down_proj.dtype)
    router, ex = getattr(block, block.router_name), block.experts
    weights, ids = router(x)
    touched = int(ids.unique().numel())
    e = arch["moe"]["num_experts"]
    expert_bytes = ex.gate_up_proj[0].numel() * ex.gate_up_proj.element_size() * 3 // 2  # gate, up and down rows
    ref = experts_reference(x.float(), ex.gate_up_proj.float(), ex.down_proj.float(), weights, ids, ex.activation,
                            *(None if b is None else b.float() for b in (ex.gate_up_proj_bias, ex.down_proj_bias)),
                            ex.alpha, ex.limit)
    args = (ex.gate_up_proj, ex.down_proj)
    extra = (ex.activation, ex.gate_up_proj_bias, ex.down_proj_bias, ex.alpha, ex.limit)

    def fused(path="auto"):
        w, i = router(x)
        return fused_moe.fused_experts(x, *args, w, i, *extra, path=path)

    def loop():
        w, i = router(x)
        return experts_reference(x, *args, w, i, *extra)

    fns = {"fused": fused, "grouped": lambda: fused("grouped"), "loop": loop}
    if t * arch["moe"]["top_k"] <= GEMV_MAX_PAIRS:
        fns["gemv"] = lambda: fused("gemv")
    for name, module in hf.items():
        fns[name] = lambda module=module: module(x[None])
    entry = {"tokens": t, "pairs": t * arch["moe"]["top_k"], "experts_touched": touched,
             "expected_touched": e * (1 - (1 - arch["moe"]["top_k"] / e) ** t),
             "weight_bytes_touched": touched * expert_bytes, "methods": {}}
    for m in METHODS:
        if m not in env.methods or m not in fns:
            reason = "not selected" if m not in env.methods else (
                f"T*k > {GEMV_MAX_PAIRS}" if m == "gemv" else "not built")
            entry["methods"][m] = {"skipped": reason}
            continue
        print(f"[kernel-bench] moe T={t}: {m} ...", flush=True)
        try:
            out = fns[m]()
            out = out[0] if isinstance(out, tuple) else out  # gpt-oss's block returns (out, scores)
            row = {**env.timer(fns[m]), "cos_vs_ref": _cos(out.reshape(t, -1), ref)}
            row["weight_GBps"] = entry["weight_bytes_touched"] / (row["ms"] / 1e3) / 1e9
            entry["methods"][m] = row
        except Exception as err:
            entry["methods"][m] = {"error": kb._err(err)}
        kb._free_memory(dev)
    base = entry["methods"].get("fused", {}).get("ms")
    entry["fused_speedup"] = {m: r["ms"] / base for m, r in entry["methods"].items()
                              if base and m != "fused" and "ms" in r}
    return entry


def run(args) -> dict:
    """The MoE shapes as one command: prints a table, writes JSON (``--out``)."""
    t0 = time.perf_counter()
    g = lambda name, default: getattr(args, name, default)  # noqa: E731
    device = torch.device(g("device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = bool(g("quick", False))
    arch_name = "tiny" if quick else g("moe_arch", "qwen3-30b-a3b")
    arch = ARCHS[arch_name]
    spec = g("moe_tokens", None)
    tokens = [int(x) for x in spec.split(",")] if spec else list(QUICK_TOKENS if quick else TOKENS)
    methods = kb._select(g("methods", "all"), METHODS, "method")
    out_path = g("out", None) or os.path.join(os.environ.get("OUT", "."), "kernel_moe.json")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = kb.Env(device=device, timer=kb.Timer(device, g("repeats", 50), g("target_ms", 1000.0)), fa={},
                 kernels=None, kernel_error=None, methods=tuple(methods), deadline=float("inf"))
    env.timer.graph = True  # capturable methods replay from a graph; the others fall back to eager
    block = make_block(arch, device, dtype)
    hf, hf_errors = {}, {}
    for name, impl in (("hf_grouped", "grouped_mm"), ("hf_eager", "eager")):
        if name in methods:
            try:
                hf[name] = hf_block(block, arch, impl)
            except Exception as err:
                hf_errors[name] = kb._err(err)
    import transformers
    result = {"benchmark": "redknot.bench.kernel --moe", "argv": ["redknot", *sys.argv[1:]],
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **kb._versions(),
              "transformers": transformers.__version__, "arch": arch_name, "config": arch,
              "dtype": str(dtype).replace("torch.", ""), "hf_errors": hf_errors, "out": out_path, "rows": []}
    for t in tokens:
        try:
            result["rows"].append(run_tokens(block, hf, arch, t, env, g("seed", 0) + t))
        except Exception as err:
            result["rows"].append({"tokens": t, "error": kb._err(err), "methods": {}})
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(f"\nMoE block, {result['arch']} ({result['config']['moe']}), {result['device']}, {result['dtype']}: "
          f"ms per call (cos vs the float32 reference); x = time / fused's")
    print(f"{'T':>6} {'experts':>8} " + " ".join(f"{m:>24}" for m in METHODS) + f" {'fused GB/s':>11}")
    for r in result["rows"]:
        cells = []
        for m in METHODS:
            x = r["methods"].get(m, {})
            if "ms" in x:
                ratio = r["fused_speedup"].get(m)
                cells.append(f"{x['ms']:8.3f} ({x['cos_vs_ref']:.5f})" + (f" x{ratio:4.1f}" if ratio else " " * 6))
            else:
                cells.append(f"{'error' if 'error' in x else '-':>24}")
        bw = r["methods"].get("fused", {}).get("weight_GBps")
        print(f"{r['tokens']:>6} {r.get('experts_touched', '-'):>8} " + " ".join(f"{c:>24}" for c in cells)
              + (f" {bw:11.0f}" if bw else f" {'-':>11}"))
