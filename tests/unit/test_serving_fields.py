"""docs/serving.md lists every request field the server knows, with what it does to each; the
table must agree with the request models: every model field honoured (or refused by a validator
that names it), every refused field in UNSUPPORTED_FIELDS or refused by the models, every ignored
one in IGNORED_FIELDS, and nothing listed that the server does not know."""

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from redknot.serve.protocol import (IGNORED_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest)

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
ROW = re.compile(r"^\| `(\w+)` \| ([a-z, ]+) \| (honoured|refused|ignored) \|")
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
# model fields that exist only to refuse any value but their "off" one (a validator names them)
REFUSED_BY_MODEL = {"presence_penalty", "frequency_penalty", "suffix"}


def table() -> dict[str, tuple[set, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = ({e.strip() for e in m.group(2).split(",")}, m.group(3))
    return rows


def fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_every_model_field_is_listed_with_its_endpoints():
    rows = table()
    for endpoint, model in MODELS.items():
        for name in fields(model):
            assert name in rows, f"{name} ({endpoint}) is not in docs/serving.md"
            where, status = rows[name]
            assert endpoint in where, f"{name}: docs/serving.md does not list {endpoint}"
            want = "refused" if name in REFUSED_BY_MODEL else "honoured"
            assert status == want, f"{name}: docs/serving.md says {status}, the model makes it {want}"


def test_every_listed_field_is_known():
    rows = table()
    for name, (where, status) in rows.items():
        if status == "ignored":
            assert name in IGNORED_FIELDS, name
        elif status == "refused":
            assert name in UNSUPPORTED_FIELDS or name in REFUSED_BY_MODEL, name
        else:
            assert all(name in fields(MODELS[e]) for e in where), name
    assert set(UNSUPPORTED_FIELDS) | set(IGNORED_FIELDS) <= set(rows)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_refused_fields_are_refused_and_ignored_ones_pass(endpoint):
    base = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
                             else {"prompt": "hi"})}
    rows = table()
    for name, (where, status) in rows.items():
        if endpoint not in where:
            continue
        if status == "refused":
            with pytest.raises(ValidationError, match=name):
                MODELS[endpoint].model_validate({**base, name: "something-on"})
        elif status == "ignored":
            MODELS[endpoint].model_validate({**base, name: "x"})
