"""The testbed training script's runs on CPU: the model can fit a batch, a short curriculum logs loss
and held-out EM, resumes exactly, and its model loads in redknot; settings that fail before any
training. Its pieces that need no training run (stages, packed layout, masks) are in
tests/unit/test_testbed_packing.py."""

import argparse
import json
import shutil

import pytest
import torch

from redknot.reuse.prompt import build_prompt
from redknot.testbed import train as T
from redknot.testbed import trainer
from redknot.testbed.architecture import build_model, grow_depth, make_config
from redknot.testbed.checkpoint import MODEL_DIR, STATE_FILE
from redknot.testbed.packing import StagePlan, build_batch, tokenize_group
from redknot.testbed.schedule import lr_factor
from redknot.testbed.stages import _MIX_SEED_STRIDE, Stage, group_records, parse_stages, stage_records
from redknot.testbed.step import forward_loss, make_optimizer, to_device, train_step
from redknot.testbed.tokenizer import TOKENIZER_FILE, load_or_train_tokenizer, train_tokenizer
from redknot.testbed.trainer import LOG_FILE

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512, contexts=8)


def _args_list(out, *extra):
    return ["--out", str(out), "--size", "tiny", "--stages", "easy:128,qa:256", "--steps-per-stage", "3",
            "--batch-tokens", "1024", "--questions-per-context", "2", "--eval-every", "2", "--eval-n", "4",
            "--log-every", "1", "--tokenizer-contexts", "8", "--vocab-size", "512", "--lr", "3e-3",
            "--device", "cpu", *extra]


def _args(out, *extra):
    p = argparse.ArgumentParser()
    T.add_arguments(p)
    return p.parse_args(_args_list(out, *extra))


def _log(out):
    return [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]


def test_model_fits_a_repeated_batch(tokenizer):
    stage = Stage("easy", 128)
    batch = build_batch(tokenizer, stage, 0, step=0, seed=0, rows=1, row_len=512, questions_per_context=4,
                          tokens_per_word=2.8, est_group_tokens=200)
    batch = to_device({k: v for k, v in batch.items() if k != "stats"}, CPU)
    model = build_model(make_config("tiny", tokenizer), seed=0)
    opt = make_optimizer(model, 3e-3, 0.0, CPU)
    losses = [train_step(model, opt, batch, 0.1, "sdpa", CPU)[1].item() for _ in range(20)]  # answer CE
    assert losses[-1] < 0.6 * losses[0], losses


