"""The training loop of one invocation, its log, and data parallelism over one host's GPUs.

A ``Trainer`` sets up a run (new, from ``--init-weights``, or resumed from ``train_state.pt``), then
trains its stages until the curriculum is done or the invocation stops (``--time-budget``, SIGTERM,
``--stop-after-steps``), always leaving a state to resume from and a loadable model. Every
``--eval-every`` steps and at every stage end it logs held-out EM; ``--advance-em`` ends a stage
once it is learned. On GPU it runs bf16 autocast, TF32 matmuls, fused AdamW, FlexAttention with the
block mask, and background DataLoader workers that build batches ahead. ``--time-budget`` stops
cleanly (state + model saved) before a wall-clock limit; with ``--fit-steps`` the last stage is
shortened instead, so its cosine ends inside the budget.

Data parallel: under ``torchrun --standalone --nproc_per_node N -m redknot.testbed.train ...`` each
rank trains on its own batches (rank r draws shard r of every step; rank 0's are a one-process
run's), DDP averages the gradients, so a step sees N x ``--batch-tokens``; rank 0 logs, evaluates
and saves, and the ranks agree on stopping at log, eval and save steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .architecture import _HF_ATTN, SIZES, build_model, count_parameters, grow_depth, make_config
from .checkpoint import MODEL_DIR, STATE_FILE, load_state, restore_rng, save_model, save_state
from .evaluate import evaluate
from .packing import StageBatches, StagePlan, plan_stage
from .records import BRIDGED_TYPES
from .schedule import fit_steps, lr_factor
from .stages import HELDOUT_SEED, Stage, parse_stages, stage_records
from .step import make_optimizer, to_device, train_step
from .tokenizer import TOKENIZER_FILE, load_or_train_tokenizer

LOG_FILE = "train_log.jsonl"
FIT_AFTER_STEPS = 20  # --fit-steps: steps timed (after the invocation's first) before the stage is fitted


class Log:
    """One line per event to stdout and one JSON object per event to ``train_log.jsonl``
    (``path`` None: silent, as on every data-parallel rank but the first)."""

    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, text: str, **record) -> None:
        if self.path is None:
            return
        print(text, flush=True)
        if record:
            with open(self.path, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def _reasoned_types(spec: str | None) -> tuple[str, ...]:
    types = tuple(spec.split("+")) if spec else ()
    bad = [t for t in types if t not in BRIDGED_TYPES]
    if bad or len(set(types)) != len(types):
        raise ValueError(f"--reasoned-answers {spec}: give distinct types among {'+'.join(BRIDGED_TYPES)} "
                         f"(the types with a bridge entity)")
    return types


def _steps(args, stages: list[Stage]) -> list[int]:
    s = list(args.steps_per_stage)
    if len(s) == 1:
        s = s * len(stages)
    if len(s) != len(stages) or any(n <= 0 for n in s):
        raise ValueError(f"--steps-per-stage: give one positive count, or one per stage ({len(stages)})")
    return s


def _loader(dataset: StageBatches, start: int, workers: int, pin: bool):
    kw = dict(num_workers=workers, pin_memory=pin)
    if workers:
        kw.update(prefetch_factor=4)
    return torch.utils.data.DataLoader(dataset, batch_size=None, sampler=range(start, len(dataset)), **kw)


def _fast_math(device: torch.device) -> None:
    # TF32 for the fp32 matmuls outside autocast (the optimizer's are elementwise): the same switch
    # as torch.backends.cuda.matmul.allow_tf32 = True, through the API that newer torch prefers
    torch.set_float32_matmul_precision("high")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = True


class Trainer:
    """One invocation of a training run: set up (new, or resumed from ``train_state.pt``), then run
    the stages until the curriculum is done or the invocation has to stop (time budget, SIGTERM,
    ``--stop-after-steps``), always leaving a state to resume from and a loadable model."""

    def __init__(self, args):
        self.t_start = time.time()
        self.args = args
        self.rank, self.world, local_rank = _distributed()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = Log(self.out / LOG_FILE if self.rank == 0 else None)  # rank 0 logs, evaluates and saves
        reasoned = _reasoned_types(args.reasoned_answers)
        if args.restate_bridge and not reasoned:
            raise ValueError("--restate-bridge restates reasoned answers: add --reasoned-answers")
        self.stages = [replace(st, reasoned=reasoned, restate=args.restate_bridge) if st.kind == "qa" else st
                       for st in parse_stages(args.stages)]
        self.steps = _steps(args, self.stages)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", local_rank)
        _fast_math(self.device)
        if args.attn == "auto":
            args.attn = "flex" if self.device.type == "cuda" else "sdpa"
        if args.attn == "flex" and self.device.type != "cuda" and not args.export:
            raise ValueError(f"--attn flex trains on CUDA only (FlexAttention has no backward on {self.device.type}); "
                             f"use --attn sdpa or auto")
        if args.init_weights and not Path(args.init_weights).exists():
            raise ValueError(f"--init-weights {args.init_weights}: no such file or directory "
                             f"(a train_state.pt or an HF checkpoint directory)")
        state = self._read_state()
        init_dir = Path(args.init_weights) if state is None and args.init_weights else None
        init_dir = init_dir if init_dir is not None and init_dir.is_dir() else None
        if args.grow_layers and state is None and init_dir is None:
            raise SystemExit("--grow-layers deepens a checkpoint: give it with --init-weights DIR")
        size = SIZES[args.size]
        self.tokenizer = None
        if self.rank == 0:  # the run's tokenizer: one process writes it, the others then read it
            if init_dir is not None and not (self.out / TOKENIZER_FILE).is_file():  # its vocabulary, not a new one
                for f in (TOKENIZER_FILE, "tokenizer_config.json", "chat_template.jinja"):
                    if (init_dir / f).is_file():
                        shutil.copy(init_dir / f, self.out / f)
            self.tokenizer = load_or_train_tokenizer(self.out, args.vocab_size or size["vocab_size"],
                                                     args.tokenizer_contexts or (24 if args.size == "tiny" else 400),
                                                     self.log)
        if self.world > 1:
            torch.distributed.barrier()
            if self.tokenizer is None:
                from transformers import PreTrainedTokenizerFast

                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.out))
        if state is not None:
            from transformers import LlamaConfig

            config = LlamaConfig.from_dict(state["config"])
            config._attn_implementation = _HF_ATTN[args.attn]
        elif init_dir is not None:  # the checkpoint's own architecture
            from transformers import LlamaConfig

            config = LlamaConfig.from_pretrained(init_dir)
            config._attn_implementation = _HF_ATTN[args.attn]
            init_layers = config.num_hidden_layers
            if args.grow_layers:
                config.num_hidden_layers = args.grow_layers
        else:
            config = make_config(args.size, self.tokenizer, args.attn)
        self.model = build_model(config, args.seed).to(self.device)
        self.optimizer = make_optimizer(self.model, args.lr, args.weight_decay, self.device)
        self.stage_i, self.step, self.tokens_seen, self.plans = 0, 0, 0, {}
        self.invocation_steps, self._unsynced_tokens = 0, 0
        if state is not None:
            self._restore(state)
        elif init_dir is not None:
            from safetensors.torch import load_file

            weights = load_file(init_dir / "model.safetensors")
            if args.grow_layers:
                weights = grow_depth(weights, init_layers, args.grow_layers)
            missing, unexpected = self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is not stored
                raise SystemExit(f"--init-weights {init_dir}: not this architecture "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            grown = f", grown from {init_layers} to {args.grow_layers} layers" if args.grow_layers else ""
            self.log(f"initialised from the checkpoint {init_dir}{grown}", event="init", path=str(init_dir),
                     layers=config.num_hidden_layers, grown_from=init_layers if args.grow_layers else None)
        elif args.init_weights:
            init = torch.load(args.init_weights, map_location="cpu", weights_only=False)
            self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init["model"].items()})
            self.log(f"initialised from {args.init_weights} (stage {init['stage'] + 1}, step {init['step']})",
                     event="init", path=str(args.init_weights))
        self.fwd = self.model
        if self.world > 1:  # data parallel: each rank its own batches, gradients averaged in backward
            from torch.nn.parallel import DistributedDataParallel

            self.fwd = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.index
                                               is not None else None)
        self.fwd = torch.compile(self.fwd) if args.compile else self.fwd
        # Building a batch is Python work (corpus generation + tokenization; ~5 s of one core for an
        # easy batch of 128K tokens), so on GPU every spare core builds batches ahead of the loop.
        self.workers = args.workers if args.workers is not None else (
            max(1, ((os.cpu_count() or 2) - 2) // self.world) if self.device.type == "cuda" else 0)
        self.last_em, self.stop_signal = None, None
        self.seconds = {"save": 30.0, "eval": 0.0, "step": 0.0}  # what a clean stop must leave time for
        self.periodic_save_s = None  # the last --save-every checkpoint's duration
        self.run_args = {"stages": [st.as_dict() for st in self.stages], "steps": self.steps, "size": args.size,
                         "seed": args.seed, "lr": args.lr, "batch_tokens": args.batch_tokens,
                         "lm_weight": args.lm_weight, "first_weight": args.first_weight,
                         "questions_per_context": args.questions_per_context, "init_weights": args.init_weights}
        if args.grow_layers:
            self.run_args["grow_layers"] = args.grow_layers
        self.fitted = dict(state["args"].get("fitted", {})) if state is not None else {}  # stage index -> steps
        for k, n in self.fitted.items():
            if int(k) < len(self.steps):
                self.steps[int(k)] = n
        self.run_args["fitted"] = self.fitted
        self._fit_clock = None  # (time, step) when this invocation's timing of the last stage began
        n, c = count_parameters(self.model), config
        self.log(f"model: {args.size}, {n / 1e6:.2f}M parameters, {c.num_hidden_layers} layers, hidden "
                 f"{c.hidden_size}, {c.num_attention_heads} query / {c.num_key_value_heads} KV heads x {c.head_dim}, "
                 f"vocab {c.vocab_size}; device {self.device}, attention {args.attn}, {self.workers} data workers"
                 f"{f' per rank, {self.world} data-parallel ranks' if self.world > 1 else ''}",
                 event="start", params=n, size=args.size, device=str(self.device), resumed=state is not None,
                 ranks=self.world)

    # -- state --
    def _read_state(self) -> dict | None:
        path = self.out / STATE_FILE
        if not path.is_file():
            if self.args.export:
                raise SystemExit(f"--export: no {path}")
            if self.args.resume:
                self.log(f"--resume: no {path} yet, starting a new run")
            return None
        if not (self.args.resume or self.args.export):
            raise SystemExit(f"{path} exists: pass --resume to continue it, or use a new --out")
        state = load_state(self.out)
        saved = [Stage(**st) for st in state["args"]["stages"]]
        if self.args.export:  # the saved run's curriculum and settings, whatever the command line says
            self.stages, self.steps = saved, list(state["args"]["steps"])
            self.saved_args = state["args"]
        if saved[:len(self.stages)] != self.stages[:len(saved)]:  # a resumed run may only add stages
            raise SystemExit(f"--stages {self.args.stages} does not match the saved run's "
                             f"{','.join(st.name for st in saved)}")
        self.args.size = state["args"]["size"]  # the architecture is the saved one
        return state

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        self.stage_i, self.step, self.tokens_seen = state["stage"], state["step"], state["tokens_seen"]
        self.plans = {k: StagePlan(**v) for k, v in state["plans"].items()}
        self.log(f"resumed {self.out}: stage {self.stage_i + 1}/{len(self.stages)}, step {self.step}",
                 event="resume", stage=self.stage_i, step=self.step)

    def checkpoint(self, write_model: bool = False) -> None:
        if self.rank != 0:
            return
        t0 = time.time()
        save_state(self.out, self.model, self.optimizer, self.stage_i, self.step, self.plans, self.run_args,
                   self.tokens_seen)
        if write_model:
            save_model(self.out, self.model, self.tokenizer,
                       {"run": self.run_args, "stage": self.stage_i, "step": self.step,
                        "tokens_seen": self.tokens_seen, "heldout": self.last_em})
        self.seconds["save"] = max(self.seconds["save"], 2 * (time.time() - t0))
        if not write_model:
            self.periodic_save_s = time.time() - t0

    # -- the loop --
    def export(self) -> int:
        """Write ``OUT/model`` from the restored state and stop (no training step)."""
        if self.rank != 0:  # under torchrun: one writer
            return 0
        path = save_model(self.out, self.model, self.tokenizer,
                          {"run": self.saved_args, "stage": self.stage_i, "step": self.step,
                           "tokens_seen": self.tokens_seen, "heldout": self._last_logged_em()})
        self.log(f"exported stage {self.stage_i + 1} step {self.step} -> {path}")
        return 0

    def _last_logged_em(self) -> dict | None:
        path = self.out / LOG_FILE
        evals = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        evals = [e for e in evals if e.get("event") == "eval"]
        return {k: evals[-1][k] for k in ("stage_name", "step", "em", "em_by_type", "n")} if evals else None

    def run(self) -> int:
        if self.args.export:
            return self.export()
        previous = _on_sigterm(lambda *_: setattr(self, "stop_signal", "SIGTERM"))
        try:
            while self.stage_i < len(self.stages):
                if not self._train_stage():
                    return 0
        finally:
            _on_sigterm(previous)
        self.log(f"done: {len(self.stages)} stages, {self.tokens_seen:,} tokens, {time.time() - self.t_start:.0f}s; "
                 f"model in {self.out / MODEL_DIR}", event="done", tokens_seen=self.tokens_seen,
                 model=str(self.out / MODEL_DIR), heldout=self.last_em)
        return 0

    def _plan(self) -> StagePlan:
        key, stage = str(self.stage_i), self.stages[self.stage_i]
        if key not in self.plans:
            self.plans[key] = plan_stage(self.tokenizer, stage, self.stage_i, self.args.batch_tokens,
                                         self._questions(stage), 2048 if self.args.attn == "flex" else 0)
        plan = self.plans[key]
        if self.step == 0:
            self.log(f"stage {self.stage_i + 1}/{len(self.stages)} {stage.name}: {self.steps[self.stage_i]} steps, "
                     f"{plan.rows} rows of {plan.row_len} tokens, contexts ~{plan.mean_context_tokens} tokens "
                     f"(tokens/word {plan.tokens_per_word})", event="stage", stage=self.stage_i,
                     stage_name=stage.name, plan=asdict(plan))
        return plan

    def _train_stage(self) -> bool:
        """Train the current stage to its end (True) or until the invocation must stop (False)."""
        plan, stage, steps = self._plan(), self.stages[self.stage_i], self.steps[self.stage_i]
        data = StageBatches(self.tokenizer, stage, self.stage_i, self.args.seed, plan.rows, plan.row_len,
                            self._questions(stage), plan.tokens_per_word, plan.est_group_tokens, steps, self.rank)
        self._window = (time.time(), self.tokens_seen, [])  # since the last log line: start, tokens seen, losses
        evaluated = False
        args = self.args
        for batch in _loader(data, self.step, self.workers, self.device.type == "cuda"):
            step = self.step + 1
            eval_now = bool(args.eval_every and step % args.eval_every == 0)
            save_now = bool(args.save_every and step % args.save_every == 0)
            # ranks meet (losses and token counts summed, the stop agreed) only at these steps
            sync = (step % args.log_every == 0 or step == steps or self.invocation_steps == 0 or eval_now
                    or save_now)
            self._train_step(batch, plan, sync)
            evaluated = False
            steps = self._maybe_fit(steps)
            if self.step == steps:
                break
            if eval_now:
                self.heldout()
                evaluated = True
                if self._agree(self._learned()):
                    break
            if save_now:
                self.checkpoint()
            why = self._stop_reason() if self.world == 1 or sync else None
            if self.world > 1 and sync:
                why = self._agree(why)
            if why:
                return self._stop(why)
        if not evaluated:
            self.heldout()
        if self.step < steps and self.rank == 0:
            self.log(f"stage {stage.name} learned at step {self.step}/{steps}: held-out EM {self.last_em['em']:.3f} "
                     f">= --advance-em {self.args.advance_em}", event="advance", stage=self.stage_i, step=self.step)
        self.stage_i, self.step = self.stage_i + 1, 0
        self.checkpoint(write_model=True)
        why = self._agree(self._stop_reason()) if self.stage_i < len(self.stages) else None
        if why:
            return self._stop(why)
        return True

    def _train_step(self, batch: dict, plan: StagePlan, sync: bool) -> None:
        t0, args, steps = time.time(), self.args, self.steps[self.stage_i]
        for g in self.optimizer.param_groups:
            g["lr"] = args.lr * lr_factor(self.step, steps, args.warmup)
        stats = batch.pop("stats").tolist()  # real tokens, questions, contexts
        losses = train_step(self.fwd, self.optimizer, to_device(batch, self.device), args.lm_weight, args.attn,
                            self.device, first_weight=args.first_weight)
        self.step += 1
        self.invocation_steps += 1
        self._unsynced_tokens += stats[0]
        start, seen_at_start, acc = self._window
        acc.append(torch.stack(losses))
        log_now = not (self.step % args.log_every and self.step != steps and self.invocation_steps != 1)
        if self.world == 1:
            self.tokens_seen, self._unsynced_tokens = self.tokens_seen + self._unsynced_tokens, 0
            if not log_now:
                return
            loss, answer, text, first = torch.stack(acc).mean(0).tolist()  # the one host sync per log line
        else:  # every log step is a sync step: all ranks' tokens (sum) and, to log, losses (mean)
            if not sync:
                return
            vec = torch.tensor([float(self._unsynced_tokens)], device=self.device)
            if log_now:
                vec = torch.cat([vec, torch.stack(acc).mean(0).float() / self.world])
            torch.distributed.all_reduce(vec)
            tokens, *mean = vec.tolist()
            self.tokens_seen, self._unsynced_tokens = self.tokens_seen + int(round(tokens)), 0
            if not log_now:
                return
            loss, answer, text, first = mean
        tokens = self.tokens_seen - seen_at_start
        dt = time.time() - start
        fill, lr = stats[0] / (plan.rows * plan.row_len), self.optimizer.param_groups[0]["lr"]
        self.seconds["step"] = max(self.seconds["step"], 2 * (time.time() - t0))
        self.log(f"[{self.stages[self.stage_i].name}] step {self.step}/{steps} loss {loss:.4f} (answer {answer:.4f}, "
                 f"first {first:.3f}, text {text:.4f}) lr {lr:.2e} {tokens / dt:,.0f} tok/s fill {fill:.0%} "
                 f"q/step {stats[1]}", event="train", stage=self.stage_i, stage_name=self.stages[self.stage_i].name,
                 step=self.step, loss=loss, answer_loss=answer, first_token_loss=first, text_loss=text, lr=lr,
                 tokens_per_s=tokens / dt, fill=fill,
                 questions=stats[1], tokens_seen=self.tokens_seen)
        self._window = (time.time(), self.tokens_seen, [])

    def _maybe_fit(self, steps: int) -> int:
        """--fit-steps: shorten the last stage once, from its measured step time (the invocation's first
        step, which carries start-up costs, is not timed), so the cosine ends inside --time-budget."""
        a = self.args
        if (not a.fit_steps or a.time_budget is None or self.stage_i != len(self.stages) - 1
                or str(self.stage_i) in self.fitted):
            return steps
        if self._fit_clock is None:
            self._fit_clock = (time.time(), self.step)
            return steps
        t0, s0 = self._fit_clock
        if self.step - s0 < FIT_AFTER_STEPS:
            return steps
        now = time.time()
        # what the stop rule keeps in reserve (a final save, an evaluation, a slow step) is not the stage's
        left = a.time_budget - (now - self.t_start) - sum(self.seconds.values())
        eval_s = max(self.seconds["eval"], 5.0)  # before the stage's first evaluation: a guess
        save_s = self.periodic_save_s if self.periodic_save_s is not None else 5.0  # before the first: a guess
        fitted = self._agree(fit_steps(self.step, steps, left, (now - t0) / (self.step - s0), a.eval_every, eval_s,
                                       a.save_every, save_s))
        self.fitted[str(self.stage_i)] = self.steps[self.stage_i] = fitted
        self.log(f"fitted stage {self.stages[self.stage_i].name} to {fitted} steps (asked {steps}) for --time-budget "
                 f"{a.time_budget:g}s: {(now - t0) / (self.step - s0):.3f}s a step", event="fit", stage=self.stage_i,
                 step=self.step, steps=fitted, asked=steps)
        return fitted

    def _questions(self, stage: Stage) -> int:
        return stage.questions or self.args.questions_per_context

    def _learned(self) -> bool:
        return (self.args.advance_em is not None and self.last_em is not None
                and self.last_em["em"] >= self.args.advance_em)

    def _agree(self, value):
        """Rank 0's value (a bool or None-or-str stop reason) on every rank; as is in one process."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def heldout(self) -> None:
        """Held-out EM of the current stage (greedy, SQuAD-normalised), overall and per type; rank 0
        evaluates while the other ranks wait at the next step's gradient exchange."""
        if self.rank != 0:
            return
        t0, s_i = time.time(), self.stage_i
        stage = self.stages[s_i]
        # the training distribution (same questions per context), on contexts no training batch draws
        qpc = self._questions(stage)
        records = stage_records(stage, HELDOUT_SEED + s_i, math.ceil(self.args.eval_n / qpc), qpc,
                                self.plans[str(s_i)].tokens_per_word)[:self.args.eval_n]
        res = evaluate(self.model, self.tokenizer, records, self.device, stage.reasoned, stage.restate)
        self.last_em = {"stage": stage.name, **{k: res[k] for k in ("em", "em_by_type", "n")}}
        self.seconds["eval"] = time.time() - t0
        by_type = " ".join(f"{k} {v:.3f}" for k, v in res["em_by_type"].items())
        self.log(f"  eval {stage.name} step {self.step}: EM {res['em']:.3f} ({by_type}) n={res['n']} "
                 f"[{self.seconds['eval']:.1f}s] e.g. {res['examples'][0]}", event="eval", stage=s_i,
                 stage_name=stage.name, step=self.step, em=res["em"], em_by_type=res["em_by_type"], n=res["n"],
                 examples=res["examples"])

    # -- stopping --
    def _stop_reason(self) -> str | None:
        if self.stop_signal:
            return self.stop_signal
        if self.args.stop_after_steps and self.invocation_steps >= self.args.stop_after_steps:
            return "--stop-after-steps"
        if self.args.time_budget is not None:
            # the next step may bring an evaluation, and the stop a save: leave time for both
            left = self.args.time_budget - (time.time() - self.t_start)
            if left < sum(self.seconds.values()):
                return "time budget"
        return None

    def _stop(self, why: str) -> bool:
        self.checkpoint(write_model=True)
        self.log(f"stopped ({why}) at stage {self.stage_i + 1}/{len(self.stages)} step {self.step}: "
                 f"rerun with --resume", event="stop", reason=why, stage=self.stage_i, step=self.step,
                 tokens_seen=self.tokens_seen)
        return False


def _on_sigterm(handler):
    """Install a SIGTERM handler (main thread only) and return the previous one."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None if handler is None else signal.SIG_DFL


def _distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun; (0, 1, 0) in one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))


def run(args) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # data workers fork after the tokenizer is used
    rank, world, local_rank = _distributed()
    if world == 1 or torch.distributed.is_initialized():
        return Trainer(args).run()
    cuda = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    try:
        code = Trainer(args).run()
        # rank 0 may still be saving: a gloo rank that tears its group down while its peer is busy
        # can abort ("terminate called without an active exception"), so every rank leaves together
        torch.distributed.barrier()
        return code
    finally:
        torch.distributed.destroy_process_group()
