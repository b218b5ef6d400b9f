"""
Kimi Delta Attention (KDA): a delta-rule linear attention with a per-channel forget gate.

Kimi Linear (arXiv 2510.26692) replaces three of every four attention layers with KDA. Each head keeps
a fixed-size state S ∈ R^{K×V} (float32) instead of a growing KV cache. Per token t:

    S ← Diag(exp g_t) S                      decay every key channel by its own gate (g_t ≤ 0, log space)
    S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ           delta rule: write the prediction error of the decayed state
    o_t = Sᵀ (scale · q_t)                   read after the write

For training, the chunkwise form does the same work with matmuls. Inside a chunk of C = 64 tokens, with
Γ the cumulative decays and A[i,j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d]) (j < i), the UT transform
gives the "pseudo-values" every token writes, U − W S_0, with

    W = (I + A)⁻¹ Diag(β) (Γ⊙K),   U = (I + A)⁻¹ Diag(β) V,
    O = (Γ⊙Q) S_0 + Tril(Q Kᵀ decayed)(U − W S_0),   S_C = Diag(γ_C) S_0 + (γ_C/Γ ⊙ K)ᵀ (U − W S_0).

Every exp() here takes a difference "later cumulative decay minus earlier one", so its argument is ≤ 0
and strong decay underflows to 0 instead of overflowing to inf.

The layer (KimiDeltaAttention) wraps the op as in the paper: q/k/v projections, a causal depthwise
short convolution + SiLU, L2-normalised q and k, a low-rank forget gate g = −exp(A_log)·softplus(f(x) +
dt_bias), β = sigmoid(b(x)), and a low-rank sigmoid output gate on a per-head RMSNorm. gate="safe" is the
bounded gate of fla's chunk_kda and Kimi K3 (see the layer).

This file: kda_recurrent_ref (the per-token loop, the oracle), kda_chunk_ref (the chunkwise algorithm in
PyTorch), kda (the public op: validates and dispatches to the reference or to the Triton kernels in
kernels/kda.py), and the layer.

    python bench.py kda                      # Triton vs SDPA flash vs fla (CPU: the references)
    python -m pytest tests/test_kda.py -q    # references, errors, the layer's incremental decoding
"""
import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CHUNK_SIZE = 64


# -----------------------------------------------------------------------------------------------------
# References (float32 math, plain PyTorch, differentiable by autograd)

def _float32_math(fn):
    # under torch.autocast, matmuls would silently run in bf16/fp16; the references must stay float32
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)
    return wrapper


