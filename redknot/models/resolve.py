"""``resolve_model``: whatever a user passes as ``model`` -> an HF checkpoint directory.

- an HF checkpoint directory (``config.json``): returned as it is;
- a ``.gguf`` file, or a directory holding exactly one: converted once (``convert_gguf``) into
  ``<cache>/converted/<sha256 prefix>-<dtype>/`` and reused on later calls (the key is the file's
  content hash, so a copied or renamed file hits the same conversion);
- a shelf name (``redknot models list``): the directory ``redknot models get NAME`` converted.
  Nothing is downloaded here: a shelf model that is not fetched yet raises ``NotFetchedError``.

``<cache>`` is ``$REDKNOT_CACHE``, else ``~/.cache/redknot``. ``bundled_model_path()`` is the
checkpoint shipped inside the package (the testbed model), the default of every ``--model``.
"""

from __future__ import annotations

from pathlib import Path

from .conversions import DEFAULT_DTYPE, convert_cached
from .shelf import SHELF, shelf_path
# The testbed model ships as package data beside the code that trained it.
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "testbed" / "model"


def bundled_model_path(path: Path | None = None) -> Path:
    """The checkpoint bundled inside the package (HF layout: ``config.json``, safetensors, tokenizer);
    ``path`` checks another directory the same way."""
    path = Path(path or BUNDLED_MODEL_DIR)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no bundled testbed model at {path} (this build of redknot ships none yet): pass a checkpoint "
            f"directory with --model DIR on the command line or LLM(model=DIR) in Python")
    return path


def resolve_model(path_or_name, dtype=DEFAULT_DTYPE, verbose: bool = False) -> Path:
    """An HF checkpoint directory for an HF dir, a ``.gguf`` file, a directory holding one ``.gguf``,
    or a shelf name. ``dtype`` is the weight dtype of a conversion (GGUF inputs only)."""
    if dtype in (None, "auto"):
        dtype = DEFAULT_DTYPE
    p = Path(path_or_name).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if len(ggufs) == 1:
            return convert_cached(ggufs[0], dtype, verbose=verbose)
        if ggufs:
            raise ValueError(f"{p}: holds {len(ggufs)} .gguf files ({', '.join(f.name for f in ggufs[:4])}); "
                             f"pass the one to load")
        raise FileNotFoundError(f"{p}: neither an HF checkpoint directory (no config.json) nor a directory "
                                f"holding a .gguf file")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return convert_cached(p, dtype, verbose=verbose)
        raise ValueError(f"{p}: a file that is not .gguf; pass an HF checkpoint directory, a .gguf file or a "
                         f"shelf name")
    name = str(path_or_name)
    if name in SHELF:
        return shelf_path(name)
    raise FileNotFoundError(f"{name!r}: no such file or directory, and not a shelf model "
                            f"(shelf: {', '.join(SHELF)}; see `redknot models list`)")
