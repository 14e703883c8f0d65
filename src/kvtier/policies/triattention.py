"""TriAttention: a calibrated trigonometric series in the query-key distance, plus a key-norm term
(Mao et al., 2026).

RoPE rotates the m-th pair of a head's dimensions (as a complex number z_m) by ω_m·p at position p,
ω_m = θ^(−2m/d). A query q at position t and a key k at position p therefore have the logit
Σ_m Re(q_m conj(k_m) e^{iω_m Δ}), Δ = t − p. Replacing q and k by their mean pre-RoPE vectors q̄, k̄
gives, per KV head h, the series

    f_h(Δ) = Σ_m a_{h,m} cos(ω_m Δ) + b_{h,m} sin(ω_m Δ),   a + i·(−b) = q̄_m conj(k̄_m),

and the part of the logit the mean query cannot predict is bounded by (E|q_m| − |q̄_m|)·|k_m| per
pair, which gives the norm term Σ_m β_{h,m} |k_{i,m}| (|k_{i,m}| is RoPE-invariant, so it is read off
the cached post-RoPE key). The score is

    s_i = mean_{o ∈ offsets} f_h(Δ_i + o) + Σ_m β_{h,m} |k_{i,m}|,

with offsets {1, 2, 4, ..., max_offset} (the released scorer averages over these future distances;
max_offset = 0 scores the current distance only).

Approximations, stated: (1) the released scorer keeps each key's own phase (q̄ against the key's
un-rotated vector); here the key's content enters only through its pair norms and the positional part
uses the mean key k̄, as the paper's §2 summary has it (s_i = f(t − i) combined with ||k_i||).
(2) With GQA, a KV head's coefficients average its query heads' (a, b are linear in q̄, so this is
the group-mean query; β averages the per-query-head β). (3) No RoPE scaling (YaRN / llama3): ω is
θ^(−2m/d) and no frequency scale factor is applied. (4) The 1/√d logit scale is dropped (it scales
both terms alike and does not change the per-head ranking).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .base import KEYS, NOT_A_PARAM, EvictionContext, EvictionPolicy, PolicyError
from .registry import register

ROPE_STYLES = ("half", "interleaved")  # HF rotate_half pairs (m, m + d/2); GPT-J pairs (2m, 2m + 1)


def rope_frequencies(rope_theta: float, head_dim: int) -> Tensor:
    """[d/2] ω_m = θ^(−2m/d) (float64)."""
    if head_dim <= 0 or head_dim % 2:
        raise PolicyError(f"head_dim must be a positive even number, got {head_dim}")
    return rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rope_pairs(x: Tensor, style: str = "half") -> tuple[Tensor, Tensor]:
    """(re, im) [..., d/2] of the RoPE pairs of x [..., d]."""
    if style == "half":
        m = x.shape[-1] // 2
        return x[..., :m], x[..., m:]
    if style == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    raise PolicyError(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")


@dataclass
class TriAttentionCalibration:
    """Per layer and KV head: cos_coef a, sin_coef b, norm_weight β, each [L, H, d/2]; omega [d/2]."""

    cos_coef: Tensor
    sin_coef: Tensor
    norm_weight: Tensor
    omega: Tensor
    rope_style: str = "half"
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        shape = self.cos_coef.shape
        if len(shape) != 3 or self.sin_coef.shape != shape or self.norm_weight.shape != shape:
            raise PolicyError("cos_coef, sin_coef and norm_weight must share one [L, H, d/2] shape")
        if self.omega.shape != shape[2:]:
            raise PolicyError(f"omega must be [{shape[2]}], got {tuple(self.omega.shape)}")
        rope_pairs(torch.zeros(2), self.rope_style)  # validates the style

    @property
    def num_layers(self) -> int:
        return self.cos_coef.shape[0]

    @property
    def num_heads(self) -> int:
        return self.cos_coef.shape[1]

    def series(self, layer: int, distance: Tensor, offsets: Sequence[int] = (0,), heads: Tensor | None = None) -> Tensor:
        """mean_o f_h(Δ + o) for distance [H, ...] (any trailing shape), float64; `heads`: the calibration
        heads of the rows (a tensor-parallel rank's slice), all by default. The mean over offsets
        is again a series in Δ: a' = a·C + b·S, b' = b·C − a·S with C, S = mean_o cos, sin(ω_m o)."""
        dev = distance.device
        omega = self.omega.double().to(dev)
        wo = omega.unsqueeze(1) * torch.tensor(offsets, dtype=torch.float64, device=dev)  # [M, n]
        c, s = wo.cos().mean(dim=1), wo.sin().mean(dim=1)
        a0, b0 = self.cos_coef[layer].double().to(dev), self.sin_coef[layer].double().to(dev)  # [H, M]
        if heads is not None:
            a0, b0 = a0[heads.to(dev)], b0[heads.to(dev)]
        a, b = a0 * c + b0 * s, b0 * c - a0 * s
        phase = distance.double().unsqueeze(-1) * omega
        view = (a.shape[0],) + (1,) * (distance.dim() - 1) + (a.shape[1],)
        return (phase.cos() * a.view(view) + phase.sin() * b.view(view)).sum(dim=-1)


def calibrate_from_samples(queries_prerope: Tensor, keys_prerope: Tensor, rope_theta: float, head_dim: int,
                           *, rope_style: str = "half") -> TriAttentionCalibration:
    """Coefficients from pre-RoPE samples: queries [L, H_q, N, d], keys [L, H, N', d] ([H_q, N, d] and
    [H, N', d] for one layer); H_q a multiple of H, query head j belongs to KV head j // (H_q / H).

    a_{h,m} − i·b_{h,m} = q̄_{h,m} conj(k̄_{h,m}) with q̄ the group-mean pre-RoPE query pair, k̄ the mean
    key pair; β_{h,m} = mean over the group of (E|q_m| − |E q_m|). See the module docstring."""
    q, k = queries_prerope, keys_prerope
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise PolicyError(f"queries [L, H_q, N, d] and keys [L, H, N, d] with H | H_q, got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[-1] != head_dim or k.shape[-1] != head_dim:
        raise PolicyError(f"head_dim={head_dim} does not match the samples' last dim")
    L, H = k.shape[:2]
    qr, qi = (t.double() for t in rope_pairs(q, rope_style))  # [L, H_q, N, M]
    kr, ki = (t.double() for t in rope_pairs(k, rope_style))
    q_mean = torch.complex(qr.mean(dim=2), qi.mean(dim=2))  # [L, H_q, M]
    beta = torch.complex(qr, qi).abs().mean(dim=2) - q_mean.abs()
    group = q.shape[1] // H
    q_mean = q_mean.view(L, H, group, -1).mean(dim=2)
    z = q_mean * torch.complex(kr.mean(dim=2), ki.mean(dim=2)).conj()
    return TriAttentionCalibration(
        cos_coef=z.real.float(), sin_coef=(-z.imag).float(), norm_weight=beta.view(L, H, group, -1).mean(dim=2).float(),
        omega=rope_frequencies(rope_theta, head_dim).float(), rope_style=rope_style, rope_theta=float(rope_theta),
    )


def save_calibration(calibration: TriAttentionCalibration, path: str | Path) -> None:
    from safetensors.torch import save_file

    c = calibration
    tensors = {"cos_coef": c.cos_coef, "sin_coef": c.sin_coef, "norm_weight": c.norm_weight, "omega": c.omega}
    meta = {"rope_style": c.rope_style, "rope_theta": "" if c.rope_theta is None else repr(c.rope_theta)}
    save_file({n: t.detach().float().contiguous().cpu() for n, t in tensors.items()}, str(path), metadata=meta)


def load_calibration(path: str | Path) -> TriAttentionCalibration:
    """Load a saved calibration. Loads are cached per (file, mtime, size): every request naming the same
    file shares one copy (the tensors are read-only in use)."""
    p = Path(path).expanduser().resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise PolicyError(f"triattention calibration {str(path)!r}: {exc.strerror or exc}") from None
    return _load_calibration(str(p), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=16)
def _load_calibration(path: str, _mtime_ns: int, _size: int) -> TriAttentionCalibration:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in ("cos_coef", "sin_coef", "norm_weight", "omega")}
    except Exception as exc:  # not a safetensors file, or missing tensors
        raise PolicyError(f"triattention calibration {path!r} is not a kvtier calibration: {exc}") from None
    theta = meta.get("rope_theta", "")
    return TriAttentionCalibration(**tensors, rope_style=meta.get("rope_style", "half"), rope_theta=float(theta) if theta else None)


def future_offsets(max_offset: int) -> list[int]:
    """[1, 2, 4, ..., <= max_offset], or [0] when max_offset is 0."""
    if max_offset < 0:
        raise PolicyError(f"max_offset must be >= 0, got {max_offset}")
    return [0] if max_offset == 0 else [1 << i for i in range(max_offset.bit_length())]


@register
@dataclass(kw_only=True, eq=False, repr=False)
class TriAttentionPolicy(EvictionPolicy):
    """s_i = mean_o f_h(Δ_i + o) + Σ_m β_{h,m} |k_{i,m}|, Δ_i = query_position − position_i (module doc).

    The calibration comes from the constructor (a TriAttentionCalibration or a path to a saved one, as
    the engine passes it from kvtier_params={"calibration": PATH}, file made by `kvtier calibrate`) or
    per round from ctx.extras["triattention"]; the layer from ctx.extras["layer"] or the constructor
    (not needed for a one-layer calibration); ctx.extras["kv_heads"]: the model's KV head index of each
    row (a tensor-parallel rank holds a slice of the calibration's heads), all heads in order by default.
    Keeps the whole prompt by default (paper §5.1).
    """

    name = "triattention"
    needs = frozenset({KEYS})
    order_free = True
    default_protect_prompt = True

    # a path is loaded in __post_init__; not in params() (the engine passes the path in kvtier_params)
    calibration: TriAttentionCalibration | str | Path | None = field(default=None, metadata=NOT_A_PARAM)
    layer: int | None = None
    max_offset: int = 65536

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.calibration, (str, Path)):
            self.calibration = load_calibration(self.calibration)
        self.max_offset = int(self.max_offset)
        self.offsets = future_offsets(self.max_offset)

    def check_serving(self, *, num_layers: int | None = None, num_kv_heads: int | None = None,
                      head_dim: int | None = None) -> None:
        """Raise unless this policy can run in an engine on its own (the engine passes no calibration
        through extras): a calibration is set and, for the shapes given, fits the model."""
        cal = self.calibration
        if cal is None:
            raise PolicyError("policy 'triattention' needs a calibration: kvtier_params={\"calibration\": "
                              "\"/path/calib.safetensors\"} (made by `kvtier calibrate`)")
        got = (cal.num_layers, cal.num_heads, 2 * cal.omega.shape[0])
        want = (num_layers, num_kv_heads, head_dim)
        if any(w is not None and w != g for g, w in zip(got, want)):
            raise PolicyError(f"triattention calibration is for {got[0]} layers x {got[1]} KV heads x head_dim "
                              f"{got[2]}, the model has {want[0]} x {want[1]} x {want[2]}")

    def score(self, ctx: EvictionContext) -> Tensor:
        cal = ctx.extras.get("triattention") or self.calibration
        if cal is None:
            raise PolicyError("policy 'triattention' needs a calibration (constructor `calibration` or ctx.extras['triattention'])")
        layer = self.layer if ctx.extras.get("layer") is None else ctx.extras["layer"]
        if layer is None and cal.num_layers != 1:
            raise PolicyError(f"policy 'triattention' needs `layer` (ctx.extras['layer']) for a {cal.num_layers}-layer calibration")
        layer = 0 if layer is None else int(layer)
        heads = ctx.extras.get("kv_heads")
        n_heads = cal.num_heads if heads is None else len(heads)
        if (not 0 <= layer < cal.num_layers or n_heads != ctx.num_heads
                or (heads is not None and int(heads.max()) >= cal.num_heads)):
            raise PolicyError(f"layer={layer} / {ctx.num_heads} heads do not fit a calibration of {cal.num_layers} layers x {cal.num_heads} heads")
        if ctx.query_position is None:
            raise PolicyError("policy 'triattention' needs query_position but the context has none")
        if ctx.keys.shape[-1] != 2 * cal.omega.shape[0]:
            raise PolicyError(f"keys head_dim {ctx.keys.shape[-1]} != calibration head_dim {2 * cal.omega.shape[0]}")
        delta = ctx.query_position - ctx.positions  # [H, S]
        positional = cal.series(layer, delta, self.offsets, heads)
        re, im = rope_pairs(ctx.keys.double(), cal.rope_style)
        beta = cal.norm_weight[layer].double().to(re.device)
        beta = (beta if heads is None else beta[heads.to(re.device)]).unsqueeze(1)  # [H, 1, M]
        return positional + ((re.square() + im.square()).sqrt() * beta).sum(dim=-1)
