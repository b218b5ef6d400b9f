"""MuonClip: Muon's orthogonalised momentum for the hidden matrices, AdamW for the rest, and QK-Clip.

The optimizer behind Kimi K2 (arXiv 2507.20534), built on Muon at scale (Moonlight, arXiv 2502.16982).

Muon, for a hidden weight W [A, B] with gradient G (mu = 0.95):
    M  <- mu·M + (1 - mu)·G                        momentum (EMA form; same direction as the sum form)
    U  <- (1 - mu)·G + mu·M                        Nesterov look-ahead
    O  <- NewtonSchulz5(U)                         ≈ U·(UᵀU)^(-1/2): all singular values pushed to ~1
    W  <- W·(1 - lr·wd) - lr · 0.2·sqrt(max(A, B)) · O
The 0.2·sqrt(max(A, B)) factor gives O the update RMS of a typical AdamW step (~0.2), so AdamW's learning
rate and weight decay carry over ("match_rms_adamw"; Keller Jordan's sqrt(max(1, A/B)) is "original").

Newton-Schulz: after X <- U / ||U||_F (every singular value <= 1; tall matrices are transposed first so A
is the small side), five steps of
    X <- a·X + (b·A + c·A²)·X,   A = X·Xᵀ,   (a, b, c) = (3.4445, -4.7750, 2.0315)
map each singular value s through a·s + b·s³ + c·s⁵, into about [0.68, 1.13] (not exactly 1, which costs
nothing in training and saves steps).

QK-Clip, after every step: S_h is the largest scaled logit scale·q·k of softmax-attention head h over the
batch and all causal pairs (all pairs for the bidirectional ViT), recorded in the forward pass. If S_h > τ
(default 100), the head shrinks so its logits shrink by γ_h = τ / S_h:
    one key head per query head (MHA):   W_q rows of h  *= sqrt(γ_h),  W_k rows of h  *= sqrt(γ_h)
    grouped keys (GQA, H > Hkv):         W_q rows of h  *= γ_h,        the shared W_k is left alone
The GQA rule is ours (K2 uses MLA, whose shared rotary key is likewise left alone): each offending head
lands exactly on τ and every other head of the group stays bit-identical. Heads at or below τ, W_v, W_o
and the optimizer state are never touched; KDA layers (L2-normalised q/k) have no logits to clip. A fused
`qkv` projection (the ViT's) has its q and k row blocks scaled as separate W_q and W_k would be.

Which parameter goes where (MuonClip.from_model walks model.named_modules()):
    nn.Linear weights                                      -> Muon
    the output head ("lm_head"), embeddings, conv weights  -> AdamW with weight decay
    1-D params (norm gains, biases) and KDA gates (A_log, dt_bias) -> AdamW, no weight decay
A parameter shared by two modules (tied embedding/head) goes to AdamW.

Bench: python bench.py muonclip     (Newton-Schulz, max logit, the optimizer step)
Tests: python -m pytest tests/test_muonclip.py -q
"""
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
GATE_PARAM_NAMES = ("A_log", "dt_bias")  # KDA decay-gate parameters: AdamW, no weight decay
BACKENDS = ("auto", "ref", "triton")


# ---------------------------------------------------------------------------------------------------
# Newton-Schulz: the reference and the fast path

def _require(ok: bool, message: str, error=ValueError):
    """The argument checks below, one line each: stop with `message` at the API boundary."""
    if not ok:
        raise error(message)


def _check_ns_args(G, steps, backend):
    _require(isinstance(G, torch.Tensor) and G.ndim >= 2, "newton_schulz: G must be a tensor with at least 2 dims "
             f"[..., rows, cols], got {tuple(G.shape) if isinstance(G, torch.Tensor) else type(G).__name__}")
    _require(G.is_floating_point(), f"newton_schulz: G must be floating point, got {G.dtype}", TypeError)
    _require(isinstance(steps, int) and steps >= 0, f"newton_schulz: steps must be a non-negative int, got {steps!r}")
    _require(backend in BACKENDS, f"newton_schulz: backend must be 'auto', 'ref' or 'triton', got {backend!r}")


