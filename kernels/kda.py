"""Triton kernels for chunked Kimi Delta Attention (forward and backward), behind one autograd Function.

Entry: `chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state) -> (o, final_state)`
with q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [B, H, K, V] float32. Per token:

    S <- Diag(exp g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale q_t)

Chunk form (C = 64 tokens, G = cumulative log decay inside the chunk, S0 the state entering the chunk):

    L[i,j]   = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])        j < i   (UT transform matrix)
    X        = (I + L)^-1,   W = X (beta * k * exp(G)),   U = X (beta * v)
    Vn       = U - W S0                                               (pseudo-values, "v_new")
    O        = (scale q * exp(G)) S0 + Aqk Vn,   Aqk[i,j] = scale sum_d q_i k_j exp(G_i - G_j), j <= i
    S_next   = exp(G_last) * S0 + (k * exp(G_last - G))^T Vn

Forward kernels (one launch each):
    1. _cumsum_fwd     G = chunk-local cumsum of g, float32, into a buffer padded to whole chunks
                       (padded rows repeat G_last, so every exp() below still sees an argument <= 0)
    2. _intra_fwd      Aqk and L/beta (Akk) per chunk, one 16-row sub-chunk at a time: the earlier columns
                       with one tl.dot anchored at the sub-chunk's first row n (exp(G_i - G_n) * exp(G_n - G_j),
                       both <= 1); the diagonal 16x16 block exactly, one exp per (i, j, d) with i >= j
    3. _solve_wy_fwd   X by forward substitution on the four 16x16 diagonal blocks + block elimination;
                       then W, U and the decayed keys Kd = k exp(G_last - G) (and Qg = scale q exp(G) when
                       recomputing for the backward)
    4. _state_fwd      sequential over chunks: store S0 of every chunk, Vn, the final state
    5. _output_fwd     O, parallel over chunks
Backward: recompute 1-4, then
    6. _state_bwd      reverse sweep: dS per chunk, dVn = Aqk^T dO + Kd dS, dh0
    7. _chunk_bwd      per chunk: dv, beta's share through U and W, the inter-chunk parts of dq, dk, dG, dAqk
                       and dX (the gradient of the inverse)
    8. _solve_bwd      through the inverse: dL = -X^T dX X^T, 16 rows at a time; the rest of dbeta
    9. _intra_bwd      dAqk, dL -> dq, dk, dG with the same sub-chunk anchors; dg = reverse cumsum of dG

Sizes: chunk 64, sub-chunk 16; any T (the last chunk is masked); K <= 128 (the state kernels hold all of
K in registers), V <= 256 (tiled). Inputs bf16, fp16 or fp32; g and beta may have their own float dtype.

Precision plan (kernels/precision.py). Float32 inputs (PLAN_FP32, the accuracy path tests use): every
product exact in float32 ("ieee", no tensor cores). 16-bit inputs (PLAN_BF16, the GPU training path): the
products marked bf16 take bf16 operands on the tensor cores with float32 accumulation; the rest is float32.

  | what (kernel)                                   | precision        | why                                  |
  |-------------------------------------------------|------------------|--------------------------------------|
  | G = cumsum g and every exp() of it (all)        | float32          | G reaches about -45 within a chunk;  |
  |                                                 |                  | a bf16 G moves exp(G) by up to 13%   |
  | diagonal 16x16 blocks of Aqk, Akk (_intra_*)    | float32, no dot  | one exact exponent per (i, j, d);    |
  |                                                 |                  | factoring through a row of the block |
  |                                                 |                  | overflows (exp(+150), strong decay)  |
  | earlier sub-chunks of Aqk, Akk:                 | bf16 operands    | anchored at the sub-chunk's first    |
  |   (q e^(G_i-G_n)) (k e^(G_n-G_j))^T (_intra_*)  |                  | row: both decays <= 1, so operands   |
  |                                                 |                  | are O(|q|, |k|), relative error 2^-9 |
  | X = (I + L)^-1 (_solve_wy_fwd) and              | float32 (tf32x3) | the solve amplifies operand error:   |
  |   dL = -X^T dX X^T (_solve_bwd)                 |                  | from a bf16 L, X is off by 4.6x one  |
  |                                                 |                  | rounding of X (correlated keys);     |
  |                                                 |                  | ~C^3/3 flops per chunk, cheap        |
  | W = X (beta k e^G), U = X (beta v) (_solve_wy)  | bf16 operands    | X rounded once, after the solve      |
  | Vn = U - W S, S += Kd^T Vn (_state_fwd)         | bf16 operands,   | the state is held, decayed and       |
  |                                                 | float32 state    | accumulated in float32: a bf16 state |
  |                                                 |                  | rounded every chunk nearly doubles   |
  |                                                 |                  | its error under long memory          |
  | O = Qg S + Aqk Vn (_output_fwd)                 | bf16 operands    | as fla's chunk_kda                   |
  | every backward product except dL (_state_bwd,   | bf16 operands,   | the transposes of the rows above;    |
  |   _chunk_bwd, _intra_bwd)                       | float32 dS       | dS accumulates in float32            |

The plan's measured error (2.8e-3 to 4.0e-3 relative RMS at T = 4096, within the 5e-3 tolerance) and the
safe gate's anchored bf16 diagonal blocks, a variant these kernels do not take, are in the README (KDA, K3).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1) in float32 numpy, where 16-bit
inputs take PLAN_BF16_EMULATED: the plan's roundings done on the bits, as the GPU's cvt.rn does. The same
roundings in PyTorch are tests/kda_precision_ref.py, which tests/test_kda_precision.py compares the kernels
with; tests/compile_check.py counts the bf16 tensor-core instructions and spills of the compiled kernels.
Tests: tests/test_kda_triton.py, tests/test_kda_precision.py. Design after fla's chunk_kda; Kimi Linear is
arXiv 2510.26692.
"""
import contextlib

