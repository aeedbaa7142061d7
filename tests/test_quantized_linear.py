"""GGUF weights run as shipped: Int4Linear against gguf-py's dequantize, a GGUF model 4-bit against dequantized,
the ``weights_dtype`` setting, and the fallback where torch has no int4 CPU kernel."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from _families import hf_model
from _gguf_files import VOCAB, write_gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvpage import LLM
from kvpage.engine.config import EngineConfig
from kvpage.model import quantized_linear
from kvpage.model.linear import PackedLinear
from kvpage.model.loader import load_model, weight_bytes
from kvpage.model.quantized_linear import DENSE_ROWS, GgufWeight, Int4Linear, int4_codes_scales, int4_kernel_available

BF16_U = 2.0**-8  # bf16 unit roundoff: one rounding to bfloat16 moves a value by at most this, relatively

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="this torch has no working int4 CPU matmul")


def _weight(qtype: Q, n: int, k: int, seed: int) -> GgufWeight:
    """Random ``[n, k]`` weights quantized by gguf-py, with extreme blocks: a constant block, a block spanning
    +-60000 (near float16's limit), one all-zero row and blocks of tiny values."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * k**-0.5
    w += rng.standard_normal((n, 1)).astype(np.float32)  # rows with an offset: Q4_1's minimum m matters
    w[0, :32] = 3.0
    w[1, :32] = np.linspace(-6e4, 6e4, 32)
    w[2] = 0.0
    w[3, 32:64] *= 1e-4
    data = quantize(w, qtype)
    return GgufWeight(int(qtype), data.reshape(n, -1), (n, k))


def _reference(weight: GgufWeight) -> torch.Tensor:
    """gguf-py's dequantized weight, float64 ``[N, K]``."""
    return torch.from_numpy(dequantize(weight.data, Q(weight.ggml_type)).reshape(weight.shape)).double()


@needs_int4
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("n,k,m", [(64, 96, 1), (960, 576, 1), (192, 576, 2), (576, 1536, 5), (48, 64, 40),
                                   (960, 576, DENSE_ROWS), (192, 576, 300), (48, 64, 100)])
def test_int4_linear_matches_dequantized_reference(qtype: Q, n: int, k: int, m: int) -> None:
    """``x @ W.T`` within its bound of the float64 product with gguf-py's dequantized weight.

    Bound per output: the scale ``d`` and zero ``m + 8d`` of each block are rounded once to bfloat16 (a weight
    moves by at most ``(8|d| + |zero|) * 2^-8``), the output is rounded once to bfloat16 (``2^-8`` of it), and
    float32 accumulation adds at most ``K * 2^-23`` of ``sum |x| |w|``. From :data:`DENSE_ROWS` rows on (with
    ``N % 64 == 0``), the weight decoded to bfloat16 is rounded twice more: ``(8|d| + |w|) * 2^-8`` more per weight.
    """
    weight = _weight(qtype, n, k, seed=n + k + m)
    lin = Int4Linear(weight)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    ref = x.double() @ _reference(weight).T  # [M, N]
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _, d, zero = int4_codes_scales(weight)  # float64 [N, K/32]
    per_weight = (8 * d.abs() + zero.abs()).repeat_interleave(32, dim=1) * BF16_U  # [N, K]
    w_abs = _reference(weight).abs()
    if m >= DENSE_ROWS and n % 64 == 0:
        per_weight = per_weight + (8 * d.abs().repeat_interleave(32, dim=1) + w_abs + per_weight) * BF16_U * 1.01
    bound = (x.double().abs() @ per_weight.T) * (1 + BF16_U) + ref.abs() * BF16_U * 1.01 \
        + (x.double().abs() @ w_abs.T) * k * 2.0**-23
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    # and the error is of the size of the bf16 dequantized path's, not larger by a factor (sanity on the bound)
    rel = (err.norm() / ref.norm()).item()
    assert rel < 4 * BF16_U, rel


@needs_int4
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_linear_weight_is_the_dequantized_weight_up_to_scale_rounding(qtype: Q) -> None:
    weight = _weight(qtype, 128, 96, seed=3)
    _, d, zero = int4_codes_scales(weight)
    bound = (8 * d.abs() + zero.abs()).repeat_interleave(32, dim=1) * BF16_U
    dense = Int4Linear(weight).weight.double()
    assert bool(((dense - _reference(weight)).abs() <= bound).all())
    # codes are exact: with scales kept in float64, the codes give back gguf-py's values exactly
    codes, d, zero = int4_codes_scales(weight)
    exact = (codes.double() - 8) * d.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    assert torch.equal(exact, _reference(weight))


def test_int4_linear_takes_int4_types_only() -> None:
    """Q8_0 stays dequantized (torch's int8 kernel has one scale per row, GGUF's Q8_0 one per 32 weights), and
    so do row counts torch's int4 layout does not take."""
    assert quantized_linear.quantized_linear(_weight(Q.Q8_0, 64, 64, seed=0)) is None
    assert quantized_linear.quantized_linear(_weight(Q.Q4_1, 40, 64, seed=0)) is None
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Linear(_weight(Q.Q4_1, 40, 64, seed=0))


# -- a GGUF model -----------------------------------------------------------------------------------

TYPES = dict(embed=Q.Q8_0, output=Q.Q4_0, attn_q=Q.Q4_1, attn_k=Q.Q4_1, attn_v=Q.Q4_1, attn_output=Q.Q4_0,
             ffn_gate=Q.Q4_1, ffn_up=Q.Q4_1, ffn_down=Q.Q8_0)
PROMPT = [1, 30, 200, 411, 57, 92, 300, 17, 250, 18, 499, 64, 77, 128, 256, 311, 42, 9, 3, 480]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama GGUF: Q4_1 q/k/v and gate/up, Q4_0 o_proj and LM head, Q8_0 down and embedding."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                                      initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("gguf_q4") / "tiny-q4.gguf"
    write_gguf(hf_model(config), path, TYPES)
    return path


def _logits(path: Path, **kwargs: object) -> tuple[LLM, torch.Tensor]:
    llm = LLM(str(path), progress=False, kv_cache_dtype="auto", block_size=16, num_blocks=16, num_threads=1,
              **kwargs)
    with llm.open_sequence() as seq:
        rows = [seq.feed([t]).float() for t in PROMPT]  # decode-shaped steps, one token each
    return llm, torch.cat(rows)


@needs_int4
def test_gguf_model_as_shipped_matches_dequantized(tiny_gguf: Path) -> None:
    """bfloat16 with ``weights_dtype='auto'``: Q4_0/Q4_1 projections (q/k/v fused, gate/up fused, o_proj, the
    untied LM head) are Int4Linear, the Q8_0 down projection stays a PackedLinear; logits agree with the
    float32 model's as closely as the bfloat16 dequantized model's do, and the weights take fewer bytes."""
    shipped, got = _logits(tiny_gguf, dtype="bfloat16")
    deq, ref = _logits(tiny_gguf, dtype="bfloat16", weights_dtype="dequantized")
    _, truth = _logits(tiny_gguf, dtype="float32", weights_dtype="dequantized")
    layer = shipped.model.layers[0]
    assert all(isinstance(m, Int4Linear) for m in (layer.qkv_proj, layer.gate_up_proj, layer.o_proj,
                                                      shipped.model.lm_head))
    assert layer.qkv_proj.ggml_type == 3 and layer.o_proj.ggml_type == 2
    assert isinstance(layer.down_proj, PackedLinear)
    assert isinstance(deq.model.layers[0].qkv_proj, PackedLinear)
    # against the float32 model on the same (dequantized) weights, the 4-bit path errs no more than bfloat16
    # weights do (measured: max 0.096 vs 0.119, mean 0.0178 vs 0.0179; logits' spread 1.28): 1.5x allowed
    err, err_deq = (got - truth).abs(), (ref - truth).abs()
    assert err.max() <= 1.5 * err_deq.max() and err.mean() <= 1.5 * err_deq.mean(), (err.max(), err_deq.max())
    assert shipped.weight_bytes < deq.weight_bytes
    E, I, V, H = 256, 512, VOCAB, (4 + 2 * 2) * 64
    int4 = lambda n, k: n * k // 2 + (k // 32) * n * 2 * 2  # noqa: E731  codes + bf16 (scale, zero) per block
    packed = lambda n, k: n * k * 2  # noqa: E731
    expected = (V * E * 2 + E * 2 * (1 + 2 * 2)  # embedding, final norm, 2 norms per layer (bf16)
                + int4(V, E) + 2 * (int4(H, E) + int4(E, H // 2) + int4(2 * I, E) + packed(E, I)))
    assert shipped.weight_bytes == expected


@needs_int4
def test_bf16_gguf_projections_are_held_in_4_bits(tiny_gguf: Path) -> None:
    """Regression (issue 30): a bfloat16 engine on a Q4_1 GGUF held its projections dequantized, 2 bytes a weight."""
    llm = LLM(str(tiny_gguf), progress=False, dtype="bfloat16", block_size=16, num_blocks=16, num_threads=1)
    qkv = llm.model.layers[0].qkv_proj
    held = sum(t.numel() * t.element_size() for t in qkv.state_dict().values())
    n, k = (4 + 2 * 2) * 64, 256
    assert held == n * k // 2 + (k // 32) * n * 4  # 4-bit codes + a bfloat16 scale and zero per 32 weights


def test_float32_auto_keeps_gguf_weights_dequantized(tiny_gguf: Path) -> None:
    """``auto`` with a float32 model: every projection dequantized, as before (exact float32 numerics)."""
    llm, _ = _logits(tiny_gguf, dtype="float32")
    assert not any(isinstance(m, Int4Linear) for m in llm.model.modules())
    assert llm.model.layers[0].qkv_proj.weight.dtype == torch.float32


@needs_int4
def test_as_shipped_with_float32_model_rounds_inputs_to_bf16(tiny_gguf: Path) -> None:
    """A float32 model can still run its Q4 projections 4-bit (inputs rounded to bfloat16 for them): float32
    logits, no further from the float32 dequantized model's than a whole bfloat16 model's are (measured max
    0.079 vs 0.119)."""
    llm, got = _logits(tiny_gguf, dtype="float32", weights_dtype="as_shipped")
    _, truth = _logits(tiny_gguf, dtype="float32", weights_dtype="dequantized")
    _, bf16 = _logits(tiny_gguf, dtype="bfloat16", weights_dtype="dequantized")
    assert isinstance(llm.model.layers[0].qkv_proj, Int4Linear)
    assert got.dtype == torch.float32
    assert (got - truth).abs().max() <= (bf16 - truth).abs().max()
    assert (got - truth).abs().max() > 0  # the 4-bit path did run (bf16 rounding shows)


def test_without_int4_kernel_falls_back_to_dequantized_with_a_warning(tiny_gguf: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_linear, "int4_kernel_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="int4 CPU matmul"):
        loaded = load_model(tiny_gguf, dtype=torch.bfloat16, progress=False)
    assert not any(isinstance(m, Int4Linear) for m in loaded.model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 auto never asks for the kernel: no warning
        load_model(tiny_gguf, dtype=torch.float32, progress=False)
    assert weight_bytes(loaded.model) > 0


@pytest.mark.parametrize("bad", ["int4", "bfloat16", "", None, 4])
def test_weights_dtype_is_validated_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="weights_dtype must be one of auto, as_shipped, dequantized"):
        EngineConfig(weights_dtype=bad)
    with pytest.raises(ValueError, match="weights_dtype"):
        LLM(None, weights_dtype=bad)  # before any model is loaded
    with pytest.raises(ValueError, match="weights_dtype"):
        load_model(None, weights_dtype=bad)


def test_cli_weights_dtype_flag_reaches_the_engine(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpage.cli import main

    code = main(["generate", "hello", "--model", str(tiny_gguf), "--no-chat", "--max-tokens", "2", "--dtype",
                 "bfloat16", "--weights-dtype", "dequantized", "--num-blocks", "8", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0
    assert "[kvpage] model: tiny-q4.gguf: 9 projections in bfloat16, " in err and "MiB of weights" in err
    code = main(["generate", "hello", "--model", str(tiny_gguf), "--no-chat", "--max-tokens", "2", "--dtype",
                 "bfloat16", "--num-blocks", "8", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0  # auto: 2 x (Q4_1 qkv, gate_up), 2 x Q4_0 o_proj + the Q4_0 LM head; Q8_0 down projections
    assert "[kvpage] model: tiny-q4.gguf: 3 Q4_0 projections 4-bit as shipped, 4 Q4_1 projections 4-bit as " \
           "shipped, 2 in bfloat16, " in err
    code = main(["generate", "hello", "--model", str(tiny_gguf), "--weights-dtype", "int3"])
    err = capsys.readouterr().err
    assert code != 0 and "weights_dtype must be one of auto, as_shipped, dequantized; got 'int3'" in err


def test_weights_dtype_off_the_cpu() -> None:
    """The 4-bit kernel is torch's CPU one: ``auto`` on CUDA loads dequantized, ``as_shipped`` there is refused
    (checked in the config, before any device or model is touched)."""
    assert EngineConfig(weights_dtype="auto", dtype="bfloat16").weights_dtype_resolved == "auto"
    assert EngineConfig(weights_dtype="auto", device="cuda").weights_dtype_resolved == "dequantized"
    with pytest.raises(ValueError, match="weights_dtype='as_shipped' runs on the CPU only"):
        EngineConfig(weights_dtype="as_shipped", device="cuda")
