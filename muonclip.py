"""MuonClip: Muon's orthogonalised momentum for the hidden matrices, AdamW for the rest, and QK-Clip.

Kimi K2 (arXiv 2507.20534), on Muon at scale (Moonlight, 2502.16982). For a hidden W [A, B], gradient G:
    M  <- mu·M + (1 - mu)·G                        momentum (EMA form, mu = 0.95)
    U  <- (1 - mu)·G + mu·M                        Nesterov look-ahead
    O  <- NewtonSchulz5(U)                         ≈ U·(UᵀU)^(-1/2): all singular values pushed to ~1
    W  <- W·(1 - lr·wd) - lr · 0.2·sqrt(max(A, B)) · O     (0.2·sqrt(max(A, B)): AdamW's update RMS)
Newton-Schulz: X <- U / ||U||_F, then five steps of X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ and
(a, b, c) = (3.4445, -4.7750, 2.0315), which maps every singular value into about [0.68, 1.13].

QK-Clip, after every step: S_h is the largest scaled logit scale·q·k of softmax-attention head h, recorded
in the forward pass. If S_h > τ, with γ_h = τ / S_h:
    one key head per query head (MHA):   W_q rows of h  *= sqrt(γ_h),  W_k rows of h  *= sqrt(γ_h)
    grouped keys (GQA, H > Hkv):         W_q rows of h  *= γ_h,        the shared W_k is left alone
so each clipped head lands on τ; other heads, W_v, W_o and the optimizer state are untouched. Routing:
nn.Linear weights -> Muon; head, embeddings, convs -> AdamW; 1-D params, KDA gates -> AdamW, no decay.

Run:   python experiments/muon_vs_adamw.py; python experiments/qk_clip.py
Test:  python -m pytest tests/test_muonclip.py tests/test_attention.py -q
Bench: python bench.py muonclip
"""
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kernels.attention import MAX_HEAD_DIM
from kernels.launch import BACKENDS, require, use_triton

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
GATE_PARAM_NAMES = ("A_log", "dt_bias")  # KDA decay-gate parameters: AdamW, no weight decay


# ---------------------------------------------------------------------------------------------------
# Newton-Schulz: the reference and the fast path

def _check_ns_args(G, steps):
    require(isinstance(G, torch.Tensor) and G.ndim >= 2, "newton_schulz: G must be a tensor with at least 2 dims "
             f"[..., rows, cols], got {tuple(G.shape) if isinstance(G, torch.Tensor) else type(G).__name__}")
    require(G.is_floating_point(), f"newton_schulz: G must be floating point, got {G.dtype}", TypeError)
    require(isinstance(steps, int) and steps >= 0, f"newton_schulz: steps must be a non-negative int, got {steps!r}")


def newton_schulz_ref(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None,
                      coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = NS_EPS) -> torch.Tensor:
    """Quintic Newton-Schulz of G [..., rows, cols] in `dtype` (None: bf16 on CUDA, float32 on CPU), in
    torch.optim.Muon's op order; returns G's shape, singular values in about [0.68, 1.13]."""
    _check_ns_args(G, steps)
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    a, b, c = coeffs
    lead, (rows, cols) = G.shape[:-2], G.shape[-2:]
    X = G.reshape(-1, rows, cols).to(dtype)             # [batch, rows, cols]
    # One matrix (a batch of 1) takes torch.optim.Muon's own calls (norm(), addmm), so the two agree bit
    # for bit on any BLAS (tests/test_muonclip.py); a stack takes the batched forms of the same calls.
    matrix = X.shape[0] == 1
    if matrix:
        X = X[0]                                        # [rows, cols]
    add_matmul = torch.addmm if matrix else torch.baddbmm
    transposed = rows > cols
    if transposed:                                      # [..., m, n] with m <= n
        X = X.mT
    # Frobenius norm >= spectral norm, so afterwards every singular value is <= 1 (clamp, not +eps,
    # keeps the map scale-invariant for tiny gradients)
    X = X / (X.norm() if matrix else X.norm(dim=(-2, -1), keepdim=True)).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT                                    # [..., m, m]
        B = add_matmul(A, A, A, beta=b, alpha=c)        # b·A + c·A·A
        X = add_matmul(X, B, X, beta=a)                 # a·X + B·X
    if transposed:
        X = X.mT
    return X.reshape(*lead, rows, cols)


