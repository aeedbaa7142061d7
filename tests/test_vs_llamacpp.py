"""benchmarks/vs_llamacpp.py's cache-type specs: K/V types, bits, and the rotation switch per spec."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def vs():
    """benchmarks/vs_llamacpp.py as a module (a script, not part of the package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_llamacpp.py"
    spec = importlib.util.spec_from_file_location("vs_llamacpp_script", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("spec, kv, bits", [
    ("q4_0", ("q4_0", "q4_0"), 4.5), ("q4_0-norot", ("q4_0", "q4_0"), 4.5),
    ("q8_0/q4_0", ("q8_0", "q4_0"), 6.5), ("q8_0/q4_0-norot", ("q8_0", "q4_0"), 6.5),
    ("f16", ("f16", "f16"), 16.0), ("iq4_nl-norot", ("iq4_nl", "iq4_nl"), 4.5),
])
def test_cache_types_and_bits(vs, spec, kv, bits):
    assert vs.cache_kv_types(spec) == kv
    assert vs.cache_bits(spec) == bits


@pytest.mark.parametrize("spec", ["q4_0-rot", "q3_k", "q8_0/q9", "-norot"])
def test_unknown_cache_types_are_refused_by_name(vs, spec):
    with pytest.raises(ValueError, match="unknown llama.cpp cache type"):
        vs.cache_kv_types(spec)


def test_rotation_switch_is_set_only_for_norot_specs(vs):
    env = {"OTHER": "x"}
    vs.set_rotation_env("q4_0-norot", env)
    assert env == {"OTHER": "x", "LLAMA_ATTN_ROT_DISABLE": "1"}
    vs.set_rotation_env("q4_0", env)          # the next type runs with llama.cpp's default again
    assert env == {"OTHER": "x"}
    vs.set_rotation_env("f16", env)
    assert env == {"OTHER": "x"}


def test_every_default_cache_type_parses(vs):
    assert vs.DEFAULT_CACHE_TYPES[0] == "f16"   # the baseline every row is scored against
    for spec in vs.DEFAULT_CACHE_TYPES:
        vs.cache_kv_types(spec)
