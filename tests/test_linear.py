"""PackedLinear: bf16 CPU weights packed for oneDNN or into AMX tiles match F.linear's numerics; every other case is
plain F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from kvpage.model import linear as packed_linear
from kvpage.model.config import ModelConfig
from kvpage.model.linear import PACKINGS, AmxTiles, OneDnnBlocked, PackedLinear, packing_available, packing_for
from kvpage.model.loader import weight_bytes
from kvpage.model.llama import LlamaForCausalLM

BF16_U = 2.0**-8  # bf16 unit roundoff (8-bit significand): one rounding moves a value by at most this, relatively
MAX_REL = 1.25 * BF16_U  # one output rounding plus float32 accumulation error, with a margin

needs_packing = pytest.mark.skipif(
    not packing_available(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="this torch/CPU does not run oneDNN bf16 packed linears (plain F.linear is used)",
)


def _case(n: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()  # [N, K]
    x = torch.randn(m, k, generator=gen).bfloat16()  # [M, K]
    return w, x


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-output error in units of the output's magnitude (floored at the row's RMS, for near-zero outputs)."""
    scale = torch.maximum(ref.abs(), ref.pow(2).mean(-1, keepdim=True).sqrt())
    return (y.double() - ref).abs() / scale


@needs_packing
@pytest.mark.parametrize("m", [1, 8, 33, 512])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (37, 53)])
def test_packed_bf16_matches_float64_like_f_linear(n, k, m):
    w, x = _case(n, k, m, seed=n + k + m)
    lin = PackedLinear(w)
    assert lin.is_packed and not list(lin.parameters())
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().T  # exact for bf16 inputs
    ours, theirs = _rel_err(y, ref), _rel_err(F.linear(x, w), ref)
    assert ours.max() <= MAX_REL, ours.max()
    # same contract as F.linear (fp32 accumulation, one bf16 rounding): as close to the truth on average
    assert ours.mean() <= 1.25 * theirs.mean() + 1e-4, (ours.mean(), theirs.mean())


@needs_packing
def test_packed_handles_batched_and_empty_inputs():
    w, x = _case(64, 48, 6)
    lin = PackedLinear(w)
    ref = x.double() @ w.double().T
    y3 = lin(x.view(2, 3, 48))
    assert y3.shape == (2, 3, 64) and _rel_err(y3.reshape(6, 64), ref).max() <= MAX_REL
    assert lin(x[:0]).shape == (0, 64)
    xt = x.T.contiguous().T  # non-contiguous input
    assert _rel_err(lin(xt), ref).max() <= MAX_REL


@needs_packing
def test_packed_weight_round_trips_and_moves():
    w, x = _case(40, 24, 3)
    lin = PackedLinear(w)
    assert torch.equal(lin.weight, w)  # the reorder is a permutation of the same bf16 values
    assert torch.equal(lin.state_dict()["weight"], w)
    assert lin.to("cpu").is_packed  # no-op
    lin.float()  # cast: unpacked, converted, float32 is not packed
    assert not lin.is_packed and lin.weight.dtype == torch.float32 and torch.equal(lin.weight, w.float())
    lin.bfloat16()  # back to bf16 on CPU: packed again
    assert lin.is_packed and torch.equal(lin.weight, w)
    lin.to("meta")  # another device (stands in for CUDA): a plain parameter there
    assert not lin.is_packed and lin.weight.device.type == "meta" and [p.shape for p in lin.parameters()] == [(40, 24)]


@needs_packing
def test_copy_of_shared_weight_is_dropped_not_moved():
    w, _ = _case(40, 24, 1)
    copy = PackedLinear(w, copy_of_shared=True)
    assert copy.is_packed and "weight" not in copy.state_dict()
    copy.to("meta")
    assert not copy.is_packed and not list(copy.parameters())
    assert not PackedLinear(w.float(), copy_of_shared=True).is_packed  # never a dense second copy


WORKING = [p for p in PACKINGS if p.works()]


@pytest.mark.skipif(not WORKING, reason="no packing runs on this torch/CPU")
@pytest.mark.parametrize("packing", WORKING, ids=lambda p: p.name)
@pytest.mark.parametrize("m", [1, 5, 16, 31, 32, 33, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(960, 576), (17, 600), (50, 100), (33, 1536)])
def test_each_packing_round_trips_and_matches_float64(packing, m, n, k):
    """Every packing this machine runs (AMX tiles: whole 16-row tiles, rows beyond 32 in K slices, outputs and inputs
    padded to 16 and 32): the weight back bit for bit, and products within one bf16 rounding of float64."""
    w, x = _case(n, k, m, seed=7 * n + k + m)
    packed = packing.pack(w)
    assert torch.equal(packing.unpack(packed, n, k), w)
    y = packing.matmul(x, packed, n, k)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().T
    ours, theirs = _rel_err(y, ref), _rel_err(F.linear(x, w), ref)
    assert ours.max() <= MAX_REL, ours.max()
    assert ours.mean() <= 1.25 * theirs.mean() + 1e-4, (ours.mean(), theirs.mean())


