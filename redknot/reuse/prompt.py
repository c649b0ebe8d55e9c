"""How a request with documents becomes tokens: ``[prefix][chunk 1]…[chunk n][suffix]``.

Every method, dense included, sees exactly ``ChunkedPrompt.token_ids``; chunk boundaries are
explicit (each document is tokenized on its own), never found by searching for separators.

With a chat template the documents go inside the user turn, before the question: the template
is rendered around a placeholder, the text before it is the prefix, the question plus the text
after it is the suffix. Each document string is tokenized with a trailing blank line so
documents read as paragraphs. Without a chat template the prefix is the BOS token (if any) and
the suffix is the prompt. Token-id lists are taken as they are.

A question string may hold ``DOCUMENTS_SLOT`` once: the text before it is an instruction that
goes before the documents, inside the same user turn (it joins the prefix, so it is shared by every
request with the same instruction), the text after it follows the documents (it leads the
suffix). This is how a LongBench-style template ("...given passages.\n{documents}Question: ...")
keeps its documents as separate chunks.

The prompt may also be a conversation (a list of ``{"role", "content"}`` messages) whose last
message is the user's question: the earlier messages (a system message, earlier turns) render
into the prefix, so a system prompt comes before the documents and chunks are cached after it.
"""

from __future__ import annotations

from dataclasses import dataclass

_PLACEHOLDER = "\x00REDKNOT_DOCUMENTS_AND_QUESTION\x00"
# Where the documents go inside a question string that wraps them in an instruction (module docstring).
DOCUMENTS_SLOT = "\x00REDKNOT_DOCUMENTS\x00"
DOCUMENT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class ChunkedPrompt:
    prefix: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    @property
    def token_ids(self) -> list[int]:
        out = list(self.prefix)
        for c in self.chunks:
            out.extend(c)
        out.extend(self.suffix)
        return out

    @property
    def chunk_starts(self) -> list[int]:
        starts, pos = [], len(self.prefix)
        for c in self.chunks:
            starts.append(pos)
            pos += len(c)
        return starts

    @property
    def suffix_start(self) -> int:
        return len(self.prefix) + sum(len(c) for c in self.chunks)

    def __len__(self) -> int:
        return self.suffix_start + len(self.suffix)

    def packed(self, min_tokens: int) -> "ChunkedPrompt":
        """The same tokens with runs of consecutive documents shorter than ``min_tokens`` (a page)
        joined into one chunk of up to about ``min_tokens``: every chunk takes at least one page per
        (layer, KV head), so 256 one-word documents would otherwise need 256 pages per head (the
        engine packs a request's documents when they do not fit unpacked). A joined run is cached
        and reused as one document (when the same run recurs)."""
        out: list[tuple[int, ...]] = []
        for c in self.chunks:
            if out and len(out[-1]) < min_tokens and len(c) < min_tokens:
                out[-1] = out[-1] + c
            else:
                out.append(c)
        return self if len(out) == len(self.chunks) else ChunkedPrompt(self.prefix, tuple(out), self.suffix)


def is_conversation(prompt) -> bool:
    """A list of chat messages (dicts), as opposed to a string or a list of token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def split_slot(question: str) -> tuple[str, str]:
    """(lead, question): the instruction before ``DOCUMENTS_SLOT`` and the text after it; ("",
    question) without a slot."""
    n = question.count(DOCUMENTS_SLOT)
    if n > 1:
        raise ValueError(f"the prompt holds DOCUMENTS_SLOT {n} times: the documents go in one place")
    lead, slot, rest = question.partition(DOCUMENTS_SLOT)
    return (lead, rest) if slot else ("", question)


def _render_around(tokenizer, history: list[dict], question: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix) ids: the template rendered with ``history`` then a user turn whose content is a
    placeholder; the text before it (and the question's lead, see ``split_slot``) is the prefix, the
    question plus the text after it the suffix."""
    lead, question = split_slot(question)
    rendered = tokenizer.apply_chat_template(history + [{"role": "user", "content": _PLACEHOLDER}], tokenize=False,
                                             add_generation_prompt=True)
    head, tail = rendered.split(_PLACEHOLDER)
    return (tuple(tokenizer.encode(head + lead, add_special_tokens=False)),
            tuple(tokenizer.encode(question + tail, add_special_tokens=False)))


def _ids(x, what: str) -> tuple[int, ...]:
    if not isinstance(x, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        raise TypeError(f"{what} must be a string or a list of token ids")
    return tuple(x)


def build_prompt(tokenizer, prompt, documents, use_chat_template: bool | None = None) -> ChunkedPrompt:
    """Split a request into prefix, chunks and suffix token ids (see module docstring)."""
    if documents is None:
        documents = []
    if isinstance(documents, (str, bytes)) or not isinstance(documents, (list, tuple)):
        raise TypeError("documents must be a list of strings or token-id lists")
    chat = getattr(tokenizer, "chat_template", None) is not None if use_chat_template is None else use_chat_template
    if is_conversation(prompt):
        if not chat:
            raise ValueError("a conversation prompt needs a tokenizer with a chat template")
        *history, last = prompt
        if last.get("role") != "user" or not isinstance(last.get("content"), str):
            raise ValueError("the last message of a conversation with documents must be a user message with text "
                             "content: it is the question, and the documents go before it in the same turn")
        prefix, suffix = _render_around(tokenizer, list(history), last["content"])
    elif isinstance(prompt, str):
        if chat:
            prefix, suffix = _render_around(tokenizer, [], prompt)
        else:
            bos = tokenizer.bos_token_id
            lead, question = split_slot(prompt)
            prefix = (bos,) if bos is not None and tokenizer.encode("a")[:1] == [bos] else ()
            prefix += tuple(tokenizer.encode(lead, add_special_tokens=False)) if lead else ()
            suffix = tuple(tokenizer.encode(question, add_special_tokens=False))
    else:
        prefix, suffix = (), _ids(prompt, "prompt")
    chunks = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            ids = tuple(tokenizer.encode(doc + DOCUMENT_SEPARATOR, add_special_tokens=False))
        else:
            ids = _ids(doc, f"documents[{i}]")
        if not ids:
            raise ValueError(f"documents[{i}] is empty")
        chunks.append(ids)
    if not suffix:
        raise ValueError("empty prompt: the suffix (question) has no tokens")
    return ChunkedPrompt(prefix, tuple(chunks), suffix)