def test_curriculum_logs_resumes_exactly_and_loads_in_redknot(tmp_path):
    from redknot import LLM, SamplingParams

    # one run straight through ...
    straight = tmp_path / "straight"
    assert T.run(_args(straight)) == 0
    log = _log(straight)
    train = [r for r in log if r["event"] == "train"]
    evals = [r for r in log if r["event"] == "eval"]
    assert [r["stage_name"] for r in log if r["event"] == "stage"] == ["easy:128", "qa:256"]
    assert all(r["loss"] > 0 and r["answer_loss"] > 0 and r["first_token_loss"] > 0 and r["tokens_per_s"] > 0
               for r in train)
    assert {(r["stage"], r["step"]) for r in evals} >= {(0, 2), (0, 3), (1, 2), (1, 3)}
    assert all(0 <= r["em"] <= 1 and r["em_by_type"] for r in evals)
    assert set(evals[-1]["em_by_type"]) <= {"single_hop", "multi_hop", "cross_doc"}

    # ... and one stopped by its time budget (after its first step), resumed for one more step,
    # then resumed to the end: it continues where it stopped, not from 0, and ends with the same weights
    resumed = tmp_path / "resumed"
    assert T.run(_args(resumed, "--time-budget", "0")) == 0
    assert [r["reason"] for r in _log(resumed) if r["event"] == "stop"] == ["time budget"]
    assert (resumed / MODEL_DIR / "config.json").is_file()
    with pytest.raises(SystemExit, match="--resume"):
        T.run(_args(resumed))
    assert T.run(_args(resumed, "--resume", "--stop-after-steps", "1")) == 0
    state = torch.load(resumed / STATE_FILE, weights_only=False)
    assert (state["stage"], state["step"]) == (0, 2)
    assert T.run(_args(resumed, "--resume")) == 0
    log = _log(resumed)
    resumes = [i for i, r in enumerate(log) if r["event"] == "resume"]
    assert [log[i]["step"] for i in resumes] == [1, 2]
    assert [r["step"] for r in log[resumes[0]:] if r["event"] == "train"][:3] == [2, 3, 1]
    final_a = torch.load(straight / STATE_FILE, weights_only=False)
    final_b = torch.load(resumed / STATE_FILE, weights_only=False)
    assert (final_b["stage"], final_b["step"]) == (2, 0)
    for k, v in final_a["model"].items():
        torch.testing.assert_close(final_b["model"][k], v, rtol=0, atol=0, msg=k)

    # the exported model is a checkpoint redknot serves
    model_dir = resumed / MODEL_DIR
    assert (model_dir / "model.safetensors").stat().st_size < 60 << 20
    llm = LLM(model=model_dir, device="cpu")
    docs = ["Osis Greby was born in Pyvik.", "The mayor of Pyvik is Ama Tel."]
    out = llm.generate(["Who is the mayor of Pyvik?"], SamplingParams(max_tokens=4, temperature=0),
                       documents=[docs])
    assert 1 <= len(out[0].outputs[0].token_ids) <= 4 and isinstance(out[0].outputs[0].text, str)
    assert out[0].prompt_token_ids == build_prompt(llm.tokenizer, "Who is the mayor of Pyvik?", docs).token_ids


def test_advance_em_ends_a_stage_early_and_export_writes_the_model(tmp_path):
    out = tmp_path / "run"
    # EM >= 0 always holds: every stage ends at its first evaluation (step 2 of 3)
    assert T.run(_args(out, "--advance-em", "0")) == 0
    log = _log(out)
    assert [(r["stage"], r["step"]) for r in log if r["event"] == "advance"] == [(0, 2), (1, 2)]
    assert [(r["stage"], r["step"]) for r in log if r["event"] == "eval"] == [(0, 2), (1, 2)]  # not twice
    assert not [r for r in log if r["event"] == "train" and r["step"] == 3]

    # a carried-back state alone (no model/): --export writes the checkpoint without training
    import shutil

    shutil.rmtree(out / MODEL_DIR)
    assert T.run(_args(out, "--export", "--stages", "qa:999")) == 0  # the saved curriculum wins
    meta = json.loads((out / MODEL_DIR / "training.json").read_text())
    assert meta["stage"] == 2 and meta["heldout"]["stage_name"] == "qa:256"
    assert meta["run"]["stages"] == [{"kind": "easy", "context_tokens": 128, "questions": None},
                                     {"kind": "qa", "context_tokens": 256, "questions": None}]
    assert (out / MODEL_DIR / "model.safetensors").is_file()
    with pytest.raises(SystemExit, match="no .*train_state.pt"):
        T.run(_args(tmp_path / "empty", "--export"))


