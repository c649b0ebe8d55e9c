"""The synthetic testbed corpus: determinism, question types and their invariants, context size,
JSON-lines I/O, the bundled-model paths and ``redknot testbed make-data``."""

import argparse
import hashlib
import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import redknot.testbed as testbed
from redknot.qa.records import RecordError, read_jsonl, write_jsonl
from redknot.testbed import cli as testbed_cli
from redknot.testbed import hops, records, templates
from redknot.testbed.documents import MAX_DOC_WORDS, MIN_DOC_WORDS
from redknot.testbed.easy import easy_records
from redknot.testbed.records import TYPES, generate_records
from redknot.testbed.world import World


def has(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def words(docs) -> int:
    return sum(len(d.split()) for d in docs)


def check_invariants(rec):
    docs, meta, answer = rec["documents"], rec["meta"], rec["answers"][0]
    support = rec["supporting"]
    answer_doc = docs[support[-1]]
    assert has(answer_doc, answer)
    name_words = meta["entity"].split()
    if rec["type"] in ("single_hop", "role"):
        assert len(support) == 1 and has(answer_doc, meta["entity"])
    else:
        assert len(support) == 2
        first = docs[support[0]]
        assert has(first, meta["entity"]) and not has(first, answer)
        # the answer document never names the question's entity: both documents are needed
        assert not any(has(answer_doc, w) for w in name_words)
    if rec["type"] in records.BRIDGED_TYPES:
        assert has(docs[support[0]], meta["bridge"])
    if rec["type"] == "multi_hop":
        assert has(answer_doc, meta["bridge"])
    if rec["type"] in ("description", "mention"):
        assert support[0] < support[1], "the referring document comes later"
        assert meta["description"].lower() in answer_doc.lower()
        assert meta["bridge"] in meta["description"]
    if rec["type"] == "cross_doc":
        assert support[1] == support[0] + 1, "the continuation follows its bio directly"
    # distractors of the same variant: other names, present in documents that do not support this answer
    assert meta["distractor_answers"]
    for other in meta["distractor_answers"]:
        assert other != answer
        assert any(has(d, other) for k, d in enumerate(docs) if k not in support)


def test_deterministic_per_seed_and_prefix_stable():
    a = generate_records(5, 6)
    assert a == generate_records(5, 6)
    assert generate_records(5, 3) == a[:3]  # context i depends on (seed, i) only
    random.seed(123)  # global random state plays no part
    assert generate_records(5, 2) == a[:2]


def test_different_seeds_differ():
    a, b = generate_records(1, 3), generate_records(2, 3)
    assert all(x["documents"] != y["documents"] and x["question"] != y["question"] for x, y in zip(a, b))


def test_record_format_and_round_robin_types():
    recs = generate_records(3, 6)
    assert [r["type"] for r in recs] == [TYPES[i % len(TYPES)] for i in range(6)]
    for i, r in enumerate(recs):
        assert r["id"] == f"s3-{i}-0"
        assert set(r) == {"id", "documents", "question", "answers", "type", "supporting"}
        assert all(isinstance(d, str) and d for d in r["documents"]) and r["question"].endswith("?")
        assert len(r["answers"]) == 1 and 1 <= len(r["answers"][0].split()) <= 3  # short answers
        assert all(MIN_DOC_WORDS <= len(d.split()) <= MAX_DOC_WORDS for d in r["documents"])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_invariants_of_every_type(seed):
    for rec in generate_records(seed, 3, context_tokens=2048, meta=True):
        check_invariants(rec)
    for rec in generate_records(seed, 2, context_tokens=2048, types=records.ALL_TYPES, meta=True):
        check_invariants(rec)


def test_role_asks_the_holder_of_the_described_role():
    """``role``: the answer is the subject of the document that names X in a role (the first hop of
    a ``mention`` record, backwards); its twin holds the same role elsewhere. It is asked only
    where named, so the default records (the held-out seeds) do not change."""
    recs = generate_records(7, 6, context_tokens=1024, questions_per_context=2, types=("role",), meta=True)
    assert {r["type"] for r in recs} == {"role"}
    for r in recs:
        docs, meta, (holder,) = r["documents"], r["meta"], r["answers"]
        (a,) = r["supporting"]
        assert meta["relation"] in templates.DESCRIPTIONS and holder in meta["description"]
        assert has(docs[a], meta["entity"]) and docs[a].startswith(holder)  # the holder's own document
        # the later document describing X by the role is in the context too, never naming X
        later = [k for k, d in enumerate(docs) if meta["description"].lower() in d.lower() and k != a]
        assert later and all(k > a and not has(docs[k], meta["entity"].split()[0]) for k in later)
        assert meta["distractor_answers"] and holder not in meta["distractor_answers"]
    assert "role" not in records.TYPES and "role" not in {r["type"] for r in generate_records(20000, 16)}
    with pytest.raises(ValueError, match="role"):
        generate_records(0, 1, types=("rol",))


@pytest.mark.parametrize("kind", ["description", "mention"])
def test_description_later_document_describes_but_never_names(kind):
    recs = generate_records(11, 12, types=(kind,), meta=True)
    assert {r["type"] for r in recs} == {kind}
    assert len({r["meta"]["relation"] for r in recs}) > 3  # several description / fact variants
    for r in recs:
        check_invariants(r)
        earlier, later = (r["documents"][k] for k in r["supporting"])
        first, last = r["meta"]["entity"].split()
        assert not has(later, first) and not has(later, last)
        assert r["meta"]["description"].lower() in later.lower()
        assert not has(r["question"], r["meta"]["bridge"])  # the question names the person, not the role
        # description: A is X's own bio, stating the role; mention: A is the holder's profile
        title = earlier.split("\n")[0]
        assert title == (r["meta"]["entity"] if kind == "description" else r["meta"]["bridge"])


def test_mention_regenerates_the_first_description_records():
    """``description`` once meant what ``mention`` is; the earlier held-out files (seeds 20000-20003)
    come back byte for byte with ``mention`` in its place (digests of the records before the change)."""
    old = ("single_hop", "multi_hop", "cross_doc", "mention")
    for seed, n, tokens, digest in [(20000, 12, 2048, "8da95b80d5caa807"), (20001, 4, 8192, "b83130535494d642")]:
        recs = generate_records(seed, n, context_tokens=tokens, meta=True, types=old)
        for r in recs:
            r["type"] = "description" if r["type"] == "mention" else r["type"]
        assert hashlib.sha256(json.dumps(recs, sort_keys=True).encode()).hexdigest()[:16] == digest


NAME = re.compile(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b")


def test_cross_doc_continuation_names_no_one_and_its_twin_reads_the_same():
    """The continuation refers to the previous document's subject by pronoun alone, and the context
    holds a same-variant twin continuation with the same pronoun: only the preceding bio tells
    which answer belongs to the question's person."""
    recs = generate_records(13, 16, context_tokens=2048, types=("cross_doc",), meta=True)
    assert {r["type"] for r in recs} == {"cross_doc"}
    assert len({r["meta"]["relation"] for r in recs}) == 4
    for r in recs:
        check_invariants(r)
        docs = r["documents"]
        bio, cont = (docs[k] for k in r["supporting"])
        assert bio.split("\n")[0] == r["meta"]["entity"]  # the bio's title is the person
        title, body = cont.split("\n", 1)
        assert not NAME.search(title)
        # no person's name in the continuation but the answer itself (a spouse); an academy may be named
        names = {m for m in NAME.findall(body) if m.split()[-1] not in templates.ACADEMY_KINDS}
        assert names <= {r["answers"][0]}
        pron = "She" if has(body, "She") else "He"
        twins = [d for k, d in enumerate(docs) if k not in r["supporting"]
                 and any(has(d, a) for a in r["meta"]["distractor_answers"])]
        assert twins, "a same-variant twin continuation is in the context"
        assert any(has(d, pron) for d in twins)


def test_cross_doc_answer_needs_the_preceding_document():
    """Every pronoun-only document follows the bio it continues, in every context of every type."""
    for r in generate_records(14, 8, context_tokens=4096, questions_per_context=4, meta=True):
        docs = r["documents"]
        for k, d in enumerate(docs):
            if d.split("\n")[0] in templates.CONTINUATION_TITLES:
                assert k > 0 and NAME.fullmatch(docs[k - 1].split("\n")[0]), "a continuation follows a bio"


def test_multi_hop_needs_two_documents():
    recs = generate_records(12, 9, types=("multi_hop",), meta=True)
    for r in recs:
        check_invariants(r)
        bridge_doc, answer_doc = (r["documents"][k] for k in r["supporting"])
        assert not has(answer_doc, r["meta"]["entity"]) and not has(bridge_doc, r["answers"][0])
        assert not has(r["question"], r["meta"]["bridge"])


def test_hop_questions_split_a_multi_hop_record_into_one_document_lookups():
    """hop1 asks for the bridge entity (stated in the first supporting document), hop2 for the
    answer from the bridge entity's name (stated in the second): each is a single-hop lookup."""
    recs = generate_records(12, 18, types=("multi_hop",), meta=True)
    assert len({r["meta"]["relation"] for r in recs}) >= 5
    assert set(hops._HOP2) == set(templates.MULTI_HOP)  # every multi_hop relation has a second-hop question
    for r in recs:
        (n0, q0, a0), (n1, q1, a1), (n2, q2, a2) = hops.hop_questions(r)
        assert (n0, q0, a0) == ("composed", r["question"], r["answers"])
        bridge_doc, answer_doc = (r["documents"][k] for k in r["supporting"])
        assert n1 == "hop1" and a1 == [r["meta"]["bridge"]] and has(q1, r["meta"]["entity"])
        assert has(bridge_doc, r["meta"]["entity"]) and has(bridge_doc, a1[0])
        assert n2 == "hop2" and a2 == r["answers"] and has(q2, r["meta"]["bridge"])
        assert not has(q2, r["meta"]["entity"]) and has(answer_doc, r["meta"]["bridge"]) and has(answer_doc, a2[0])
    with pytest.raises(ValueError, match="make-data --meta"):
        hops.hop_questions({k: v for k, v in recs[0].items() if k != "meta"})
    with pytest.raises(ValueError, match="multi_hop"):
        hops.hop_questions(generate_records(12, 1, types=("single_hop",), meta=True)[0])


def test_distractors_share_entity_types():
    """Any city (company, person, year) is not enough: each context has several of each type."""
    r = generate_records(4, 1, types=("single_hop",), meta=True)[0]
    text = "\n".join(r["documents"])
    assert len(set(re.findall(r"\b1[6-9]\d\d\b|\b20[0-2]\d\b", text))) >= 5
    assert len(set(re.findall(r"\b[A-Z]\w+ (?:Works|Mills|Labs|Foundry|Shipping|Instruments|Press|Glassworks)\b",
                              text))) >= 2


@pytest.mark.parametrize("tokens", [1024, 2048, 4096, 8192])
def test_context_size_near_target(tokens):
    recs = generate_records(0, 6, context_tokens=tokens)
    est = [words(r["documents"]) * 1.3 for r in recs]
    assert abs(sum(est) / len(est) - tokens) < 0.1 * tokens
    assert all(abs(e - tokens) < 0.2 * tokens for e in est)


def test_tokens_per_word_sets_the_word_budget():
    recs = generate_records(0, 3, context_tokens=4096, tokens_per_word=2.0)
    assert all(abs(words(r["documents"]) * 2.0 - 4096) < 0.2 * 4096 for r in recs)


def test_questions_per_context_share_documents():
    recs = generate_records(8, 3, context_tokens=4096, questions_per_context=4, meta=True)
    assert len(recs) == 12
    for i in range(3):
        ctx = recs[4 * i:4 * i + 4]
        assert [r["id"] for r in ctx] == [f"s8-{i}-{q}" for q in range(4)]
        assert all(r["documents"] is ctx[0]["documents"] or r["documents"] == ctx[0]["documents"] for r in ctx)
        assert len({r["question"] for r in ctx}) == 4 and len({r["answers"][0] for r in ctx}) == 4
        for r in ctx:
            check_invariants(r)
    assert {r["type"] for r in recs} == set(TYPES)


def test_bad_arguments():
    with pytest.raises(ValueError, match="types"):
        generate_records(0, 1, types=("nope",))
    with pytest.raises(ValueError, match="questions_per_context"):
        generate_records(0, 1, questions_per_context=0)
    assert generate_records(0, 0) == []


def test_names_are_unambiguous():
    world = World(random.Random(0))
    names = [world.person().name for _ in range(40)] + [world.city_name() for _ in range(40)]
    parts = [w.lower() for n in names for w in n.split()]
    assert len(set(parts)) == len(parts)
    assert not any(a != b and a in b for a in parts for b in parts)


def test_easy_records():
    recs = easy_records(2, 5, context_tokens=128, meta=True)
    assert recs == easy_records(2, 5, context_tokens=128, meta=True)
    for r in recs:
        assert r["type"] == "easy" and r["id"].startswith("e2-")
        assert words(r["documents"]) * 1.3 < 128 * 1.3
        doc = r["documents"][r["supporting"][0]]
        sentence = r["meta"]["sentence"]
        assert sentence in doc and has(sentence, r["meta"]["entity"]) and has(sentence, r["answers"][0])
        assert r["meta"]["entity"] in r["question"]
        assert r["meta"]["distractor_answers"] and all(has(" ".join(r["documents"]), a)
                                                       for a in r["meta"]["distractor_answers"])


def test_easy_role_records():
    """Backward facts: the holder comes before the name it is asked by, as in mention's document A."""
    recs = easy_records(3, 6, context_tokens=128, questions_per_context=2, types=("role",), meta=True)
    assert recs == easy_records(3, 6, context_tokens=128, questions_per_context=2, types=("role",), meta=True)
    for r in recs:
        sentence, x, holder = r["meta"]["sentence"], r["meta"]["entity"], r["answers"][0]
        assert r["type"] == "easy_role" and sentence in r["documents"][r["supporting"][0]]
        assert sentence.index(holder) < sentence.index(x) and x in r["question"] and holder not in r["question"]
        assert r["meta"]["distractor_answers"] and holder not in r["meta"]["distractor_answers"]
    mixed = easy_records(3, 8, context_tokens=256, questions_per_context=4, types=("single_hop", "role"))
    assert {r["type"] for r in mixed} == {"easy", "easy_role"}
    # the default stream is the single_hop one, unchanged by the role option
    assert easy_records(2, 4, context_tokens=256, questions_per_context=2) == \
        easy_records(2, 4, context_tokens=256, questions_per_context=2, types=("single_hop",))
    for bad in ((), ("cross_doc",), ("role", "nope")):
        with pytest.raises(ValueError, match="easy types"):
            easy_records(0, 1, types=bad)


def test_short_contexts_get_short_documents():
    """Below ~1K tokens (four documents of MIN_DOC_WORDS) documents shrink towards their core
    sentences, so a role stage can start at 256 tokens; from 1K up the documents keep their size."""
    short = generate_records(9, 12, context_tokens=256, questions_per_context=2, types=("role",), meta=True)
    for r in short:
        assert len(r["documents"]) == 4 and words(r["documents"]) < 2 * 256
        assert all(len(d.split()) < MIN_DOC_WORDS for d in r["documents"])
        doc = r["documents"][r["supporting"][0]]  # the holder's own document names X
        assert doc.split("\n")[0] == r["answers"][0] and has(doc, r["meta"]["entity"])
    long = generate_records(9, 12, context_tokens=1024, questions_per_context=2, types=records.ALL_TYPES)
    assert min(len(d.split()) for r in long for d in r["documents"]) >= MIN_DOC_WORDS


def test_jsonl_round_trip(tmp_path):
    recs = generate_records(0, 3) + easy_records(0, 2)
    path = write_jsonl(recs, tmp_path / "sub" / "data.jsonl")
    assert read_jsonl(path) == recs


def test_jsonl_errors_name_file_and_line(tmp_path):
    good = json.dumps({"id": "a", "documents": ["d"], "question": "q?", "answers": ["x"], "type": "t"})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n{not json\n")
    with pytest.raises(RecordError, match=rf"{re.escape(str(path))}:2: malformed JSON"):
        read_jsonl(path)
    path.write_text(good + "\n\n" + json.dumps({"id": "b", "documents": ["d"], "question": "q?"}) + "\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:3: missing field\(s\) \['answers', 'type'\]"):
        read_jsonl(path)
    path.write_text(json.dumps({"id": "a", "documents": "d", "question": "q?", "answers": [], "type": "t"}))
    with pytest.raises(RecordError, match=r":1: field 'documents' must be list"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(RecordError, match="expected a JSON object"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_model_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(testbed, "_MODEL_DIR", tmp_path / "model")
    with pytest.raises(FileNotFoundError, match=r"--model DIR.*LLM\(model=DIR\)"):
        testbed.model_path()
    with pytest.raises(FileNotFoundError, match=r"--model DIR"):
        testbed.head_config_path()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "heads.json").write_text("{}")
    assert testbed.model_path() == tmp_path / "model"
    assert testbed.head_config_path() == tmp_path / "model" / "heads.json"


def test_cli_make_data(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    testbed_cli.add_arguments(parser)
    out = tmp_path / "d.jsonl"
    args = parser.parse_args(["make-data", "--seed", "4", "--n", "2", "--context-tokens", "1024", "--out", str(out),
                              "--questions-per-context", "2", "--types", "multi_hop", "cross_doc"])
    assert testbed_cli.run(args) == 0
    recs = read_jsonl(out)
    assert recs == generate_records(4, 2, 1024, 2, types=("multi_hop", "cross_doc"))
    assert "wrote 4 records" in capsys.readouterr().out
    args = parser.parse_args(["make-data", "--n", "3", "--context-tokens", "128", "--out", str(out), "--easy"])
    assert testbed_cli.run(args) == 0
    assert [r["type"] for r in read_jsonl(out)] == ["easy"] * 3
    args = parser.parse_args(["make-data", "--n", "3", "--context-tokens", "128", "--out", str(out), "--easy",
                              "--types", "role"])
    assert testbed_cli.run(args) == 0
    assert read_jsonl(out) == easy_records(0, 3, 128, types=("role",))
    with pytest.raises(ValueError, match="easy facts are single_hop or role"):
        testbed_cli.run(parser.parse_args(["make-data", "--n", "1", "--out", str(out), "--easy", "--types",
                                           "cross_doc"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["make-data", "--n", "1", "--out", str(out), "--types", "bogus"])
    args = parser.parse_args(["make-data", "--seed", "4", "--n", "2", "--context-tokens", "1024", "--out", str(out),
                              "--types", "multi_hop", "--meta"])
    assert testbed_cli.run(args) == 0
    assert read_jsonl(out) == generate_records(4, 2, 1024, types=("multi_hop",), meta=True)
    with pytest.raises(ValueError, match="--easy"):
        testbed_cli.run(parser.parse_args(["make-data", "--n", "1", "--out", str(out), "--easy", "--meta"]))
