"""A tiny random Llama with a byte-level tokenizer, for engine tests that need no checkpoint (each ``LLM`` ≈ 0.1 s).

:class:`ByteTokenizer` is the smallest tokenizer with the traits the engine relies on: token ``i < 256`` is
the byte ``i`` (so one multi-byte UTF-8 character spans several tokens, as in GPT-2's byte-level BPE), its
token strings use GPT-2's printable byte alphabet, and a few special tokens (EOS) are skipped on decode.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from kvpage.model.config import ModelConfig
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import LoadedModel

EOS = 256
BOS = 257
VOCAB = 260  # 256 bytes, EOS, BOS and two unused ids


def _gpt2_alphabet() -> list[str]:
    """Byte ``b`` -> the printable character GPT-2's byte-level BPE writes for it."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``decode`` replaces an incomplete or invalid sequence by U+FFFD (as byte-level BPE)."""

    chat_template = "{role}: {content}\n"
    all_special_ids = [EOS, BOS]
    eos_token_id = EOS
    _alphabet = _gpt2_alphabet()

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special ids are dropped, the rest decoded with ``errors="replace"``."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings (GPT-2's byte alphabet; special tokens as ``<eos>``/``<bos>``)."""
        return [self._alphabet[i] if i < 256 else ("<eos>" if i == EOS else "<bos>") for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        """``role: content`` lines, then ``assistant:`` when asked for."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


def tiny_loaded(seed: int = 0, *, layers: int = 2, max_positions: int = 512) -> LoadedModel:
    """A random-initialised 2-layer Llama (hidden 64, 4 query / 2 KV heads of 16) with :class:`ByteTokenizer`."""
    torch.manual_seed(seed)
    hf_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=EOS,
    )
    hf = HFLlama(hf_config).eval()
    config = ModelConfig.from_hf(hf_config)
    model = LlamaForCausalLM(config)
    model.load_hf_state_dict({k: v.detach().clone() for k, v in hf.state_dict().items()})
    return LoadedModel(config=config, model=model.eval(), tokenizer=ByteTokenizer(), path=Path("/tiny-random-llama"))
