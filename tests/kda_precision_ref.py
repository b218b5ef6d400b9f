"""KDA's bf16 precision plan (the table in kernels/kda.py) emulated in PyTorch, for tests/test_kda_precision.py.

kda_chunk_plan is kda.kda_chunk_ref with roundings: `op` rounds the operands of the products the plan marks
bf16 (to the nearest bfloat16, as the GPU's cvt.rn.bf16.f32) and the products accumulate in float32; `kept`
rounds what the plan keeps in float32 (only for "bf16-all"). precision:
    "bf16"       the kernels' plan for 16-bit inputs: decays, the solve for (I + A)⁻¹ and the state float32
    "bf16-all"   a naive bf16 port: also the cumulative decays, the inverse, W, U, the pseudo-values and the
                 state between chunks rounded to bf16 (the tests show why the plan avoids it)
    "bf16-safe"  the plan with the diagonal blocks of the scores as anchored bf16 products too (what the
                 safe gate's bound allows; under unbounded decay they overflow)
"""
import torch

from kda import CHUNK_SIZE, _chunks, _float32_math

PRECISIONS = ("bf16", "bf16-all", "bf16-safe")


def _exact(x):
    return x


def _to_bf16(x):
    # round to the nearest bfloat16 (ties to even, as the GPU's cvt.rn.bf16.f32) and compute on in float32
    return x.to(torch.bfloat16).float()


def _decayed_scores(a, b, gc, operand, anchored_diag, sub_chunk=16):
    # kda._decayed_scores with the off-diagonal product's operands rounded by `operand`; with anchored_diag
    # the diagonal blocks go through the same anchor (one product; exp(gc_n − gc_j) ≥ 1 there)
    C = a.shape[-2]
    S = sub_chunk if C % sub_chunk == 0 else C
    NS = C // S
    a_s, b_s, g_s = (x.unflatten(-2, (NS, S)) for x in (a, b, gc))       # [..., NS, S, K]
    anchor = g_s[..., :1, :]                                                # [..., NS, 1, K]
    a_anchored = a_s * (g_s - anchor).exp()
    b_anchored = b[..., None, :, :] * (anchor - gc[..., None, :, :]).clamp(max=0).exp()  # [..., NS, C, K]
    blocks = operand(a_anchored) @ operand(b_anchored).transpose(-1, -2)   # [..., NS, S, C]
    sub_id = torch.arange(C, device=a.device) // S
    earlier_sub_chunk = sub_id[:, None] > sub_id[None, :]                  # [C, C]
    scores = blocks.flatten(-3, -2) * earlier_sub_chunk                     # [..., C, C]

    mask = torch.ones(S, S, dtype=torch.bool, device=a.device).tril()
    if anchored_diag:
        diag = (operand(a_anchored) @ operand(b_s * (anchor - g_s).exp()).transpose(-1, -2)) * mask
    else:
        diff = g_s[..., :, None, :] - g_s[..., None, :, :]                  # [..., NS, S, S, K]
        decay = diff.masked_fill(~mask[:, :, None], float("-inf")).exp()
        diag = torch.einsum("...ik,...ijk,...jk->...ij", a_s, decay, b_s)  # [..., NS, S, S]
    eye = torch.eye(NS, device=a.device)
    diag = (diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return scores + diag


@_float32_math
def kda_chunk_plan(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   chunk_size=CHUNK_SIZE, precision="bf16"):
    """kda_chunk_ref (same arguments and results) with the roundings of `precision` (see the module)."""
    if precision not in PRECISIONS:
        raise ValueError(f"kda_chunk_plan: precision must be bf16, bf16-all or bf16-safe, got {precision!r}")
    op = _to_bf16                                                 # a matmul operand on the plan's bf16 rows
    kept = _to_bf16 if precision == "bf16-all" else _exact        # what the plan keeps in float32
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (_chunks(x, C) for x in (q, k, v, g, beta))        # [B,H,N,C,*]; beta [B,H,N,C,1]
    N = q.shape[2]
    gc = kept(g.cumsum(dim=-2))

    A_kk, A_qk = _decayed_scores(torch.stack([k, q]), k, gc, op, precision == "bf16-safe").unbind(0)
    A_kk = beta * A_kk.tril(-1)
    A_qk = scale * A_qk

    eye = torch.eye(C, device=q.device)
    X = kept(torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk), upper=False, unitriangular=True))
    W = kept(op(X) @ op(k * gc.exp() * beta))
    U = kept(op(X) @ op(v * beta))

    q_decayed = q * gc.exp() * scale
    k_to_end = k * (gc[..., -1:, :] - gc).exp()
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for n in range(N):
        pseudo_v = kept(U[:, :, n] - op(W[:, :, n]) @ op(S))                # [B,H,C,V]
        outputs.append(op(q_decayed[:, :, n]) @ op(S) + op(A_qk[:, :, n]) @ op(pseudo_v))
        S = kept(S * gc[:, :, n, -1, :, None].exp() + op(k_to_end[:, :, n]).transpose(-1, -2) @ op(pseudo_v))
    o = torch.stack(outputs, dim=2) if N > 0 else q.new_zeros(B, H, 0, C, V)  # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]            # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)
