"""One response choice as its engine deltas arrive: its text, tokens and logprobs, its tool calls,
and the OpenAI shapes of each (whole response or stream chunks).

A request with ``n`` choices (and, on ``/v1/completions``, several prompts) runs one engine
sequence per choice; ``merge`` interleaves their streams.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from . import tools as tl
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChoiceLogprobs, CompletionChoice,
                       CompletionLogprobs, DeltaFunctionCall, DeltaMessage, DeltaToolCall, ResponseFunctionCall,
                       ResponseToolCall, TokenLogprob, TopLogprob)


class TokenText:
    """Token strings for logprobs (each token decoded alone, special tokens kept) and their bytes
    (the token's own bytes, so a character split over tokens joins back), memoised."""

    def __init__(self, tokenizer, vocab_bytes=None):
        """``vocab_bytes``: a callable giving the byte list of every token id (xgrammar's decoded
        vocabulary), made on first use; None: a token's bytes are its decoded text's."""
        self.tokenizer, self._vocab_bytes, self._memo = tokenizer, vocab_bytes, {}
        self._vocab = None

    def __call__(self, token: int) -> str:
        s = self._memo.get(token)
        if s is None:
            s = self._memo[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s

    def bytes(self, token: int) -> list[int]:
        if self._vocab is None and self._vocab_bytes is not None:
            try:
                self._vocab = self._vocab_bytes()
            except Exception:  # no byte-level view of this tokenizer: the decoded text's bytes
                self._vocab_bytes = None
        b = self._vocab[token] if self._vocab is not None and token < len(self._vocab) else b""
        return list(b) if b else list(self(token).encode("utf-8"))

    def chat(self, entries, token_ids) -> list[TokenLogprob]:
        out = []
        for t, (lp, top) in zip(token_ids, entries):
            out.append(TokenLogprob(token=self(t), logprob=lp, bytes=self.bytes(t),
                                    top_logprobs=[TopLogprob(token=self(i), logprob=v, bytes=self.bytes(i))
                                                  for i, v in top]))
        return out

    def completion(self, entries, token_ids, offset: int) -> CompletionLogprobs:
        res = CompletionLogprobs()
        for t, (lp, top) in zip(token_ids, entries):
            s = self(t)
            res.tokens.append(s)
            res.token_logprobs.append(lp)
            res.top_logprobs.append({self(i): v for i, v in top})
            res.text_offset.append(offset)
            offset += len(s)
        return res


@dataclass
class Choice:
    """What one choice has produced so far."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, d) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = d.prompt_tokens, d.completion_tokens, \
            d.cached_tokens


@dataclass
class ToolMode:
    """How a chat request's output becomes tool calls: forced by a grammar (``tool_choice``
    required or named), parsed from free text (``auto`` with a parser), or not at all."""
    choice: object = None  # "required" or a NamedToolChoice when forced
    parser: str | None = None  # auto: the server's --tool-call-parser
    names: frozenset | None = None

    @property
    def forced(self) -> bool:
        return self.choice is not None

    @property
    def active(self) -> bool:
        return self.forced or self.parser is not None

    def calls(self, text: str) -> tuple[str | None, list[tl.Call]]:
        if self.forced:
            calls = tl.forced_calls(text, self.choice)
            return (None, calls) if calls else (text, [])
        if self.parser is not None:
            return tl.parse(self.parser, text, self.names)
        return text, []

    def finish_reason(self, reason: str | None, calls) -> str | None:
        # a named call finishes with "stop" (as OpenAI does); other calls with "tool_calls"
        if calls and reason == "stop" and not (self.forced and self.choice != "required"):
            return "tool_calls"
        return reason


def chat_message(c: Choice, mode: ToolMode, echo: str = "") -> tuple[AssistantMessage, str | None]:
    content, calls = mode.calls(c.text) if mode.active else (c.text, [])
    if echo:
        content = echo + (content or "")
    msg = AssistantMessage(content=content, tool_calls=[
        ResponseToolCall(id=k.id, function=ResponseFunctionCall(name=k.name, arguments=k.arguments)) for k in calls])
    return msg, mode.finish_reason(c.finish_reason, calls)


def chat_choice(c: Choice, mode: ToolMode, text_of: TokenText, want_logprobs: bool, echo: str = "") -> ChatChoice:
    msg, reason = chat_message(c, mode, echo)
    lp = ChoiceLogprobs(content=text_of.chat(c.logprobs, c.token_ids)) if want_logprobs else None
    return ChatChoice(index=c.index, message=msg, logprobs=lp, finish_reason=reason)


def completion_choice(c: Choice, text_of: TokenText, want_logprobs: bool, echo: str = "") -> CompletionChoice:
    lp = text_of.completion(c.logprobs, c.token_ids, len(echo)) if want_logprobs else None
    return CompletionChoice(index=c.index, text=echo + c.text, logprobs=lp, finish_reason=c.finish_reason)


class ChatStream:
    """The stream chunks of one chat choice: content as it comes, tool calls as deltas (a forced
    call's name as soon as it is written and its arguments as they are generated; calls parsed
    from free text (``auto``) whole once the output ends, the text that may hold them held back
    meanwhile), logprobs with the tokens of each chunk."""

    def __init__(self, index: int, mode: ToolMode, text_of: TokenText, want_logprobs: bool):
        self.index, self.mode, self.text_of, self.want_logprobs = index, mode, text_of, want_logprobs
        self.choice = Choice(index)
        self.sent = 0  # characters of choice.text sent as content (or streamed arguments)
        self.call_id = tl.Call("", "").id
        self.forced_sent: list[list] = []  # required: per call [id, characters of its arguments sent]

    def first(self, echo: str = "") -> list[ChatChunkChoice]:
        out = [ChatChunkChoice(index=self.index, delta=DeltaMessage(role="assistant", content=""))]
        if echo:
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=echo)))
        if self.mode.forced and not isinstance(self.mode.choice, str):  # named: the call starts at once
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id=self.call_id, type="function",
                function=DeltaFunctionCall(name=self.mode.choice.function.name, arguments=""))])))
        return out

    def feed(self, d) -> list[ChatChunkChoice]:
        c = self.choice
        c.add(d)
        lp = ChoiceLogprobs(content=self.text_of.chat(d.logprobs or [], d.token_ids)) if self.want_logprobs else None
        out = []
        named = self.mode.forced and not isinstance(self.mode.choice, str)
        if self.mode.choice == "required":
            calls = self._forced_deltas()
            if calls or lp:
                out.append(ChatChunkChoice(index=self.index, logprobs=lp, delta=DeltaMessage(tool_calls=calls or None)))
            if c.finish_reason is not None:
                done = tl.forced_calls(c.text, "required")
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(),
                                           finish_reason=self.mode.finish_reason(c.finish_reason, done)))
            return out
        if named:  # the output is the arguments: stream them
            piece = c.text[self.sent:]
            self.sent = len(c.text)
            if piece or lp:
                out.append(ChatChunkChoice(index=self.index, logprobs=lp, delta=DeltaMessage(tool_calls=[
                    DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))])))
        elif not self.mode.active:
            piece = c.text[self.sent:]
            self.sent = len(c.text)
            if piece or lp:
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=piece), logprobs=lp))
        else:  # auto: content up to where calls may begin; the rest waits for the end
            upto = len(c.text) if c.finish_reason else tl.may_start_calls(self.mode.parser, c.text)
            upto = max(upto, self.sent)
            piece = c.text[self.sent:upto]
            if c.finish_reason is None and (piece or lp):
                self.sent = upto
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=piece), logprobs=lp))
            elif lp is not None and c.finish_reason is not None:
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(), logprobs=lp))
        if c.finish_reason is not None:
            out += self._finish(named)
        return out

    def _forced_deltas(self) -> list[DeltaToolCall]:
        """New pieces of a ``required`` output's calls: each call's id and name once written, then
        its arguments as they grow."""
        text, out = self.choice.text, []
        for k, (name, start, end) in enumerate(tl.scan_forced(text)):
            if k == len(self.forced_sent):
                self.forced_sent.append([tl.Call(name, "").id, start])
                out.append(DeltaToolCall(index=k, id=self.forced_sent[k][0], type="function",
                                         function=DeltaFunctionCall(name=name, arguments="")))
            upto = len(text) if end is None else end
            sent = self.forced_sent[k][1]
            if upto > sent:
                out.append(DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=text[sent:upto])))
                self.forced_sent[k][1] = upto
        return out

    def _finish(self, named: bool) -> list[ChatChunkChoice]:
        c = self.choice
        if named or not self.mode.active:
            calls = [1] if named else []
            return [ChatChunkChoice(index=self.index, delta=DeltaMessage(),
                                    finish_reason=self.mode.finish_reason(c.finish_reason, calls))]
        rest = c.text[self.sent:]
        content, calls = self.mode.calls(c.text)
        out = []
        if not calls:
            if rest:
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=rest)))
        else:
            already = c.text[:self.sent]
            if content and len(content) > len(already.strip()) and content.startswith(already.strip()):
                out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=content[len(already.strip()):])))
            out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(tool_calls=[
                DeltaToolCall(index=i, id=k.id, type="function",
                              function=DeltaFunctionCall(name=k.name, arguments=k.arguments))
                for i, k in enumerate(calls)])))
        out.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(),
                                   finish_reason=self.mode.finish_reason(c.finish_reason, calls)))
        return out


_DONE = object()


async def merge(streams) -> AsyncIterator[tuple[int, object]]:
    """(choice index, delta) from every stream as each arrives; an error in one ends all."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for d in stream:
                await queue.put((i, d))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
