"""Triton Newton-Schulz for Muon: symmetric Gram kernels (compute one triangle, mirror the other).

One quintic Newton-Schulz step on a wide matrix X [m, n] (m <= n) is three GEMMs:

    A = X Xᵀ               [m, m]  symmetric   -> `sym_gram(X)`                  (this file)
    B = b·A + c·A·A        [m, m]  symmetric   -> `sym_gram(A, alpha=c, beta=b, add=A)`
    X = a·X + B·X          [m, n]  general     -> torch.baddbmm (cuBLAS is hard to beat here)

A·A = A·Aᵀ because A is symmetric, so the first two lines are the same operation, P·Pᵀ, and only the
blocks on or above the diagonal need computing: each program computes one upper block in float32 and
stores it twice, at (i, j) and mirrored at (j, i). That halves the FLOPs of two of the three GEMMs,
so a step costs 4m²n + 2m³ -> 2m²n + m³ + (m²n), at best 1.5x fewer FLOPs for square X.

GPU: inputs are bfloat16 (tl.dot on bf16, float32 accumulation) and the block sizes are autotuned.
float32 inputs use tl.dot(input_precision="ieee"), exact float32 products, so a float32 GPU run can be
compared with the reference; bf16 is the speed path. CPU: the same kernel runs under the Triton
interpreter (TRITON_INTERPRET=1) with fixed small blocks, which is how tests exercise it.

This file imports no concept file; muonclip.py calls `newton_schulz_triton` from `newton_schulz`.
"""
import torch
import triton
import triton.language as tl

from kernels.launch import gpu_config


