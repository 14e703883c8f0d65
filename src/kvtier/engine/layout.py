"""Where one token's K and V live inside a paged, per-layer KV cache tensor.

Attention backends store a (block, kv-head) page in their own element order: vLLM 0.31's CPU backend
keeps `[num_blocks, kv_heads, block_size, 2*head_dim]` pages whose K and V halves are in an ISA-specific
tile order (AMX here), FlashAttention keeps K and V as separate planes. Copying `[block, head, slot, :]`
runs without error and silently corrupts attention. So instead of hard-coding a layout per backend we
*probe* it once: write recognisable values through the backend's own cache-update op into a two-block
scratch cache of the same shape, and read back which element holds (slot, head, dim) of K and of V.
The result is a table of flat offsets (for block 0) plus the block stride, valid for the real cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# write(key [T, H, d], value [T, H, d], cache, slot_mapping [T]) using the backend's own op.
CacheWriter = Callable[[Tensor, Tensor, Tensor, Tensor], None]


class LayoutError(RuntimeError):
    pass


@dataclass
class PagedLayout:
    block_size: int
    num_kv_heads: int
    head_dim: int
    block_dim: int          # which dimension of the cache tensor indexes blocks
    block_stride: int       # elements between block b and b+1
    k_offsets: Tensor       # [H, block_size, d] flat element offsets (block 0) of K
    v_offsets: Tensor       # [H, block_size, d] of V

    def flat(self, cache: Tensor) -> Tensor:
        """A 1-D view over every element the offsets can address (shares storage with `cache`)."""
        span = sum((s - 1) * st for s, st in zip(cache.shape, cache.stride())) + 1
        return cache.as_strided((span,), (1,), cache.storage_offset())


def probe_layout(cache: Tensor, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 write: CacheWriter) -> PagedLayout:
    """Probe how `write` lays tokens out in a cache shaped like `cache` (only its shape/strides/dtype are used)."""
    if cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LayoutError(f"kvtier compaction supports bf16/fp16/fp32 KV caches, not {cache.dtype}")
    if max(block_size, head_dim, num_kv_heads) > 255:
        raise LayoutError("layout probe encodes indices as small integers; sizes above 255 are unsupported")
    block_dims = [i for i, s in enumerate(cache.shape) if s == num_blocks]
    if not block_dims:
        raise LayoutError(f"no dimension of the KV cache {tuple(cache.shape)} has num_blocks={num_blocks}")
    block_dim = block_dims[0]
    shape = list(cache.shape)
    shape[block_dim] = 2
    scratch = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    T = 2 * block_size
    slots = torch.arange(T, device=cache.device, dtype=torch.long)
    grid_t = torch.arange(T, device=cache.device).view(T, 1, 1).expand(T, num_kv_heads, head_dim)
    grid_h = torch.arange(num_kv_heads, device=cache.device).view(1, -1, 1).expand(T, num_kv_heads, head_dim)
    grid_d = torch.arange(head_dim, device=cache.device).view(1, 1, -1).expand(T, num_kv_heads, head_dim)

    def probe(k_code: Tensor, v_code: Tensor) -> Tensor:
        scratch.fill_(-1)
        write(k_code.to(cache.dtype), v_code.to(cache.dtype), scratch, slots)
        return scratch.reshape(-1).clone()

    zero = torch.zeros_like(grid_t)
    # K probes carry +1 codes, V probes -2-codes: tells K from V and from untouched (-1) elements.
    tok = probe(grid_t % block_size + 1, zero - 2)
    head = probe(grid_h + 1, zero - 2)
    dim = probe(grid_d + 1, zero - 2)
    blk = probe(grid_t // block_size + 1, zero - 2)
    vtok = probe(zero + 1, -(grid_t % block_size) - 2)
    vhead = probe(zero + 1, -grid_h - 2)
    vdim = probe(zero + 1, -grid_d - 2)
    vblk = probe(zero + 1, -(grid_t // block_size) - 2)

    # Multi-index of each scratch element -> real flat offset (real strides, block index forced to 0).
    idx = torch.arange(scratch.numel(), device=cache.device)
    real_block0 = torch.zeros_like(idx)
    rem = idx
    for dim_i in reversed(range(len(shape))):
        coord, rem = rem % shape[dim_i], rem // shape[dim_i]
        if dim_i != block_dim:  # block index forced to 0: offsets are for block 0
            real_block0 += coord * cache.stride(dim_i)

    def table(t: Tensor, h: Tensor, d: Tensor, b: Tensor, positive: bool) -> Tensor:
        sel = (t > 0) if positive else (t < -1)
        if positive:
            tt, hh, dd, bb = t - 1, h - 1, d - 1, b - 1
        else:
            tt, hh, dd, bb = -t - 2, -h - 2, -d - 2, -b - 2
        sel = sel & (bb == 0)
        out = torch.full((num_kv_heads, block_size, head_dim), -1, dtype=torch.long, device=cache.device)
        out[hh[sel].long(), tt[sel].long(), dd[sel].long()] = real_block0[sel]
        if (out < 0).any() or sel.sum().item() != out.numel():
            raise LayoutError("layout probe could not place every (head, slot, dim) exactly once")
        return out

    k_off = table(tok, head, dim, blk, True)
    v_off = table(vtok, vhead, vdim, vblk, False)
    return PagedLayout(block_size, num_kv_heads, head_dim, block_dim, cache.stride(block_dim), k_off, v_off)
