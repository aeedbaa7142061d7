"""GGUF weights run as shipped: GgufLinear against gguf-py's dequantize, a GGUF model as shipped against
dequantized, the tied LM head kept in the file's Q8_0 blocks, the ``weights_dtype`` setting, and the fallback
where kvpage's CPU kernels are not built."""
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
from kvpage.model.quantized_linear import DENSE_ROWS, GgufLinear, GgufWeight, gguf_kernels_available, to_tiles

BF16_U = 2.0**-8  # bf16 unit roundoff: one rounding to bfloat16 moves a value by at most this, relatively
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}

needs_kernels = pytest.mark.skipif(not gguf_kernels_available(), reason="kvpage's CPU kernels are not built here")


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


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("n,k,m", [(64, 96, 1), (960, 576, 1), (45, 64, 2), (192, 576, 3), (576, 1536, 5),
                                   (7, 32, 4), (48, 64, DENSE_ROWS - 1), (960, 576, DENSE_ROWS), (190, 576, 300)])
def test_gguf_linear_matches_dequantized_reference(qtype: Q, n: int, k: int, m: int) -> None:
    """``x @ W.T`` within its bound of the float64 product with gguf-py's dequantized weight.

    Below :data:`DENSE_ROWS` rows the kernel's weights are exact and each row of ``x`` is coded as int16 with
    one scale: an element moves by at most half of ``max|x| / 32767``, an output by that times ``sum |w|``;
    float32 sums add at most ``K * 2^-23`` of ``sum |x| |w|``; the bfloat16 output is rounded once (``2^-8``
    of it). From :data:`DENSE_ROWS` rows on the weight is decoded to bfloat16 (``2^-8`` of each weight) and
    multiplied by the BLAS.
    """
    weight = _weight(qtype, n, k, seed=n + k + m)
    lin = GgufLinear(weight)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    x[0, 0] = 8.0  # one large element: the int16 coding's step follows it
    ref = x.double() @ _reference(weight).T  # [M, N]
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    w_abs = _reference(weight).abs()
    xw = x.double().abs() @ w_abs.T
    if m < DENSE_ROWS:
        coding = x.double().abs().amax(dim=1, keepdim=True) / 32767 / 2 * w_abs.sum(dim=1)[None, :]
        bound = coding * 1.01 + xw * k * 2.0**-23 + ref.abs() * BF16_U * 1.01
    else:
        bound = xw * BF16_U * 1.01 + xw * k * 2.0**-23 + ref.abs() * BF16_U * 1.01
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    # and the error is of the size of a bfloat16 rounding of the output, not larger by a factor (sanity)
    rel = (err.norm() / ref.norm()).item()
    assert rel < 2 * BF16_U, rel


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_linear_float32_input_keeps_float32(qtype: Q) -> None:
    """A float32 ``x`` is not rounded to bfloat16 below :data:`DENSE_ROWS` rows: only the int16 coding's error
    remains (well under bfloat16's), and the output stays float32."""
    weight = _weight(qtype, 64, 128, seed=5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    y = GgufLinear(weight)(x)
    ref = x.double() @ _reference(weight).T
    assert y.dtype == torch.float32
    w_abs = _reference(weight).abs()
    bound = x.double().abs().amax(dim=1, keepdim=True) / 32767 / 2 * w_abs.sum(dim=1)[None, :] * 1.01 \
        + (x.double().abs() @ w_abs.T) * 128 * 2.0**-23
    assert bool(((y.double() - ref).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_gguf_linear_non_finite_input_row_gives_nan_row_only(bad: float) -> None:
    """A NaN or infinite activation turns its own output row into NaN (not silently coded as 0 or a finite value);
    the other rows are unaffected."""
    weight = _weight(Q.Q4_1, 16, 64, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    x[1, 5] = bad
    y = GgufLinear(weight)(x)
    assert bool(torch.isnan(y[1]).all())
    ref = GgufLinear(weight)(x[[0, 2]])
    assert torch.equal(y[[0, 2]], ref)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_linear_weight_is_gguf_py_dequantized_weight_exactly(qtype: Q) -> None:
    """``d * q + mn`` in float32 is gguf-py's value bit for bit (``d * q`` is exact), extremes included; the
    bfloat16 copy is that rounded to nearest even, as torch rounds."""
    weight = _weight(qtype, 130, 96, seed=3)  # 130 rows: the last tile is half padding
    lin = GgufLinear(weight)
    ref = _reference(weight).float()
    assert torch.equal(lin.weight, ref)
    assert torch.equal(lin.dense(), ref.bfloat16())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("n", [4, 5, 9])
def test_to_tiles_reorders_the_file_bytes(qtype: Q, n: int) -> None:
    """Tiles hold the file's bytes, no more (padding rows are zeros) and no fewer, in the documented order."""
    weight = _weight(qtype, max(n, 4), 64, seed=n)
    if n < 4:
        weight = GgufWeight(weight.ggml_type, weight.data[:n], (n, 64))
    tiles = to_tiles(weight)
    bb, hb = BLOCK_BYTES[qtype], 4 if qtype == Q.Q4_1 else 2
    padded = -(-n // 4) * 4
    assert tiles.nbytes == padded * 2 * bb
    assert sorted(tiles.tolist()) == sorted(weight.data.reshape(-1).tolist() + [0] * (padded - n) * 2 * bb)
    blocks = weight.data.reshape(n, 2, bb)
    t = tiles.reshape(-1, 2, 4 * bb)  # [tile, block, bytes]
    for row in range(n):
        tile, j = divmod(row, 4)
        for b in range(2):
            got = t[tile, b]
            assert bytes(got[2 * j:2 * j + 2]) == bytes(blocks[row, b, 0:2])  # step d
            if qtype == Q.Q4_1:
                assert bytes(got[8 + 2 * j:8 + 2 * j + 2]) == bytes(blocks[row, b, 2:4])  # minimum m
            cb = bb - hb
            assert bytes(got[4 * hb + j * cb:4 * hb + (j + 1) * cb]) == bytes(blocks[row, b, hb:])  # codes


def test_gguf_linear_takes_its_types_only() -> None:
    """Other ggml types, and ``K`` off the 32-weight blocks, stay dequantized (``None``); the module refuses them."""
    q5 = GgufWeight(int(Q.Q5_0), quantize(np.ones((4, 64), np.float32), Q.Q5_0).reshape(4, -1), (4, 64))
    assert quantized_linear.quantized_linear(q5) is None
    with pytest.raises(ValueError, match="ggml type 6 is not one of"):
        GgufLinear(q5)
    odd = GgufWeight(int(Q.Q8_0), np.zeros((4, 17), np.uint8), (4, 16))
    assert quantized_linear.quantized_linear(odd) is None


@needs_kernels
def test_gguf_kernel_refuses_tiles_of_the_wrong_size() -> None:
    """The kernel checks its bytes against the shape and type it is told (no read past the buffer)."""
    from kvpage.ops.cpu.build import load_kernels

    k = load_kernels()
    tiles = torch.from_numpy(to_tiles(_weight(Q.Q4_1, 8, 64, seed=0)))
    with pytest.raises(RuntimeError, match="bytes do not hold"):
        k.gguf_matmul(torch.ones(1, 64), tiles, int(Q.Q4_1), 12)
    with pytest.raises(RuntimeError, match="bytes do not hold"):
        k.gguf_matmul(torch.ones(1, 64), tiles, int(Q.Q8_0), 8)
    with pytest.raises(RuntimeError, match="ggml type 6"):
        k.gguf_dequantize(tiles, 6, 8, 64, False)


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


def _tiles_bytes(qtype: Q, n: int, k: int) -> int:
    """Bytes of :func:`to_tiles` for an ``[n, k]`` weight: the file's blocks, rows padded to a multiple of 4."""
    return -(-n // 4) * 4 * (k // 32) * BLOCK_BYTES[qtype]


@needs_kernels
def test_gguf_model_as_shipped_matches_dequantized(tiny_gguf: Path) -> None:
    """bfloat16 with ``weights_dtype='auto'``: every projection (q/k/v fused Q4_1, gate/up fused Q4_1, Q4_0
    o_proj, Q8_0 down, the untied Q4_0 LM head) is a GgufLinear; logits agree with the float32 model's as
    closely as the bfloat16 dequantized model's do, and the weights take the file's bytes."""
    shipped, got = _logits(tiny_gguf, dtype="bfloat16")
    deq, ref = _logits(tiny_gguf, dtype="bfloat16", weights_dtype="dequantized")
    _, truth = _logits(tiny_gguf, dtype="float32", weights_dtype="dequantized")
    layer = shipped.model.layers[0]
    assert all(isinstance(m, GgufLinear) for m in (layer.qkv_proj, layer.gate_up_proj, layer.o_proj,
                                                     layer.down_proj, shipped.model.lm_head))
    assert (layer.qkv_proj.ggml_type, layer.o_proj.ggml_type, layer.down_proj.ggml_type) == (3, 2, 8)
    assert isinstance(deq.model.layers[0].qkv_proj, PackedLinear)
    # against the float32 model on the same (dequantized) weights, the as-shipped path errs no more than
    # bfloat16 weights do (its weights are exact; x coded as int16): 1.5x allowed
    err, err_deq = (got - truth).abs(), (ref - truth).abs()
    assert err.max() <= 1.5 * err_deq.max() and err.mean() <= 1.5 * err_deq.mean(), (err.max(), err_deq.max())
    assert shipped.weight_bytes < deq.weight_bytes
    E, I, V, H = 256, 512, VOCAB, (4 + 2 * 2) * 64
    expected = (V * E * 2 + E * 2 * (1 + 2 * 2)  # embedding, final norm, 2 norms per layer (bf16)
                + _tiles_bytes(Q.Q4_0, V, E)
                + 2 * (_tiles_bytes(Q.Q4_1, H, E) + _tiles_bytes(Q.Q4_0, E, H // 2) + _tiles_bytes(Q.Q4_1, 2 * I, E)
                       + _tiles_bytes(Q.Q8_0, E, I)))
    assert shipped.weight_bytes == expected


@needs_kernels
def test_bf16_gguf_projections_are_held_as_shipped(tiny_gguf: Path) -> None:
    """Regression (issue 30): a bfloat16 engine on a Q4_1 GGUF held its projections dequantized, 2 bytes a weight;
    now the file's 20 bytes per 32 weights."""
    llm = LLM(str(tiny_gguf), progress=False, dtype="bfloat16", block_size=16, num_blocks=16, num_threads=1)
    qkv = llm.model.layers[0].qkv_proj
    held = sum(t.numel() * t.element_size() for t in qkv.state_dict().values())
    assert held == _tiles_bytes(Q.Q4_1, (4 + 2 * 2) * 64, 256)


@needs_kernels
def test_tied_lm_head_runs_the_files_q8_0_blocks(tmp_path: Path) -> None:
    """With tied embeddings the LM head is the file's Q8_0 embedding as shipped (a GgufLinear, no dense packed
    copy), the lookup reads the dequantized embedding; logits track the float32 model as bfloat16 weights do."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.08,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path / "tied.gguf"
    write_gguf(hf_model(config), path, {**TYPES, "embed": Q.Q8_0})
    shipped, got = _logits(path, dtype="bfloat16")
    deq, ref = _logits(path, dtype="bfloat16", weights_dtype="dequantized")
    _, truth = _logits(path, dtype="float32", weights_dtype="dequantized")
    head = shipped.model.tied_lm_head
    assert isinstance(head, GgufLinear) and head.ggml_type == int(Q.Q8_0) and shipped.model.lm_head is None
    assert torch.equal(head.weight.bfloat16(), shipped.model.embed_tokens.weight)  # one weight, two forms
    assert isinstance(deq.model.tied_lm_head, PackedLinear)
    err, err_deq = (got - truth).abs(), (ref - truth).abs()
    assert err.max() <= 1.5 * err_deq.max() and err.mean() <= 1.5 * err_deq.mean(), (err.max(), err_deq.max())
    # o_proj Q4_0; qkv and gate_up Q4_1; down and the tied head Q8_0
    assert _summary(shipped) == "1 Q4_0 projection as shipped, 2 Q4_1 projections as shipped, 2 Q8_0 projections " \
                                "as shipped"
    assert shipped.weight_bytes < deq.weight_bytes


def _summary(llm: LLM) -> str:
    from kvpage.model.loader import weights_summary

    return weights_summary(llm.model)


def test_float32_auto_keeps_gguf_weights_dequantized(tiny_gguf: Path) -> None:
    """``auto`` with a float32 model: every projection dequantized, as before (exact float32 numerics)."""
    llm, _ = _logits(tiny_gguf, dtype="float32")
    assert not any(isinstance(m, GgufLinear) for m in llm.model.modules())
    assert llm.model.layers[0].qkv_proj.weight.dtype == torch.float32


@needs_kernels
def test_as_shipped_with_float32_model(tiny_gguf: Path) -> None:
    """A float32 model can run its projections as shipped (float32 activations coded as int16 for them): float32
    logits, closer to the float32 dequantized model's than a whole bfloat16 model's are."""
    llm, got = _logits(tiny_gguf, dtype="float32", weights_dtype="as_shipped")
    _, truth = _logits(tiny_gguf, dtype="float32", weights_dtype="dequantized")
    _, bf16 = _logits(tiny_gguf, dtype="bfloat16", weights_dtype="dequantized")
    assert isinstance(llm.model.layers[0].qkv_proj, GgufLinear)
    assert got.dtype == torch.float32
    assert (got - truth).abs().max() <= (bf16 - truth).abs().max()
    assert (got - truth).abs().max() > 0  # the as-shipped path did run (the int16 coding shows)


def test_kernels_turned_off_warning_names_the_variable(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``KVPAGE_CPU_KERNELS=0`` the bfloat16 fallback warning said the kernels "are not built here"; it names
    the variable that turned them off."""
    from kvpage.ops.cpu import build as cpu_build

    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setenv("KVPAGE_CPU_KERNELS", "0")
    with pytest.warns(RuntimeWarning, match=r"not available: they are turned off by KVPAGE_CPU_KERNELS=0"):
        loaded = load_model(tiny_gguf, dtype=torch.bfloat16, progress=False)
    assert not any(isinstance(m, GgufLinear) for m in loaded.model.modules())


def test_without_kernels_falls_back_to_dequantized_with_a_warning(tiny_gguf: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_linear, "gguf_kernels_available", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"CPU kernels \(gguf_matmul\) are not available"):
        loaded = load_model(tiny_gguf, dtype=torch.bfloat16, progress=False)
    assert not any(isinstance(m, GgufLinear) for m in loaded.model.modules())
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
    assert code == 0  # auto: 2 x (Q4_1 qkv, gate_up), 2 x Q4_0 o_proj + the Q4_0 LM head, 2 x Q8_0 down
    assert "[kvpage] model: tiny-q4.gguf: 3 Q4_0 projections as shipped, 4 Q4_1 projections as shipped, " \
           "2 Q8_0 projections as shipped, " in err
    code = main(["generate", "hello", "--model", str(tiny_gguf), "--weights-dtype", "int3"])
    err = capsys.readouterr().err
    assert code != 0 and "--weights-dtype must be one of auto, as_shipped, dequantized; got 'int3'" in err


def test_weights_dtype_off_the_cpu() -> None:
    """The as-shipped kernel is kvpage's CPU one: ``auto`` on CUDA loads dequantized, ``as_shipped`` there is refused
    (checked in the config, before any device or model is touched)."""
    assert EngineConfig(weights_dtype="auto", dtype="bfloat16").weights_dtype_resolved == "auto"
    assert EngineConfig(weights_dtype="auto", device="cuda").weights_dtype_resolved == "dequantized"
    with pytest.raises(ValueError, match="weights_dtype='as_shipped' runs on the CPU only"):
        EngineConfig(weights_dtype="as_shipped", device="cuda")
