"""--chat-template takes a Jinja template inline or the path of a file holding one."""

import pytest

from redknot.serve.app import load_chat_template


def test_inline_file_and_neither(tmp_path):
    t = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_chat_template(t) == t
    f = tmp_path / "t.jinja"
    f.write_text(t)
    assert load_chat_template(str(f)) == t
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
