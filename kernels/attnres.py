"""Fused Triton kernels for Attention Residuals (depth-wise softmax over earlier layer outputs).

For each token m and each query q (a pseudo-query already multiplied by its key-RMSNorm gain):

    r_i = 1 / sqrt(mean_d(v_i²) + eps)      s_i = r_i · <q, v_i>      h = Σ_i softmax(s)_i · v_i

The op is bandwidth-bound (about 1 FLOP per byte), so the forward reads every source exactly once,
with an online softmax and float32 accumulation, and writes h plus two float32 numbers per token
(the running max and the log-sum-exp). The backward recomputes the keys from the sources instead
of saving float32 [N, M, D] intermediates, and also reads every source once:

    α_i = exp(s_i - lse)          g_i = <dh, v_i>          δ = <dh, h> - dlse   (= Σ_j α_j g_j - dlse)
    ds_i = α_i (g_i - δ)
    dv_i = α_i dh + ds_i (r_i q - s_i r_i² v_i / D)
    dq   = Σ_tokens Σ_i ds_i r_i v_i

Layout: sources [N, M, D] contiguous (M = flattened batch and time), queries [S, D] float32.
S > 1 is the batched phase-1 pass of two-phase inference: S queries against the same sources.

Kernels use plain pointer arithmetic with masks (no block pointers, no tensor descriptors, no
autotune, no tl.dot), so the same code runs under Triton 3.6 on a GPU and under the Triton 3.9
interpreter on CPU (TRITON_INTERPRET=1), which is how the tests exercise them.
"""
import os

import torch
import triton
import triton.language as tl

from kernels.launch import gpu_config, sm_count

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_D = 16384  # one token's row lives in registers; beyond this the kernel would spill badly


@triton.jit
def _attnres_fwd_kernel(
    V, Q, O, MX, LSE,
    N, M, D, S, stride_vn, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program id -> (tile of BLOCK_M tokens, query); the query index varies fastest so that
    # the S programs reading the same source tile run side by side and share it through L2.
    pid = tl.program_id(0)
    tile = pid // S
    qi = pid % S
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < M
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]  # [BLOCK_M, BLOCK_D] into one [M, D] plane

    q = tl.load(Q + qi * D + cols, mask=col_mask, other=0.0)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    v_ptrs = V + offs
    for _ in range(N):
        v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
        sum_sq = tl.sum(v * v, axis=1)
        dot = tl.sum(v * q[None, :], axis=1)
        s = dot / tl.sqrt(sum_sq / D + eps)
        m_new = tl.maximum(m_run, s)
        rescale = tl.exp(m_run - m_new)  # exp(-inf) = 0 on the first source
        p = tl.exp(s - m_new)
        l_run = l_run * rescale + p
        acc = acc * rescale[:, None] + p[:, None] * v
        m_run = m_new
        v_ptrs += stride_vn
    out = acc / l_run[:, None]
    plane = qi.to(tl.int64) * M
    tl.store(O + plane * D + offs, out.to(O.dtype.element_ty), mask=mask)
    tl.store(MX + plane + rows, m_run, mask=row_mask)
    tl.store(LSE + plane + rows, m_run + tl.log(l_run), mask=row_mask)