@_float32_math
def kda_recurrent_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """The KDA recurrence, one token at a time. q, k, g: [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H];
    initial_state: [B,H,K,V]. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] fp32 or None)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]                                  # decay the rows (key channels)
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)       # what the decayed state gets wrong
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], error)
        outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(v.shape)  # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)


def _exact(x):
    return x


def _to_bf16(x):
    # round to the nearest bfloat16 (ties to even, as the GPU's cvt.rn.bf16.f32) and compute on in float32
    return x.to(torch.bfloat16).float()


def _decayed_scores(a, b, gc, sub_chunk=16, operand=_exact, anchored_diag=False):
    """P[i,j] = Σ_d a_i[d] b_j[d] exp(gc_i[d] − gc_j[d]) for j ≤ i, else 0.

    a, b, gc: [..., C, K] (a may carry extra leading dims, broadcast against b and gc). gc is the
    within-chunk cumulative log decay (non-increasing along C), so every causal exponent gc_i − gc_j
    is ≤ 0. Two ways to keep every computed exponent ≤ 0:
      - pairs in different sub-chunks: factor through the anchor n = first row of i's sub-chunk,
        exp(gc_i − gc_n) · exp(gc_n − gc_j), both ≤ 1 for j < n ≤ i, so the block is one matmul
        (whose operands the precision plan may round: `operand`);
      - pairs in the same sub-chunk: the exact per-channel exponent gc_i − gc_j (a [sub, sub, K] tensor),
        or with anchored_diag through the same anchor (one matmul; exp(gc_n − gc_j) ≥ 1 there, finite only
        under a bounded gate: see KimiDeltaAttention's gate="safe").
    """
    C = a.shape[-2]
    S = sub_chunk if C % sub_chunk == 0 else C                              # sub-chunk length
    NS = C // S
    a_s, b_s, g_s = (x.unflatten(-2, (NS, S)) for x in (a, b, gc))       # [..., NS, S, K]
    anchor = g_s[..., :1, :]                                                # [..., NS, 1, K]
    a_anchored = a_s * (g_s - anchor).exp()                                 # exponents ≤ 0
    # b seen from each anchor; pairs with j ≥ n would have positive exponents, but they are masked
    # below, so their exponents are clamped to 0 rather than allowed to overflow
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
        decay = diff.masked_fill(~mask[:, :, None], float("-inf")).exp()    # non-causal -> exp(-inf) = 0
        diag = torch.einsum("...ik,...ijk,...jk->...ij", a_s, decay, b_s)  # [..., NS, S, S]
    # place the NS diagonal blocks on the block diagonal of [C, C]
    eye = torch.eye(NS, device=a.device)
    diag = (diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return scores + diag


@_float32_math
def kda_chunk_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=CHUNK_SIZE, precision="fp32"):
    """The chunkwise KDA algorithm (same math as kda_recurrent_ref, matmuls inside each chunk).

    Any T: the sequence is padded to a multiple of chunk_size with tokens that neither decay (g = 0) nor
    write (k = 0, β = 0), so outputs and the final state are unchanged.

    precision: "fp32" (exact float32); "bf16", the Triton kernels' precision plan for 16-bit inputs (see
    the table in kernels/kda.py): the operands of the matmuls marked bf16 there are rounded to bfloat16,
    products accumulate in float32, and the decays, the solve for (I + A)⁻¹ and the state stay float32;
    "bf16-all", what a naive bf16 port would do: also the cumulative decays, the inverse, W, U, the
    pseudo-values and the state between chunks rounded to bfloat16 (the tests show why the plan avoids it);
    "bf16-safe", the plan with the diagonal blocks of the scores as anchored bf16 matmuls too (what a
    bounded gate allows, see gate="safe"; under unbounded decay it overflows).
    """
    if precision not in ("fp32", "bf16", "bf16-all", "bf16-safe"):
        raise ValueError(f"kda_chunk_ref: precision must be fp32, bf16, bf16-all or bf16-safe, got {precision!r}")
    op = _exact if precision == "fp32" else _to_bf16              # a matmul operand on the plan's bf16 rows
    kept = _to_bf16 if precision == "bf16-all" else _exact        # what the plan keeps in float32
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x):  # [B,T,H,*] -> [B,H,N,C,*] float32
        x = x.float()
        if x.dim() == 3:
            x = x[..., None]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))                                 # zero-pad along T
        return x.view(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g)
    beta = to_chunks(beta)                                                 # [B,H,N,C,1]
    gc = kept(g.cumsum(dim=-2))                                            # log of Γ, within each chunk

    # both score matrices share k and the decays, so they are computed together
    A_kk, A_qk = _decayed_scores(torch.stack([k, q]), k, gc, operand=op,                # 2 × [B,H,N,C,C], j ≤ i
                                 anchored_diag=precision == "bf16-safe").unbind(0)
    A_kk = beta * A_kk.tril(-1)                                             # the delta rule: j < i only
    A_qk = scale * A_qk

    # UT transform: X = (I + A_kk)⁻¹ (unit lower-triangular: a forward solve), then [W U] = X Diag(β) [Γ⊙K  V]
    eye = torch.eye(C, device=q.device)
    X = kept(torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk), upper=False, unitriangular=True))
    W = kept(op(X) @ op(k * gc.exp() * beta))
    U = kept(op(X) @ op(v * beta))

    q_decayed = q * gc.exp() * scale                                       # Γ⊙Q: read of the start state
    k_to_end = k * (gc[..., -1:, :] - gc).exp()                           # γ_C/Γ ⊙ K: writes seen at chunk end
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for n in range(N):                                                     # the only sequential part
        pseudo_v = kept(U[:, :, n] - op(W[:, :, n]) @ op(S))               # [B,H,C,V]
        outputs.append(op(q_decayed[:, :, n]) @ op(S) + op(A_qk[:, :, n]) @ op(pseudo_v))
        S = kept(S * gc[:, :, n, -1, :, None].exp() + op(k_to_end[:, :, n]).transpose(-1, -2) @ op(pseudo_v))
    o = torch.stack(outputs, dim=2) if N > 0 else q.new_zeros(B, H, 0, C, V)  # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]            # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)


def kda_flops_per_token(n_heads: int, K: int, V: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Forward FLOPs per token of the chunked algorithm above (what MFU counts; train.py x 3 for the
    backward). Per head and token of a chunk of C: the two decayed C x C score matrices (2 · 2CK), the
    unit-triangular solve for [W U] (C(K+V): half of a C x C by C x (K+V) product), the intra-chunk
    output A_qk (U - WS) (2CV), and three products with the K x V state: W S, (Γ⊙Q) S and the state
    update (3 · 2KV)."""
    C = chunk_size
    return n_heads * (4 * C * K + C * (K + V) + 2 * C * V + 6 * K * V)


