"""GGUF files of every family (issue 29): kvpage against transformers on the same file.

Usage::

    python benchmarks/gguf_families.py

For each family of ``tests/test_gguf_families.py`` (tiny random models the tests write as llama.cpp would,
quantized), prints the tensor types in the file, whether the prompt ids start with BOS, kvpage's max |logit diff| from the reference over the last
prompt position and 16 greedy steps (float32 cache), and whether the 16 greedy tokens are equal. The reference
is transformers' ``from_pretrained(..., gguf_file=...)``, or, for the rows marked *, transformers running the
source config on the file's weights (keys transformers' GGUF reader ignores, and DeepSeek-V3's ``deepseek2``
files, which transformers does not load).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_gguf_families import DEEPSEEK2, FAMILIES, LLAMACPP_KEYS, PROMPT, compare  # noqa: E402


def main() -> None:
    """Print the table (markdown)."""
    print("| family | tensor types in the file | prompt ids BOS first | max abs logit diff | greedy 16 equal |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for model_id in [*FAMILIES, *LLAMACPP_KEYS, *DEEPSEEK2]:
            diff, same, types = compare(model_id, Path(folder))
            mark = "" if model_id in FAMILIES else "*"
            bos = "yes" if PROMPT[0] == 1 else "no"  # id 1 is the files' BOS
            print(f"| {model_id}{mark} | {types} | {bos} | {diff:.2e} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
