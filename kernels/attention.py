"""Triton softmax attention, forward and backward, that also returns each head's max scaled logit:
QK-Clip's statistic (muonclip.py) comes out of the attention forward instead of a second pass over q, k.

Forward (flash-style online softmax). A program owns BLOCK_M queries of one (batch, head) and walks the
key tiles (up to the diagonal when causal; all of them for the bidirectional ViT), keeping per query row i

    s_ij = scale · q_i · k_j            over masked-in pairs only (j <= i when causal)
    m_i  = max_j s_ij                   the running row max; when it grows by Δ, l_i and acc_i shrink by e^-Δ
    l_i  = Σ_j exp(s_ij - m_i)          acc_i = Σ_j exp(s_ij - m_i) · v_j

then writes o_i = acc_i / l_i and the logsumexp L_i = m_i + log l_i (float32, one number per row): with
q, k, v and o, all that the backward needs.

The max logit: after the last key tile m_i *is* row i's largest scaled logit, already in registers. Each
program writes the max of its rows' m_i, the wrapper takes the max over the query tiles -> [B, H] float32.
So the max logit costs no extra QKᵀ (kernels/max_logit.py is that extra pass, for SDPA users).

Backward (the standard flash backward: P is recomputed from q, k and L, never stored):

    P_ij = exp(s_ij - L_i)    dV = Pᵀ dO    dP = dO Vᵀ    D_i = Σ_d dO_id · O_id    dS = P ∘ (dP - D)
    dQ = scale · dS K         dK = scale · dSᵀ Q

One kernel per key tile accumulates dK and dV over the query tiles of every query head of its group (GQA:
H / Hkv query heads read one key head, so their terms sum in registers, no atomics); one kernel per query
tile accumulates dQ over the key tiles. D is one torch reduction.

Precision: bf16/fp16 inputs multiply on tensor cores with float32 accumulation (P and dS are rounded to the
input dtype for their products, as flash attention does); float32 inputs use IEEE float32 products
(input_precision="ieee"): the interpreter's CPU tests, and a max logit that QK-Clip compares with τ.
Plain pointer arithmetic with masks, so the same code runs under the Triton interpreter.

Shapes: q [B, H, T, Dh], k, v [B, Hkv, T, Dh], any strides; o comes back as a [B, H, T, Dh] view of a
[B, T, H, Dh] buffer, so the caller's transpose to [B, T, H·Dh] is free. Head dim <= MAX_HEAD_DIM.
No mask but causal: model.py keeps SDPA for padded chunks and KV-cache decoding (this is for training).
This file imports no concept file; muonclip.attention_max_logit is its entry.
"""
import math

import torch
import triton
import triton.language as tl

from kernels.launch import gpu_config
from kernels.precision import PLAN_FP32, plan_dot

MAX_HEAD_DIM = 128  # q, k, v, o and the accumulators of one tile live in registers