@pytest.mark.skipif(not PACKINGS[0].works(), reason="no AMX on this CPU/build")
def test_amx_tiles_are_preferred_padded_and_checked(monkeypatch):
    """Where AMX runs, PackedLinear takes the tiles (oneDNN with KVPAGE_AMX_LINEAR off); the tiles are padded to
    16 outputs x 32 inputs, which weight_bytes counts; a packed tensor of the wrong size is refused by name."""
    monkeypatch.setattr(packed_linear, "AMX_ENABLED", True)  # (whatever KVPAGE_AMX_LINEAR says here)
    w, x = _case(50, 100, 3)
    lin = PackedLinear(w)
    assert lin.packing is packing_for(w) and isinstance(lin.packing, AmxTiles) and "packed=amx" in repr(lin)
    assert lin.packed_nbytes == 64 * 128 * 2
    model = torch.nn.Sequential(lin)
    assert weight_bytes(model) == 64 * 128 * 2
    assert torch.equal(lin(x.view(3, 1, 100)).view(3, 50), lin(x)) and lin(x[:0]).shape == (0, 50)
    kernels = AmxTiles.kernels()
    with pytest.raises(RuntimeError, match="packed holds"):
        kernels.amx_linear(x, lin._packed[:-1], 50, 100)
    with pytest.raises(RuntimeError, match="2-D bfloat16"):
        kernels.amx_linear(x.float(), lin._packed, 50, 100)
    with pytest.raises(RuntimeError, match="x has 64 inputs, the packed weight 100"):  # same tiles, wrong width
        kernels.amx_linear(torch.zeros(3, 64, dtype=torch.bfloat16), lin._packed, 50, 100)
    with pytest.raises(RuntimeError):
        lin(torch.zeros(3, 64, dtype=torch.bfloat16))  # as F.linear raises
    empty_k = PackedLinear(torch.zeros(50, 0, dtype=torch.bfloat16))  # K == 0: empty sums, zeros out
    assert torch.equal(empty_k(torch.zeros(40, 0, dtype=torch.bfloat16)), torch.zeros(40, 50, dtype=torch.bfloat16))
    xt = x.T.contiguous().T  # non-contiguous x
    assert torch.equal(kernels.amx_linear(xt, lin._packed, 50, 100), kernels.amx_linear(x, lin._packed, 50, 100))
    monkeypatch.setattr(packed_linear, "AMX_ENABLED", False)
    other = PackedLinear(w)
    if OneDnnBlocked().works():
        assert isinstance(other.packing, OneDnnBlocked) and torch.equal(other.weight, w)
        assert other.packed_nbytes == 50 * 100 * 2


def test_unsupported_cases_stay_plain_f_linear(monkeypatch):
    w, x = _case(48, 32, 5)
    ref = x.double() @ w.double().T
    for weight, inp in [(w.float(), x.float()), (w.half(), x.half())]:
        lin = PackedLinear(weight)
        assert not lin.is_packed and lin.weight is next(lin.parameters()) and not lin.weight.requires_grad
        assert (lin(inp).double() - ref).abs().max() <= 2**-9 * ref.abs().max() * 4
    assert not packing_available(torch.empty(4, 4, dtype=torch.bfloat16, device="meta"))
    assert not packing_available(torch.empty(2, 4, 4, dtype=torch.bfloat16))
    monkeypatch.setattr(packed_linear, "ENABLED", False)
    assert not PackedLinear(w).is_packed
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.empty(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_weights_are_plain():
    w, x = _case(64, 32, 4)
    lin = PackedLinear(w).to("cuda")
    assert not lin.is_packed and lin.weight.is_cuda
    assert _rel_err(lin(x.cuda()).cpu(), x.double() @ w.double().T).max() <= MAX_REL


# -- in the model ----------------------------------------------------------------------------------


class CausalAttention:
    """One sequence, no cache: causal SDPA over the tokens of this call (float32 math)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(*(t.float().transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                           enable_gqa=True)  # [H, T, D]
        return o.transpose(0, 1).to(q.dtype).contiguous()  # [T, H, D]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bf16_model_packs_and_matches_plain(tied, monkeypatch):
    torch.manual_seed(0)
    hf_config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            tie_word_embeddings=tied)
    sd = {n: t.bfloat16() for n, t in HFLlama(hf_config).state_dict().items()}
    config = ModelConfig.from_hf(hf_config)
    ids, pos = torch.randint(0, 300, (20,)), torch.arange(20)

    def logits(dtype: torch.dtype, enabled: bool) -> tuple[LlamaForCausalLM, torch.Tensor]:
        monkeypatch.setattr(packed_linear, "ENABLED", enabled)
        model = LlamaForCausalLM(config, dtype=dtype)
        model.load_hf_state_dict(dict(sd))
        with torch.inference_mode():
            return model, model.compute_logits(model(ids, pos, CausalAttention()))

    _, ref = logits(torch.float32, True)  # same bf16 weights, float32 activations: never packed
    plain_model, plain = logits(torch.bfloat16, False)
    model, packed = logits(torch.bfloat16, True)
    assert not any(m.is_packed for m in plain_model.modules() if isinstance(m, PackedLinear))
    if packing_available(torch.empty(2, 2, dtype=torch.bfloat16)):
        projections = [getattr(layer, n) for layer in model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        assert all(p.is_packed for p in projections)
        head = model.tied_lm_head if tied else model.lm_head
        assert head.is_packed and (model.lm_head is None) == tied
        assert torch.equal(model.layers[1].qkv_proj.weight[:64], sd["model.layers.1.self_attn.q_proj.weight"])
    assert packed.dtype == torch.float32 and packed.shape == (20, 300)
    err_packed, err_plain = (packed - ref).abs(), (plain - ref).abs()
    assert err_packed.max() <= 4 * BF16_U * ref.abs().max(), err_packed.max()  # bf16 activations through 2 layers
    assert err_packed.mean() <= 1.5 * err_plain.mean() + 1e-4, (err_packed.mean(), err_plain.mean())
    model.to("meta")  # moving off the CPU: plain weights there, the tied copy dropped
    assert not any(m.is_packed for m in model.modules() if isinstance(m, PackedLinear))