@triton.jit
def _sym_gram_kernel(
    P, ADD, C,                       # P [batch, M, K], ADD [batch, M, M] (optional), C [batch, M, M]
    M, K,
    stride_pb, stride_pm, stride_pk,
    stride_ab, stride_am, stride_an,
    stride_cb, stride_cm, stride_cn,
    alpha, beta,
    HAS_ADD: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C = alpha · P·Pᵀ (+ beta · ADD), one BLOCK x BLOCK tile of the upper triangle per program."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m > pid_n:  # below the diagonal: its mirror image above writes this tile
        return
    batch = tl.program_id(2).to(tl.int64)
    P += batch * stride_pb
    C += batch * stride_cb

    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        # left operand: rows of P [BLOCK, BLOCK_K]; right operand: other rows of P, read transposed [BLOCK_K, BLOCK]
        left = tl.load(P + rows[:, None] * stride_pm + ks[None, :] * stride_pk,
                       mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        right = tl.load(P + ks[:, None] * stride_pk + cols[None, :] * stride_pm,
                        mask=(ks[:, None] < K) & (cols[None, :] < M), other=0.0)
        if IEEE_FP32:
            acc = tl.dot(left, right, acc, input_precision="ieee")
        else:
            acc = tl.dot(left, right, acc)
    acc = acc * alpha
    in_bounds = (rows[:, None] < M) & (cols[None, :] < M)
    if HAS_ADD:
        ADD += batch * stride_ab
        extra = tl.load(ADD + rows[:, None] * stride_am + cols[None, :] * stride_an, mask=in_bounds, other=0.0)
        acc += beta * extra.to(tl.float32)
    if pid_m == pid_n:
        # a diagonal tile's dot need not be symmetric bit for bit ((i, j) and (j, i) can sum in different
        # orders on some BLAS / tensor-core paths): its lower triangle is the upper one, transposed
        acc = tl.where(rows[:, None] <= cols[None, :], acc, tl.trans(acc))
    out = acc.to(C.dtype.element_ty)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out, mask=in_bounds)
    if pid_m != pid_n:
        # the mirrored tile C[cols, rows] = tileᵀ: same values, swapped strides
        tl.store(C + rows[:, None] * stride_cn + cols[None, :] * stride_cm, out, mask=in_bounds)


# GPU: a few standard tile shapes, tuned once per (M, K). BLOCK is both tile sides (the mirror needs square tiles).
# bf16/fp16 (the speed path) runs on tensor cores. The epilogue holds the float32 tile, the `add` tile and
# two tiles of 64-bit pointers (the store and its mirror): 128-wide tiles reached 255 registers and
# spilled 64-612 bytes with HAS_ADD under Triton 3.6 (tests/compile_check.py), so the tiles are 64 wide.
_GPU_CONFIGS = [
    triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=8, num_stages=3),
]
# float32 with input_precision="ieee" has no tensor-core path: the products are FMAs on operands held in
# registers. 128-wide tiles spilled (tests/compile_check.py, sm_80 and sm_90a), and so did 64-wide ones
# (56 bytes on 4 warps, 8-12 bytes on 8 warps under Triton 3.9); 32-wide tiles do not.
_GPU_CONFIGS_FP32 = [
    triton.Config({"BLOCK": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2),
]
_KEY = ["M", "K", "HAS_ADD", "IEEE_FP32"]
_sym_gram_tuned = triton.autotune(configs=_GPU_CONFIGS, key=_KEY)(_sym_gram_kernel)
_sym_gram_tuned_fp32 = triton.autotune(configs=_GPU_CONFIGS_FP32, key=_KEY)(_sym_gram_kernel)

# interpreter (CPU tests): fixed small tiles, no autotune
_INTERPRET_BLOCK, _INTERPRET_BLOCK_K = 32, 32


def sym_gram(P: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, add: torch.Tensor | None = None) -> torch.Tensor:
    """alpha · P·Pᵀ + beta · add for a batch P [batch, M, K]; `add` must be symmetric [batch, M, M].

    The result is exactly symmetric on every backend: each value of the upper triangle is computed once
    and stored twice, also on the diagonal tiles (whose dot need not be symmetric bit for bit).
    """
    if P.ndim != 3:
        raise ValueError(f"sym_gram: P must be [batch, M, K], got shape {tuple(P.shape)}")
    if P.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"sym_gram: P must be float32/bfloat16/float16, got {P.dtype}")
    batch, M, K = P.shape
    if add is not None and (add.shape != (batch, M, M) or add.dtype != P.dtype or add.device != P.device):
        raise ValueError(f"sym_gram: add must be [{batch}, {M}, {M}] {P.dtype} on {P.device}, "
                         f"got {tuple(add.shape)} {add.dtype} on {add.device}")
    C = torch.empty(batch, M, M, device=P.device, dtype=P.dtype)
    if batch == 0 or M == 0:
        return C
    add_t = add if add is not None else C  # a dummy pointer when HAS_ADD is False; never read
    (spb, spm, spk), (sab, sam, san), (scb, scm, scn) = P.stride(), add_t.stride(), C.stride()
    args = dict(P=P, ADD=add_t, C=C, M=M, K=K, stride_pb=spb, stride_pm=spm, stride_pk=spk,
                stride_ab=sab, stride_am=sam, stride_an=san, stride_cb=scb, stride_cm=scm, stride_cn=scn,
                alpha=float(alpha), beta=float(beta), HAS_ADD=add is not None, IEEE_FP32=P.dtype == torch.float32)
    if gpu_config(P):
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK"]), triton.cdiv(M, meta["BLOCK"]), batch)  # noqa: E731
        tuned = _sym_gram_tuned_fp32 if args["IEEE_FP32"] else _sym_gram_tuned
        tuned[grid](**args)
    else:
        nb = triton.cdiv(M, _INTERPRET_BLOCK)
        _sym_gram_kernel[(nb, nb, batch)](**args, BLOCK=_INTERPRET_BLOCK, BLOCK_K=_INTERPRET_BLOCK_K)
    return C


def newton_schulz_triton(G: torch.Tensor, steps: int, coeffs: tuple[float, float, float],
                         eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Quintic Newton-Schulz on G [..., rows, cols] with the symmetric kernels; same math as the reference.

    Arguments are validated by the caller (muonclip.newton_schulz). Returns `dtype`, shape of G.
    """
    a, b, c = coeffs
    lead, (rows, cols) = G.shape[:-2], G.shape[-2:]
    X = G.reshape(-1, rows, cols).to(dtype)          # [batch, rows, cols]
    transposed = rows > cols
    if transposed:                                   # work on the wide side so X·Xᵀ is the small Gram
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    X = X.contiguous()
    for _ in range(steps):
        A = sym_gram(X)                              # [batch, m, m]
        B = sym_gram(A, alpha=c, beta=b, add=A)      # c·A·A + b·A, [batch, m, m]
        X = torch.baddbmm(X, B, X, beta=a)           # a·X + B·X, [batch, m, n]
    if transposed:
        X = X.mT
    return X.reshape(*lead, rows, cols)
