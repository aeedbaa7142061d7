"""Print prefix-cache block-hash test vectors computed by vLLM's own hashing code, as JSON.

Run once, in an environment that has ``cbor2`` but neither kvpage nor torch, against a vLLM wheel (the
functions are read out of the wheel's source, so vLLM's heavy imports never run)::

    python3 -m venv /work/peers/vllm-hash && /work/peers/vllm-hash/bin/pip install cbor2
    /work/peers/vllm-hash/bin/pip download --no-deps vllm==0.34.0 -d /tmp/vl
    /work/peers/vllm-hash/bin/python tests/data/make_vllm_hash_vectors.py \
        /tmp/vl/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl > tests/data/vllm_hash_vectors.json

What runs is vLLM's code, unmodified: ``vllm/utils/hashing.py`` (``sha256_cbor``) imported from the wheel
as a module, and from ``vllm/v1/core/kv_cache_utils.py`` the function definitions of
``resolve_none_hash_seed``, ``init_none_hash``, ``hash_block_tokens``, ``generate_block_hash_extra_keys``
(with its LoRA / multimodal / prompt-embeds helpers), ``get_request_block_hasher`` and
``maybe_convert_block_hash``, compiled from their source text into one namespace. The few names those
functions import (logger, ``envs``, ``token_slice``, ...) are given plain stand-ins here. Each vector is the
request block hasher's output for a stand-in request (token ids, ``cache_salt``, LoRA request), after
``init_none_hash(sha256_cbor)`` with ``PYTHONHASHSEED`` set as the vector says (unset: vLLM's fixed
default seed). ``hashes_int64`` is ``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
on: the low 64 bits of each full hash, as KV events and llm-d's indexer carry them.
"""
from __future__ import annotations

import __future__
import ast
import hashlib
import importlib.util
import json
import logging
import os
import sys
import zipfile
from types import SimpleNamespace
from typing import Any

_WANTED = {
    "resolve_none_hash_seed", "get_none_hash_seed", "init_none_hash", "hash_block_tokens",
    "generate_block_hash_extra_keys", "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys", "get_request_block_hasher", "maybe_convert_block_hash",
}
_WANTED_GLOBALS = {"DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED"}


def _load(wheel: str) -> tuple[dict[str, Any], Any, str]:
    """vLLM's hashing module and its kv_cache_utils functions from ``wheel``; also the wheel's version."""
    with zipfile.ZipFile(wheel) as z:
        hashing_src = z.read("vllm/utils/hashing.py").decode()
        utils_src = z.read("vllm/v1/core/kv_cache_utils.py").decode()
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        version = next(line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                       if line.startswith("Version:"))
    spec = importlib.util.spec_from_loader("vllm_hashing", loader=None)
    hashing = importlib.util.module_from_spec(spec)
    exec(compile(hashing_src, "vllm/utils/hashing.py", "exec"), hashing.__dict__)

    tree = ast.parse(utils_src)
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in _WANTED:
            keep.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in _WANTED_GLOBALS for t in targets):
                keep.append(node)
    found = {n.name for n in keep if isinstance(n, ast.FunctionDef)}
    if found != _WANTED:
        raise SystemExit(f"kv_cache_utils.py lacks {sorted(_WANTED - found)}; another vLLM version?")
    ns: dict[str, Any] = {
        "os": os, "hashlib": hashlib, "Any": Any, "BlockHash": bytes, "logger": logging.getLogger("vllm"),
        "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor,
        "envs": SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True),
        "token_slice": lambda tokens, start, stop: tokens[start:stop],
        "cast": lambda _t, v: v,
    }
    module = ast.Module(body=keep, type_ignores=[])
    exec(compile(module, "vllm/v1/core/kv_cache_utils.py", "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns, hashing, version


def _request(tokens: list[int], cache_salt: str | None, lora: tuple[str, str] | None) -> SimpleNamespace:
    """The attributes of vLLM's ``Request`` that the block hasher reads."""
    lora_request = None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1])
    return SimpleNamespace(block_hashes=[], num_tokens=len(tokens), all_token_ids=tokens, _all_token_ids=tokens,
                           mm_features=[], lora_request=lora_request, cache_salt=cache_salt, prompt_embeds=None,
                           _prompt_embeds_per_block_hashes={})


#: (name, PYTHONHASHSEED or None, block_size, token ids, cache_salt, (lora_name, lora_path) or None)
CASES = [
    ("plain", None, 4, list(range(1, 15)), None, None),
    ("seed0", "0", 4, list(range(1, 15)), None, None),
    ("seed_text", "kvpage-test", 4, list(range(1, 15)), None, None),
    ("salt", None, 4, list(range(1, 15)), "tenant-a", None),
    ("salt_seed0", "0", 4, list(range(1, 15)), "tenant-b", None),
    ("lora", None, 4, list(range(1, 15)), None, ("adapter-x", "/adapters/x")),
    ("lora_salt", None, 4, list(range(1, 15)), "tenant-a", ("adapter-x", "/adapters/x")),
    ("big_ids_bs16", None, 16, [(i * 7919) % 49152 for i in range(40)] + [0, 23, 255, 256, 65535, 65536, 2**31 - 1],
     None, None),
]


def main(wheel: str) -> None:
    """Compute every case with vLLM's functions and print the JSON document to stdout."""
    ns, hashing, version = _load(wheel)
    out = []
    for name, seed, block_size, tokens, salt, lora in CASES:
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        ns["init_none_hash"](hashing.sha256_cbor)
        hasher = ns["get_request_block_hasher"](block_size, hashing.sha256_cbor)
        req = _request(tokens, salt, lora)
        hashes = hasher(req)
        extra = [ns["generate_block_hash_extra_keys"](req, i * block_size, (i + 1) * block_size, 0)[0]
                 for i in range(len(hashes))]
        out.append({
            "name": name, "algo": "sha256_cbor", "pythonhashseed": seed, "block_size": block_size,
            "token_ids": tokens, "cache_salt": salt,
            "lora": None if lora is None else {"name": lora[0], "path": lora[1]},
            "extra_keys": extra,
            "none_hash": ns["NONE_HASH"].hex(),
            "hashes": [h.hex() for h in hashes],
            "hashes_int64": [ns["maybe_convert_block_hash"](h) for h in hashes],
        })
    doc = {"generator": "tests/data/make_vllm_hash_vectors.py", "vllm_version": version,
           "default_none_hash_seed": ns["DEFAULT_NONE_HASH_SEED"], "vectors": out}
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} VLLM_WHEEL")
    main(sys.argv[1])
