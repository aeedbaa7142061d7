"""Model runner: config, weight loading (GGUF, safetensors) and forward for the families of :mod:`kvpage.model.families`.

Importing this package does not import transformers or gguf; the loader does so
when it is called.
"""
from kvpage.model.attention_fn import AttentionFn
from kvpage.model.config import ModelConfig
from kvpage.model.decoder import DecoderForCausalLM
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.loader import (
    LoadedModel,
    ModelNotFoundError,
    apply_chat_template,
    default_model_path,
    load_model,
)

__all__ = [
    "AttentionFn",
    "DecoderForCausalLM",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelNotFoundError",
    "apply_chat_template",
    "default_model_path",
    "load_model",
]
