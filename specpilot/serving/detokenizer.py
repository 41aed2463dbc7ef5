"""A reply's text as its tokens arrive: incremental, UTF-8 safe, special tokens left out, cut at the request's
stop strings (few and short, matched only over the text's new tail). Design notes: docs/design/serving.md.
"""

from __future__ import annotations

from specpilot.serving.api_errors import APIError

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # one stop string's length: held-back text and scans grow with it


def parse_stops(stop, stop_token_ids, vocab_size: int) -> tuple[tuple[str, ...], frozenset[int]]:
    """(stop strings, stop token ids) of a request's `stop` and `stop_token_ids`, or APIError naming them."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    for s in stops:
        if not s:
            raise APIError(400, "stop strings must not be empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string is {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"a stop string is not valid Unicode text ({e.reason} at character {e.start})",
                           "stop") from None
    ids = frozenset(stop_token_ids or ())
    bad = sorted(t for t in ids if not 0 <= t < vocab_size)
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return stops, ids


class Detokenizer:
    """A reply's text as its tokens arrive. Each token decodes only a short window (the tokens since the
    last complete piece, after the piece before it as context), so a reply costs linear time; text enters
    `text` only once its UTF-8 characters are complete."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""  # the reply so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False
        self._context = 0  # tokens[_context:_read]: the last piece, decoded again as the next one's context
        self._read = 0  # tokens before this are in `text`

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> None:
        self.tokens.append(int(token))
        if not self.stopped:
            self._take(final=False)

    def _take(self, final: bool) -> None:
        before = self._decode(self.tokens[self._context:self._read])
        after = self._decode(self.tokens[self._context:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):  # U+FFFD: a character's
            self._append(after[len(before):])  # first bytes only; wait for the rest
            self._context, self._read = self._read, len(self.tokens)

    def _append(self, piece: str) -> None:
        old = len(self.text)
        self.text += piece
        cut = min((at for s in self.stops if (at := self.text.find(s, max(0, old - len(s) + 1))) >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True

    def delta(self, final: bool) -> str:
        """Text not handed out yet that can no longer change (all of it when `final`)."""
        if final and not self.stopped and self._read < len(self.tokens):
            self._take(final=True)
        end = len(self.text)
        if not final and not self.stopped:
            for s in self.stops:  # the text could be the start of a stop string: wait
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text.endswith(s[:k], 0, end):
                        end -= k
                        break
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out