def newton_schulz(G: torch.Tensor, steps: int = 5, backend: str = "auto", dtype: torch.dtype | None = None,
                  coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = NS_EPS) -> torch.Tensor:
    """newton_schulz_ref's result through the symmetric Triton kernels (kernels/newton_schulz.py)."""
    _check_ns_args(G, steps)
    if not use_triton(backend, G.is_cuda, op="newton_schulz"):
        return newton_schulz_ref(G, steps, dtype, coeffs, eps)
    from kernels.newton_schulz import newton_schulz_triton
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    return newton_schulz_triton(G, steps, coeffs, eps, dtype)


# ---------------------------------------------------------------------------------------------------
# Per-head max logit (what QK-Clip reads): reference, online Triton kernel, fused attention that returns it

def _check_max_logit_args(q, k, scale):
    require(isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.ndim == 4 and k.ndim == 4,
             "max_logit: q must be [B, H, T, Dh] and k [B, Hkv, T, Dh] tensors, got "
             f"{getattr(q, 'shape', type(q))} and {getattr(k, 'shape', type(k))}")
    (B, H, T, Dh), (Bk, Hkv, Tk, Dk) = q.shape, k.shape
    require((B, T, Dh) == (Bk, Tk, Dk), f"max_logit: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in B, T, Dh")
    require(Hkv > 0 and H % Hkv == 0, f"max_logit: n_head {H} must be a multiple of n_kv_head {Hkv}")
    require(T > 0 and B > 0, f"max_logit: empty input {tuple(q.shape)}")
    require(q.is_floating_point() and q.dtype == k.dtype,
             f"max_logit: q and k must share a floating dtype, got {q.dtype} and {k.dtype}", TypeError)
    require(q.device == k.device, f"max_logit: q on {q.device} but k on {k.device}")
    require(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
             f"max_logit: scale must be a positive finite number, got {scale!r}")


def max_logit_ref(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """Max of scale·q·kᵀ [B, H] (float32) over pairs j <= i (causal) or all pairs, for q [B, H, T, Dh] and
    k [B, Hkv, T, Dh] (query head h reads key head h // (H // Hkv)), from the explicit T x T logits."""
    _check_max_logit_args(q, k, scale)
    H, Hkv, T = q.shape[1], k.shape[1], q.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)                           # [B, H, T, Dh]
    logits = (q.float() @ k.float().mT) * scale                        # [B, H, T, T]
    if causal:
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
    return logits.amax(dim=(-2, -1))


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, backend: str = "auto",
              causal: bool = True) -> torch.Tensor:
    """Same as max_logit_ref, without the T x T matrix on the Triton path (kernels/max_logit.py)."""
    _check_max_logit_args(q, k, scale)
    if not use_triton(backend, q.is_cuda, op="max_logit"):
        return max_logit_ref(q, k, scale, causal)
    from kernels.max_logit import max_logit_triton
    return max_logit_triton(q.detach(), k.detach(), float(scale), causal)


