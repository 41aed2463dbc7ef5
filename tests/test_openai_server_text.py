"""The server's incremental detokenizer, on SmolLM2's tokenizer: pieces add up to the tokenizer's own decode."""

import glob
import os

import pytest

from specpilot.data.tokenizer import load_tokenizer

pytest.importorskip("fastapi")
from server_helpers import detokenize_stream  # noqa: E402
from specpilot.serving.detokenizer import Detokenizer  # noqa: E402

FOLDERS = glob.glob("/tmp/smolcache/gguf/*/tokenizer.json") + glob.glob(
    os.path.expanduser("~/.cache/specpilot/gguf/*/tokenizer.json"))
pytestmark = pytest.mark.skipif(not FOLDERS, reason="no converted SmolLM2-135M-Instruct folder with a tokenizer")

TEXT = "héllo 🙂 wörld — 日本語のテキスト, naïve café 🎉🎉 end"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(FOLDERS[0], eos_token="<|im_end|>")


def test_pieces_are_utf8_safe_and_add_up_to_the_decode(tok):
    ids = tok.encode(TEXT) + [tok.eos_id]
    # some token of the emoji or CJK text ends inside a character: its prefix decodes to U+FFFD
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    pieces = detokenize_stream(Detokenizer(tok), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_cuts_the_text_and_is_never_sent(tok):
    ids = tok.encode(TEXT)
    detok = Detokenizer(tok, stops=("wörld", "zzz"))
    pieces = detokenize_stream(detok, ids)
    assert detok.stopped and "".join(pieces) == TEXT[: TEXT.index("wörld")]
    assert all("w" not in p for p in pieces[1:])  # the stop string's start was held back, not sent early
    assert tok.decode(detok.tokens).startswith(TEXT[: TEXT.index("wörld") + 1])
