"""Kimi Delta Attention (KDA): a delta-rule linear attention with a per-channel forget gate.

Kimi Linear (arXiv 2510.26692) replaces three of every four attention layers with KDA. Each head keeps
a fixed-size state S ∈ R^{K×V} (float32) instead of a growing KV cache. Per token t:

    S ← Diag(exp g_t) S                      decay every key channel by its own gate (g_t ≤ 0, log space)
    S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ           delta rule: write the prediction error of the decayed state
    o_t = Sᵀ (scale · q_t)                   read after the write

Chunkwise (C = 64 tokens, Γ the cumulative decays, A[i,j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d]), j < i):

    W = (I + A)⁻¹ Diag(β) (Γ⊙K),   U = (I + A)⁻¹ Diag(β) V,
    O = (Γ⊙Q) S_0 + Tril(Q Kᵀ decayed)(U − W S_0),   S_C = Diag(γ_C) S_0 + (γ_C/Γ ⊙ K)ᵀ (U − W S_0),

each exp() of a later cumulative decay minus an earlier one: ≤ 0, so strong decay underflows, never to inf.
The layer: q/k/v projections, causal depthwise conv + SiLU, L2-normalised q and k, a low-rank forget gate
g = −exp(A_log)·softplus(f(x) + dt_bias), β = sigmoid(b(x)), a sigmoid output gate on a per-head RMSNorm.

Run:   python train.py --pattern=KKKA
Test:  python -m pytest tests/test_kda.py tests/test_kda_triton.py -q
Bench: python bench.py kda
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import kda as kda_kernels
from kernels.launch import BACKENDS, require, use_triton

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
    """The KDA recurrence, one token at a time (the oracle); arguments and results as kda()'s."""
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


def _chunks(x, C):
    # [B,T,H,D] (or [B,T,H], as D = 1) -> [B,H,N,C,D] float32, zero-padded along T to N whole chunks
    x = x.float()
    if x.dim() == 3:
        x = x[..., None]
    B, T, H, D = x.shape
    x = F.pad(x, (0, 0, 0, 0, 0, (-T) % C))                                # zero-pad along T
    return x.view(B, x.shape[1] // C, C, H, D).permute(0, 3, 1, 2, 4)


def _decayed_scores(a, b, gc, sub_chunk=16):
    """P[i,j] = Σ_d a_i[d] b_j[d] exp(gc_i[d] − gc_j[d]) for j ≤ i, else 0. a, b, gc: [..., C, K] (a may carry
    extra leading dims); gc, the cumulative log decay within the chunk, falls along C, so gc_i − gc_j ≤ 0."""
    # Pairs across 16-row sub-chunks go through n, the first row of i's: exp(gc_i − gc_n)·exp(gc_n − gc_j),
    # both ≤ 1, so each block row is one matmul (the exact per-pair exponent, [C, C, K], measured ~4x slower).
    C = a.shape[-2]
    S = sub_chunk if C % sub_chunk == 0 else C                              # sub-chunk length
    NS = C // S
    a_s, b_s, g_s = (x.unflatten(-2, (NS, S)) for x in (a, b, gc))       # [..., NS, S, K]
    anchor = g_s[..., :1, :]                                                # [..., NS, 1, K]
    a_anchored = a_s * (g_s - anchor).exp()                                 # exponents ≤ 0
    # b seen from each anchor; pairs with j ≥ n would have positive exponents, but they are masked
    # below, so their exponents are clamped to 0 rather than allowed to overflow
    b_anchored = b[..., None, :, :] * (anchor - gc[..., None, :, :]).clamp(max=0).exp()  # [..., NS, C, K]
    blocks = a_anchored @ b_anchored.transpose(-1, -2)                      # [..., NS, S, C]
    sub_id = torch.arange(C, device=a.device) // S
    earlier_sub_chunk = sub_id[:, None] > sub_id[None, :]                  # [C, C]
    scores = blocks.flatten(-3, -2) * earlier_sub_chunk                     # [..., C, C]

    # pairs within a sub-chunk: the exact exponent (through n, exp(gc_n − gc_j) > 1 could overflow)
    mask = torch.ones(S, S, dtype=torch.bool, device=a.device).tril()
    diff = g_s[..., :, None, :] - g_s[..., None, :, :]                      # [..., NS, S, S, K]
    decay = diff.masked_fill(~mask[:, :, None], float("-inf")).exp()        # non-causal -> exp(-inf) = 0
    diag = torch.einsum("...ik,...ijk,...jk->...ij", a_s, decay, b_s)      # [..., NS, S, S]
    # place the NS diagonal blocks on the block diagonal of [C, C]
    eye = torch.eye(NS, device=a.device)
    diag = (diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-4, -3).flatten(-2, -1)
    return scores + diag


@_float32_math
def kda_chunk_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=CHUNK_SIZE):
    """kda_recurrent_ref in the chunkwise form above. Any T: the padding to whole chunks neither decays
    (g = 0) nor writes (k = 0, β = 0), so outputs and the final state are unchanged."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (_chunks(x, C) for x in (q, k, v, g, beta))        # [B,H,N,C,*]; beta [B,H,N,C,1]
    N = q.shape[2]
    gc = g.cumsum(dim=-2)                                                  # log of Γ, within each chunk

    # both score matrices share k and the decays, so they are computed together
    A_kk, A_qk = _decayed_scores(torch.stack([k, q]), k, gc).unbind(0)    # 2 × [B,H,N,C,C], j ≤ i
    A_kk = beta * A_kk.tril(-1)                                             # the delta rule: j < i only
    A_qk = scale * A_qk

    # UT transform: X = (I + A_kk)⁻¹ (unit lower-triangular: a forward solve), then [W U] = X Diag(β) [Γ⊙K  V]
    eye = torch.eye(C, device=q.device)
    X = torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk), upper=False, unitriangular=True)
    W = X @ (k * gc.exp() * beta)
    U = X @ (v * beta)

    q_decayed = q * gc.exp() * scale                                       # Γ⊙Q: read of the start state
    k_to_end = k * (gc[..., -1:, :] - gc).exp()                           # γ_C/Γ ⊙ K: writes seen at chunk end
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for n in range(N):                                                     # the only sequential part
        pseudo_v = U[:, :, n] - W[:, :, n] @ S                             # [B,H,C,V]
        outputs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ pseudo_v)
        S = S * gc[:, :, n, -1, :, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ pseudo_v
    o = torch.stack(outputs, dim=2) if N > 0 else q.new_zeros(B, H, 0, C, V)  # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]            # [B,T,H,V]
    return o.to(out_dtype), (S if output_final_state else None)


def kda_flops_per_token(n_heads: int, K: int, V: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Forward FLOPs per token of the chunked algorithm (MFU; train.py x 3 for the backward), per head: the two
    C x C scores 2·2CK, the solve for [W U] C(K+V), A_qk (U − WS) 2CV; W S, (Γ⊙Q) S, the state update 3·2KV."""
    C = chunk_size
    return n_heads * (4 * C * K + C * (K + V) + 2 * C * V + 6 * K * V)