def test_fit_steps_shortens_the_last_stage_once_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """--fit-steps: after the timed steps the last stage is cut to what fits (here a fixed count),
    its cosine runs over the fitted count, and a resume keeps that count."""
    monkeypatch.setattr(trainer, "FIT_AFTER_STEPS", 1)
    asked = []
    budget = []
    monkeypatch.setattr(trainer, "fit_steps", lambda step, steps, left, *rest: asked.append((step, steps))
                        or budget.append((left, rest[-2:])) or 4)
    out = tmp_path / "fit"
    stages = ["--stages", "easy:128,qa:256", "--steps-per-stage", "3", "8", "--eval-every", "0", "--warmup", "1"]
    assert T.run(_args(out, *stages, "--fit-steps", "--time-budget", "3600", "--stop-after-steps", "5")) == 0
    log = _log(out)
    assert asked == [(2, 8)]  # stage 1 (not the last) untouched; stage 2 timed from its 1st step, fitted at its 2nd
    # the stop rule's reserve (a final save's 30 s at least) is not the stage's; periodic saves are costed
    assert budget[0][0] < 3600 - 30 and budget[0][1][0] == 250
    assert [(r["stage"], r["steps"], r["asked"]) for r in log if r["event"] == "fit"] == [(1, 4, 8)]
    assert T.run(_args(out, *stages, "--fit-steps", "--time-budget", "3600", "--resume")) == 0
    log = _log(out)
    train = [r for r in log if r["event"] == "train" and r["stage"] == 1]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and asked == [(2, 8)]  # fitted once
    # the cosine runs over the fitted count, not the asked one
    assert [r["lr"] for r in train[2:]] == pytest.approx([3e-3 * lr_factor(k, 4, 1) for k in (2, 3)])
    assert log[-1]["event"] == "done"
    assert torch.load(out / STATE_FILE, weights_only=False)["args"]["fitted"] == {"1": 4}


def test_stage_questions_and_init_weights(tmp_path):
    first = tmp_path / "first"
    assert T.run(_args(first, "--stop-after-steps", "1")) == 0
    # a new run from those weights, with a stage of its own questions per context
    second = tmp_path / "second"
    assert T.run(_args(second, "--stages", "easy:64/1", "--steps-per-stage", "1",
                       "--init-weights", str(first / STATE_FILE))) == 0
    log = _log(second)
    assert [r["event"] for r in log][:2] == ["init", "start"]
    stage = [r for r in log if r["event"] == "stage"][0]
    assert stage["stage_name"] == "easy:64/1"
    assert [r["n"] for r in log if r["event"] == "eval"] == [4]
    init = torch.load(first / STATE_FILE, weights_only=False)["model"]
    model = build_model(make_config("tiny", load_or_train_tokenizer(second, 512, 8)), seed=1)
    model.load_state_dict(init)  # same architecture: the second run really started from these weights


def test_init_weights_from_a_checkpoint_directory(tmp_path):
    """A new run can start from an exported HF checkpoint (e.g. the bundled model): its weights,
    architecture and tokenizer; a checkpoint of another architecture is refused."""
    first = tmp_path / "first"
    assert T.run(_args(first, "--stop-after-steps", "1")) == 0
    assert T.run(_args(first, "--export")) == 0
    second = tmp_path / "second"
    assert T.run(_args(second, "--stages", "easy:64/1", "--steps-per-stage", "1", "--stop-after-steps", "1",
                       "--init-weights", str(first / MODEL_DIR))) == 0
    assert (second / TOKENIZER_FILE).read_bytes() == (first / MODEL_DIR / TOKENIZER_FILE).read_bytes()
    assert _log(second)[0]["event"] == "init"
    broken = tmp_path / "broken"
    shutil.copytree(first / MODEL_DIR, broken)
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    weights["extra.weight"] = torch.zeros(1)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(SystemExit, match="not this architecture"):
        T.run(_args(tmp_path / "third", "--init-weights", str(broken)))


def test_mixed_length_stage_trains_and_resumes(tmp_path):
    """A stage of several context lengths draws each into the same batches (equal token shares),
    and a resumed run recognises it."""
    stage = parse_stages("qa:512+128")[0]
    recs = stage_records(stage, seed=5, contexts=10)
    from redknot.testbed.records import generate_records

    # 10 contexts, equal token shares of 512 and 128: 2 long (the stage's seed), 8 short (their own)
    assert recs == generate_records(5, 2, context_tokens=512) + generate_records(5 + _MIX_SEED_STRIDE, 8,
                                                                                 context_tokens=128)
    out = tmp_path / "mix"
    assert T.run(_args(out, "--stages", "qa:512+128", "--stop-after-steps", "1")) == 0
    assert T.run(_args(out, "--stages", "qa:512+128", "--resume", "--stop-after-steps", "1")) == 0
    names = [r.get("stage_name") for r in _log(out) if r["event"] == "stage"]
    assert names and set(names) == {"qa:512+128"}


