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

import contextlib
import hashlib
import json
import os
from pathlib import Path

DEFAULT_DTYPE = "bfloat16"
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


def cache_dir() -> Path:
    root = os.environ.get("REDKNOT_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "redknot"


def file_sha256(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _cached_sha256(path: Path) -> str:
    """sha256 of ``path``, remembered by (path, size, mtime) so a large file is hashed once."""
    index_file = cache_dir() / "converted" / "hashes.json"
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError):
        index = {}
    if key in index:
        return index[key]
    sha = file_sha256(path)
    index[key] = sha
    index_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = index_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, index_file)
    return sha


def converted_dir(sha256: str, dtype=DEFAULT_DTYPE) -> Path:
    from .gguf import dtype_name

    return cache_dir() / "converted" / f"{sha256[:16]}-{dtype_name(dtype)}"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock file (two processes resolving the same GGUF convert it once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX: no lock, conversion is still atomic
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_cached(gguf_path, dtype=DEFAULT_DTYPE, sha256: str | None = None, verbose: bool = False) -> Path:
    """The HF directory of ``gguf_path`` in the cache, converting it on the first call."""
    from .gguf import convert_gguf

    gguf_path = Path(gguf_path)
    sha = sha256 or _cached_sha256(gguf_path)
    out = converted_dir(sha, dtype)
    if is_checkpoint(out):
        return out
    with _lock(out.with_name(out.name + ".lock")):
        if not is_checkpoint(out):  # another process may have finished it meanwhile
            if verbose:
                print(f"converting {gguf_path} -> {out}", flush=True)
            convert_gguf(gguf_path, out, dtype=dtype, overwrite=True)
            (out / "gguf_sha256.txt").write_text(f"{sha}  {gguf_path.name}\n")
    return out


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
    from .shelf import SHELF, shelf_path

    name = str(path_or_name)
    if name in SHELF:
        return shelf_path(name)
    raise FileNotFoundError(f"{name!r}: no such file or directory, and not a shelf model "
                            f"(shelf: {', '.join(SHELF)}; see `redknot models list`)")