@triton.jit
def _load_rows(X, offs_t, offs_d, stride_t, stride_d, T, Dh):
    """Rows offs_t of one head's [T, Dh] matrix as a [len(offs_t), len(offs_d)] tile (zeros outside)."""
    return tl.load(X + offs_t[:, None] * stride_t + offs_d[None, :] * stride_d,
                   mask=(offs_t[:, None] < T) & (offs_d[None, :] < Dh), other=0.0)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, MaxOut,         # Q, O [B, H, T, Dh]; K, V [B, Hkv, T, Dh]; LSE [B*H, T]; MaxOut [B*H, n_tiles]
    T, H, Dh, group, scale, n_tiles,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    IEEE_FP32: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    PREC: tl.constexpr = "ieee" if IEEE_FP32 else None   # exact float32 products, else the tensor cores
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kv_h = h // group  # GQA: `group` query heads share one key/value head
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    K += b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    # int64 token indices: offs * stride_qt passes 2^31 at T·H·Dh >= 2^31 for a [B, T, H, Dh] view
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, offs_m, offs_d, stride_qt, stride_qd, T, Dh)                   # [BLOCK_M, BLOCK_D]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # causal: the tile's last query sees keys 0 .. its own index; the first key tile holds key 0, which
    # every row sees, so m_i is finite from then on (no -inf - -inf)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if CAUSAL else T
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        kt = tl.load(K + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                     mask=(offs_n[None, :] < T) & (offs_d[:, None] < Dh), other=0.0)  # [BLOCK_D, BLOCK_N]
        v = _load_rows(V, offs_n, offs_d, stride_vt, stride_vd, T, Dh)               # [BLOCK_N, BLOCK_D]
        s = plan_dot(q, kt, PLAN_FP32, PREC) * scale                                  # [BLOCK_M, BLOCK_N] fp32
        keep = offs_n[None, :] < T
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)                                                   # 0 on the first tile
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + plan_dot(p.to(v.dtype), v, PLAN_FP32, PREC)
        m_i = m_new

    rows = offs_m < T
    tl.store(O + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od, (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None] & (offs_d[None, :] < Dh))
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log(l_i), mask=rows)
    tl.store(MaxOut + bh.to(tl.int64) * n_tiles + pid_m, tl.max(tl.where(rows, m_i, float("-inf")), axis=0))


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV,  # DO like Q, DK like K, DV like V; LSE, Delta [B*H, T] float32
    T, H, Hkv, Dh, group, scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dvd,
    IEEE_FP32: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one tile of BLOCK_N keys of one (batch, key head); the query heads of its group and every query
    # tile that sees these keys stream past. Products are written transposed ([keys, queries]), so that
    # dV += Pᵀ dO and dK += dSᵀ Q need no transposed P.
    PREC: tl.constexpr = "ieee" if IEEE_FP32 else None   # exact float32 products, else the tensor cores
    pid_n = tl.program_id(0)
    bkv = tl.program_id(1)
    b, kv_h = bkv // Hkv, bkv % Hkv
    K += b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    DK += b.to(tl.int64) * stride_dkb + kv_h.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + kv_h.to(tl.int64) * stride_dvh
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K, offs_n, offs_d, stride_kt, stride_kd, T, Dh)                   # [BLOCK_N, BLOCK_D]
    v = _load_rows(V, offs_n, offs_d, stride_vt, stride_vd, T, Dh)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # causal: queries before this tile's first key see none of it; start at the query tile holding that key
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for g in range(group):
        h = kv_h * group + g
        Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DOh = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        row = (b * H + h).to(tl.int64) * T                                            # LSE, Delta offset
        for m0 in range(lo, T, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
            q = _load_rows(Qh, offs_m, offs_d, stride_qt, stride_qd, T, Dh)          # [BLOCK_M, BLOCK_D]
            do = _load_rows(DOh, offs_m, offs_d, stride_dot, stride_dod, T, Dh)
            lse = tl.load(LSE + row + offs_m, mask=offs_m < T, other=0.0)            # [BLOCK_M]
            delta = tl.load(Delta + row + offs_m, mask=offs_m < T, other=0.0)
            st = plan_dot(k, tl.trans(q), PLAN_FP32, PREC) * scale                    # [BLOCK_N, BLOCK_M] = Sᵀ
            keep = offs_m[None, :] < T
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(keep, tl.exp(st - lse[None, :]), 0.0)                       # Pᵀ
            dv += plan_dot(pt.to(do.dtype), do, PLAN_FP32, PREC)
            dpt = plan_dot(v, tl.trans(do), PLAN_FP32, PREC)                          # dPᵀ [BLOCK_N, BLOCK_M]
            dst = pt * (dpt - delta[None, :])                                         # dSᵀ
            dk += plan_dot(dst.to(q.dtype), q, PLAN_FP32, PREC)
    keys = (offs_n[:, None] < T) & (offs_d[None, :] < Dh)
    tl.store(DK + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd, (dk * scale).to(DK.dtype.element_ty),
             mask=keys)
    tl.store(DV + offs_n[:, None] * stride_dvt + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=keys)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    T, H, Dh, group, scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_dob, stride_doh, stride_dot, stride_dod,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    IEEE_FP32: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    PREC: tl.constexpr = "ieee" if IEEE_FP32 else None   # exact float32 products, else the tensor cores
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kv_h = h // group
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    DO += b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    K += b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, offs_m, offs_d, stride_qt, stride_qd, T, Dh)                   # [BLOCK_M, BLOCK_D]
    do = _load_rows(DO, offs_m, offs_d, stride_dot, stride_dod, T, Dh)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)    # [BLOCK_M]
    delta = tl.load(Delta + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if CAUSAL else T
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        k = _load_rows(K, offs_n, offs_d, stride_kt, stride_kd, T, Dh)               # [BLOCK_N, BLOCK_D]
        v = _load_rows(V, offs_n, offs_d, stride_vt, stride_vd, T, Dh)
        s = plan_dot(q, tl.trans(k), PLAN_FP32, PREC) * scale                         # [BLOCK_M, BLOCK_N]
        keep = offs_n[None, :] < T
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = plan_dot(do, tl.trans(v), PLAN_FP32, PREC)
        ds = p * (dp - delta[:, None])
        dq += plan_dot(ds.to(k.dtype), k, PLAN_FP32, PREC)
    tl.store(DQ + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < T) & (offs_d[None, :] < Dh))