def attention_max_logit(q, k, v, scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax attention [B, H, T, Dh], max logit [B, H]) in one Triton pass (kernels/attention.py): the
    online softmax's row maxima are the logits' row maxima. Differentiable in q, k, v."""
    from kernels.attention import attention_max_logit_triton
    return attention_max_logit_triton(q, k, v, scale, causal)


def softmax_attention(module: nn.Module, q, k, v, causal: bool = True) -> torch.Tensor:
    """softmax(scale·q·kᵀ) v [B, H, T, Dh] for q [B, H, T, Dh], k, v [B, Hkv, T, Dh]: `module`'s attention
    (the LM's or the ViT's). Training with module.record_max_logit set, each head's largest logit also
    goes into module.max_logit [H] (max over batch and micro-steps until QK-Clip reads it): from the
    fused kernel on the Triton backend, else from a max_logit pass beside SDPA."""
    scale, recording = module.head_dim ** -0.5, module.record_max_logit and module.training
    y = None
    if recording:
        if use_triton(module.backend, q.is_cuda, q.shape[-1] <= MAX_HEAD_DIM, "attention", f"head dim <= {MAX_HEAD_DIM}"):
            y, new = attention_max_logit(q, k, v, scale, causal)                       # [B, H, T, Dh], [B, H]
        else:
            new = max_logit(q.detach(), k.detach(), scale, module.backend, causal)      # [B, H]
        new = new.amax(dim=0)                                                          # [H]
        module.max_logit = new if module.max_logit is None else torch.maximum(module.max_logit, new)
    if y is None:
        if k.shape[1] != q.shape[1]:                                                   # grouped KV heads
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # [B, H, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1)
    return y


# ---------------------------------------------------------------------------------------------------
# The optimizer

def _is_attention(module: nn.Module) -> bool:
    # duck typing: a softmax-attention module that reports per-head max logits (q_proj/k_proj or one qkv)
    return ((hasattr(module, "q_proj") and hasattr(module, "k_proj")) or hasattr(module, "qkv")) and \
        all(hasattr(module, a) for a in ("n_head", "n_kv_head", "head_dim", "record_max_logit"))


def _qk_head_rows(m: nn.Module, name: str):
    """Views [H, Dh, ...] of the query rows and [Hkv, Dh, ...] of the key rows of m's "weight" or "bias"
    (None if absent); a fused qkv projection lays its outputs out as (3, H, Dh)."""
    H, Hkv, Dh = m.n_head, m.n_kv_head, m.head_dim
    if hasattr(m, "qkv"):
        t = getattr(m.qkv, name)
        return None if t is None else tuple(t.view(3, H, Dh, -1)[:2])   # [3, H, Dh, D] (bias [3, H, Dh, 1])
    q, k = getattr(m.q_proj, name), getattr(m.k_proj, name)
    return None if q is None else (q.view(H, Dh, -1), k.view(Hkv, Dh, -1))


def _adjusted_lr(lr: float, shape: torch.Size, adjust_lr: str) -> float:
    A, B = shape[0], math.prod(shape[1:])
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr * math.sqrt(max(1.0, A / B))  # "original" (Keller Jordan)


def _world() -> tuple[int, int]:
    """(world size, rank) under torch.distributed, else (1, 0)."""
    distributed = dist.is_available() and dist.is_initialized()
    return (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)


class MuonClip(torch.optim.Optimizer):
    """Muon for groups with use_muon=True (default: params with ndim >= 2), AdamW for the others, then
    QK-Clip at τ = qk_clip_tau (None: plain Muon). Build it with MuonClip.from_model(model, ...).
    After each step, last_clip_stats is None or {"layers", "max_logit" (per layer, before the clip),
    "clipped_heads", "max_logit_per_head"}."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr: str = "match_rms_adamw",
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 qk_clip_tau: float | None = 100.0, attention_modules=(), ns_backend: str = "auto",
                 ns_dtype: torch.dtype | None = None):
        require(isinstance(lr, (int, float)) and lr >= 0, f"MuonClip: lr must be a number >= 0, got {lr!r}")
        require(isinstance(weight_decay, (int, float)) and weight_decay >= 0,
                 f"MuonClip: weight_decay must be >= 0, got {weight_decay!r}")
        require(0.0 <= momentum < 1.0, f"MuonClip: momentum must be in [0, 1), got {momentum!r}")
        require(adjust_lr in ("match_rms_adamw", "original"),
                 f"MuonClip: adjust_lr must be 'match_rms_adamw' or 'original', got {adjust_lr!r}")
        require(len(adamw_betas) == 2 and all(0.0 <= beta < 1.0 for beta in adamw_betas),
                 f"MuonClip: adamw_betas must be two numbers in [0, 1), got {adamw_betas!r}")
        require(qk_clip_tau is None or (isinstance(qk_clip_tau, (int, float)) and qk_clip_tau > 0),
                 f"MuonClip: qk_clip_tau must be a positive number or None, got {qk_clip_tau!r}")
        require(ns_backend in BACKENDS, f"MuonClip: ns_backend must be 'auto', 'ref' or 'triton', got {ns_backend!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, adjust_lr=adjust_lr, betas=tuple(adamw_betas), eps=adamw_eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if "use_muon" not in group:
                group["use_muon"] = all(p.ndim >= 2 for p in group["params"])
            if group["use_muon"] and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("MuonClip: a use_muon group holds a parameter with fewer than 2 dims")
        self.qk_clip_tau, self.ns_backend, self.ns_dtype = qk_clip_tau, ns_backend, ns_dtype
        self.attention_modules = list(attention_modules)  # [(name, module)]
        for name, module in self.attention_modules:
            if not _is_attention(module):
                raise ValueError(f"MuonClip: attention module {name!r} lacks q_proj/k_proj (or qkv)/n_head/"
                                 "n_kv_head/head_dim/record_max_logit")
            if hasattr(module, "qkv") and module.n_kv_head != module.n_head:
                raise ValueError(f"MuonClip: attention module {name!r} has a fused qkv projection with grouped "
                                 "KV heads; a fused projection is supported for n_kv_head == n_head only")
        self.last_clip_stats = None

    @classmethod
    def from_model(cls, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1,
                   qk_clip_tau: float | None = 100.0, head_name: str = "lm_head", use_muon: bool = True,
                   track_max_logit: bool = True, **kwargs) -> "MuonClip":
        """Route a model's parameters (module docstring) and hook up its attention modules. use_muon=False:
        all to AdamW (the baseline). ns_backend defaults to model.config.backend (one switch)."""
        roles = {}  # id(param) -> "muon" | "decay" | "no_decay"; a shared param takes the AdamW role
        params = {}
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                if p_name in GATE_PARAM_NAMES or p.ndim < 2:
                    role = "no_decay"
                elif isinstance(module, nn.Linear) and p_name == "weight" and mod_name.split(".")[-1] != head_name:
                    role = "muon" if use_muon else "decay"
                else:  # embeddings, the output head, conv kernels, other >=2-D tensors
                    role = "decay"
                previous = roles.get(id(p))
                if previous is not None and previous != role:
                    role = "no_decay" if "no_decay" in (previous, role) else "decay"
                roles[id(p)], params[id(p)] = role, p
        groups = [
            dict(params=[params[i] for i, r in roles.items() if r == "muon"], use_muon=True),
            dict(params=[params[i] for i, r in roles.items() if r == "decay"], use_muon=False),
            dict(params=[params[i] for i, r in roles.items() if r == "no_decay"], use_muon=False, weight_decay=0.0),
        ]
        groups = [g for g in groups if g["params"]]
        attention = [(n, m) for n, m in model.named_modules() if _is_attention(m)]
        if track_max_logit or qk_clip_tau is not None:
            for _, m in attention:
                m.record_max_logit = True
        # one switch for every kernel: a model.Config's backend also picks the Newton-Schulz path
        kwargs.setdefault("ns_backend", getattr(getattr(model, "config", None), "backend", "auto"))
        return cls(groups, lr=lr, weight_decay=weight_decay, qk_clip_tau=qk_clip_tau,
                   attention_modules=attention, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon_update(group, params)
            else:
                self._adamw_update(group, params)
        self.qk_clip()
        return loss

    def _muon_update(self, group, params):
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        directions = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            directions.append(u.reshape(u.shape[0], -1))  # conv kernels [out, in, kh, kw] -> [out, in·kh·kw]
        for p, o in zip(params, self._orthogonalise(directions, group["ns_steps"])):
            p.mul_(1 - lr * wd)  # decoupled decay with the unscaled lr, before the update (as torch and Moonlight)
            p.add_(o.reshape(p.shape), alpha=-_adjusted_lr(lr, p.shape, group["adjust_lr"]))

    def _orthogonalise(self, mats, steps):
        """Newton-Schulz of every matrix, batched by shape. Under DDP rank r takes slice r of each
        zero-padded [n, A, B] stack and all_gather reassembles it, so every rank applies the same updates."""
        world, rank = _world()
        out = [None] * len(mats)
        by_shape = defaultdict(list)
        for i, m in enumerate(mats):
            by_shape[tuple(m.shape)].append(i)
        for idx in by_shape.values():
            stack = torch.stack([mats[i] for i in idx])        # [n, A, B]
            if world == 1:
                ortho = newton_schulz(stack, steps, self.ns_backend, self.ns_dtype)
            else:
                per_rank = math.ceil(len(idx) / world)
                pad = per_rank * world - len(idx)
                if pad:
                    stack = torch.cat([stack, stack.new_zeros(pad, *stack.shape[1:])])  # [per_rank·W, A, B]
                mine = newton_schulz(stack[rank * per_rank:(rank + 1) * per_rank], steps, self.ns_backend,
                                     self.ns_dtype).contiguous()
                gathered = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
                ortho = torch.cat(gathered)[:len(idx)]
            for j, i in enumerate(idx):
                out[i] = ortho[j]
        return out

    def _adamw_update(self, group, params):
        (beta1, beta2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

    @torch.no_grad()
    def qk_clip(self):
        """Clip every head whose recorded max logit (all-reduced with MAX across ranks) exceeds τ; fill
        last_clip_stats. Resets each module.max_logit, so a module that does not run is not clipped twice."""
        layers = [(n, m) for n, m in self.attention_modules if getattr(m, "max_logit", None) is not None]
        if not layers:
            self.last_clip_stats = None
            return
        flat = torch.cat([m.max_logit.detach().float().reshape(-1) for _, m in layers])  # [sum of n_head]
        world, _ = _world()
        if world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        # a few hundred floats: decide on the CPU, one device sync per step instead of several per layer
        per_layer = flat.cpu().split([m.n_head for _, m in layers])
        tau = self.qk_clip_tau
        clipped = [(s_max > tau) if tau is not None else torch.zeros_like(s_max, dtype=torch.bool)
                   for s_max in per_layer]
        for (_, m), s_max, mask in zip(layers, per_layer, clipped):
            if mask.any():
                self._clip_heads(m, s_max, mask, tau)
            m.max_logit = None
        self.last_clip_stats = {"layers": [name for name, _ in layers],
                                "max_logit": [s.max().item() for s in per_layer],
                                "clipped_heads": [int(mask.sum()) for mask in clipped],
                                "max_logit_per_head": [s.tolist() for s in per_layer]}

    @staticmethod
    def _clip_heads(m, s_max, clipped, tau):
        mha = m.n_kv_head == m.n_head
        device = (m.qkv if hasattr(m, "qkv") else m.q_proj).weight.device
        heads = clipped.nonzero().flatten().to(device)
        gamma = (tau / s_max[clipped]).to(device)              # < 1 for every clipped head
        # MHA: split γ evenly between q and k (K2); GQA: the query head takes all of γ, the shared key none
        for name in ("weight", "bias"):
            rows = _qk_head_rows(m, name)
            if rows is None:
                continue
            q_rows, k_rows = rows                              # [H, Dh, D], [Hkv, Dh, D] (bias: [.., Dh, 1])
            if mha:
                factor = gamma.sqrt().to(q_rows.dtype).view(-1, 1, 1)
                q_rows[heads] = q_rows[heads] * factor
                k_rows[heads] = k_rows[heads] * factor
            else:
                q_rows[heads] = q_rows[heads] * gamma.to(q_rows.dtype).view(-1, 1, 1)