@triton.jit
def _attnres_bwd_kernel(
    V, Q, O, DO, LSE, DLSE, DV, DQ_PARTIAL,
    N, M, D, S, stride_vn, eps, n_tiles, n_programs,
    ACCUMULATE_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Each program walks tiles pid, pid + n_programs, ... and keeps its own float32 row of dq per
    # query in DQ_PARTIAL [S, n_programs, D]: no atomics, deterministic, summed on the host.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    for tile in range(pid, n_tiles, n_programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        # per-query planes of out/dout/lse are reached by pointer increments, so no index product
        # overflows int32 and the loop variable never needs a cast (it is a Python int when interpreted)
        q_ptrs = Q + cols
        o_ptrs = O + offs
        do_ptrs = DO + offs
        lse_ptrs = LSE + rows
        dlse_ptrs = DLSE + rows
        dq_ptrs = DQ_PARTIAL + pid.to(tl.int64) * D + cols
        for qi in range(S):
            q = tl.load(q_ptrs, mask=col_mask, other=0.0)
            dh = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
            lse = tl.load(lse_ptrs, mask=row_mask, other=0.0)
            dlse = tl.load(dlse_ptrs, mask=row_mask, other=0.0)
            delta = tl.sum(dh * h, axis=1) - dlse
            dq_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            v_ptrs = V + offs
            dv_ptrs = DV + offs
            for _ in range(N):
                v = tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
                r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
                s = tl.sum(v * q[None, :], axis=1) * r
                alpha = tl.exp(s - lse)
                ds = alpha * (tl.sum(dh * v, axis=1) - delta)
                dv = alpha[:, None] * dh + ds[:, None] * (
                    r[:, None] * q[None, :] - (s * r * r / D)[:, None] * v)
                if ACCUMULATE_DV:  # several queries write the same dv: float32 read-modify-write
                    dv += tl.load(dv_ptrs, mask=mask, other=0.0)
                tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)
                dq_acc += (ds * r)[:, None] * v
                v_ptrs += stride_vn
                dv_ptrs += stride_vn
            dq_prev = tl.load(dq_ptrs, mask=col_mask, other=0.0)
            tl.store(dq_ptrs, dq_prev + tl.sum(dq_acc, axis=0), mask=col_mask)
            q_ptrs += D
            o_ptrs += stride_vn
            do_ptrs += stride_vn
            lse_ptrs += M
            dlse_ptrs += M
            dq_ptrs += n_programs * D


