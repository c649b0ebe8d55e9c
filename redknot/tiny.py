"""Tiny random HF checkpoints of each supported family, written with transformers' own
``save_pretrained`` so tests and the demo exercise the real loading path without any download."""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

ROPE_VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}

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


def make_tiny_checkpoint(path: str | Path, family: str = "llama", rope: str = "default",
                         tie_word_embeddings: bool = False, num_hidden_layers: int = 2,
                         num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                         max_position_embeddings: int = 1024, seed: int = 0, sharded: bool = False,
                         **overrides) -> Path:
    """Write a random checkpoint (config.json, safetensors, tokenizer) and return its directory."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: use one of {FAMILIES}")
    path = Path(path)
    tokenizer = make_tokenizer()
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    rope_params = {"rope_theta": 10000.0, **ROPE_VARIANTS[rope]}
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=num_attention_heads * head_dim, intermediate_size=96,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, initializer_range=0.08, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_parameters=rope_params,
    )
    if family == "mistral":
        kwargs["sliding_window"] = None  # full attention unless a test asks for a window
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "qwen2":  # HF initialises biases to zero; make them matter in the comparison
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.05)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    tokenizer.save_pretrained(path)
    return path