# -----------------------------------------------------------------------------------------------------
# The public op: validate once at the boundary, then dispatch

def _require(ok: bool, message: str, error=ValueError):
    if not ok:
        raise error(f"kda: {message}")


def _check_inputs(q, k, v, g, beta, scale, initial_state, backend):
    """Every input check of the op, here once (the Triton wrapper in kernels/kda.py trusts them)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require(isinstance(x, torch.Tensor), f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
        _require(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
                 f"{name} must be float32, float16 or bfloat16, got {x.dtype}", TypeError)
    _require(q.dim() == 4, f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    _require(k.shape == q.shape, f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    _require(g.shape == q.shape, f"g shape {tuple(g.shape)} must equal q shape {tuple(q.shape)} (per-channel decay)")
    _require(v.dim() == 4 and v.shape[:3] == q.shape[:3],
             f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    _require(beta.shape == q.shape[:3], f"beta must be [B, T, H] = [{B}, {T}, {H}], got shape {tuple(beta.shape)}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
             TypeError)
    V = v.shape[-1]
    _require(K > 0 and V > 0, f"head dims must be >= 1, got K={K}, V={V}")
    tensors = [("k", k), ("v", v), ("g", g), ("beta", beta)]
    if initial_state is not None:
        _require(isinstance(initial_state, torch.Tensor),
                 f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}", TypeError)
        _require(initial_state.shape == (B, H, K, V), f"initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}], "
                 f"got shape {tuple(initial_state.shape)}")
        _require(initial_state.dtype == torch.float32, f"initial_state must be float32, got {initial_state.dtype}",
                 TypeError)
        tensors.append(("initial_state", initial_state))
    for name, x in tensors:
        _require(x.device == q.device, f"{name} is on {x.device} but q is on {q.device}")
    _require(scale is None or (isinstance(scale, (int, float)) and scale > 0),
             f"scale must be a positive number or None, got {scale!r}")
    _require(backend in ("auto", "ref", "triton"), f"backend must be 'auto', 'ref' or 'triton', got {backend!r}")


def resolve_backend(backend: str, on_cuda: bool, K: int, V: int) -> str:
    """"auto" -> Triton on CUDA where the kernels support the head sizes, else the reference (so a config
    that trains on CPU does not crash on a GPU); "ref" and "triton" stay as asked."""
    if backend != "auto":
        return backend
    if not on_cuda:
        return "ref"
    import kernels.kda as triton_kda
    return "triton" if K <= triton_kda.MAX_K and V <= triton_kda.MAX_V else "ref"


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """Kimi Delta Attention. q, k, g (log decay ≤ 0): [B,T,H,K]; v: [B,T,H,V]; beta: [B,T,H];
    initial_state: [B,H,K,V] float32 or None; scale defaults to K^-0.5.
    Returns (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] float32 or None).

    backend: "ref" (chunkwise PyTorch), "triton" (kernels/kda.py, CUDA, or CPU under TRITON_INTERPRET=1),
    "auto" (Triton on CUDA tensors within the kernels' K <= 128, V <= 256, else the reference; a single
    token takes the recurrent step)."""
    _check_inputs(q, k, v, g, beta, scale, initial_state, backend)
    K, V = q.shape[-1], v.shape[-1]
    if backend == "auto":
        if q.shape[1] == 1:  # one decoding step: the recurrence itself is cheapest, no chunk padding
            return kda_recurrent_ref(q, k, v, g, beta, scale, initial_state, output_final_state)
        backend = resolve_backend("auto", q.is_cuda, K, V)
    if backend == "ref" or q.numel() == 0:  # (nothing to compute: the reference returns the empty output)
        return kda_chunk_ref(q, k, v, g, beta, scale, initial_state, output_final_state)
    # imported here so that kda.py (references, layer) works even where the kernels cannot load
    import kernels.kda as triton_kda
    _require(K <= triton_kda.MAX_K and V <= triton_kda.MAX_V,  # the kernels keep a state slice on-chip
             f"the Triton path supports K <= {triton_kda.MAX_K} and V <= {triton_kda.MAX_V}, got K={K}, V={V}; "
             "use backend='ref' for larger heads")
    _require(q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1", f"backend='triton' on {q.device} tensors "
             "needs CUDA, or TRITON_INTERPRET=1 set before triton is imported (the interpreter runs the kernels on CPU)")
    scale = K ** -0.5 if scale is None else float(scale)
    return triton_kda.chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state)


# -----------------------------------------------------------------------------------------------------
# The layer (Kimi Linear's token mixer)

class KimiDeltaAttention(nn.Module):
    """KDA token mixer: x [B,T,D] -> [B,T,D], with K = V = head_dim per head.

    cache (optional dict) carries the decoding state across calls: "conv" (the last conv_size − 1
    projected inputs, [B, 3·H·K, conv_size − 1]) and "state" (the KDA state, [B,H,K,V] float32). Its size
    does not grow with the sequence, so each decoded token costs the same time and memory.

    gate="channel" is KDA: one forget rate per key channel, g [B,T,H,K]. gate="head" is Gated DeltaNet's
    gating (arXiv 2412.06464): one forget rate per head, shared by its K channels. The two differ only in
    the gate's up-projection (head_dim -> H·K or -> H) and dt_bias (H·K or H values); everything else,
    including the op, is the same (the head rate is broadcast over K before the op).

    gate="safe" (fla's chunk_kda safe_gate; the gate of Kimi K3's configs) bounds the channel gate below:
    g = lower_bound · sigmoid(exp(A_log) · (f(x) + dt_bias)) ∈ [lower_bound, 0], A_log initialised to 0 (as
    fla), lower_bound = gate_lower_bound (K3, fla: −5). What the bound buys: inside a chunk, the decay over n
    tokens is ≥ n · lower_bound, so exp(G_n − G_j) ≤ exp(−lower_bound · (j − n)) even for "wrong-way" pairs
    j > n. The unbounded gate (−exp(A_log) · softplus, A up to 16) has no such ceiling, so the kernels'
    precision plan computes each 16×16 diagonal block with one exact exponent per (i, j, d): factoring it
    through the block's first row n overflows (U(−20, 0) decays give exp(+150)). Under the bound the largest
    factor is exp(15 · |lower_bound|) = exp(75) at −5, below float32's (and bf16's) exp(88.7), so for
    lower_bound ≥ −88.7/15 = −5.9 a diagonal block can be one product of anchored operands like the others
    (fla's 16-row tensor-core path; tests/test_kda_precision.py measures it in bf16). G itself is not bounded
    usefully (64 tokens at −5 reach −320) and memory can still be long (g ≈ 0), so the plan's other rows keep
    float32 for the same reasons. The op is unchanged: g is its input, and the reference and Triton paths run
    any g ≤ 0."""

    def __init__(self, d_model, n_heads, head_dim, conv_size=4, backend="auto", norm_eps=1e-5, init_std=0.02,
                 gate="channel", gate_lower_bound=-5.0):
        super().__init__()
        if backend not in ("auto", "ref", "triton"):
            raise ValueError(f"KimiDeltaAttention: backend must be 'auto', 'ref' or 'triton', got {backend!r}")
        if gate not in ("channel", "head", "safe"):
            raise ValueError(f"KimiDeltaAttention: gate must be 'channel', 'head' or 'safe', got {gate!r}")
        if not (isinstance(gate_lower_bound, (int, float)) and -math.inf < gate_lower_bound < 0):
            raise ValueError(f"KimiDeltaAttention: gate_lower_bound must be finite and < 0, got {gate_lower_bound!r}")
        if min(d_model, n_heads, head_dim, conv_size) < 1:
            raise ValueError(f"KimiDeltaAttention: d_model, n_heads, head_dim, conv_size must be >= 1, got "
                             f"{d_model}, {n_heads}, {head_dim}, {conv_size}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.conv_size, self.backend, self.norm_eps, self.gate = conv_size, backend, norm_eps, gate
        self.gate_lower_bound = float(gate_lower_bound)
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        # one depthwise causal conv over the concatenated q|k|v channels (depthwise, so this equals three
        # separate convs) keeps a single conv state in the cache
        self.conv = nn.Conv1d(3 * inner, 3 * inner, conv_size, groups=3 * inner, bias=False)
        # forget gate: low rank D -> head_dim -> H·K (channel, safe) or H (head), then
        # g = −exp(A_log)·softplus(· + dt_bias) ≤ 0, or (safe) lower_bound·sigmoid(exp(A_log)·(· + dt_bias))
        gate_dim = n_heads if gate == "head" else inner
        self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, gate_dim, bias=False)
        # A_log and dt_bias stay float32 and should get no weight decay (their names let optimizers find them).
        # Published inits: A = U(1, 16) (safe: A = 1); dt log-uniform in [1e-3, 1e-1], stored as softplus⁻¹(dt).
        self.A_log = nn.Parameter(torch.zeros(n_heads) if gate == "safe" else torch.empty(n_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(gate_dim) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)           # β = sigmoid(b(x)), one per head
        # output gate: low rank D -> head_dim -> H·V, sigmoid, on a per-head RMSNorm of the KDA output
        self.g_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        # GPT-2-style N(0, 0.02) for every projection, as fla's models initialise KDA layers (a model may
        # scale o_proj down with depth, like its other residual-branch outputs); the conv keeps torch's init
        for m in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.f_b_proj, self.b_proj,
                  self.g_a_proj, self.g_b_proj, self.o_proj):
            nn.init.normal_(m.weight, std=init_std)

    def _short_conv(self, x, conv_state, n_real=None):
        # x: [B,T,C] -> causal depthwise conv + SiLU; conv_state: the previous conv_size-1 inputs or None
        # n_real [B]: real tokens per row (then pads); the new state is then the last inputs that were real
        x = x.transpose(1, 2)                                              # [B,C,T]
        if conv_state is None:
            conv_state = x.new_zeros(x.shape[0], x.shape[1], self.conv_size - 1)
        x = torch.cat([conv_state.to(x.dtype), x], dim=2)                 # [B,C,conv_size-1+T]
        if n_real is None:
            new_state = x[:, :, x.shape[2] - (self.conv_size - 1):]
        else:
            idx = n_real[:, None] + torch.arange(self.conv_size - 1, device=x.device)   # [B,conv_size-1]
            new_state = x.gather(2, idx[:, None, :].expand(-1, x.shape[1], -1))
        return F.silu(self.conv(x)).transpose(1, 2), new_state            # [B,T,C], [B,C,conv_size-1]

    def log_decay(self, x):
        """The forget gate g [B,T,H,K] (float32, ≤ 0; safe: within [lower_bound, 0]) from x [B,T,D]."""
        B, T, H = x.shape[0], x.shape[1], self.n_heads
        logits = self.f_b_proj(self.f_a_proj(x)).float().view(B, T, H, -1) + self.dt_bias.view(H, -1)
        rate = self.A_log.exp()[:, None]                                   # [H,1]; logits [B,T,H,K or 1]
        if self.gate == "safe":
            g = self.gate_lower_bound * torch.sigmoid(rate * logits)
        else:
            g = -rate * F.softplus(logits)
        return g.expand(B, T, H, self.head_dim).contiguous()   # a head gate decays all K rows alike

    def forward(self, x, cache=None, valid=None):
        """valid [B,T] bool (optional): each row's real tokens first, then pads (batched decoding of rows
        of different lengths, see model.GPT.forward). Pads get beta = 0 and g = 0, so the state passes
        them unchanged, and the conv state keeps the last real inputs."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"KimiDeltaAttention: x must be [B, T, {self.d_model}], got shape {tuple(x.shape)}")
        if cache is not None and not isinstance(cache, dict):
            raise TypeError(f"KimiDeltaAttention: cache must be a dict or None, got {type(cache).__name__}")
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        cache_in = {} if cache is None else cache
        if "state" in cache_in and cache_in["state"].shape[0] != B:
            raise ValueError(f"KimiDeltaAttention: cache holds batch {cache_in['state'].shape[0]}, x has batch {B}")

        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)   # [B,T,3·H·K]
        qkv, conv_state = self._short_conv(qkv, cache_in.get("conv"), None if valid is None else valid.sum(1))
        q, k, v = qkv.view(B, T, 3, H, K).unbind(dim=2)                   # 3 × [B,T,H,K]
        # L2 norm in float32 (eps inside the root, as in the paper's kernels); keys of unit length keep
        # the delta rule's write (I − β k kᵀ) a contraction for β ∈ [0, 1]
        q = (q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + 1e-6)).to(v.dtype)
        k = (k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + 1e-6)).to(v.dtype)
        g = self.log_decay(x)                                              # [B,T,H,K] float32, ≤ 0
        beta = torch.sigmoid(self.b_proj(x).float())                       # [B,T,H]
        if valid is not None:  # pads: no write (beta = 0), no decay (g = 0)
            beta = beta * valid[:, :, None]
            g = g * valid[:, :, None, None]

        if T == 1:  # a decoding step: one step of the recurrence, O(1) per token and no chunk padding
            o, state = kda_recurrent_ref(q, k, v, g, beta, None, cache_in.get("state"), cache is not None)
        else:
            o, state = kda(q, k, v, g, beta, initial_state=cache_in.get("state"),
                           output_final_state=cache is not None, backend=self.backend)
        if cache is not None:
            cache["conv"], cache["state"] = conv_state, state

        # per-head RMSNorm, then the sigmoid output gate, in float32
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight
        out_gate = torch.sigmoid(self.g_b_proj(self.g_a_proj(x)).float().view(B, T, H, K))
        o = (o * out_gate).to(x.dtype).reshape(B, T, H * K)               # [B,T,H·V]
        return self.o_proj(o)
