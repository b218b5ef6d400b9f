"""Triton per-head max attention logit for QK-Clip, without materialising the T x T logits.

S_max[b, h] = max over causal pairs j <= i of scale · q[b, h, i] · k[b, h // group, j]
             (or over every pair (i, j) when causal=False: the bidirectional ViT's attention)

Each program owns one tile of BLOCK_M queries of one (batch, head): it walks the key tiles up to the
diagonal (the causal bound; every key tile when not causal), keeps a running per-row max in
registers, and writes one float per tile;
the wrapper takes the max over tiles. Memory is O(B·H·T/BLOCK_M) instead of O(B·H·T²), and the work
is half of an attention forward's QKᵀ (no softmax, no V).

float32 inputs use tl.dot(input_precision="ieee") so the result matches the float32 reference (QK-Clip
compares it against τ; TF32's ~1e-3 error would move the clip). bf16/fp16 inputs multiply exactly and
accumulate in float32. The kernel runs on CUDA and under the Triton interpreter (CPU tests).

This file imports no concept file; muonclip.py calls `max_logit_triton` from `max_logit`.
"""
import torch
import triton
import triton.language as tl

from kernels.launch import gpu_config
from kernels.precision import PLAN_FP32, plan_dot


@triton.jit
def _max_logit_kernel(
    Q, K, Out,                       # Q [B, H, T, Dh], K [B, Hkv, T, Dh], Out [B*H, n_tiles] float32
    T, H, Dh, group, scale, n_tiles,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    IEEE_FP32: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    PREC: tl.constexpr = "ieee" if IEEE_FP32 else None   # exact float32 products, else the tensor cores
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kv_h = h // group  # GQA: `group` query heads share one key head
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh

    # int64 token indices: offs * stride_qt reaches 2^31 at T * H * Dh >= 2^31 for a [B, T, H, Dh] view
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < T) & (offs_d[None, :] < Dh), other=0.0)  # [BLOCK_M, BLOCK_D]
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    # causal: the last query of this tile sees keys 0 .. its own index, so stop after that key tile
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        hi = T
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        kt = tl.load(K + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                     mask=(offs_n[None, :] < T) & (offs_d[:, None] < Dh), other=0.0)  # [BLOCK_D, BLOCK_N]
        s = plan_dot(q, kt, PLAN_FP32, PREC) * scale  # [BLOCK_M, BLOCK_N], float32
        keep = offs_n[None, :] < T
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        row_max = tl.maximum(row_max, tl.max(s, axis=1))
    row_max = tl.where(offs_m < T, row_max, float("-inf"))  # padded query rows do not count
    tl.store(Out + bh.to(tl.int64) * n_tiles + pid_m, tl.max(row_max, axis=0))


def launch_config(Dh: int, dtype: torch.dtype, gpu: bool, causal: bool = True) -> dict:
    """Tile sizes and warps of one launch: BLOCK_M queries x BLOCK_N keys x BLOCK_D (head dim, padded)."""
    block_d = max(16, triton.next_power_of_2(Dh))
    if not gpu:  # the interpreter: small tiles keep it quick
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d, num_warps=1)
    if dtype == torch.float32:
        # IEEE float32 products are FMAs on operands held in registers (no tensor cores): 64 x 64 tiles at
        # head dim 128 spilled kilobytes per thread on sm_80 (tests/compile_check.py); 32 x 32 fit. The
        # bidirectional loop (causal=False) at head dim 128 still spilled ~300 B on sm_90 at 32 x 32
        # (and with 8 warps, or one stage): 16 x 16 tiles there
        small = not causal and block_d >= 128
        return dict(BLOCK_M=16 if small else 32, BLOCK_N=16 if small else 32, BLOCK_D=block_d, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4)


def max_logit_triton(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """Per-(batch, head) max of scale·q·kᵀ (causal pairs, or all pairs); q [B, H, T, Dh], k [B, Hkv, T, Dh]
    -> float32 [B, H].

    Arguments are validated by the caller (muonclip.max_logit). No gradient flows (it is a statistic).
    """
    B, H, T, Dh = q.shape
    Hkv = k.shape[1]
    cfg = launch_config(Dh, q.dtype, gpu_config(q), causal)
    n_tiles = triton.cdiv(T, cfg["BLOCK_M"])
    out = torch.empty(B * H, n_tiles, device=q.device, dtype=torch.float32)
    strides = {f"stride_{name}{dim}": st for name, x in (("q", q), ("k", k)) for dim, st in zip("bhtd", x.stride())}
    _max_logit_kernel[(n_tiles, B * H)](
        Q=q, K=k, Out=out, T=T, H=H, Dh=Dh, group=H // Hkv, scale=float(scale), n_tiles=n_tiles, **strides,
        IEEE_FP32=q.dtype == torch.float32, CAUSAL=bool(causal), **cfg)
    return out.amax(dim=1).view(B, H)
