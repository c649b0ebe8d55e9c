"""The testbed trainer's pieces that need no training run: stage syntax, exact match, packed rows
== the served prompt, the dense and block masks (SDPA and FlexAttention agree) and the step count
that fits a time budget. The training runs themselves are in tests/slow/test_testbed_train.py."""

import pytest
import torch

from redknot.qa.answers import exact_match
from redknot.reuse.prompt import build_prompt
from redknot.testbed.architecture import build_model, make_config
from redknot.testbed.masks import block_mask, dense_mask, visibility
from redknot.testbed.packing import Rows, build_batch, tokenize_group
from redknot.testbed.schedule import fit_steps
from redknot.testbed.stages import Stage, group_records, parse_stages, stage_records
from redknot.testbed.step import forward_loss, to_device
from redknot.testbed.tokenizer import train_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512, contexts=8)


def test_parse_stages_and_em():
    assert parse_stages("easy:512, qa:2048") == [Stage("easy", 512), Stage("qa", 2048)]
    assert parse_stages("easy:64/2") == [Stage("easy", 64, 2)] and Stage("easy", 64, 2).name == "easy:64/2"
    mixed = parse_stages("qa:2048+8192/4")[0]
    assert mixed == Stage("qa", 8192, 4, (2048,)) and mixed.name == "qa:8192+2048/4"
    assert Stage(**{**mixed.__dict__, "mix": [2048]}) == mixed  # as a saved state gives it back
    typed = parse_stages("qa:8192+2048@cross_doc+cross_doc+single_hop")[0]
    assert typed == Stage("qa", 8192, None, (2048,), ("cross_doc", "cross_doc", "single_hop"))
    assert typed.name == "qa:8192+2048@cross_doc+cross_doc+single_hop" and parse_stages(typed.name) == [typed]
    assert Stage(**typed.as_dict()) == typed and "types" not in mixed.as_dict()
    assert parse_stages("qa:1024/2@role+description")[0].types == ("role", "description")
    role = parse_stages("easy:64/2@role")[0]  # backward easy facts
    assert role == Stage("easy", 64, 2, (), ("role",)) and role.name == "easy:64/2@role"
    assert {r["type"] for r in stage_records(role, seed=1, contexts=3, questions_per_context=2)} == {"easy_role"}
    for bad in ("hard:512", "qa", "qa:0", "qa:2k", "easy:64/", "easy:64/0", "easy:64/x", "qa:2048+2048",
                "qa:2048+", "qa:+512", "qa:2048@", "qa:2048@nope", "easy:64@cross_doc", "easy:64@"):
        with pytest.raises(ValueError, match="--stages"):
            parse_stages(bad)
    assert exact_match("The Varna.", ["varna"]) and not exact_match("Varna Port", ["Varna"])


def test_packed_layout_is_the_served_prompt(tokenizer):
    """Each QA block, sharing its context with the others in one row, gets the same logits as the
    prompt redknot serves for that question alone; labels of the answer span are answer + </s>."""
    records = stage_records(Stage("easy", 128), seed=5, contexts=2, questions_per_context=3)
    groups = group_records(records)
    assert [len(g) for g in groups] == [3, 3]
    rows = Rows(1, 1024, tokenizer.pad_token_id)
    packed = [tokenize_group(tokenizer, g) for g in groups]
    assert all(rows.add(g) for g in packed) and rows.questions == 6
    batch = {k: torch.as_tensor(v) for k, v in rows.arrays().items() if k != "stats"}
    model = build_model(make_config("tiny", tokenizer), seed=0).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=dense_mask(batch["seg"], batch["qa"])).logits[0]
    offset = 0
    for g, recs in zip(packed, groups):
        offset += len(g.context)
        for (q, a), r in zip(g.blocks, recs):
            served = build_prompt(tokenizer, r["question"], r["documents"]).token_ids
            assert served == g.context + q
            assert a == tokenizer.encode(r["answers"][0], add_special_tokens=False) + [tokenizer.eos_token_id]
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([served + a])).logits[0, len(g.context):]
            n = len(q) + len(a)
            torch.testing.assert_close(logits[offset:offset + n], alone, atol=1e-4, rtol=1e-4)
            span = batch["answer"][0, offset:offset + n]
            assert batch["labels"][0, offset:offset + n][span].tolist() == a
            offset += n
    # padding and the last token of each block carry no label; every context token but the last
    # predicts its successor
    assert (batch["labels"][0, offset:] == -100).all()
    assert batch["labels"][0, :len(packed[0].context) - 1].tolist() == packed[0].context[1:]


def test_dense_and_block_mask_follow_one_rule():
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
    qa = torch.tensor([[0, 0, 1, 2, 2, 0, 1, 1, 0]])
    m = dense_mask(seg, qa)[0, 0]
    assert m[3].tolist() == [True, True, False, True, False, False, False, False, False]  # block 2 skips block 1
    assert m[7].tolist() == [False] * 5 + [True] * 3 + [False]                            # group 1 only
    assert m[8].tolist() == [False] * 8 + [True]                                          # padding sees itself