def launch_config(Dh: int, dtype: torch.dtype, gpu: bool) -> dict:
    """Tiles, warps and stages per kernel ("fwd", "dkdv", "dq"): BLOCK_M queries x BLOCK_N keys; BLOCK_D is
    the head dim padded to a power of two (>= 16, tl.dot's smallest)."""
    block_d = max(16, triton.next_power_of_2(Dh))

    def tiles(m, n, warps, stages=2):
        return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    if not gpu:  # the interpreter: several tiles per test sequence, and BLOCK_N != BLOCK_M
        return dict(fwd=tiles(32, 64, 1), dkdv=tiles(32, 64, 1), dq=tiles(32, 64, 1))
    # Chosen with the compile check (tests/compile_check.py), spill-free on sm_90a and sm_80 at head dims
    # 16-128 (60 included). The dK/dV kernel holds the most (two [BLOCK_N, BLOCK_D] float32 accumulators
    # beside k and v): 8 warps and 16-query steps; at 64 x 64 with 4 warps it spilled up to 800 B (bf16)
    if dtype == torch.float32:  # IEEE float32 products are FMAs on register operands (no tensor cores):
        small = tiles(16, 16, 4)  # 32 x 32 tiles spilled up to 144 B, 8 warps over 16 x 32 up to 12 B
        fwd = small if block_d <= 64 else tiles(16, 16, 8)  # 4 warps at head dim 128 spilled 12 B (sm_80)
        return dict(fwd=fwd, dkdv=small, dq=small)
    # forward: 3 stages at head dim 32 spilled 4 B on sm_80
    fwd = tiles(128, 64, 8, 3) if block_d == 64 else tiles(128, 64, 8, 2) if block_d < 64 else tiles(64, 64, 8)
    # dK/dV at head dim 64 (60 padded): 16 x 64 tiles reached 255 registers and spilled 24 B under Triton 3.6;
    # 16 x 32 with 8 warps was capped at 128 registers and spilled 20 B; 32 x 32 or 32 x 64 with 4 warps spilled
    dkdv = tiles(16, 32, 4) if block_d == 64 else tiles(16, 64, 8)
    return dict(fwd=fwd, dkdv=dkdv, dq=tiles(64, 32, 4))


