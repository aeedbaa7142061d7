"""Token ids of a text prompt: the one place that decides whether BOS (and other special tokens) is added.

Every entry point that turns text into ids goes through :func:`encode_text`: ``LLM.generate("...")``
(and so ``kvpage generate --no-chat`` and the server's ``/v1/completions`` with a string prompt),
``kvpage eval`` and ``kvpage calibrate``. By default it encodes as the model's own tokenizer does
(``tokenizer(text)``, i.e. ``add_special_tokens=True``): Gemma's, Llama 3's and Mistral's tokenizers put
their BOS first, SmolLM2's adds nothing. A chat is rendered by the chat template, which writes the BOS
text itself, so its text is encoded with ``bos=False`` (no special tokens), as transformers'
``apply_chat_template(..., tokenize=True)`` does: one BOS, never two.
"""
from __future__ import annotations

from typing import Any


def encode_text(tokenizer: Any, text: str, *, bos: bool | None = None) -> list[int]:
    """Token ids of ``text`` (a plain list of ints).

    Args:
        tokenizer: a transformers tokenizer (anything with ``encode(text, add_special_tokens=...)``;
            ``bos_token_id`` is read only when ``bos`` is True).
        text: the text to encode.
        bos: ``None`` (default): as the tokenizer's configuration says, exactly ``tokenizer(text)``'s ids
            (BOS first where the tokenizer adds one, and any other special tokens it adds);
            ``False``: no special tokens at all; ``True``: the text's ids without special tokens, after
            exactly one BOS, whether or not the tokenizer would add it.

    Raises:
        ValueError: ``bos=True`` and the tokenizer has no BOS token.
    """
    if bos is None:
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not bos:
        return ids
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        raise ValueError("BOS was asked for, but the tokenizer has no BOS token (bos_token_id is None)")
    return [int(bos_id), *ids]


def starts_with_bos(tokenizer: Any, ids: list[int]) -> bool:
    """Whether ``ids`` begins with the tokenizer's BOS token (``False`` for a tokenizer without one)."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    return bos_id is not None and bool(ids) and ids[0] == bos_id


def bos_words(tokenizer: Any, ids: list[int]) -> str:
    """``"BOS first"`` or ``"no BOS"``: how ``kvpage eval`` and ``kvpage calibrate`` describe the ids they use."""
    return "BOS first" if starts_with_bos(tokenizer, ids) else "no BOS"
