"""The testbed: the synthetic multi-document QA corpus and the small model trained on it.

``model_path()`` / ``head_config_path()`` locate the checkpoint bundled inside the package
(``redknot/testbed/model/``); a build without one raises ``FileNotFoundError``.

The corpus: ``templates`` (words and sentences), ``world`` (entities and their names),
``documents`` (a document's plan and text), ``clusters`` (the documents and question of one
question type), ``records`` (contexts of clusters as QA records, ``generate_records``), ``easy``
(the easy curriculum's one-sentence facts) and ``answers`` (the answer a model is trained to write).
The model's training: ``train`` (the command line), ``trainer`` (the loop, logging, data
parallelism), ``stages``, ``tokenizer``, ``architecture``, ``packing``, ``masks``, ``step``,
``schedule``, ``evaluate`` and ``checkpoint``. ``cli`` wires ``redknot testbed ...``; ``hops``
is the multi_hop diagnostic.
"""

from __future__ import annotations

from pathlib import Path

from ..models.resolve import BUNDLED_MODEL_DIR, bundled_model_path
from ..qa.records import read_jsonl, write_jsonl
from .easy import easy_records
from .records import TYPES, generate_records

__all__ = ["TYPES", "generate_records", "easy_records", "read_jsonl", "write_jsonl", "model_path",
           "head_config_path"]

_MODEL_DIR = BUNDLED_MODEL_DIR


def model_path() -> Path:
    """The bundled testbed checkpoint directory (HF layout: ``config.json``, safetensors, tokenizer)."""
    return bundled_model_path(_MODEL_DIR)


def head_config_path() -> Path:
    """The head config of the bundled testbed model (``redknot/testbed/model/heads.json``)."""
    path = Path(_MODEL_DIR) / "heads.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no bundled testbed head config at {path} (this build of redknot ships no testbed model yet): pass "
            f"a checkpoint with --model DIR / LLM(model=DIR) and its head config with --head-config FILE / "
            f"LLM(head_config=FILE), or write one with `redknot profile --model DIR --out heads.json`")
    return path
