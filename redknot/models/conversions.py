"""The conversion cache: a GGUF file converted once into an HF checkpoint directory under
``<cache>/converted/<sha256 prefix>-<dtype>/``, keyed by the file's content hash (a copied or renamed
file hits the same conversion). ``<cache>`` is ``$REDKNOT_CACHE``, else ``~/.cache/redknot``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

DEFAULT_DTYPE = "bfloat16"


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
