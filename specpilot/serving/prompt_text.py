"""A request's text made into prompt tokens under bounds, meant to run on the server's text workers (never
the event loop): text that is not valid Unicode is refused naming its field, text too long for the
context is refused by its size before any tokenising, a chat template renders under a CPU-time cap and
an output-size cap, and tokenising releases the GIL. Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import sys
import time

from specpilot.data.chat import render_chat
from specpilot.serving.api_errors import APIError

TRACE_EVERY = 64  # a rendering's CPU clock is read every this many trace events (the read is a syscall)


def utf8_size(text: str, param: str) -> int:
    """`text`'s UTF-8 byte count, or APIError 400 naming `param` for text that has no UTF-8 form (a lone
    surrogate, which JSON's \\uD800 escapes can carry)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode text: {e.reason} at character {e.start} "
                            f"({text[e.start]!r}); send UTF-8 text", param, "invalid_text") from None


def token_bytes_bound(tokenizer) -> int:
    """The most UTF-8 bytes one token adds to a text: its own text's bytes, plus one for a decoder that
    drops a leading space. A text of more than context x this bytes has more tokens than the context."""
    longest = max(len(tokenizer.decode([i]).encode("utf-8", "surrogatepass")) for i in range(tokenizer.vocab_size))
    return longest + 1


class TemplateTimeout(Exception):
    """A chat template rendering ran past its CPU-time cap."""


def render_capped(template: str, messages: list[dict], cpu_s: float, special_tokens: dict) -> str:
    """`render_chat` that stops once it has used `cpu_s` of this thread's CPU time: a trace function reads
    the thread's CPU clock as the template's (Python) code runs and raises TemplateTimeout past it."""
    deadline = time.thread_time() + cpu_s
    events = 0

    def tracer(frame, event, arg):
        nonlocal events
        events += 1
        if events % TRACE_EVERY == 0 and time.thread_time() > deadline:
            raise TemplateTimeout(f"the chat template ran past {cpu_s} s of CPU time on these messages")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return render_chat(template, messages, add_generation_prompt=True, **special_tokens)
    finally:
        sys.settrace(previous)


class PromptBuilder:
    """A served model's prompts from request text; its methods run on a text worker thread."""

    def __init__(self, tokenizer, chat_template: str | None, special_tokens: dict, context_len: int,
                 template_cpu_s: float):
        self.tokenizer, self.chat_template, self.special_tokens = tokenizer, chat_template, special_tokens
        self.context_len, self.template_cpu_s = context_len, template_cpu_s
        self.token_bytes = token_bytes_bound(tokenizer)
        self.max_prompt_bytes = (context_len - 1) * self.token_bytes  # a reply needs one position

    def _check_size(self, size: int, param: str) -> None:
        if size > self.max_prompt_bytes:
            raise APIError(400, f"the prompt is {size} bytes of text, more than this model's context of "
                                f"{self.context_len} tokens can hold (a token is at most {self.token_bytes} "
                                f"bytes); shorten it", param, "context_length_exceeded")

    def _encode(self, text: str) -> list[int]:
        # encode_batch runs in Rust with the GIL released; encode would hold it, stalling the event loop
        return list(self.tokenizer.encode_batch([text])[0])

    def text_prompt(self, prompt: str, param: str = "prompt") -> list[int]:
        self._check_size(utf8_size(prompt, param), param)
        return self._encode(prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        total = 0
        for i, m in enumerate(messages):
            utf8_size(m["role"], f"messages.{i}.role")
            total += utf8_size(m["content"], f"messages.{i}.content")
        self._check_size(total, "messages")  # the template only adds text
        try:
            text = render_capped(self.chat_template, messages, self.template_cpu_s, self.special_tokens)
        except TemplateTimeout as e:
            raise APIError(400, str(e), "messages", "template_timeout") from None
        except Exception as e:  # noqa: BLE001 -- any failure of the template on client messages is theirs
            raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}"[:500],
                           "messages", "template_error") from None
        self._check_size(utf8_size(text, "messages"), "messages")  # the rendering's output cap
        return self._encode(text)