def test_reasoned_answers_name_the_bridge_and_train(tmp_path, tokenizer):
    """--reasoned-answers: two-hop questions are trained on 'BRIDGE => ANSWER' (the bridge the record's
    meta names), the others on the plain answer; the flag is part of the stage, so a resume without it
    is refused instead of silently changing the targets."""
    from redknot.testbed.answers import target_answer

    stage = Stage("qa", 1024, types=("multi_hop", "description", "single_hop"), reasoned=("multi_hop", "description"))
    recs = stage_records(stage, seed=3, contexts=2, questions_per_context=6)
    assert Stage(**stage.as_dict()) == stage and "reasoned" not in Stage("qa", 1024).as_dict()
    two_hop = [r for r in recs if r["type"] != "single_hop"]
    assert two_hop and all(target_answer(r, stage.reasoned) == f"{r['meta']['bridge']} => {r['answers'][0]}"
                           for r in two_hop)
    assert all(target_answer(r, stage.reasoned) == r["answers"][0] for r in recs if r["type"] == "single_hop")
    assert all(target_answer(r) == r["answers"][0] for r in recs)
    assert all(target_answer(r, ("multi_hop",)) == r["answers"][0] for r in recs if r["type"] == "description")
    with pytest.raises(ValueError, match="bridge"):
        target_answer({k: v for k, v in two_hop[0].items() if k != "meta"}, stage.reasoned)
    # the packed labels of a two-hop block are the reasoned answer + </s>
    g = tokenize_group(tokenizer, group_records(recs)[0], stage.reasoned)
    first = group_records(recs)[0]
    for r, (_, answer) in zip(first, g.blocks):
        assert answer == tokenizer.encode(target_answer(r, stage.reasoned), add_special_tokens=False) + [
            tokenizer.eos_token_id]
    out = tmp_path / "reasoned"
    st = ["--stages", "qa:512@multi_hop+single_hop"]
    assert T.run(_args(out, *st, "--reasoned-answers", "--stop-after-steps", "1")) == 0
    names = [r["stage_name"] for r in _log(out) if r["event"] == "stage"]
    assert names == ["qa:512@multi_hop+single_hop reasoned:multi_hop+description"]
    for other in ([], ["--reasoned-answers", "multi_hop"]):  # other targets than the saved run's
        with pytest.raises(SystemExit, match="does not match"):
            T.run(_args(out, *st, "--resume", *other))
    assert T.run(_args(out, *st, "--reasoned-answers", "--resume", "--stop-after-steps", "1")) == 0
    for bad in ("cross_doc", "multi_hop+multi_hop", "nope"):
        with pytest.raises(ValueError, match="--reasoned-answers"):
            T.run(_args(tmp_path / "bad", *st, "--reasoned-answers", bad))