def newton_schulz_ref(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None,
                      coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = NS_EPS) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of G [..., rows, cols], batched over leading dims.

    dtype: the working precision; None means bfloat16 on CUDA (Muon's speed path) and float32 on CPU.
    Returns a tensor of that dtype and G's shape whose singular values lie in about [0.68, 1.13].
    The op order (addmm-style b·A + c·A·A, then a·X + B·X) follows torch.optim.Muon's routine.
    """
    _check_ns_args(G, steps, "ref")
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
    """Newton-Schulz with the symmetric Triton kernels (kernels/newton_schulz.py) or the reference.

    backend "auto": Triton for CUDA tensors, the reference for CPU tensors; "triton" on a CPU tensor
    runs the kernels under the Triton interpreter (slow; used by the tests).
    """
    _check_ns_args(G, steps, backend)
    if backend == "ref" or (backend == "auto" and not G.is_cuda):
        return newton_schulz_ref(G, steps, dtype, coeffs, eps)
    from kernels.newton_schulz import newton_schulz_triton
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    return newton_schulz_triton(G, steps, coeffs, eps, dtype)


# ---------------------------------------------------------------------------------------------------
# Per-head max logit (what QK-Clip reads): reference, online Triton kernel, fused attention that returns it

def _check_max_logit_args(q, k, scale, backend):
    _require(isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.ndim == 4 and k.ndim == 4,
             "max_logit: q must be [B, H, T, Dh] and k [B, Hkv, T, Dh] tensors, got "
             f"{getattr(q, 'shape', type(q))} and {getattr(k, 'shape', type(k))}")
    (B, H, T, Dh), (Bk, Hkv, Tk, Dk) = q.shape, k.shape
    _require((B, T, Dh) == (Bk, Tk, Dk), f"max_logit: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in B, T, Dh")
    _require(Hkv > 0 and H % Hkv == 0, f"max_logit: n_head {H} must be a multiple of n_kv_head {Hkv}")
    _require(T > 0 and B > 0, f"max_logit: empty input {tuple(q.shape)}")
    _require(q.is_floating_point() and q.dtype == k.dtype,
             f"max_logit: q and k must share a floating dtype, got {q.dtype} and {k.dtype}", TypeError)
    _require(q.device == k.device, f"max_logit: q on {q.device} but k on {k.device}")
    _require(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0,
             f"max_logit: scale must be a positive finite number, got {scale!r}")
    _require(backend in BACKENDS, f"max_logit: backend must be 'auto', 'ref' or 'triton', got {backend!r}")


def max_logit_ref(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    """Max of scale·q·kᵀ per (batch, head), from the explicit T x T logits, in float32.

    q [B, H, T, Dh], k [B, Hkv, T, Dh]; query head h reads key head h // (H // Hkv). Returns [B, H].
    causal=True takes the max over pairs j <= i only (a decoder); False over all pairs (the ViT).
    """
    _check_max_logit_args(q, k, scale, "ref")
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
    _check_max_logit_args(q, k, scale, backend)
    if backend == "ref" or (backend == "auto" and not q.is_cuda):
        return max_logit_ref(q, k, scale, causal)
    from kernels.max_logit import max_logit_triton
    return max_logit_triton(q.detach(), k.detach(), float(scale), causal)


def fused_attention(backend: str, q: torch.Tensor) -> bool:
    """Whether a training forward that records max logits runs attention_max_logit (one pass) instead of
    SDPA + max_logit: the backend resolves to Triton (auto: CUDA, head dim within the kernel's 128)."""
    return backend == "triton" or (backend == "auto" and q.is_cuda and q.shape[-1] <= 128)


def attention_max_logit(q, k, v, scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention o [B, H, T, Dh] of q [B, H, T, Dh] over k, v [B, Hkv, T, Dh] (causal or all pairs)
    and the per-head max logit [B, H] in one Triton pass (kernels/attention.py): the online softmax's row
    maxima are the logits' row maxima, so no second QKᵀ. Differentiable in q, k, v (not the max logit)."""
    from kernels.attention import attention_max_logit_triton
    return attention_max_logit_triton(q, k, v, scale, causal)


# ---------------------------------------------------------------------------------------------------
# The optimizer

def _is_attention(module: nn.Module) -> bool:
    """Duck typing: a softmax-attention module that reports per-head max logits (q_proj/k_proj or one qkv)."""
    return ((hasattr(module, "q_proj") and hasattr(module, "k_proj")) or hasattr(module, "qkv")) and \
        all(hasattr(module, a) for a in ("n_head", "n_kv_head", "head_dim", "record_max_logit"))


def _qk_head_rows(m: nn.Module, name: str):
    """Views [H, Dh, ...] of the query rows and [Hkv, Dh, ...] of the key rows of m's `name` tensor
    ("weight" or "bias"), or None when m's projections have no such tensor. A fused qkv projection
    lays its output features out as (3, H, Dh): q, then k, then v."""
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
    """Muon for groups with use_muon=True, AdamW for the others, then QK-Clip on the attention modules.

    Build it with MuonClip.from_model(model, lr=..., weight_decay=...), or pass param groups yourself (each
    may set "use_muon"; when absent, params with ndim >= 2 go to Muon). qk_clip_tau: τ, or None for plain
    Muon. After each step, self.last_clip_stats is None (no attention module ran) or
        {"layers": [name, ...], "max_logit": [float per layer, max over heads, before the clip],
         "clipped_heads": [int per layer], "max_logit_per_head": [[float per head] per layer]}.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr: str = "match_rms_adamw",
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 qk_clip_tau: float | None = 100.0, attention_modules=(), ns_backend: str = "auto",
                 ns_dtype: torch.dtype | None = None):
        _require(isinstance(lr, (int, float)) and lr >= 0, f"MuonClip: lr must be a number >= 0, got {lr!r}")
        _require(isinstance(weight_decay, (int, float)) and weight_decay >= 0,
                 f"MuonClip: weight_decay must be >= 0, got {weight_decay!r}")
        _require(0.0 <= momentum < 1.0, f"MuonClip: momentum must be in [0, 1), got {momentum!r}")
        _require(adjust_lr in ("match_rms_adamw", "original"),
                 f"MuonClip: adjust_lr must be 'match_rms_adamw' or 'original', got {adjust_lr!r}")
        _require(len(adamw_betas) == 2 and all(0.0 <= beta < 1.0 for beta in adamw_betas),
                 f"MuonClip: adamw_betas must be two numbers in [0, 1), got {adamw_betas!r}")
        _require(qk_clip_tau is None or (isinstance(qk_clip_tau, (int, float)) and qk_clip_tau > 0),
                 f"MuonClip: qk_clip_tau must be a positive number or None, got {qk_clip_tau!r}")
        _require(ns_backend in BACKENDS, f"MuonClip: ns_backend must be 'auto', 'ref' or 'triton', got {ns_backend!r}")
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
        """Route a model's parameters (see the module docstring) and hook up its attention modules.

        use_muon=False: every parameter to AdamW with the same decay rules (the AdamW baseline, with
        qk_clip_tau=None). track_max_logit: max logits are reported even when nothing is clipped.
        ns_backend defaults to model.config.backend (model.Config.backend governs every kernel)."""
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
        """Newton-Schulz of every matrix, batched by shape; under torch.distributed each rank does a share:
        same-shape matrices are stacked [n, A, B] and padded to a multiple of the W ranks (zero matrices stay
        zero), rank r orthogonalises slice r, and all_gather reassembles the stack, so every rank applies the
        same updates (grads are identical after DDP's all-reduce)."""
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
        """Clip every head whose recorded max logit exceeds τ (see the module docstring); fill last_clip_stats.
        Called at the end of step(). Reads each module.max_logit ([n_head] float32, all-reduced with MAX
        across ranks so every rank clips alike) and resets it to None: a module that does not run in the
        next step is not clipped twice with stale numbers."""
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
