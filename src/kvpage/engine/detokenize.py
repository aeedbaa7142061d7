"""Detokenization of a growing output: incremental decoding, and split multi-byte characters (U+FFFD).

:class:`IncrementalDetokenizer` keeps a request's text up to date token by token while
decoding only a short window of recent tokens (the ``prefix_offset`` / ``read_offset``
scheme of vLLM and HF TGI), so a token costs the same at position 10 and 10,000; its
text equals ``tokenizer.decode(ids, skip_special_tokens=True)`` of the whole output.

Byte-level tokenizers (GPT-2-style BPE, SentencePiece byte fallback) split one
UTF-8 character over several tokens; ``decode`` of a sequence cut inside one
shows U+FFFD for the missing bytes. While a request runs the engine holds that
character back; when it ends there (``length``, a stop token, an abort) the
U+FFFD is dropped. A U+FFFD the model really produced (the complete bytes
``EF BF BD``) is kept. The tokenizer is only read.
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


class IncrementalDetokenizer:
    """The text of a growing token sequence, decoded a few tokens at a time.

    State (vLLM's scheme): ``text`` of ``ids[:read_offset]`` is final; each new token decodes
    ``ids[prefix_offset:]`` and takes what it adds to ``decode(ids[prefix_offset:read_offset])`` (the
    window's first tokens give the context a tokenizer needs: SentencePiece's leading-space strip,
    byte-level merges). That addition is made final once it does not end in U+FFFD (an incomplete
    UTF-8 character, completed by later tokens); until then it is the pending tail of :attr:`text`.

    Exactness: :attr:`text` is ``tokenizer.decode(ids, skip_special_tokens=True)`` whenever that does not end
    in U+FFFD, and ends in the same U+FFFD otherwise (tested over random token sequences of the bundled
    tokenizer). Tokenizers whose decode is not prefix-stable are decoded whole every token instead (the old
    behaviour, exact by construction): those with ``clean_up_tokenization_spaces`` set (it rewrites " ." as
    "." across the window's edge), and any whose window decode stops extending the previous one (checked
    every token; the request then switches for good).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``; only read.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._final = ""  # text of ids[:read_offset]
        self._pending = ""  # text that ids[read_offset:] add (may end in U+FFFD)
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far."""
        return len(self._ids)

    @property
    def text(self) -> str:
        """The decode of every token appended so far (specials skipped), a trailing U+FFFD included."""
        return self._final + self._pending

    def append(self, token: int) -> str:
        """Add one token id; returns the updated :attr:`text`.

        Costs two decodes of a few tokens (one while a character is still incomplete), or one decode of
        everything for a tokenizer decoded whole (see the class). Errors of ``tokenizer.decode`` propagate.
        """
        ids = self._ids
        ids.append(int(token))
        decode = self._tokenizer.decode
        if self.whole:
            self._pending = decode(ids, skip_special_tokens=True)
            return self._pending
        window = decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if not window.startswith(self._prefix_text):  # not prefix-stable: decode whole from now on
            self.whole = True
            self._final, self._pending = "", decode(ids, skip_special_tokens=True)
            return self._pending
        added = window[len(self._prefix_text):]
        if added and not added.endswith(REPLACEMENT):
            self._final += added
            self._pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._prefix_text = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        else:
            self._pending = added
        return self._final + self._pending