def test_restated_bridge_answers_state_the_first_hop(tmp_path, tokenizer):
    """--restate-bridge: a reasoned answer states its first hop up to the bridge, then '=> ANSWER':
    multi_hop 'X was born in BRIDGE' (the easy stages' fact sentence), description 'X is the founder
    of BRIDGE' (the role document A gives X); a run refuses it without reasoned answers, and a resume
    must keep it."""
    from redknot.bench.quality import bridge_match, exact_match
    from redknot.qa.answers import restated_fact
    from redknot.testbed.answers import target_answer

    stage = Stage("qa", 1024, types=("multi_hop", "description"), reasoned=("multi_hop", "description"),
                    restate=True)
    assert Stage(**stage.as_dict()) == stage and "restate" not in Stage("qa", 1024).as_dict()
    recs = stage_records(stage, seed=5, contexts=12, questions_per_context=4)
    facts = {"birth_city": "was born in", "employer": "works for", "school": "studied at", "residence": "lives in",
             "founder": "is the founder of", "mayor": "is the mayor of", "engineer": "is the chief engineer of"}
    seen = set()
    for r in recs:
        m, answer = r["meta"], r["answers"][0]
        first = m["relation"].split("->")[0]
        seen.add(first)
        got = target_answer(r, stage.reasoned, stage.restate)
        assert got == f"{m['entity']} {facts[first]} {m['bridge']} => {answer}"
        if r["type"] == "description":  # the restated role names the holder that the later document describes
            assert m["description"].endswith(m["bridge"])
        # scored: the bridge after the restated fact, the answer after '=>'
        assert bridge_match(got, m["bridge"], restated_fact(r)) == 1.0 and exact_match(got, answer) == 1.0
        assert bridge_match(f"{m['entity']} {facts[first]} Nowhere => {answer}", m["bridge"], restated_fact(r)) == 0.0
        assert bridge_match(f"{m['bridge']} => {answer}", m["bridge"], restated_fact(r)) == 1.0  # short form too
        assert target_answer(r, stage.reasoned) == f"{m['bridge']} => {answer}"  # unrestated
    assert {r["type"] for r in recs} == {"multi_hop", "description"} and {"founder", "mayor", "engineer"} <= seen
    assert restated_fact({**recs[0], "type": "single_hop"}) is None
    g = tokenize_group(tokenizer, group_records(recs)[0], stage.reasoned, stage.restate)
    r0 = group_records(recs)[0][0]
    assert g.blocks[0][1][:-1] == tokenizer.encode(target_answer(r0, stage.reasoned, True), add_special_tokens=False)
    out = tmp_path / "restated"
    st = ["--stages", "qa:512@multi_hop+single_hop", "--reasoned-answers", "multi_hop"]
    assert T.run(_args(out, *st, "--restate-bridge", "--stop-after-steps", "1")) == 0
    names = [r["stage_name"] for r in _log(out) if r["event"] == "stage"]
    assert names == ["qa:512@multi_hop+single_hop reasoned:multi_hop restated"]
    with pytest.raises(SystemExit, match="does not match"):
        T.run(_args(out, *st, "--resume"))
    with pytest.raises(ValueError, match="--restate-bridge"):
        T.run(_args(tmp_path / "bad", "--stages", "qa:512", "--restate-bridge"))


def test_grow_layers_keeps_the_function_and_trains(tmp_path):
    """--grow-layers deepens a checkpoint: at the start the deeper model gives the same logits, and
    it trains from there; without a checkpoint to grow it is an error."""
    first = tmp_path / "first"
    assert T.run(_args(first, "--stop-after-steps", "1")) == 0
    assert T.run(_args(first, "--export")) == 0
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    src = first / MODEL_DIR
    weights = load_file(src / "model.safetensors")
    config = LlamaConfig.from_pretrained(src)
    small = build_model(config, seed=0)
    small.load_state_dict(weights, strict=False)
    grown_weights = grow_depth(weights, config.num_hidden_layers, 5)
    config5 = LlamaConfig.from_pretrained(src)
    config5.num_hidden_layers = 5
    grown = build_model(config5, seed=0)
    missing, unexpected = grown.load_state_dict(grown_weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, config.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, small(ids).logits, rtol=1e-5, atol=1e-5)
    # the copies are real layers (their input projections copied), only their outputs zeroed
    # 2 -> 5: [0, copy of 0, 1, copy of 1, copy of 1]; copies keep their inputs, only outputs are zeroed
    for new, old, copy in ((0, 0, False), (1, 0, True), (2, 1, False), (3, 1, True), (4, 1, True)):
        q = grown_weights[f"model.layers.{new}.self_attn.q_proj.weight"]
        assert torch.equal(q, weights[f"model.layers.{old}.self_attn.q_proj.weight"])
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w = grown_weights[f"model.layers.{new}.{name}"]
            assert (w.abs().sum() == 0) == copy
    with pytest.raises(ValueError, match="already has"):
        grow_depth(weights, config.num_hidden_layers, 1)

    second = tmp_path / "second"
    assert T.run(_args(second, "--stages", "easy:64/1", "--steps-per-stage", "2", "--init-weights", str(src),
                       "--grow-layers", "5")) == 0
    assert LlamaConfig.from_pretrained(second / MODEL_DIR).num_hidden_layers == 5
    init = _log(second)[0]
    assert (init["event"], init["layers"], init["grown_from"]) == ("init", 5, 2)
    with pytest.raises(SystemExit, match="--init-weights"):
        T.run(_args(tmp_path / "third", "--grow-layers", "5"))


