"""One rank's share of a Llama-family model: its config, its modules and its weight slices.

A ``Shard`` maps every full checkpoint tensor to the rank's slice (``slice``), so the loader
reads each tensor once and keeps 1/N of it (``models.loader.load_model(shard=...)``), and
``shard_model`` does the same from a model already in memory. KV heads go to ranks in blocks of
``Hkv / N`` after a per-layer permutation (``balance.py``), each with its query heads; the head
plan is permuted and sliced the same way (``head_config``), so every rank's pool and plan cover
exactly the heads it computes.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from ..config import HeadConfig
from ..models.config import ModelConfig, UnsupportedModelError
from ..models.registry import model_class
from ..models.rope import RotaryEmbedding
from .layers import GatherLogits, VocabParallelEmbedding, head_rows, query_heads, vocab_range, vocab_rows

# The families whose layers this splits (the Llama adapter's dense decoders)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """Raise a clear error where ``cfg`` cannot be split over ``world`` ranks."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    if world == 1:
        return
    if cfg.model_type not in SUPPORTED:
        raise UnsupportedModelError(f"tensor_parallel_size={world}: model_type {cfg.model_type!r} is not split "
                                    f"across ranks yet (supported: {', '.join(SUPPORTED)})")
    if cfg.attention_sinks or (cfg.qk_norm and not cfg.qk_norm_per_head):
        raise UnsupportedModelError(f"tensor_parallel_size={world}: attention sinks / whole-projection q/k norms "
                                    "are not split across ranks")
    for field, n in (("num_key_value_heads", cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            raise UnsupportedModelError(f"tensor_parallel_size={world} does not divide {field}={n}")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's model: 1/N of the query and KV heads and of the MLP width."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                               num_key_value_heads=cfg.num_key_value_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def identity_order(cfg: ModelConfig) -> list[list[int]]:
    return [list(range(cfg.num_key_value_heads)) for _ in range(cfg.num_hidden_layers)]


@dataclasses.dataclass
class Shard:
    cfg: ModelConfig  # the full model's
    rank: int
    world: int
    order: list[list[int]] | None = None  # per layer, the KV heads in rank order (None: 0..Hkv-1)

    def __post_init__(self):
        check_tensor_parallel(self.cfg, self.world)
        self.order = self.order or identity_order(self.cfg)
        self.local = local_config(self.cfg, self.world)

    def kv_heads(self, layer: int) -> list[int]:
        """The checkpoint's KV heads of ``layer`` this rank holds, in its order."""
        k = self.local.num_key_value_heads
        return self.order[layer][self.rank * k:(self.rank + 1) * k]

    def head_config(self, hc: HeadConfig | None) -> HeadConfig | None:
        """The rank's slice of a head plan: its (layer, KV head) entries, in its order."""
        if hc is None:
            return None
        pick = [self.kv_heads(l) for l in range(hc.num_layers)]
        cut = lambda rows: [[row[h] for h in heads] for row, heads in zip(rows, pick)]  # noqa: E731
        return dataclasses.replace(hc, classes=cut(hc.classes), windows=cut(hc.windows), sinks=cut(hc.sinks),
                                   metadata={**hc.metadata, "tensor_parallel": {"rank": self.rank, "world": self.world,
                                                                              "kv_heads": pick}})

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of the full checkpoint tensor ``name``."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_rows(tensor, self.rank, self.world)
        m = _LAYER_KEY.match(name)
        if m is None:
            return tensor  # norms: every rank holds them whole
        layer, block, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        d, cfg = self.cfg.head_dim, self.cfg
        heads = self.kv_heads(layer)
        if proj == "q_proj":
            return tensor[head_rows(query_heads(heads, cfg.num_kv_groups), d)]
        if proj in ("k_proj", "v_proj"):
            return tensor[head_rows(heads, d)]
        if proj in ("gate_proj", "up_proj"):
            n = self.local.intermediate_size
            return tensor[self.rank * n:(self.rank + 1) * n]
        if proj in ("o_proj", "down_proj") and kind == "bias":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)  # added once over the sum
        if proj == "o_proj":
            return tensor[:, head_rows(query_heads(heads, cfg.num_kv_groups), d)]
        if proj == "down_proj":
            n = self.local.intermediate_size
            return tensor[:, self.rank * n:(self.rank + 1) * n]
        return tensor  # q_norm / k_norm: one [head_dim] weight every head shares

    def build(self) -> nn.Module:
        """The rank's model with uninitialised weights (under the caller's device / dtype context)."""
        model = model_class(self.local)(self.local)
        start, rows = vocab_range(self.cfg.vocab_size, self.rank, self.world)
        model.model.embed_tokens = VocabParallelEmbedding(rows, self.cfg.hidden_size, start)
        model.lm_head = nn.Linear(self.cfg.hidden_size, rows, bias=False)
        if self.cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def connect(self, model: nn.Module, group) -> nn.Module:
        """Wire the model's collectives to ``group`` (None: none, each rank's partial outputs stay)."""
        reduce = None if group is None else group.all_reduce
        model.model.embed_tokens.reduce = reduce
        for layer in model.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = reduce
        model.gather_logits = None if group is None else GatherLogits(group, self.cfg.vocab_size)
        model.tensor_parallel = (self.rank, self.world)
        return model


def shard_model(full: nn.Module, shard: Shard, group=None) -> nn.Module:
    """The rank's model cut from a full one in memory (the post-load path; ``load_model(shard=)``
    reads a checkpoint straight into shards)."""
    weight = next(full.parameters())
    with torch.device("meta"):
        model = shard.build()
    model = model.to(weight.dtype).to_empty(device=weight.device)
    if shard.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in full.state_dict().items():
            if name in params:
                params[name].copy_(shard.slice(name, tensor))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_frequencies(weight.device)
    return shard.connect(model.eval(), group)