def test_flex_block_mask_gives_the_sdpa_loss(tokenizer):
    """The FlexAttention path (block mask from the rows' structure) computes the masked-SDPA loss on a
    packed batch.
    CPU runs flex forward only; training with it needs CUDA."""
    batch = build_batch(tokenizer, Stage("easy", 128), 0, step=0, seed=0, rows=2, row_len=512,
                          questions_per_context=4, tokens_per_word=2.8, est_group_tokens=200)
    batch = to_device({k: v for k, v in batch.items() if k != "stats"}, CPU)
    assert (batch["seg"] == 1).any()  # several groups share a row: the mask must keep them apart
    sdpa = build_model(make_config("tiny", tokenizer, "sdpa"), seed=0).eval()
    flex = build_model(make_config("tiny", tokenizer, "flex"), seed=1).eval()
    flex.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        want = forward_loss(sdpa, batch, 0.1, "sdpa", first_weight=1.0)
        got = forward_loss(flex, batch, 0.1, "flex", first_weight=1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_fit_steps_counts_what_fits():
    # 100 s left at 1 s a step and a 10 s evaluation every 10 steps: 50 more steps
    assert fit_steps(step=20, steps=1000, seconds_left=100, step_s=1.0, eval_every=10, eval_s=10) == 70
    assert fit_steps(20, 60, 100, 1.0, 10, 10) == 60       # the asked count is the most it runs
    assert fit_steps(20, 1000, -5, 1.0, 10, 10) == 21      # out of time: the next step ends the stage
    assert fit_steps(20, 1000, 100, 0.5, 0, 10) == 220     # no evaluations
    # and a 20 s save every 20 steps: 3 s a step, 33 more
    assert fit_steps(20, 1000, 100, 1.0, 10, 10, save_every=20, save_s=20) == 53


def test_typed_stage_asks_its_types_in_their_weights():
    """``@TYPE+TYPE`` restricts a qa stage's questions to those types, a repeat weighting one."""
    stage = parse_stages("qa:1024@cross_doc+cross_doc+single_hop")[0]
    recs = stage_records(stage, seed=3, contexts=6, questions_per_context=6)
    counts = {t: sum(r["type"] == t for r in recs) for t in ("cross_doc", "single_hop", "multi_hop", "description")}
    assert counts["multi_hop"] == counts["description"] == 0
    assert counts["cross_doc"] == 2 * counts["single_hop"] > 0


def _block_sets(bm):
    """A BlockMask's (partial, full) kv blocks per query block as bool [B, nq, nk]."""
    def dense(num, idx):
        B, _, nq, nk = idx.shape
        out = torch.zeros(B, nq, nk, dtype=torch.bool)
        for b in range(B):
            for q in range(nq):
                out[b, q, idx[b, 0, q, :num[b, 0, q]].long()] = True
        return out
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def test_structural_block_mask_is_sound_against_the_exact_one(tokenizer):
    """The block-level mask built from the rows' structure never skips a block holding a visible
    pair and calls a block full only when every pair in it is visible (create_block_mask, eager,
    is the exact reference); on packed training rows it finds every full block too."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(0)
    layouts = []
    for _ in range(6):  # random rows: groups of a context and QA blocks, then padding
        seg, qa = torch.full((2, 1024), -1), torch.zeros(2, 1024, dtype=torch.long)
        for b in range(2):
            pos, gid = 0, 0
            while True:
                ctx = int(torch.randint(20, 400, (1,), generator=gen))
                blocks = torch.randint(3, 90, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
                if pos + ctx + sum(blocks) > 1024:
                    break
                seg[b, pos:pos + ctx + sum(blocks)] = gid
                o = pos + ctx
                for k, n in enumerate(blocks, 1):
                    qa[b, o:o + n] = k
                    o += n
                pos, gid = o, gid + 1
        layouts.append((seg, qa))
    batch = build_batch(tokenizer, Stage("easy", 128), 0, step=0, seed=0, rows=2, row_len=512,
                          questions_per_context=4, tokens_per_word=2.8, est_group_tokens=200)
    packed = (torch.as_tensor(batch["seg"]), torch.as_tensor(batch["qa"]))
    for seg, qa in layouts + [packed]:
        B, L = seg.shape
        ours = _block_sets(block_mask(seg, qa))
        exact = _block_sets(create_block_mask(visibility(seg, qa), B, None, L, L, device="cpu", _compile=False))
        assert ((exact[0] | exact[1]) & ~(ours[0] | ours[1])).sum() == 0  # nothing visible is skipped
        assert (ours[1] & ~exact[1]).sum() == 0                             # full only where it is
        assert not (ours[0] & ours[1]).any()
    assert (ours[1] == exact[1]).all() and ((ours[0] | ours[1]) == (exact[0] | exact[1])).all()  # packed rows
    with pytest.raises(ValueError, match="multiple of"):
        block_mask(seg[:, :500], qa[:, :500])
