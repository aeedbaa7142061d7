"""The feed-forward blocks of the DeepSeek-V3 decoder: a dense SwiGLU MLP and the routed mixture of experts.

Both take the post-attention normed hidden states ``h [T, E]`` and return ``[T, E]``, name their weights as
transformers' ``DeepseekV3MLP`` / ``DeepseekV3MoE`` do under a layer's ``mlp.`` prefix (:meth:`hf_shapes`),
and load them from such a state dict (:meth:`load`); :class:`~kvpage.model.deepseek.MLADecoderLayer` picks
one per layer (MoE from ``first_k_dense_replace`` on). Neither touches the KV cache.

The MoE is DeepSeek-V3's (arXiv:2412.19437, sec. 2.1.2; transformers' ``DeepseekV3TopkRouter``): sigmoid
affinities ``s = sigmoid(h @ W_g.T)`` in float32; expert *choice* adds the load-balancing bias
``e_score_correction_bias`` (auxiliary-loss-free balancing) and is group-limited -- the ``n_group`` groups
are ranked by the sum of their two best biased scores, the ``topk_group`` best kept, and the
``num_experts_per_tok`` best experts chosen inside them; the *weights* are the unbiased ``s`` of the chosen
experts, normalised to sum 1 when ``norm_topk_prob``, times ``routed_scaling_factor``. The output is the
weighted sum of the chosen experts' SwiGLU MLPs (``moe_intermediate_size`` wide) plus the shared experts'
(one SwiGLU MLP ``n_shared_experts * moe_intermediate_size`` wide). Notation: ``T`` tokens, ``E`` hidden,
``I`` MLP width, ``X`` routed experts, ``k`` experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.model.linear import PackedLinear
from kvpage.ops import fused


@dataclass(frozen=True)
class MoEDims:
    """The routing and expert widths of a DeepSeek-V3 config.

    Attributes:
        n_routed_experts: ``X``, routed experts per MoE layer.
        num_experts_per_tok: ``k``, experts each token is sent to.
        n_group: expert groups (``X`` divisible by it).
        topk_group: groups a token's experts may come from.
        norm_topk_prob: normalise the chosen experts' weights to sum 1.
        routed_scaling_factor: factor on the routed weights.
        moe_intermediate_size: ``I`` of each expert.
        n_shared_experts: shared experts (one MLP of ``n_shared_experts * I``; 0: none).
    """

    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_intermediate_size: int
    n_shared_experts: int

    @classmethod
    def from_hf(cls, c: Any) -> MoEDims:
        """Read and check the MoE fields of a transformers ``DeepseekV3Config``.

        Raises:
            ValueError: naming the field: a size below 1 (``n_shared_experts`` below 0), experts not divisible
                into groups of at least two (the group score sums the two best), ``topk_group`` above
                ``n_group``, or more experts per token than the kept groups hold.
        """
        def field(name: str, default: int | None = None) -> int:
            v = getattr(c, name, default)
            if v is None:
                raise ValueError(f"MoE config: {name} is not set")
            return int(v)

        d = cls(field("n_routed_experts"), field("num_experts_per_tok"), field("n_group", 1), field("topk_group", 1),
                bool(getattr(c, "norm_topk_prob", True)), float(getattr(c, "routed_scaling_factor", 1.0)),
                field("moe_intermediate_size"), field("n_shared_experts", 0))
        for name in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size"):
            if getattr(d, name) < 1:
                raise ValueError(f"MoE config: {name} must be >= 1, got {getattr(d, name)}")
        if d.n_shared_experts < 0:
            raise ValueError(f"MoE config: n_shared_experts must be >= 0, got {d.n_shared_experts}")
        per_group = d.n_routed_experts // d.n_group
        if d.n_routed_experts % d.n_group or per_group < 2:
            raise ValueError(f"MoE config: n_routed_experts={d.n_routed_experts} must split into n_group={d.n_group} "
                             f"groups of at least 2 experts")
        if d.topk_group > d.n_group:
            raise ValueError(f"MoE config: topk_group={d.topk_group} exceeds n_group={d.n_group}")
        if d.num_experts_per_tok > d.topk_group * per_group:
            raise ValueError(f"MoE config: num_experts_per_tok={d.num_experts_per_tok} exceeds the "
                             f"{d.topk_group * per_group} experts of topk_group={d.topk_group} groups of {per_group}")
        return d


def route(h: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, d: MoEDims) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited top-k routing of ``h [T, E]`` (see the module docstring; no side effects).

    Args:
        h: ``[T, E]`` hidden states (any float dtype; routed in float32).
        gate: ``[X, E]`` float32 router weight.
        bias: ``[X]`` float32 ``e_score_correction_bias`` (choice only).
        d: the MoE widths.

    Returns:
        ``(weights [T, k] float32, experts [T, k] int64)``.
    """
    T, X, G = h.shape[0], d.n_routed_experts, d.n_group
    scores = F.linear(h.float(), gate).sigmoid()                                         # [T, X]
    choice = scores + bias                                                               # [T, X]
    group_scores = choice.view(T, G, X // G).topk(2, dim=-1).values.sum(dim=-1)           # [T, G]
    groups = group_scores.topk(d.topk_group, dim=-1, sorted=False).indices               # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)    # [T, G]
    choice = choice.masked_fill(~keep.repeat_interleave(X // G, dim=1), float("-inf"))   # [T, X]
    experts = choice.topk(d.num_experts_per_tok, dim=-1, sorted=False).indices           # [T, k]
    weights = scores.gather(1, experts)                                                  # [T, k]
    if d.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * d.routed_scaling_factor, experts


def swiglu_shapes(prefix: str, hidden_size: int, intermediate_size: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's tensor names under ``prefix`` as transformers names them, and their shapes."""
    E, inter = hidden_size, intermediate_size
    return {prefix + "gate_proj.weight": (inter, E), prefix + "up_proj.weight": (inter, E),
            prefix + "down_proj.weight": (E, inter)}


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(h)) * up(h))`` with fused ``gate_up_proj [2I, E]`` and ``down_proj [E, I]``.

    Args:
        hidden_size: ``E``.
        intermediate_size: ``I``.
        dtype: the model dtype (weights live on ``meta`` until :meth:`load`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size, self.dtype = hidden_size, intermediate_size, dtype
        meta = {"dtype": dtype, "device": "meta"}
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, **meta)
        self.down_proj: nn.Module = nn.Linear(intermediate_size, hidden_size, bias=False, **meta)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [T, E]`` -> ``[T, E]`` in the model dtype."""
        return self.down_proj(fused.silu_mul(self.gate_up_proj(h)))

    def hf_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """transformers' tensor names under ``prefix`` (e.g. ``model.layers.0.mlp.``) and their shapes."""
        return swiglu_shapes(prefix, self.hidden_size, self.intermediate_size)

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Take the weights named by :meth:`hf_shapes` from ``sd`` (checked by the caller), cast to the model dtype."""
        gate_up = torch.cat([sd[prefix + "gate_proj.weight"], sd[prefix + "up_proj.weight"]]).to(self.dtype)
        self.gate_up_proj = PackedLinear(gate_up.contiguous())
        self.down_proj = PackedLinear(sd[prefix + "down_proj.weight"].to(self.dtype).contiguous())


class MoEMLP(nn.Module):
    """DeepSeek-V3's mixture of experts: routed SwiGLU experts plus the shared experts (module docstring).

    Weights after :meth:`load`: ``gate [X, E]`` and ``bias [X]`` in float32, per routed expert a fused
    ``gate_up [2I, E]`` and ``down [E, I]`` in the model dtype (``experts_gate_up [X, 2I, E]``,
    ``experts_down [X, E, I]``), and the shared experts as one :class:`DenseMLP`.

    Args:
        hidden_size: ``E``.
        dims: the MoE widths.
        dtype: the model dtype.
    """

    def __init__(self, hidden_size: int, dims: MoEDims, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.dims, self.dtype = hidden_size, dims, dtype
        X, E, inter = dims.n_routed_experts, hidden_size, dims.moe_intermediate_size
        meta = {"device": "meta"}
        self.register_buffer("gate", torch.empty(X, E, dtype=torch.float32, **meta), persistent=False)
        self.register_buffer("bias", torch.empty(X, dtype=torch.float32, **meta), persistent=False)
        self.register_buffer("experts_gate_up", torch.empty(X, 2 * inter, E, dtype=dtype, **meta), persistent=False)
        self.register_buffer("experts_down", torch.empty(X, E, inter, dtype=dtype, **meta), persistent=False)
        self.shared = (None if dims.n_shared_experts == 0 else
                       DenseMLP(hidden_size, dims.n_shared_experts * inter, dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [T, E]`` -> ``[T, E]``: each token's chosen experts, weighted, plus the shared experts."""
        weights, experts = route(h, self.gate, self.bias, self.dims)                   # [T, k] each
        out = torch.zeros_like(h)                                                       # [T, E]
        for x in experts.unique().tolist():
            tok, slot = torch.where(experts == x)                                       # tokens sent to expert x
            y = fused.silu_mul(F.linear(h[tok], self.experts_gate_up[x]))              # [t, I]
            y = F.linear(y, self.experts_down[x]) * weights[tok, slot, None]           # [t, E] float32
            out.index_add_(0, tok, y.to(out.dtype))
        return out if self.shared is None else out + self.shared(h)

    def hf_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """transformers' tensor names under ``prefix`` (``mlp.gate.*``, ``mlp.experts.{x}.*``,
        ``mlp.shared_experts.*``, as DeepSeek-V3 checkpoints store them) and their shapes."""
        d, E = self.dims, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (d.n_routed_experts, E),
                                              prefix + "gate.e_score_correction_bias": (d.n_routed_experts,)}
        for x in range(d.n_routed_experts):
            shapes.update(swiglu_shapes(f"{prefix}experts.{x}.", E, d.moe_intermediate_size))
        if self.shared is not None:
            shapes.update(self.shared.hf_shapes(prefix + "shared_experts."))
        return shapes

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Take the weights named by :meth:`hf_shapes` from ``sd`` (checked by the caller)."""
        X = self.dims.n_routed_experts
        self.gate = sd[prefix + "gate.weight"].float().contiguous()
        self.bias = sd[prefix + "gate.e_score_correction_bias"].float().contiguous()
        e = [f"{prefix}experts.{x}." for x in range(X)]
        self.experts_gate_up = torch.stack([torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]])
                                            for p in e]).to(self.dtype).contiguous()
        self.experts_down = torch.stack([sd[p + "down_proj.weight"] for p in e]).to(self.dtype).contiguous()
        if self.shared is not None:
            self.shared.load(sd, prefix + "shared_experts.")


def split_fused_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with transformers' in-memory fused expert tensors (``mlp.experts.gate_up_proj [X, 2I, E]``,
    ``mlp.experts.down_proj [X, E, I]``, what ``DeepseekV3ForCausalLM.state_dict()`` holds) renamed to the
    per-expert names checkpoints use (``mlp.experts.{x}.gate_proj.weight``, ...), as views (no copies); other
    tensors pass through. A new dict; ``sd`` is not modified."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for x in range(t.shape[0]):
                out[f"{prefix}{x}.gate_proj.weight"] = t[x, :inter]
                out[f"{prefix}{x}.up_proj.weight"] = t[x, inter:]
        elif name.endswith("mlp.experts.down_proj") and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            for x in range(t.shape[0]):
                out[f"{prefix}{x}.down_proj.weight"] = t[x]
        else:
            out[name] = t
    return out