def test_data_parallel_step_is_the_mean_gradient_of_every_ranks_batch(tmp_path):
    """Two ranks under torchrun (gloo, CPU): one step equals one process stepping on the mean loss of
    both ranks' batches (rank 1 draws its own shard), tokens count both, and only rank 0 logs."""
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import LlamaConfig

    first = tmp_path / "first"
    assert T.run(_args(first, "--stop-after-steps", "1")) == 0  # an fp32 checkpoint to start both from
    ddp = tmp_path / "ddp"
    cli = _args_list(ddp) + ["--stages", "qa:256", "--steps-per-stage", "3",
                             "--stop-after-steps", "1", "--eval-every", "0", "--init-weights", str(first / MODEL_DIR)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for attempt in range(2):
        shutil.rmtree(ddp, ignore_errors=True)
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "-m", "redknot.testbed.train", *cli], capture_output=True, text=True, env=env,
                             timeout=300)
        # gloo's worker threads can abort a rank while the process exits ("terminate called without an
        # active exception"), after the step and its checkpoint are done: that abort alone is retried once
        if res.returncode == 0 or "terminate called without an active exception" not in res.stderr:
            break
    assert res.returncode == 0, res.stderr[-3000:]
    log = _log(ddp)
    starts = [r for r in log if r["event"] == "start"]
    assert len(starts) == 1 and starts[0]["ranks"] == 2  # rank 1 is silent
    state = torch.load(ddp / STATE_FILE, weights_only=False)
    assert (state["stage"], state["step"]) == (0, 1)

    # the same step in one process: both shards' batches, mean loss
    config = LlamaConfig.from_dict(state["config"])
    model = build_model(config, 0)
    model.load_state_dict(load_file(first / MODEL_DIR / "model.safetensors"), strict=False)
    plan = StagePlan(**state["plans"]["0"])
    tok = load_or_train_tokenizer(ddp, 0, 0)
    stage = parse_stages("qa:256")[0]
    batches = [build_batch(tok, stage, 0, 0, 0, plan.rows, plan.row_len, 2, plan.tokens_per_word,
                             plan.est_group_tokens, shard=r) for r in (0, 1)]
    assert not torch.equal(torch.as_tensor(batches[0]["input_ids"]), torch.as_tensor(batches[1]["input_ids"]))
    assert state["tokens_seen"] == sum(int(b["stats"][0]) for b in batches)
    opt = make_optimizer(model, 3e-3, 0.1, CPU)
    for g in opt.param_groups:
        g["lr"] = 3e-3 * lr_factor(0, 3, 100)
    losses = [forward_loss(model, to_device({k: v for k, v in b.items() if k != "stats"}, CPU), 0.1, "sdpa",
                             1.0)[0] for b in batches]
    (sum(losses) / 2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state["model"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_bad_settings_fail_before_any_training(tmp_path):
    with pytest.raises(ValueError, match="--init-weights .*no such file"):
        T.run(_args(tmp_path / "a", "--init-weights", str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="--attn flex trains on CUDA only"):
        T.run(_args(tmp_path / "b", "--attn", "flex"))
    assert not (tmp_path / "a" / STATE_FILE).exists() and not (tmp_path / "b" / STATE_FILE).exists()
