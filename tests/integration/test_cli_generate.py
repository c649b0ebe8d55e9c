"""`redknot generate`: a chat model's prompt gets its chat template under every method (so every
method sees the same prompt tokens), documents come from files, and the finish reason is printed."""

from redknot import LLM, SamplingParams
from redknot.cli import main


def test_generate_uses_the_template_under_every_method(tiny_checkpoint, tmp_path, capsys):
    path = str(tiny_checkpoint("llama"))
    doc = tmp_path / "doc.txt"
    doc.write_text("Question: who founded the city of Varna? Answer: the merchant Ilsa Torv founded it in 1120.")
    ref = LLM(model=path, device="cpu", page_size=16, kv_pages=256)
    conv = [{"role": "user", "content": "Who founded Varna?"}]
    params = SamplingParams(max_tokens=6, temperature=0)
    want = ref.generate(conv, params)[0].outputs[0]
    want_docs = ref.generate(conv, params, documents=[doc.read_text()])[0].outputs[0]
    for method, docs, expect in [("dense", [], want), ("full_reuse", [], want), ("dense", [str(doc)], want_docs),
                                 ("full_reuse", [str(doc)], want_docs)]:
        args = ["generate", "--model", path, "--prompt", "Who founded Varna?", "--max-tokens", "6",
                "--method", method, "--device", "cpu"] + (["--documents", *docs] if docs else [])
        assert main(args) == 0
        out = capsys.readouterr()
        assert out.out == expect.text + "\n", (method, docs)
        assert f"[finish_reason: {expect.finish_reason}" in out.err