import torch
import triton
import triton.language as tl

from kernels.launch import gpu_config
from kernels.precision import PLAN_BF16, PLAN_BF16_EMULATED, PLAN_FP32, plan_dot, round_bf16

CHUNK = 64      # tokens per chunk
SUB = 16        # rows per sub-chunk (the anchor span)
MAX_K = 128
MAX_V = 256
# the kernels with bf16 rows in the precision plan: on the 16-bit GPU path (PLAN_BF16) each must compile to
# bf16 tensor-core instructions (mma.sync / wgmma), which tests/compile_check.py checks in the PTX
BF16_TENSOR_CORE_KERNELS = ("_intra_fwd", "_solve_wy_fwd", "_state_fwd", "_output_fwd",
                            "_state_bwd", "_chunk_bwd", "_intra_bwd")


# -----------------------------------------------------------------------------------------------------
# helpers (the products themselves are kernels/precision.py's plan_dot)

@triton.jit
def _out(x, ptr, PLAN: tl.constexpr):
    """x cast to the dtype ptr points to. The interpreter's float32 -> bf16 cast truncates where the
    GPU's rounds to nearest, so off the GPU's bf16 path the rounding is done first."""
    if PLAN != PLAN_BF16:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = round_bf16(x)
    return x.to(ptr.dtype.element_ty)


# -----------------------------------------------------------------------------------------------------
# forward kernels

