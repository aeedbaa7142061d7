"""Whether a decoded output ends in a split multi-byte character (a U+FFFD the model did not produce).

Byte-level tokenizers (GPT-2-style BPE, SentencePiece byte fallback) split one
UTF-8 character over several tokens; ``decode`` of a sequence cut inside one
shows U+FFFD for the missing bytes. While a request runs the engine holds that
character back; when it ends there (``length``, a stop token, an abort) the
U+FFFD is dropped. A U+FFFD the model really produced (the complete bytes
``EF BF BD``) is kept. Pure functions; the tokenizer is only read.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's stand-in character for each byte -> that byte.

    Bytes that are printable Latin-1 stand for themselves; the other 68 map, in
    byte order, to ``chr(256)``, ``chr(257)``, ...
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token string stands for, or ``None`` if it is not one."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    alphabet = _byte_level_alphabet()
    if token.startswith("\u2581"):  # SentencePiece word piece: text, not bytes
        return token.replace("\u2581", " ").encode("utf-8")
    if all(c in alphabet for c in token):
        return bytes(alphabet[c] for c in token)
    return None


def _ends_incomplete(data: bytes) -> bool:
    """Whether ``data`` ends with the first 1-3 bytes of a longer UTF-8 character."""
    for back in range(1, min(3, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back < need
    return False


def ends_with_split_character(tokenizer: Any, token_ids: Sequence[int], text: str) -> bool:
    """Whether ``text`` (the decode of ``token_ids``) ends in a U+FFFD that stands for an incomplete character.

    With token strings in a byte alphabet (GPT-2 byte-level BPE, ``<0xNN>`` byte fallback) the last tokens'
    bytes decide exactly. Otherwise: decoding without the last token gives the same text, so the last token
    only added bytes to a character that is still incomplete (a cut right after a lead byte is not seen then).
    Special tokens (``tokenizer.all_special_ids``) are ignored, as ``decode(skip_special_tokens=True)`` does.
    """
    if not text.endswith(REPLACEMENT):
        return False
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    ids = [int(t) for t in token_ids if int(t) not in special]
    if not ids:
        return False
    to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_tokens is not None:
        pieces = [_token_bytes(str(t)) for t in to_tokens(ids[-4:])]
        if all(p is not None for p in pieces):
            return _ends_incomplete(b"".join(p for p in pieces if p is not None))
    return bool(tokenizer.decode(ids[:-1], skip_special_tokens=True) == text)
