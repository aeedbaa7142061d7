"""Speculative decoding: proposers, verification and acceptance."""
