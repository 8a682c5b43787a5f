"""What a finished reply's text should be, computed apart from the detokenizer: from the bytes its ids spell."""
from __future__ import annotations

import codecs


def finished_text(full: str, spelled: bytes) -> str:
    """The text of a finished reply whose ids decode to ``full`` and spell the bytes ``spelled``: ``full`` less the
    U+FFFD of a character the bytes end inside (Python's incremental UTF-8 decoder, given all of them, holds such a
    tail back); a whole U+FFFD, or stray bytes no character continues, stay."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(spelled, final=False)
    cut = bool(decoder.getstate()[0])
    assert not cut or full.endswith("\ufffd"), "a decode that shows no cut character where the bytes end inside one"
    return full[:-1] if cut else full