@triton.jit
def _chunk_program(H: tl.constexpr, BT: tl.constexpr):
    """The chunk and batch*head a chunk-parallel program works on: (t0, i_bh, i_b, i_h). The chunk's first
    row t0 is int64: row * H * K passes 2^31 at T * H * K >= 2^31 (e.g. T = 512k at H * K = 4096)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    return i_t.to(tl.int64) * BT, i_bh, i_bh // H, i_bh % H


@triton.jit
def _cumsum_fwd(g, gc, T, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    t0, i_bh, i_b, i_h = _chunk_program(H, BT)
    rows = t0 + tl.arange(0, BT)
    cols = tl.arange(0, BK)
    m = (rows[:, None] < T) & (cols[None, :] < K)
    x = tl.load(g + (i_b * T + rows[:, None]) * H * K + i_h * K + cols[None, :], mask=m, other=0.0)
    # padded rows load g = 0, so their cumulative decay repeats the last real row's
    G = tl.cumsum(x.to(tl.float32), axis=0)
    tl.store(gc + (i_bh * Tp + rows[:, None]) * K + cols[None, :], G, mask=cols[None, :] < K)


@triton.jit
def _intra_fwd(q, k, gc, Aqk, Akk, scale, T, Tp, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """Aqk [BT, BT] (j <= i, scale included) and Akk [BT, BT] (j < i, without beta) of one chunk, one
    16-row block r at a time: its diagonal block exactly, all earlier columns with one tl.dot."""
    t0, i_bh, i_b, i_h = _chunk_program(H, BT)
    NC: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BKD)
    x_base = i_b * T * H * K + i_h * K      # q, k: [B, T, H, K]
    g_base = i_bh * Tp * K                  # gc: [B*H, Tp, K]
    a_base = i_bh * Tp * BT                 # Aqk, Akk: [B*H, Tp, BT]
    rows_all = t0 + o_t
    for r in range(NC):
        rows_r = t0 + r * BC + o_c
        before = (o_t < r * BC)[:, None]    # key rows j in earlier sub-chunks
        off_q = tl.zeros([BC, BT], dtype=tl.float32)
        off_k = tl.zeros([BC, BT], dtype=tl.float32)
        dia_q = tl.zeros([BC, BC], dtype=tl.float32)
        dia_k = tl.zeros([BC, BC], dtype=tl.float32)
        for k0 in range(0, K, BKD):
            cols = k0 + o_d
            mc = cols[None, :] < K
            q_r = tl.load(q + x_base + rows_r[:, None] * H * K + cols[None, :],
                          mask=(rows_r[:, None] < T) & mc, other=0.0).to(tl.float32)
            k_r = tl.load(k + x_base + rows_r[:, None] * H * K + cols[None, :],
                          mask=(rows_r[:, None] < T) & mc, other=0.0).to(tl.float32)
            g_r = tl.load(gc + g_base + rows_r[:, None] * K + cols[None, :], mask=mc, other=0.0)
            # the diagonal block, exactly per (i, j, d), one key row j at a time (2-D tiles: a [BC, BC, BKD]
            # product would not fit in registers): the exponent is only taken where i >= j, so <= 0
            for j in range(BC):
                row_j = t0 + r * BC + j
                k_j = tl.load(k + x_base + row_j * H * K + cols, mask=(cols < K) & (row_j + 0 * cols < T), other=0.0)
                g_j = tl.load(gc + g_base + row_j * K + cols, mask=cols < K, other=0.0)
                on = o_c[:, None] >= j
                kj_e = k_j.to(tl.float32)[None, :] * tl.where(on, tl.exp(tl.where(on, g_r - g_j[None, :], 0.0)), 0.0)
                dia_q += tl.where(o_c[None, :] == j, tl.sum(q_r * kj_e, axis=1)[:, None], 0.0)
                dia_k += tl.where(o_c[None, :] == j, tl.sum(k_r * kj_e, axis=1)[:, None], 0.0)
            if r > 0:
                # earlier sub-chunks, anchored at this block's first row n: e^(G_i-G_n) e^(G_n-G_j), both <= 1
                g_n = tl.load(gc + g_base + (t0 + r * BC) * K + cols, mask=cols < K, other=0.0)
                k_all = tl.load(k + x_base + rows_all[:, None] * H * K + cols[None, :],
                                mask=(rows_all[:, None] < T) & mc, other=0.0).to(tl.float32)
                g_all = tl.load(gc + g_base + rows_all[:, None] * K + cols[None, :], mask=mc, other=0.0)
                k_n = tl.where(before, k_all * tl.exp(tl.where(before, g_n[None, :] - g_all, 0.0)), 0.0)
                e_r = tl.exp(g_r - g_n[None, :])
                off_q += plan_dot(q_r * e_r, tl.trans(k_n), PLAN, PREC)
                off_k += plan_dot(k_r * e_r, tl.trans(k_n), PLAN, PREC)
        dia_k = tl.where(o_c[:, None] > o_c[None, :], dia_k, 0.0)
        # two disjoint stores: the row block without its diagonal block (zeros after it, so later kernels
        # can load whole 64x64 tiles), then the diagonal block
        not_dia = ((o_t < r * BC) | (o_t >= (r + 1) * BC))[None, :]
        row_ptr = a_base + rows_r[:, None] * BT
        tl.store(Aqk + row_ptr + o_t[None, :], off_q * scale, mask=not_dia)
        tl.store(Akk + row_ptr + o_t[None, :], off_k, mask=not_dia)
        tl.store(Aqk + row_ptr + r * BC + o_c[None, :], dia_q * scale)
        tl.store(Akk + row_ptr + r * BC + o_c[None, :], dia_k)


@triton.jit
def _solve_wy_fwd(q, k, v, beta, gc, Akk, X, W, U, Kd, Qg, scale, T, Tp, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
                  STORE_QG: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """X = (I + Diag(beta) Akk)^-1 of one chunk; W = X (beta k exp(G)), U = X (beta v); the decayed keys
    Kd = k exp(G_last - G) the state update needs, and (for the backward) Qg = scale q exp(G)."""
    t0, i_bh, i_b, i_h = _chunk_program(H, BT)
    NC: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    a_base = i_bh * Tp * BT
    # the NC diagonal blocks side by side, [NC, BC, BC], each row scaled by its beta
    o_n = tl.arange(0, NC)
    rows3 = t0 + o_n[:, None, None] * BC + o_c[None, :, None]
    b3 = tl.load(beta + (i_b * T + rows3) * H + i_h, mask=rows3 < T, other=0.0).to(tl.float32)
    A = -tl.load(Akk + a_base + rows3 * BT + o_n[:, None, None] * BC + o_c[None, None, :]) * b3
    # (I + L_d)^-1 of every diagonal block by forward substitution: row i from the finished rows above it
    is_row = o_c[None, :, None]
    for i in range(1, BC):
        row = tl.sum(tl.where(is_row == i, A, 0.0), axis=1)            # [NC, BC]: row i of each block
        upd = tl.sum(row[:, :, None] * A, axis=1)
        A = tl.where(is_row == i, (row + upd)[:, None, :], A)
    inv3 = A + tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)[None, :, :]
    Xf = tl.zeros([BT, BT], dtype=tl.float32)
    for r in range(NC):                 # a loop, not unrolled: fewer live registers
        rows_r = t0 + r * BC + o_c
        b_r = tl.load(beta + (i_b * T + rows_r) * H + i_h, mask=rows_r < T, other=0.0).to(tl.float32)
        L_r = tl.load(Akk + a_base + rows_r[:, None] * BT + o_t[None, :]) * b_r[:, None]     # [BC, BT]
        inv_d = tl.sum(tl.where(o_n[:, None, None] == r, inv3, 0.0), axis=0)
        # block row r of X: (I + L_d)^-1 (E_r - sum_{m<r} L_rm X_m); rows of Xf at or below r are still 0
        E_r = tl.where(o_t[None, :] == (r * BC + o_c)[:, None], 1.0, 0.0)                   # [BC, BT]
        rhs = E_r - tl.dot(L_r, Xf, input_precision=PREC)
        X_r = tl.dot(inv_d, rhs, input_precision=PREC)
        # write X_r into rows r*BC..r*BC+BC-1 of Xf: X_r repeated NC times down the rows, then selected
        X_rep = tl.reshape(tl.broadcast_to(X_r[None, :, :], (NC, BC, BT)), (BT, BT))
        Xf = tl.where((o_t // BC == r)[:, None], X_rep, Xf)
    tl.store(X + a_base + (t0 + o_t[:, None]) * BT + o_t[None, :], Xf)

    rows = t0 + o_t
    mt = rows < T
    b = tl.load(beta + (i_b * T + rows) * H + i_h, mask=mt, other=0.0).to(tl.float32)
    for k0 in range(0, K, BKS):
        o_k = k0 + tl.arange(0, BKS)
        mk = o_k[None, :] < K
        x_off = (i_b * T + rows[:, None]) * H * K + i_h * K + o_k[None, :]
        kk = tl.load(k + x_off, mask=mt[:, None] & mk, other=0.0).to(tl.float32)
        b_off = (i_bh * Tp + rows[:, None]) * K + o_k[None, :]
        G = tl.load(gc + b_off, mask=mk, other=0.0)
        g_last = tl.load(gc + (i_bh * Tp + t0 + BT - 1) * K + o_k, mask=o_k < K, other=0.0)
        w = plan_dot(Xf, kk * tl.exp(G) * b[:, None], PLAN, PREC)
        tl.store(W + b_off, w, mask=mk)
        tl.store(Kd + b_off, kk * tl.exp(g_last[None, :] - G), mask=mk)   # decay to the chunk's end: <= 1
        if STORE_QG:
            qq = tl.load(q + x_off, mask=mt[:, None] & mk, other=0.0).to(tl.float32)
            tl.store(Qg + b_off, qq * tl.exp(G) * scale, mask=mk)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        mv = o_v[None, :] < V
        vv = tl.load(v + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                     mask=mt[:, None] & mv, other=0.0).to(tl.float32)
        u = plan_dot(Xf, vv * b[:, None], PLAN, PREC)
        tl.store(U + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], u, mask=mv)


@triton.jit
def _state_tile(ptr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr):
    """A state kernel program's [BK, BV] tile (V tile = program 0, batch*head = program 1) of the [K, V]
    state: (i_bh, row and column indices, offsets, its float32 value read from ptr if LOAD, else zeros)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    s_off = o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if LOAD:
        S = tl.load(ptr + i_bh * K * V + s_off, mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)
        S = S.to(tl.float32)
    return i_bh, o_k, o_v, s_off, S