def launch_shape(M: int, D: int, gpu: bool, backward: bool = False):
    """(BLOCK_M tokens, BLOCK_D >= D, num_warps) of one forward or backward launch."""
    block_d = triton.next_power_of_2(D)
    # Elements per [BLOCK_M, BLOCK_D] tile. Small under the interpreter so that tests with a few
    # dozen tokens still cover several tiles, partial tiles and several tiles per backward program.
    # GPU sizes are measured with tests/compile_check.py (registers and spills on sm_80 and sm_90a). The
    # backward keeps about six tiles live (v, dh, h, dv, dq_acc, the q broadcast): 4096-element tiles on
    # 8 warps spilled 1,100 bytes (fp32, D = 100); at D <= 128 even 512- and 1024-element tiles on 8 warps
    # spilled a few bytes (ptxas gave them 64-128 registers), while 1024 on 4 warps fit (fp32 with
    # accumulated dv: 168/214 registers on sm_80/sm_90a, bf16: 157/144). The forward spilled 4 bytes on
    # sm_80 with 2 rows of D = 2048 on 8 warps; one row on 4 warps fits.
    if not gpu:
        return max(1, min(512 // block_d, triton.next_power_of_2(M))), block_d, 1
    tile_elems = 1024 if backward else (2048 if block_d >= 2048 else 4096)
    block_m = max(1, min(tile_elems // block_d, triton.next_power_of_2(M)))
    if backward:
        return block_m, block_d, 4 if block_d <= 128 else 8
    return block_m, block_d, 4 if block_m * block_d <= 2048 else 8


def _num_backward_programs(n_tiles: int, device: torch.device, gpu: bool) -> int:
    if not gpu:
        return min(n_tiles, 3)  # small and odd, so programs own uneven numbers of tiles in tests
    return min(n_tiles, 8 * sm_count(device))


def attnres_fwd(sources: torch.Tensor, queries: torch.Tensor, eps: float):
    """sources [N, M, D] (contiguous, fp32/bf16/fp16), queries [S, D] float32 (gain folded in).

    Returns out [S, M, D] in the sources' dtype, max [S, M] and lse [S, M] in float32."""
    N, M, D = sources.shape
    S = queries.shape[0]
    out = torch.empty((S, M, D), device=sources.device, dtype=sources.dtype)
    mx = torch.empty((S, M), device=sources.device, dtype=torch.float32)
    lse = torch.empty((S, M), device=sources.device, dtype=torch.float32)
    if M == 0:
        return out, mx, lse
    block_m, block_d, num_warps = launch_shape(M, D, gpu_config(sources))
    n_tiles = triton.cdiv(M, block_m)
    _attnres_fwd_kernel[(n_tiles * S,)](
        V=sources, Q=queries, O=out, MX=mx, LSE=lse, N=N, M=M, D=D, S=S, stride_vn=M * D, eps=eps,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out, mx, lse


def attnres_bwd(sources, queries, out, lse, dout, dlse, eps):
    """Gradients of (out, lse) -> (dsources [N, M, D] in the sources' dtype, dqueries [S, D] fp32)."""
    N, M, D = sources.shape
    S = queries.shape[0]
    if M == 0:
        return torch.zeros_like(sources), torch.zeros_like(queries)
    gpu = gpu_config(sources)
    block_m, block_d, num_warps = launch_shape(M, D, gpu, backward=True)
    n_tiles = triton.cdiv(M, block_m)
    n_programs = _num_backward_programs(n_tiles, sources.device, gpu)
    accumulate = S > 1
    if accumulate:
        dsources = torch.zeros((N, M, D), device=sources.device, dtype=torch.float32)
    else:
        dsources = torch.empty_like(sources)
    dq_partial = torch.zeros((S, n_programs, D), device=sources.device, dtype=torch.float32)
    _attnres_bwd_kernel[(n_programs,)](
        V=sources, Q=queries, O=out, DO=dout, LSE=lse, DLSE=dlse, DV=dsources, DQ_PARTIAL=dq_partial,
        N=N, M=M, D=D, S=S, stride_vn=M * D, eps=eps, n_tiles=n_tiles, n_programs=n_programs,
        ACCUMULATE_DV=accumulate, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dsources.to(sources.dtype), dq_partial.sum(dim=1)


class AttnResFunction(torch.autograd.Function):
    """(queries [S, D] fp32, eps, *sources, each [M, D]) -> (out [S, M, D], max [S, M], lse [S, M]).

    The sources come as separate tensors and are saved as themselves: they are alive in the model anyway
    (sublayer outputs, block sums), so a stack of 16 sublayers saves each once, O(L) in all, instead of
    a fresh [N, M, D] copy per read, O(L^2). The kernels want one [N, M, D] block, so forward and backward
    each stack a transient copy that is freed when they return. Besides the sources, only the output and
    one float32 per token and query are saved; the max output carries no gradient (it is bookkeeping for
    the two-phase merge)."""

    @staticmethod
    def forward(ctx, queries, eps, *sources):
        out, mx, lse = attnres_fwd(torch.stack(sources), queries, eps)
        ctx.save_for_backward(queries, out, lse, *sources)
        ctx.eps = eps
        ctx.mark_non_differentiable(mx)
        return out, mx, lse

    @staticmethod
    def backward(ctx, dout, dmx, dlse):
        queries, out, lse, *sources = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous().float()
        dsources, dqueries = attnres_bwd(torch.stack(sources), queries, out, lse, dout, dlse, ctx.eps)
        return (dqueries, None, *dsources.unbind(0))


def attnres_triton(sources, queries: torch.Tensor, eps: float):
    """Autograd entry: sources a list of N tensors [M, D] (or one tensor [N, M, D]), queries [S, D] (any
    float dtype; computed in fp32)."""
    sources = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)
    if sources[0].shape[-1] > MAX_D:
        raise ValueError(f"fused attnres supports D <= {MAX_D}, got D={sources[0].shape[-1]}")
    return AttnResFunction.apply(queries.float().contiguous(), float(eps), *sources)
