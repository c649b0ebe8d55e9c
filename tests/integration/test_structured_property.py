"""Property: whatever JSON schema a request sends (random schemas of every kind xgrammar bounds),
the guided output parses as strict JSON and validates against it. Sizes are bounded in the
schemas (string lengths, integer ranges, item counts), so every output must also finish.
``REDKNOT_SCHEMA_CASES`` sets how many schemas run (CI: 20; 200 for the full check), on the bundled
model (``REDKNOT_SCHEMA_MODEL``: another)."""

import json
import os
import string

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from redknot import LLM, SamplingParams  # noqa: E402
from redknot.engine.structured import StructuredOutputs  # noqa: E402

CASES = int(os.environ.get("REDKNOT_SCHEMA_CASES", "20"))
NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=6)
WORDS = st.text(string.ascii_letters + string.digits + " ,.-", min_size=0, max_size=5)


def _int_range(draw_pair):
    lo, span = draw_pair
    return {"type": "integer", "minimum": lo, "maximum": lo + span}


LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 500)).map(_int_range),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(0, 2), st.integers(0, 4)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.lists(st.one_of(WORDS, st.integers(-50, 50), st.booleans()), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[A-F]{1,2}$"]).map(lambda p: {"type": "string", "pattern": p}),
)


def _object(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


def _array(children):
    return st.tuples(children, st.integers(0, 1), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


SCHEMAS = st.recursive(LEAVES, lambda c: st.one_of(_object(c), _array(c), st.lists(c, min_size=2, max_size=3).map(
    lambda alts: {"anyOf": alts})), max_leaves=6)


MODEL = os.environ.get("REDKNOT_SCHEMA_MODEL", "bundled")  # or "tiny" (a random checkpoint), a shelf name, a path


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    tiny = MODEL == "tiny"
    model = tiny_checkpoint("llama") if tiny else None if MODEL == "bundled" else MODEL
    return LLM(model=model, method="dense", device="cpu", page_size=16, kv_pages=512 if tiny else None,
               max_model_len=1024)


def test_random_schemas_give_valid_json(llm):
    seen = []

    @given(schema=SCHEMAS, seed=st.integers(0, 2 ** 31))
    @settings(max_examples=CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(schema, seed):
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed,
                                structured_outputs=StructuredOutputs(json=schema))
        out = llm.generate("The quick brown fox", params)[0].outputs[0]
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)  # strict JSON: no raw control characters
        seen.append(schema)

    check()
    assert len(seen) >= CASES