@triton.jit
def _state_fwd(Kd, gc, W, U, h, vn, h0, ht, T, Tp, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """Walk the chunks in order for one (batch*head, V tile): h[n] = state entering chunk n, Vn, final state."""
    i_bh, o_k, o_v, s_off, S = _state_tile(h0, K, V, BK, BV, HAS_H0)
    o_t = tl.arange(0, BT)
    mk, mv = o_k < K, o_v < V
    m_kv = mk[:, None] & mv[None, :]
    for n in range(NT):
        tl.store(h + (i_bh * NT + n) * K * V + s_off, S, mask=m_kv)
        rows = n * BT + o_t
        w = tl.load(W + (i_bh * Tp + rows[:, None]) * K + o_k[None, :], mask=mk[None, :], other=0.0)
        u = tl.load(U + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv[None, :], other=0.0)
        v_new = u - plan_dot(w, S, PLAN, PREC)
        tl.store(vn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], v_new, mask=mv[None, :])
        k_dec = tl.load(Kd + (i_bh * Tp + rows[:, None]) * K + o_k[None, :], mask=mk[None, :], other=0.0)
        g_last = tl.load(gc + (i_bh * Tp + n * BT + BT - 1) * K + o_k, mask=mk, other=0.0)
        S = S * tl.exp(g_last)[:, None] + plan_dot(tl.trans(k_dec), v_new, PLAN, PREC)
    if STORE_HT:
        tl.store(ht + i_bh * K * V + s_off, S, mask=m_kv)