def _check(q, k, v, scale):
    """One-line ValueErrors for what the kernels cannot take."""
    if not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in (q, k, v)):
        raise ValueError("attention_max_logit: q must be [B, H, T, Dh] and k, v [B, Hkv, T, Dh] tensors, got "
                         f"{[tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in (q, k, v)]}")
    (B, H, T, Dh), Hkv = q.shape, k.shape[1]
    if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (B, T, Dh):
        raise ValueError(f"attention_max_logit: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, T, Dh] "
                         f"for q {tuple(q.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"attention_max_logit: n_head {H} must be a multiple of n_kv_head {Hkv}")
    if B == 0 or T == 0 or not 1 <= Dh <= MAX_HEAD_DIM:
        raise ValueError(f"attention_max_logit: needs B, T >= 1 and 1 <= Dh <= {MAX_HEAD_DIM}, got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention_max_logit: q, k, v must share a float32/bf16/fp16 dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"attention_max_logit: q, k, v on different devices ({q.device}, {k.device}, {v.device})")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"attention_max_logit: scale must be a positive finite number, got {scale!r}")


def _strides(**tensors) -> dict:
    """Stride arguments of [B, H, T, Dh] tensors by name: _strides(q=q) = {stride_qb: ..., ..., stride_qd: ...}."""
    return {f"stride_{name}{dim}": st for name, x in tensors.items() for dim, st in zip("bhtd", x.stride())}


def attention_fwd(q, k, v, scale: float, causal: bool):
    """o [B, H, T, Dh] (a view of a [B, T, H, Dh] buffer), lse float32 [B*H, T], max logit float32 [B, H]."""
    B, H, T, Dh = q.shape
    Hkv = k.shape[1]
    cfg = launch_config(Dh, q.dtype, gpu_config(q))["fwd"]
    n_tiles = triton.cdiv(T, cfg["BLOCK_M"])
    o = q.new_empty(B, T, H, Dh).transpose(1, 2)                                     # [B, H, T, Dh]
    lse = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    tile_max = torch.empty(B * H, n_tiles, device=q.device, dtype=torch.float32)
    _attn_fwd_kernel[(n_tiles, B * H)](
        Q=q, K=k, V=v, O=o, LSE=lse, MaxOut=tile_max, T=T, H=H, Dh=Dh, group=H // Hkv, scale=float(scale),
        n_tiles=n_tiles, **_strides(q=q, k=k, v=v, o=o), IEEE_FP32=q.dtype == torch.float32, CAUSAL=bool(causal),
        **cfg)
    return o, lse, tile_max.amax(dim=1).view(B, H)


def attention_bwd(q, k, v, o, lse, do, scale: float, causal: bool):
    """dq, dk, dv (strided like q, k, v) from the forward's o and lse and the output gradient do."""
    B, H, T, Dh = q.shape
    Hkv = k.shape[1]
    cfgs = launch_config(Dh, q.dtype, gpu_config(q))
    delta = (do.float() * o.float()).sum(-1).view(B * H, T)                           # D_i = Σ_d dO·O
    # the strides of a dense input (a transposed [B, T, H, Dh] projection), contiguous for a gapped view
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    shared = dict(Q=q, K=k, V=v, DO=do, LSE=lse, Delta=delta, T=T, H=H, Dh=Dh, group=H // Hkv, scale=float(scale),
                  **_strides(q=q, k=k, v=v, do=do), IEEE_FP32=q.dtype == torch.float32, CAUSAL=bool(causal))
    cfg = cfgs["dkdv"]
    _attn_bwd_dkdv_kernel[(triton.cdiv(T, cfg["BLOCK_N"]), B * Hkv)](
        DK=dk, DV=dv, Hkv=Hkv, **_strides(dk=dk, dv=dv), **shared, **cfg)
    cfg = cfgs["dq"]
    _attn_bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](DQ=dq, **_strides(dq=dq), **shared, **cfg)
    return dq, dk, dv


class AttentionMaxLogit(torch.autograd.Function):
    """(o, max logit) = attention of q over k, v; gradients for q, k, v (the max logit is a statistic)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        o, lse, max_logit = attention_fwd(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)   # lse: one float per query row, so P is recomputed, never stored
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(max_logit)
        return o, max_logit

    @staticmethod
    def backward(ctx, do, _dmax):
        q, k, v, o, lse = ctx.saved_tensors
        return (*attention_bwd(q, k, v, o, lse, do, ctx.scale, ctx.causal), None, None)


def attention_max_logit_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                               causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, T, Dh] over k, v [B, Hkv, T, Dh] (causal, or every pair) -> o [B, H, T, Dh]
    in q's dtype, and each (batch, head)'s max of scale·q·kᵀ over the same pairs -> float32 [B, H]."""
    _check(q, k, v, scale)
    return AttentionMaxLogit.apply(q, k, v, float(scale), bool(causal))
