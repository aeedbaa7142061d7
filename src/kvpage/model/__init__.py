"""Llama-family model runner: config, weight loading (GGUF, safetensors) and forward."""
