"""The run's tokenizer: a byte-level BPE trained on the corpus itself, saved once per run directory."""

from __future__ import annotations

import time
from pathlib import Path

from .stages import Stage, stage_records

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]  # role markers: one token each
TOKENIZER_SEED = 30_000       # the tokenizer's training text: neither held-out nor a training batch
TOKENIZER_FILE = "tokenizer.json"


def _tokenizer_texts(seed: int, contexts: int):
    """Documents, questions and answers of both corpus kinds, plus the chat scaffolding."""
    per_kind = max(1, contexts // 2)
    for stage in (Stage("easy", 512), Stage("qa", 1024)):
        for r in stage_records(stage, seed, per_kind, questions_per_context=4):
            yield from r["documents"]
            yield r["question"] + "\n" + "\n".join(r["answers"])
    yield "<|user|>\n<|assistant|>\n\n"


def train_tokenizer(vocab_size: int, seed: int = TOKENIZER_SEED, contexts: int = 200):
    """A byte-level BPE trained on generated text, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ..models.tokenizer import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tokenizer_texts(seed, contexts), trainer)
    # Plain (non-chat) encodes start with <s>, like Llama's; build_prompt's chat path adds no specials.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def load_or_train_tokenizer(out: Path, vocab_size: int, contexts: int, log=print):
    from transformers import PreTrainedTokenizerFast

    if (out / TOKENIZER_FILE).is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(out))
    t0 = time.time()
    tokenizer = train_tokenizer(vocab_size, contexts=contexts)
    tokenizer.save_pretrained(str(out))
    log(f"trained a {len(tokenizer)}-token byte-level BPE in {time.time() - t0:.1f}s -> {out / TOKENIZER_FILE}")
    return tokenizer
