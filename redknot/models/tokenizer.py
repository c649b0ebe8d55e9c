"""A small byte-level BPE tokenizer built in memory: the tokenizer of random-weight architectures
(benchmarks) and of the tiny test checkpoints, so neither needs a tokenizer file."""

from __future__ import annotations

_CORPUS = """The quick brown fox jumps over the lazy dog. A river flows past the old mill at dawn.
Documents are split into chunks; each chunk is cached once and reused at any position.
Question: who founded the city of Varna? Answer: the merchant Ilsa Torv founded it in 1120.
Attention heads differ: some look far back, most look at recent tokens and a few sinks.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 the and of to in is was for on with as by"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 384):
    """A small byte-level BPE tokenizer wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)
