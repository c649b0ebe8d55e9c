import os
from pathlib import Path

import pytest

# Triton kernels run on CPU through its interpreter.
if os.environ.get("REDKNOT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ANCHORS = Path(os.environ.get("REDKNOT_ANCHORS", Path(__file__).resolve().parents[2] / "shared" / "anchors"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, rope=..., tie_word_embeddings=..., ...) -> directory, built once per spec."""
    from redknot.tiny import make_tiny_checkpoint

    cache = {}

    def make(family="llama", **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            name = "-".join([family] + [f"{k}={v}" for k, v in sorted(kw.items())])
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), family, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def anchor_head_config():
    path = ANCHORS / "head_config" / "mistral-7B_optimal_g15_lf_ret.json"
    if not path.is_file():
        pytest.skip(f"anchor head config not found at {path} (set REDKNOT_ANCHORS)")
    return path
