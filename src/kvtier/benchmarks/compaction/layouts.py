"""The compaction benchmark's shapes and paged caches: one cache per layer in a backend's own layout,
written through that backend's cache-update op (or a torch emulation of it) and probed as the engine's
worker probes it.

`flash` = FlashAttention's `[2, blocks, block_size, kv_heads, d]`; `cpu` = vLLM 0.31's CPU backend page
`[blocks, kv_heads, block_size, 2*d]`, written with vLLM's own `cpu_attn_reshape_and_cache` when vLLM is
importable and supports the shape, else with a torch emulation of the same element order (the
`vec`/`vec16` ISAs store K *transposed*, `[d, block_size]` per (block, head), then V as `[block_size, d]`:
rows of one element); `cpu_plain` = the same page with K stored like V (`[block_size, d]`), the layout
one would assume from the view in `do_kv_cache_update`. Torch only (vLLM imported lazily, if at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from kvtier.engine.layout import PagedLayout, probe_layout
from kvtier.engine.paged_compaction import RowLayout

LAYOUTS = ("flash", "cpu", "cpu_plain")


@dataclass(frozen=True)
class CompactionShapes:
    """Qwen3-4B by default."""

    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    buffer: int = 64
    query_heads: int = 32
    prompt_len: int = 64
    query_window: int = 8          # the engine's default query_window (snapkv/rkv read the last 8 queries)


def cache_shape(layout: str, num_blocks: int, s: CompactionShapes) -> tuple[int, ...]:
    if layout == "flash":
        return (2, num_blocks, s.block_size, s.kv_heads, s.head_dim)
    if layout in ("cpu", "cpu_plain"):
        return (num_blocks, s.kv_heads, s.block_size, 2 * s.head_dim)
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def flash_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """FlashAttention's reshape_and_cache_flash: K and V planes of [blocks, block_size, H, d]."""
    H, d = k.shape[1], k.shape[2]
    cache[0].view(-1, H, d)[slots] = k
    cache[1].view(-1, H, d)[slots] = v


def cpu_vec_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """vLLM 0.31's CPU `vec`/`vec16` page: per (block, head) K as [d, block_size] (transposed), then V
    as [block_size, d] (what `cpu_attn_reshape_and_cache` writes; the layout probe checks it)."""
    nb, H, bs, two_d = cache.shape
    d = two_d // 2
    page = cache.view(nb, H, 2 * bs * d)
    kt = page[:, :, : bs * d].view(nb, H, d, bs).permute(0, 3, 1, 2)     # [nb, bs, H, d] view
    vv = page[:, :, bs * d :].view(nb, H, bs, d).permute(0, 2, 1, 3)
    kt[slots // bs, slots % bs] = k
    vv[slots // bs, slots % bs] = v


def cpu_plain_write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """The CPU page read naively: key_cache[b, h, s, :], value_cache[b, h, s, :] after
    `kv_cache.view(blocks, H, 2 * block_size, d).chunk(2, dim=2)`."""
    nb, H, bs, two_d = cache.shape
    kc, vc = cache.view(nb, H, 2 * bs, two_d // 2).chunk(2, dim=2)
    kc.permute(0, 2, 1, 3)[slots // bs, slots % bs] = k
    vc.permute(0, 2, 1, 3)[slots // bs, slots % bs] = v


def vllm_cpu_writer(s: CompactionShapes, dtype: torch.dtype):
    """(writer, isa) through vLLM's own CPU cache-update op, as CPUAttentionBackendImpl.do_kv_cache_update
    calls it; raises ImportError without vLLM."""
    from vllm import _custom_ops as ops
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(dtype, s.block_size, s.head_dim, "auto")
    except Exception:  # noqa: BLE001 - same rule, for a vLLM whose backend module does not import here
        isa = "vec16" if (s.head_dim % 32 and not s.head_dim % 16) or s.block_size % 32 else "vec"

    def write(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
        nb, H, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, H, bs * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    return write, isa


@dataclass
class LayoutWriter:
    """A layout's cache-update op (torch emulation or vLLM's own) and what was found about it."""

    name: str
    writer: str
    write: Callable[[Tensor, Tensor, Tensor, Tensor], None]
    info: dict = field(default_factory=dict)

    def probe(self, cache: Tensor, num_blocks: int, s: CompactionShapes) -> tuple[PagedLayout, RowLayout]:
        """Probe the layout of `cache` (a pool of num_blocks) through the op, as the engine's worker does."""
        paged = probe_layout(cache, num_blocks, s.kv_heads, s.block_size, s.head_dim, self.write)
        return paged, RowLayout.from_layout(paged, cache.device)


def layout_writer(name: str, s: CompactionShapes, device: torch.device, dtype: torch.dtype,
                  cpu_writer: str = "auto") -> LayoutWriter:
    """cpu_writer (layout `cpu` only): auto = vLLM's op when vLLM imports and its kernels take the shape
    (on a CPU device), else the emulation; vllm = vLLM's op or an error; emulated."""
    if name == "flash":
        return LayoutWriter(name, "emulated", flash_write)
    if name == "cpu_plain":
        return LayoutWriter(name, "emulated", cpu_plain_write)
    if name != "cpu":
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    info: dict = {}
    if cpu_writer == "vllm" or (cpu_writer == "auto" and device.type == "cpu"):
        try:
            fn, isa = vllm_cpu_writer(s, dtype)
            nb = pool_size(3, name, s)
            cache = torch.empty(cache_shape(name, nb, s), dtype=dtype, device=device)
            real = probe_layout(cache, nb, s.kv_heads, s.block_size, s.head_dim, fn)
            emul = probe_layout(cache, nb, s.kv_heads, s.block_size, s.head_dim, cpu_vec_write)
            info["emulation_matches_vllm"] = bool(torch.equal(real.k_offsets, emul.k_offsets)
                                                  and torch.equal(real.v_offsets, emul.v_offsets))
            return LayoutWriter(name, f"vllm:cpu_attn_reshape_and_cache(isa={isa})", fn, info)
        except Exception as exc:  # noqa: BLE001 - no vLLM, or a shape its kernels do not take
            if cpu_writer == "vllm":
                raise
            msg = str(exc).strip().splitlines()
            info["vllm_unavailable"] = f"{type(exc).__name__}: {msg[0][:160] if msg else ''}"
    return LayoutWriter(name, "emulated", cpu_vec_write, info)


def pool_size(blocks: int, layout: str, s: CompactionShapes) -> int:
    """`blocks`, plus spare blocks while another cache dimension before the block one has that size
    (probe_layout takes the first dimension of size num_blocks as the block dimension)."""
    shape = cache_shape(layout, 10**9, s)
    while blocks in shape[: shape.index(10**9)]:
        blocks += 1
    return blocks


def cache_bytes(requests: int, budget: int, s: CompactionShapes, dtype: torch.dtype) -> int:
    blocks = -(-(budget + 2 * s.buffer) // s.block_size)
    return requests * blocks * s.block_size * s.layers * s.kv_heads * s.head_dim * 2 * torch.empty((), dtype=dtype).element_size()
