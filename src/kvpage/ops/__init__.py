"""Tensor ops over the paged KV cache."""