@triton.jit
def _output_fwd(q, gc, h, Aqk, vn, o, scale, T, Tp, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """O = (scale q exp(G)) h[n] + Aqk Vn for one chunk and V tile."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    rows = i_t.to(tl.int64) * BT + o_t
    mk = o_k < K
    mv = o_v < V
    mt = rows < T
    qq = tl.load(q + (i_b * T + rows[:, None]) * H * K + i_h * K + o_k[None, :],
                 mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
    G = tl.load(gc + (i_bh * Tp + rows[:, None]) * K + o_k[None, :], mask=mk[None, :], other=0.0)
    S = tl.load(h + (i_bh * NT + i_t) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=mk[:, None] & mv[None, :], other=0.0)
    A = tl.load(Aqk + (i_bh * Tp + rows[:, None]) * BT + o_t[None, :])
    v_new = tl.load(vn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv[None, :], other=0.0)
    out = plan_dot(qq * tl.exp(G) * scale, S, PLAN, PREC) + plan_dot(A, v_new, PLAN, PREC)
    tl.store(o + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :], _out(out, o, PLAN),
             mask=mt[:, None] & mv[None, :])


# -----------------------------------------------------------------------------------------------------
# backward kernels

@triton.jit
def _state_bwd(Qg, Kd, gc, W, Aqk, do, dh, dvn, dht, dh0, T, Tp, NT, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               HAS_DHT: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """Reverse sweep: dh[n] = dLoss/d(state leaving chunk n); dVn; dh0 = dLoss/d(initial state)."""
    i_bh, o_k, o_v, s_off, dS = _state_tile(dht, K, V, BK, BV, HAS_DHT)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    mk, mv = o_k < K, o_v < V
    m_kv = mk[:, None] & mv[None, :]
    for i in range(NT):
        n = NT - 1 - i
        tl.store(dh + (i_bh * NT + n) * K * V + s_off, dS, mask=m_kv)
        rows = n * BT + o_t
        mt = rows < T
        d_o = tl.load(do + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                      mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        A = tl.load(Aqk + (i_bh * Tp + rows[:, None]) * BT + o_t[None, :])
        x_off = (i_bh * Tp + rows[:, None]) * K + o_k[None, :]
        k_dec = tl.load(Kd + x_off, mask=mk[None, :], other=0.0)
        g_last = tl.load(gc + (i_bh * Tp + n * BT + BT - 1) * K + o_k, mask=mk, other=0.0)
        dv_new = plan_dot(tl.trans(A), d_o, PLAN, PREC) + plan_dot(k_dec, dS, PLAN, PREC)
        tl.store(dvn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], dv_new, mask=mv[None, :])
        q_g = tl.load(Qg + x_off, mask=mk[None, :], other=0.0)
        dS = dS * tl.exp(g_last)[:, None] + plan_dot(tl.trans(q_g), d_o, PLAN, PREC)
        w = tl.load(W + x_off, mask=mk[None, :], other=0.0)
        dS -= plan_dot(tl.trans(w), dv_new, PLAN, PREC)
    tl.store(dh0 + i_bh * K * V + s_off, dS, mask=m_kv)


@triton.jit
def _chunk_bwd(q, k, v, beta, gc, X, Kd, h, dh, vn, dvn, do, dq_p, dk_p, dg_p, dv, db_p, Pq, Pk,
               scale, T, Tp, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """Everything of one chunk's backward except the intra-chunk exp(G_i - G_j) kernels (see _intra_bwd)."""
    t0, i_bh, i_b, i_h = _chunk_program(H, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    mt = rows < T
    b = tl.load(beta + (i_b * T + rows) * H + i_h, mask=mt, other=0.0).to(tl.float32)
    Xf = tl.load(X + (i_bh * Tp + rows[:, None]) * BT + o_t[None, :])
    h_base = (i_bh * NT + t0 // BT) * K * V
    a_off = (i_bh * Tp + rows[:, None]) * BT + o_t[None, :]
    # pass 1 over V: dLoss/dAqk, the U = X (beta v) part of dLoss/dX, dv, and beta's share through U
    dA = tl.zeros([BT, BT], dtype=tl.float32)
    dX = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        mv = o_v[None, :] < V
        m_tv = mt[:, None] & mv
        v_new = tl.load(vn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv, other=0.0)
        dv_new = tl.load(dvn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv, other=0.0)
        d_o = tl.load(do + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                      mask=m_tv, other=0.0).to(tl.float32)
        vv = tl.load(v + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                     mask=m_tv, other=0.0).to(tl.float32)
        dA += plan_dot(d_o, tl.trans(v_new), PLAN, PREC)
        dX += plan_dot(dv_new, tl.trans(vv * b[:, None]), PLAN, PREC)
        t_v = plan_dot(tl.trans(Xf), dv_new, PLAN, PREC)      # dLoss/d(beta v)
        tl.store(dv + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                 _out((t_v * b[:, None]), dv, PLAN), mask=m_tv)
        db += tl.sum(t_v * vv, axis=1)
    tl.store(Pq + a_off, tl.where(o_t[:, None] >= o_t[None, :], dA * scale, 0.0))
    # pass 2, one key slice at a time (keeps three [BT, BKS] accumulators in registers, not [BT, K])
    for k0 in range(0, K, BKS):
        o_k = k0 + tl.arange(0, BKS)
        mk = o_k < K
        dqg = tl.zeros([BT, BKS], dtype=tl.float32)      # dLoss/d(scale q exp(G))
        dkd = tl.zeros([BT, BKS], dtype=tl.float32)      # dLoss/dKd
        dw = tl.zeros([BT, BKS], dtype=tl.float32)       # dLoss/dW
        dgl = tl.zeros([BKS], dtype=tl.float32)          # sum_v h * dh: the state decay exp(G_last)
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            mv = o_v[None, :] < V
            m_kv = mk[:, None] & mv
            S = tl.load(h + h_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            dS = tl.load(dh + h_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            v_new = tl.load(vn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv, other=0.0)
            dv_new = tl.load(dvn + (i_bh * Tp + rows[:, None]) * V + o_v[None, :], mask=mv, other=0.0)
            d_o = tl.load(do + (i_b * T + rows[:, None]) * H * V + i_h * V + o_v[None, :],
                          mask=mt[:, None] & mv, other=0.0).to(tl.float32)
            dqg += plan_dot(d_o, tl.trans(S), PLAN, PREC)
            dkd += plan_dot(v_new, tl.trans(dS), PLAN, PREC)
            dw -= plan_dot(dv_new, tl.trans(S), PLAN, PREC)
            dgl += tl.sum(S * dS, axis=1)
        x_off = (i_b * T + rows[:, None]) * H * K + i_h * K + o_k[None, :]
        b_off = (i_bh * Tp + rows[:, None]) * K + o_k[None, :]
        qq = tl.load(q + x_off, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        kk = tl.load(k + x_off, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        G = tl.load(gc + b_off, mask=mk[None, :], other=0.0)
        k_dec = tl.load(Kd + b_off, mask=mk[None, :], other=0.0)
        g_last = tl.load(gc + (i_bh * Tp + t0 + BT - 1) * K + o_k, mask=mk, other=0.0)
        e_g = tl.exp(G)
        dq = dqg * e_g * scale
        kg_b = kk * e_g * b[:, None]                   # the rows W is built from
        dX += plan_dot(dw, tl.trans(kg_b), PLAN, PREC)
        t_w = plan_dot(tl.trans(Xf), dw, PLAN, PREC)          # dLoss/d(beta k exp(G))
        dk = dkd * tl.exp(g_last[None, :] - G) + t_w * e_g * b[:, None]
        db += tl.sum(t_w * kk * e_g, axis=1)
        kd_dkd = k_dec * dkd
        dG = qq * dq - kd_dkd + kg_b * t_w
        # G_last scales the carried state and every Kd row; its gradient joins the chunk's last row, from
        # where the reverse cumsum in _intra_bwd hands it to every token of the chunk
        dg_last = dgl * tl.exp(g_last) + tl.sum(kd_dkd, axis=0)
        dG = tl.where(o_t[:, None] == BT - 1, dG + dg_last[None, :], dG)
        tl.store(dq_p + b_off, dq, mask=mk[None, :])
        tl.store(dk_p + b_off, dk, mask=mk[None, :])
        tl.store(dg_p + b_off, dG, mask=mk[None, :])
    # dX goes on to _solve_bwd (in Pk's buffer) with beta's share so far: the products through the
    # inverse live in their own kernel, so this one's registers hold no fp32 [BT, BT] dot operands
    tl.store(Pk + a_off, dX)
    tl.store(db_p + (i_b * T + rows) * H + i_h, db, mask=mt)


@triton.jit
def _solve_bwd(beta, X, Akk, Pk, db_p, dbeta, T, Tp, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               PLAN: tl.constexpr, PREC: tl.constexpr):
    """Through the inverse, one chunk: X = (I + L)^-1 => dL = -X^T dX X^T, kept strictly below the diagonal.
    Pk holds dX on entry and beta * dL (what _intra_bwd reads) on exit; dbeta gets its last share.
    One 16-row block of dL at a time: two float32 [64, 64] products at once do not fit sm_80's registers."""
    t0, i_bh, i_b, i_h = _chunk_program(H, BT)
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    a_base = i_bh * Tp * BT
    Xf = tl.load(X + a_base + (t0 + o_t[:, None]) * BT + o_t[None, :])
    dX = tl.load(Pk + a_base + (t0 + o_t[:, None]) * BT + o_t[None, :])
    for r in range(BT // BC):
        rows = t0 + r * BC + o_c
        mt = rows < T
        X_r = tl.load(X + a_base + (t0 + o_t[:, None]) * BT + r * BC + o_c[None, :])          # X[:, block r]
        dL = -tl.dot(tl.dot(tl.trans(X_r), dX, input_precision=PREC), tl.trans(Xf), input_precision=PREC)
        dL = tl.where((r * BC + o_c)[:, None] > o_t[None, :], dL, 0.0)                        # [BC, BT]
        a_off = a_base + rows[:, None] * BT + o_t[None, :]
        b = tl.load(beta + (i_b * T + rows) * H + i_h, mask=mt, other=0.0).to(tl.float32)
        db = tl.load(db_p + (i_b * T + rows) * H + i_h, mask=mt, other=0.0) + tl.sum(dL * tl.load(Akk + a_off), axis=1)
        tl.store(Pk + a_off, dL * b[:, None])
        tl.store(dbeta + (i_b * T + rows) * H + i_h, _out(db, dbeta, PLAN), mask=mt)


@triton.jit
def _intra_bwd(q, k, gc, Pq, Pk, dq_p, dk_p, dg_p, dq, dk, dg, T, Tp, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr, PLAN: tl.constexpr, PREC: tl.constexpr):
    """Gradients through Aqk[i,j] = sum_d q_i k_j e^(G_i - G_j) and Akk (same with k_i) for one chunk and
    key slice, then the finished dq, dk and dg = reverse cumsum of dG inside the chunk.
    Pq = scale * dAqk (j <= i) and Pk = beta_i * dL (j < i) come from _chunk_bwd. For each 16-row block s:
    as the row i it meets the earlier columns (one tl.dot, anchored at its first row), as the column j the
    later rows (one tl.dot, anchored at its last row), and itself exactly."""
    i_t, i_kd, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NC: tl.constexpr = BT // BC
    t0 = i_t.to(tl.int64) * BT                 # int64 rows, as in _chunk_program
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    cols = i_kd * BKD + tl.arange(0, BKD)
    mc = cols[None, :] < K
    x_base = i_b * T * H * K + i_h * K
    g_base = i_bh * Tp * K
    a_base = i_bh * Tp * BT
    rows_all = t0 + o_t
    m_all = (rows_all[:, None] < T) & mc
    q_all = tl.load(q + x_base + rows_all[:, None] * H * K + cols[None, :], mask=m_all, other=0.0).to(tl.float32)
    k_all = tl.load(k + x_base + rows_all[:, None] * H * K + cols[None, :], mask=m_all, other=0.0).to(tl.float32)
    g_all = tl.load(gc + g_base + rows_all[:, None] * K + cols[None, :], mask=mc, other=0.0)
    carry = tl.zeros([BKD], dtype=tl.float32)      # sum of dG over the later sub-chunks of this chunk
    for s_rev in range(NC):                       # last sub-chunk first, for the reverse cumsum
        s = NC - 1 - s_rev
        rows_s = t0 + s * BC + o_c
        ms = (rows_s[:, None] < T) & mc
        q_s = tl.load(q + x_base + rows_s[:, None] * H * K + cols[None, :], mask=ms, other=0.0).to(tl.float32)
        k_s = tl.load(k + x_base + rows_s[:, None] * H * K + cols[None, :], mask=ms, other=0.0).to(tl.float32)
        g_s = tl.load(gc + g_base + rows_s[:, None] * K + cols[None, :], mask=mc, other=0.0)
        # the diagonal block, exactly per (i, j, d)
        rq = tl.zeros([BC, BKD], dtype=tl.float32)      # block s as the row i (query side)
        rk = tl.zeros([BC, BKD], dtype=tl.float32)
        cq = tl.zeros([BC, BKD], dtype=tl.float32)      # block s as the column j (key side)
        ck = tl.zeros([BC, BKD], dtype=tl.float32)
        for j in range(BC):                             # one key row j at a time, as in _intra_fwd
            row_j = t0 + s * BC + j
            k_j = tl.load(k + x_base + row_j * H * K + cols, mask=(cols < K) & (row_j + 0 * cols < T), other=0.0)
            g_j = tl.load(gc + g_base + row_j * K + cols, mask=cols < K, other=0.0)
            pq_j = tl.load(Pq + a_base + rows_s * BT + s * BC + j)       # column j of the block: [BC] over i
            pk_j = tl.load(Pk + a_base + rows_s * BT + s * BC + j)
            on = o_c[:, None] >= j
            e_j = tl.where(on, tl.exp(tl.where(on, g_s - g_j[None, :], 0.0)), 0.0)       # e[i, j, d], [BC, BKD]
            k_e = k_j.to(tl.float32)[None, :] * e_j
            rq += pq_j[:, None] * k_e
            rk += pk_j[:, None] * k_e
            cq += tl.where(o_c[:, None] == j, tl.sum(pq_j[:, None] * q_s * e_j, axis=0)[None, :], 0.0)
            ck += tl.where(o_c[:, None] == j, tl.sum(pk_j[:, None] * k_s * e_j, axis=0)[None, :], 0.0)
        if s > 0:
            # earlier columns j, anchored at this block's first row n: e^(G_i-G_n) e^(G_n-G_j), both <= 1
            g_n = tl.load(gc + g_base + (t0 + s * BC) * K + cols, mask=cols < K, other=0.0)
            before = (o_t < s * BC)[:, None]
            k_n = tl.where(before, k_all * tl.exp(tl.where(before, g_n[None, :] - g_all, 0.0)), 0.0)
            p_q = tl.load(Pq + a_base + rows_s[:, None] * BT + o_t[None, :])              # [BC, BT]
            p_k = tl.load(Pk + a_base + rows_s[:, None] * BT + o_t[None, :])
            e_s = tl.exp(g_s - g_n[None, :])
            rq += e_s * plan_dot(p_q, k_n, PLAN, PREC)
            rk += e_s * plan_dot(p_k, k_n, PLAN, PREC)
        if s < NC - 1:
            # later rows i, anchored at this block's last row m: e^(G_i-G_m) e^(G_m-G_j), both <= 1
            g_m = tl.load(gc + g_base + (t0 + s * BC + BC - 1) * K + cols, mask=cols < K, other=0.0)
            after = (o_t >= (s + 1) * BC)[:, None]
            e_after = tl.where(after, tl.exp(tl.where(after, g_all - g_m[None, :], 0.0)), 0.0)
            p_q = tl.load(Pq + a_base + rows_all[:, None] * BT + s * BC + o_c[None, :])   # [BT, BC]
            p_k = tl.load(Pk + a_base + rows_all[:, None] * BT + s * BC + o_c[None, :])
            e_s = tl.exp(g_m[None, :] - g_s)
            cq += e_s * plan_dot(tl.trans(p_q), q_all * e_after, PLAN, PREC)
            ck += e_s * plan_dot(tl.trans(p_k), k_all * e_after, PLAN, PREC)
        x_off = g_base + rows_s[:, None] * K + cols[None, :]
        d_q = tl.load(dq_p + x_off, mask=mc, other=0.0) + rq
        d_k = tl.load(dk_p + x_off, mask=mc, other=0.0) + rk + cq + ck
        d_G = tl.load(dg_p + x_off, mask=mc, other=0.0) + q_s * rq + k_s * rk - k_s * (cq + ck)
        # g_t enters every G_u with u >= t in its chunk
        d_g = tl.cumsum(d_G, axis=0, reverse=True) + carry[None, :]
        carry += tl.sum(d_G, axis=0)
        out_off = x_base + rows_s[:, None] * H * K + cols[None, :]
        tl.store(dq + out_off, _out(d_q, dq, PLAN), mask=ms)
        tl.store(dk + out_off, _out(d_k, dk, PLAN), mask=ms)
        tl.store(dg + out_off, _out(d_g, dg, PLAN), mask=ms)


# -----------------------------------------------------------------------------------------------------
# host side

def _settings(gpu, dtype, K, V):
    """Block sizes, warps and the precision plan. PLAN (kernels/precision.py): PLAN_FP32 for float32 inputs,
    PLAN_BF16 for 16-bit inputs on a GPU, PLAN_BF16_EMULATED for 16-bit inputs in the interpreter (whose bf16
    tl.dot is wrong). PREC, the float32 products' precision: tf32x3 (about float32 accuracy, on the tensor
    cores) for the solve on the 16-bit GPU path, exact ("ieee") elsewhere. The interpreter runs each program
    as numpy code, so there fewer and wider programs are faster; on a GPU no kernel spills registers on the
    16-bit path (tests/compile_check.py; the float32 state kernels at K = 128 still spill, reported there)."""
    BK = max(16, triton.next_power_of_2(K))
    bv_full = max(16, triton.next_power_of_2(V))
    low = dtype in (torch.bfloat16, torch.float16)
    if not gpu:
        one = dict(num_warps=1, num_stages=1)
        return dict(BK=BK, BKS=BK, BKD=BK, BV=bv_full, BV_STATE=bv_full, BV_CHUNK=bv_full,
                    PLAN=(PLAN_BF16_EMULATED if low else PLAN_FP32).value, PREC="ieee",
                    l_cumsum=one, l_intra=one, l_solve=one, l_state=one, l_state_bwd=one, l_out=one,
                    l_chunk=one, l_solve_bwd=one, l_intra_bwd=one)
    # launch options per kernel (num_stages is explicit: the default of 3 would ask the state kernels
    # for more shared memory than an H100/H200 SM has). float32 inputs are the accuracy path: exact
    # float32 products ("ieee", no tensor cores) and narrower V tiles, since float32 operand tiles take
    # twice the registers of bf16 ones
    bv = 16 if not low else 32
    return dict(BK=BK, BKS=16, BKD=16, BV=min(bv, bv_full), BV_STATE=min(bv, bv_full), BV_CHUNK=min(16, bv_full),
                PLAN=(PLAN_BF16 if low else PLAN_FP32).value, PREC="tf32x3" if low else "ieee",
                l_cumsum=dict(num_warps=4, num_stages=1), l_intra=dict(num_warps=4, num_stages=2),
                l_solve=dict(num_warps=8, num_stages=1), l_state=dict(num_warps=8, num_stages=2),
                l_state_bwd=dict(num_warps=8, num_stages=1), l_out=dict(num_warps=8, num_stages=2),
                l_chunk=dict(num_warps=8, num_stages=1), l_solve_bwd=dict(num_warps=8, num_stages=1),
                l_intra_bwd=dict(num_warps=8, num_stages=1))


def _forward(q, k, v, g, beta, scale, h0, output_final_state, for_backward=False):
    """Run kernels 1-5 (1-4 when recomputing for the backward). Returns o, the final state and the
    intermediates the backward needs."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    Tp, BH = NT * CHUNK, B * H
    c = _settings(gpu_config(q), q.dtype, K, V)
    f32 = dict(device=q.device, dtype=torch.float32)
    # internal buffers are [B*H, Tp, .] with T padded to whole chunks (Tp = NT * 64)
    gc = torch.empty(BH, Tp, K, **f32)                  # chunk-local cumsum of g
    Aqk = torch.empty(BH, Tp, CHUNK, **f32)
    Akk = torch.empty(BH, Tp, CHUNK, **f32)
    X = torch.empty(BH, Tp, CHUNK, **f32)
    W = torch.empty(BH, Tp, K, **f32)
    U = torch.empty(BH, Tp, V, **f32)
    Kd = torch.empty(BH, Tp, K, **f32)
    Qg = torch.empty(BH, Tp, K, **f32) if for_backward else Kd
    h = torch.empty(BH, NT, K, V, **f32)                # state entering each chunk
    vn = torch.empty(BH, Tp, V, **f32)
    ht = torch.empty(B, H, K, V, **f32) if output_final_state else None
    size = dict(T=T, Tp=Tp, H=H, K=K, BT=CHUNK)
    plan = dict(PLAN=c["PLAN"], PREC=c["PREC"])
    _cumsum_fwd[(NT, BH)](g=g, gc=gc, **size, BK=c["BK"], **c["l_cumsum"])
    _intra_fwd[(NT, BH)](q=q, k=k, gc=gc, Aqk=Aqk, Akk=Akk, scale=scale, **size, BC=SUB, BKD=c["BKD"], **plan,
                         **c["l_intra"])
    _solve_wy_fwd[(NT, BH)](q=q, k=k, v=v, beta=beta, gc=gc, Akk=Akk, X=X, W=W, U=U, Kd=Kd, Qg=Qg, scale=scale,
                            **size, V=V, BC=SUB, BKS=c["BKS"], BV=c["BV_CHUNK"], STORE_QG=for_backward, **plan,
                            **c["l_solve"])
    _state_fwd[(triton.cdiv(V, c["BV_STATE"]), BH)](
        Kd=Kd, gc=gc, W=W, U=U, h=h, vn=vn, h0=h0 if h0 is not None else gc, ht=ht if ht is not None else gc,
        **size, NT=NT, V=V, BK=c["BK"], BV=c["BV_STATE"], HAS_H0=h0 is not None, STORE_HT=ht is not None, **plan,
        **c["l_state"])
    if for_backward:
        return None, None, (gc, Aqk, Akk, X, W, Kd, Qg, h, vn)
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    _output_fwd[(NT, triton.cdiv(V, c["BV"]), BH)](q=q, gc=gc, h=h, Aqk=Aqk, vn=vn, o=o, scale=scale, **size, NT=NT,
                                                  V=V, BK=c["BK"], BV=c["BV"], **plan, **c["l_out"])
    return o, ht, None


def _backward(q, k, v, g, beta, scale, h0, do, dht):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK)
    Tp, BH = NT * CHUNK, B * H
    c = _settings(gpu_config(q), q.dtype, K, V)
    # recompute the forward intermediates instead of keeping them alive between forward and backward
    _, _, (gc, Aqk, Akk, X, W, Kd, Qg, h, vn) = _forward(q, k, v, g, beta, scale, h0, False, for_backward=True)
    f32 = dict(device=q.device, dtype=torch.float32)
    dh = torch.empty(BH, NT, K, V, **f32)               # gradient of the state leaving each chunk
    dvn = torch.empty(BH, Tp, V, **f32)
    dh0 = torch.empty(B, H, K, V, **f32)
    size = dict(T=T, Tp=Tp, H=H, BT=CHUNK)
    plan = dict(PLAN=c["PLAN"], PREC=c["PREC"])
    _state_bwd[(triton.cdiv(V, c["BV_STATE"]), BH)](
        Qg=Qg, Kd=Kd, gc=gc, W=W, Aqk=Aqk, do=do, dh=dh, dvn=dvn, dht=dht if dht is not None else gc, dh0=dh0,
        **size, NT=NT, K=K, V=V, BK=c["BK"], BV=c["BV_STATE"], HAS_DHT=dht is not None, **plan, **c["l_state_bwd"])
    dq_p, dk_p, dg_p = (torch.empty(BH, Tp, K, **f32) for _ in range(3))
    Pq = torch.empty(BH, Tp, CHUNK, **f32)
    Pk = torch.empty(BH, Tp, CHUNK, **f32)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    db_p = torch.empty(B, T, H, **f32)                  # beta's gradient before the inverse's share
    _chunk_bwd[(NT, BH)](q=q, k=k, v=v, beta=beta, gc=gc, X=X, Kd=Kd, h=h, dh=dh, vn=vn, dvn=dvn, do=do, dq_p=dq_p,
                         dk_p=dk_p, dg_p=dg_p, dv=dv, db_p=db_p, Pq=Pq, Pk=Pk, scale=scale, **size, NT=NT, K=K, V=V,
                         BKS=c["BKS"], BV=c["BV_CHUNK"], **plan, **c["l_chunk"])
    _solve_bwd[(NT, BH)](beta=beta, X=X, Akk=Akk, Pk=Pk, db_p=db_p, dbeta=dbeta, **size, BC=SUB, **plan,
                         **c["l_solve_bwd"])
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    _intra_bwd[(NT, triton.cdiv(K, c["BKD"]), BH)](q=q, k=k, gc=gc, Pq=Pq, Pk=Pk, dq_p=dq_p, dk_p=dk_p, dg_p=dg_p,
                                                    dq=dq, dk=dk, dg=dg, **size, K=K, BC=SUB, BKD=c["BKD"], **plan,
                                                    **c["l_intra_bwd"])
    return dq, dk, dv, dg, dbeta, dh0


def _on_device(x):
    # Triton launches on the current CUDA device: make it the tensors' device (cuda:1 under DDP, say)
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state):
        with _on_device(q):
            o, ht, _ = _forward(q, k, v, g, beta, scale, initial_state, output_final_state)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        dht = dht.contiguous() if dht is not None else None
        with _on_device(q):
            dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, ctx.scale, h0, do.contiguous(), dht)
        dh0 = dh0.to(h0.dtype) if h0 is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None


def chunk_kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Chunked KDA with Triton kernels, differentiable in q, k, v, g, beta and initial_state.

    q, k, g: [B, T, H, K] (g = log decay <= 0); v: [B, T, H, V]; beta: [B, T, H]; initial_state:
    [B, H, K, V] or None. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None).

    Inputs are checked once, by the public op kda.kda() (shapes, dtypes, devices, K <= MAX_K, V <= MAX_V,
    CUDA or the interpreter); this wrapper trusts them, so call the op unless the inputs are known good.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return ChunkKDAFunction.apply(q, k, v, g, beta, scale, initial_state, bool(output_final_state))
