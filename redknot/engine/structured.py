"""Structured output with xgrammar (vLLM's default backend): a request's constraint, its compiled
grammar (cached by the constraint's text), a matcher per sequence, and the batched token bitmask
the sampler applies.

Compilation runs when a request is made (``LLM.make_sequence``; the server calls it in its
tokenizer threads), never inside the engine's step loop. Each step the sampler fills one bitmask
row per constrained sequence (``BatchGrammarMatcher``, threads in C++) and masks the logits in one
call; the engine then advances each matcher with the token it took.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint, as vLLM's ``StructuredOutputsParams``: exactly one of a JSON schema
    (``json``, a dict or its text), any JSON object (``json_object``), a regular expression, a
    choice among strings, or an EBNF grammar (xgrammar's GBNF dialect)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(given) or 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple:
        return (self.json, self.regex, self.choice, self.grammar, self.json_object)


def choice_grammar(choices) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are the grammar's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiles constraints for one tokenizer and keeps the last ``capacity`` compiled grammars
    (keyed by the constraint's text), so a schema every request sends compiles once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, capacity: int = 256):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.info = info  # its decoded_vocab: each token's bytes, whatever the tokenizer's kind
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size, self.capacity = vocab_size, capacity
        # tokens holding a raw control character (U+0000-U+001F): never valid in JSON without
        # whitespace, but xgrammar's JSON string rule lets them through (json.loads then fails)
        self.control_ids = torch.tensor([i for i, b in enumerate(info.decoded_vocab)
                                         if i not in info.special_token_ids and any(c < 0x20 for c in b)],
                                        dtype=torch.long)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputs):
        """The compiled grammar of ``so``; raises ValueError naming what is wrong with it."""
        with self._lock:
            hit = self._cache.get(so.key)
            if hit is not None:
                self._cache.move_to_end(so.key)
                return hit
        c = self.compiler
        try:
            if so.json is not None:
                # compact separators: whitespace the model could repeat forever is not in the grammar
                g = c.compile_json_schema(so.json, any_whitespace=False)
            elif so.json_object:  # any object, compact (no whitespace the model could repeat forever)
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif so.regex is not None:
                g = c.compile_regex(so.regex)
            elif so.choice is not None:
                g = c.compile_grammar(choice_grammar(so.choice))
            else:
                g = c.compile_grammar(so.grammar)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            what = "json schema" if so.json is not None else "regex" if so.regex is not None else \
                "grammar" if so.grammar is not None else "choice"
            raise ValueError(f"invalid {what} for structured output: {str(e).strip().splitlines()[0][:300]}") from None
        with self._lock:
            self._cache[so.key] = g
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return g

    def matcher(self, so: StructuredOutputs) -> "GrammarState":
        forbid = self.control_ids if so.json is not None or so.json_object else None
        return GrammarState(self._xgr.GrammarMatcher(self.compile(so)), self.vocab_size, forbid)


class GrammarState:
    """One sequence's place in its grammar (``forbid``: token ids masked besides the grammar's)."""

    def __init__(self, matcher, vocab_size: int, forbid: torch.Tensor | None = None):
        self.matcher, self.vocab_size, self.forbid = matcher, vocab_size, forbid

    def accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


_batch = None  # one BatchGrammarMatcher (its thread pool) per process


def apply_grammars(logits: torch.Tensor, grammars: list) -> None:
    """Mask, in place, every token a row's grammar does not allow next (rows without one keep
    their logits). One bitmask for the batch, filled in parallel, applied in one call."""
    import xgrammar as xgr

    global _batch
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not rows:
        return
    vocab = grammars[rows[0]].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    if len(rows) == 1:
        grammars[rows[0]].matcher.fill_next_token_bitmask(bitmask, rows[0])
    else:
        if _batch is None:
            _batch = xgr.BatchGrammarMatcher()
        _batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bitmask, indices=rows)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, logits.shape[-1]), indices=rows)
    groups: dict[int, list[int]] = {}  # rows by the token set they forbid (one set per tokenizer)
    for i in rows:
        forbid = grammars[i].forbid
        if forbid is not None and forbid.numel():
            groups.setdefault(id(forbid), []).append(i)
    with torch.inference_mode():  # the model's logits are inference tensors
        for members in groups.values():
            forbid = _on(grammars[members[0]].forbid, logits.device)
            idx = torch.tensor(members, device=logits.device)
            logits[idx[:, None], forbid[None, :]] = float("-inf")


_device_copies: dict = {}


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied once per tensor and device."""
    if t.device == device:
        return t
    key = (id(t), str(device))
    hit = _device_copies.get(key)
    if hit is None or hit[0] is not t:
        hit = _device_copies[key] = (t, t.to(device))
    return hit[1]