# -----------------------------------------------------------------------------------------------------
# The public op: validate once at the boundary, then dispatch

def _check_inputs(q, k, v, g, beta, scale, initial_state):
    # every input check of the op, here once (the Triton wrapper in kernels/kda.py trusts them)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require(isinstance(x, torch.Tensor), f"kda: {name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
        require(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
                f"kda: {name} must be float32, float16 or bfloat16, got {x.dtype}", TypeError)
    require(q.dim() == 4, f"kda: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    require(k.shape == q.shape, f"kda: k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    require(g.shape == q.shape,
            f"kda: g shape {tuple(g.shape)} must equal q shape {tuple(q.shape)} (per-channel decay)")
    require(v.dim() == 4 and v.shape[:3] == q.shape[:3],
            f"kda: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    require(beta.shape == q.shape[:3], f"kda: beta must be [B, T, H] = [{B}, {T}, {H}], got shape {tuple(beta.shape)}")
    require(q.dtype == k.dtype == v.dtype, f"kda: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
            TypeError)
    V = v.shape[-1]
    require(K > 0 and V > 0, f"kda: head dims must be >= 1, got K={K}, V={V}")
    tensors = [("k", k), ("v", v), ("g", g), ("beta", beta)]
    if initial_state is not None:
        require(isinstance(initial_state, torch.Tensor),
                f"kda: initial_state must be a torch.Tensor, got {type(initial_state).__name__}", TypeError)
        require(initial_state.shape == (B, H, K, V), f"kda: initial_state must be [B, H, K, V] = [{B}, {H}, {K}, {V}], "
                f"got shape {tuple(initial_state.shape)}")
        require(initial_state.dtype == torch.float32, f"kda: initial_state must be float32, got {initial_state.dtype}",
                TypeError)
        tensors.append(("initial_state", initial_state))
    for name, x in tensors:
        require(x.device == q.device, f"kda: {name} is on {x.device} but q is on {q.device}")
    require(scale is None or (isinstance(scale, (int, float)) and scale > 0),
            f"kda: scale must be a positive number or None, got {scale!r}")


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """Kimi Delta Attention: q, k, g (log decay ≤ 0) [B,T,H,K], v [B,T,H,V], beta [B,T,H], initial_state
    [B,H,K,V] float32 or None, scale K^-0.5 by default -> (o [B,T,H,V] in v's dtype, final state or None).
    backend: kernels.launch.use_triton's rule; the kernels (kernels/kda.py) take K <= 128 and V <= 256."""
    _check_inputs(q, k, v, g, beta, scale, initial_state)
    K, V = q.shape[-1], v.shape[-1]
    fits = K <= kda_kernels.MAX_K and V <= kda_kernels.MAX_V           # the kernels hold a [K, V] state on-chip
    kernels = use_triton(backend, q.is_cuda, fits, "kda", f"K <= {kda_kernels.MAX_K} and V <= {kda_kernels.MAX_V}, "
                         f"got K={K}, V={V}")
    if q.shape[1] == 1:  # a decoding step, on every backend: one step of the recurrence, no chunk padding
        return kda_recurrent_ref(q, k, v, g, beta, scale, initial_state, output_final_state)
    if not kernels or q.numel() == 0:  # (nothing to compute: the reference returns the empty output)
        return kda_chunk_ref(q, k, v, g, beta, scale, initial_state, output_final_state)
    return kda_kernels.chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state)


# -----------------------------------------------------------------------------------------------------
# The layer (Kimi Linear's token mixer)

class KimiDeltaAttention(nn.Module):
    """KDA token mixer: x [B,T,D] -> [B,T,D], with K = V = head_dim per head. gate: "channel" (KDA: a forget
    rate per key channel), "head" (Gated DeltaNet, arXiv 2412.06464: one per head, broadcast over K) or "safe"
    (fla's safe_gate, Kimi K3's: g = lower_bound · sigmoid(exp(A_log)·(f(x) + dt_bias)) ∈ [lower_bound, 0]).
    cache (optional dict) carries decoding across calls, "conv" (the last conv_size − 1 projected inputs) and
    "state" ([B,H,K,V] float32): its size does not grow, so every decoded token costs the same."""

    def __init__(self, d_model, n_heads, head_dim, conv_size=4, backend="auto", norm_eps=1e-5, init_std=0.02,
                 gate="channel", gate_lower_bound=-5.0):
        super().__init__()
        require(backend in BACKENDS, f"KimiDeltaAttention: backend must be 'auto', 'ref' or 'triton', got {backend!r}")
        require(gate in ("channel", "head", "safe"),
                f"KimiDeltaAttention: gate must be 'channel', 'head' or 'safe', got {gate!r}")
        require(isinstance(gate_lower_bound, (int, float)) and -math.inf < gate_lower_bound < 0,
                f"KimiDeltaAttention: gate_lower_bound must be finite and < 0, got {gate_lower_bound!r}")
        require(min(d_model, n_heads, head_dim, conv_size) >= 1, f"KimiDeltaAttention: d_model, n_heads, head_dim, "
                f"conv_size must be >= 1, got {d_model}, {n_heads}, {head_dim}, {conv_size}")
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
        # valid [B,T] bool (optional): each row's real tokens first, then pads (batched decoding of rows of
        # different lengths, see model.GPT.forward). Pads get beta = 0 and g = 0, so the state passes them
        # unchanged, and the conv state keeps the last real inputs.
        require(x.dim() == 3 and x.shape[-1] == self.d_model,
                f"KimiDeltaAttention: x must be [B, T, {self.d_model}], got shape {tuple(x.shape)}")
        require(cache is None or isinstance(cache, dict),
                f"KimiDeltaAttention: cache must be a dict or None, got {type(cache).__name__}", TypeError)
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        cache_in = {} if cache is None else cache
        if "state" in cache_in:
            require(cache_in["state"].shape[0] == B,
                    f"KimiDeltaAttention: cache holds batch {cache_in['state'].shape[0]}, x has batch {B}")

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

        o, state = kda(q, k, v, g, beta, initial_state=cache_in.get("state"), output_final_state=cache is not None,
                       backend=self.backend)
        if cache is not None:
            cache["conv"], cache["state"] = conv_state, state

        # per-head RMSNorm, then the sigmoid output gate, in float32
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight
        out_gate = torch.sigmoid(self.g_b_proj(self.g_a_proj(x)).float().view(B, T, H, K))
        o = (o * out_gate).to(x.dtype).reshape(B, T, H * K)               # [B,T,H·V]
        return self.o_proj(o)
