"""Where did FlexAttention training stall? One step per process, each under a time limit:

    for s in mask_eager flex mask_compiled mask_structural; do timeout 140 python docs/results/flex_block_mask_check.py $s; done

mask_eager: ``create_block_mask`` evaluated eagerly on a packed batch like the trainer's (3 rows of
8,832 tokens: contexts, then 8 QA blocks that see the context and themselves); flex: compiled
``flex_attention`` forward + backward with that mask (8 query / 4 KV heads of 64, bf16) against
masked SDPA; mask_compiled: ``torch.compile(create_block_mask)``; mask_structural: the trainer's
``train.block_mask`` (built from the rows' structure) against the eager mask, build time and
compiled flex forward + backward with each, in one process. Results: testbed.md, tenth session
(mask_structural: eleventh session, run V).
"""
import sys, time, torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import torch.nn.functional as F

step = sys.argv[1]
B, L, H, KV, D = 3, 8832, 8, 4, 64
dev = "cuda" if torch.cuda.is_available() else "cpu"
# a packed batch like the trainer's: groups of contexts + 8 QA blocks of ~20 tokens
seg = torch.full((B, L), -1, dtype=torch.int32); qa = torch.zeros((B, L), dtype=torch.int32)
g = 0
for b in range(B):
    pos = 0
    while pos + 2400 <= L:
        n = 8000 if (b == 0 and pos == 0) else 2200
        n = min(n, L - pos - 200)
        seg[b, pos:pos + n + 160] = g
        for k in range(8):
            qa[b, pos + n + 20 * k: pos + n + 20 * (k + 1)] = k + 1
        pos += n + 160; g += 1
seg, qa = seg.to(dev), qa.to(dev)

def mask_mod(b, h, q, k):
    return (q >= k) & (seg[b, q] == seg[b, k]) & ((qa[b, k] == 0) | (qa[b, q] == qa[b, k]))

def t(fn, n=10):
    fn(); torch.cuda.synchronize(); t0 = time.time()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.time() - t0) / n * 1e3

t0 = time.time()
if step == "mask_eager":
    bm = create_block_mask(mask_mod, B, None, L, L, device=dev, _compile=False)
    print(f"eager create_block_mask {time.time()-t0:.1f}s; per call {t(lambda: create_block_mask(mask_mod, B, None, L, L, device=dev, _compile=False)):.1f} ms; sparsity {bm.sparsity():.1f}%")
elif step == "mask_compiled":
    cbm = torch.compile(create_block_mask)
    bm = cbm(mask_mod, B, None, L, L, device=dev)
    print(f"compiled create_block_mask first call {time.time()-t0:.1f}s; per call {t(lambda: cbm(mask_mod, B, None, L, L, device=dev)):.1f} ms")
elif step == "mask_structural":
    from redknot.testbed.train import block_mask
    eager = create_block_mask(mask_mod, B, None, L, L, device=dev, _compile=False)
    ours = block_mask(seg, qa)
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    fa = torch.compile(flex_attention, dynamic=False)
    outs = {}
    for name, bm in (("eager", eager), ("structural", ours)):
        outs[name] = fa(q, k, v, block_mask=bm, enable_gqa=True).float()
        print(f"{name}: sparsity {bm.sparsity():.1f}%, full blocks {int(bm.full_kv_num_blocks.sum())}, "
              f"partial {int(bm.kv_num_blocks.sum())}")
    print(f"outputs max |diff| {(outs['eager'] - outs['structural']).abs().max().item():.2e}")
    build = {"eager": lambda: create_block_mask(mask_mod, B, None, L, L, device=dev, _compile=False),
             "structural": lambda: block_mask(seg, qa)}
    for name, bm in (("eager", eager), ("structural", ours)):
        def fb(bm=bm):
            fa(q, k, v, block_mask=bm, enable_gqa=True).sum().backward()
        print(f"{name}: build {t(build[name]):.2f} ms; flex fwd+bwd {t(fb):.2f} ms; "
              f"build + 12 layers {t(build[name]) + 12 * t(fb):.1f} ms")
elif step in ("flex", "flex_noautotune"):
    bm = create_block_mask(mask_mod, B, None, L, L, device=dev, _compile=False)
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    fa = torch.compile(flex_attention, dynamic=False)
    def fb():
        fa(q, k, v, block_mask=bm, enable_gqa=True).sum().backward()
    fb(); torch.cuda.synchronize()
    print(f"flex fwd+bwd compile {time.time()-t0:.1f}s; per fwd+bwd {t(fb):.2f} ms")
    dense = ~torch.zeros(1, dtype=torch.bool, device=dev)
    i = torch.arange(L, device=dev)
    m = mask_mod(torch.arange(B, device=dev)[:, None, None], None, i[None, :, None], i[None, None, :])[:, None]
    def sb():
        F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).sum().backward()
    print(f"masked SDPA per fwd+bwd {t(sb):.2f} ms")
