"""Attention Residuals (AttnRes): each sublayer reads a softmax mix of all earlier outputs along depth.

A standard PreNorm residual stream adds every sublayer output with weight 1: h_l = v_0 + Σ_{i<l} v_i,
where v_0 is the token embedding and v_i the raw output of sublayer i. AttnRes (Kimi Team, Moonshot
AI, arXiv 2603.15031) replaces that fixed sum by attention over depth, per token:

    h_l = Σ_{i<l} α_{i→l} v_i        α_{·→l} = softmax_i( w_l · RMSNorm(v_i) )

    w_l   a learned pseudo-query per sublayer ([D], input-independent, initialised to ZERO)
    keys  the RMS-normalised sources (own gain per sublayer), values the raw sources
    no 1/sqrt(D) and no temperature; the scale lives in |w_l|

Every sublayer (attention or KDA, and MLP, separately) has its own (w_l, key gain); the sublayer still
applies its usual PreNorm to h_l, and one more query reads all sources before the final norm. At
zero init the weights are uniform, h_l = (standard residual stream) / l, and since RMSNorm ignores
scale the model computes the PreNorm baseline's function (up to eps): a property the tests check.

Block AttnRes keeps fewer sources: b_0 = embedding, b_n = sum of the outputs of the sublayers in
block n (block_size sublayers each). The first sublayer of a block sees completed blocks only, later
ones also the block's partial sum. Block size 1 is full AttnRes. The paper finds ~8 blocks (block size
4 at its ablation depth) recovers most of the gain: val loss 1.766 baseline, 1.746 block, 1.737 full.

Two-phase computation (paper §4): the queries do not depend on the input, so all queries of a block
can read the completed blocks in one batched pass (phase 1, returns output, max and log-sum-exp);
each sublayer then merges in its intra-block sources with an online-softmax merge (phase 2). With a
single new source the merge is a sigmoid lerp: h = o1 + σ(s_new - lse1) (v_new - o1). Exact.

The fused op lives in kernels/attnres.py (one pass over the sources, online softmax, float32
accumulation; the backward recomputes keys instead of saving float32 intermediates).

    python bench.py attnres                 # eager vs torch.compile vs the fused Triton op
    python experiments/attnres_compare.py   # trains the three residuals; draws the depth-attention heatmaps
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import attnres as attnres_kernels

BACKENDS = ("auto", "ref", "triton")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------
# Input checks: one clear line at the API boundary instead of a traceback from inside a kernel


def _source_list(sources, D: int) -> list:
    """A list of N tensors [..., D] or one tensor [N, ..., D] -> the checked list of N tensors [..., D]
    (the fused path saves those, not a stacked copy)."""
    if isinstance(sources, (list, tuple)):
        if len(sources) == 0:
            raise ValueError("sources is an empty list: AttnRes needs at least one source")
        if not all(isinstance(s, torch.Tensor) for s in sources):
            raise TypeError("sources must be a tensor [N, ..., D] or a list of tensors [..., D]")
        first = sources[0]
        for i, s in enumerate(sources):
            if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
                raise ValueError(f"sources[{i}] is {tuple(s.shape)} {s.dtype} on {s.device}, but sources[0] "
                                 f"is {tuple(first.shape)} {first.dtype} on {first.device}")
        if first.dim() < 1:
            raise ValueError("each source must have a last dimension D")
        shape, dtype = (len(sources), *first.shape), first.dtype
    elif isinstance(sources, torch.Tensor):
        shape, dtype = tuple(sources.shape), sources.dtype
    else:
        raise TypeError(f"sources must be a tensor or a list of tensors, got {type(sources).__name__}")
    if len(shape) < 2:
        raise ValueError(f"sources must be [N, ..., D] with at least 2 dims, got shape {shape}")
    if shape[0] < 1:
        raise ValueError("sources has N=0: AttnRes needs at least one source")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"sources dtype {dtype} is not supported; use float32, bfloat16 or float16")
    if shape[-1] != D:
        raise ValueError(f"sources last dim {shape[-1]} != query dim {D}")
    return list(sources) if isinstance(sources, (list, tuple)) else list(sources.unbind(0))


def _check_vectors(name: str, t, D: int, device, rows: int | None = None):
    want = (D,) if rows is None else (rows, D)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape {want}, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the sources are on {device}")


def _check_common(eps, backend):
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)}")


def _check_inputs(query, sources, norm_weight, eps, backend, many=False) -> list:
    """Every check of the three ops, once: eps and backend, query [D] (many: queries [S, D]), sources,
    and the key gain(s) of the query's shape. Returns the checked list of N sources [..., D]."""
    _check_common(eps, backend)
    q_name, g_name = ("queries", "norm_weights") if many else ("query", "norm_weight")
    if not isinstance(query, torch.Tensor) or query.dim() != (2 if many else 1):
        want = "a 2-D tensor [S, D]" if many else "a 1-D tensor [D]"
        raise ValueError(f"{q_name} must be {want}, got {getattr(query, 'shape', type(query).__name__)}")
    D, rows = query.shape[-1], (query.shape[0] if many else None)
    srcs = _source_list(sources, D)
    _check_vectors(q_name, query, D, srcs[0].device, rows)
    _check_vectors(g_name, norm_weight, D, srcs[0].device, rows)
    return srcs


def _use_triton(backend: str, sources: torch.Tensor) -> bool:
    if backend == "ref":
        return False
    if backend == "auto":
        return sources.is_cuda and sources.shape[-1] <= attnres_kernels.MAX_D
    if not sources.is_cuda and not attnres_kernels.INTERPRET:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    if sources.shape[-1] > attnres_kernels.MAX_D:
        raise ValueError(f"backend='triton' supports D <= {attnres_kernels.MAX_D}, got D={sources.shape[-1]}")
    return True


# ----------------------------------------------------------------------------------------------------
# The op: reference (plain PyTorch, float32 math) and the fused path


def _attnres_math(query, sources, norm_weight, eps):
    """float32 reference math; returns (out [..., D] in the sources' dtype, weights [N, ...] fp32)."""
    with torch.autocast(sources.device.type, enabled=False):  # bf16 autocast would round the logits
        values = sources.float()                                              # [N, ..., D]
        keys = F.rms_norm(values, (values.shape[-1],), weight=norm_weight.float(), eps=eps)
        logits = keys @ query.float()                                        # [N, ...]
        weights = torch.softmax(logits, dim=0)
        out = (weights.unsqueeze(-1) * values).sum(dim=0)                    # [..., D]
    return out.to(sources.dtype), weights


def _attnres_math_list(query, srcs, norm_weight, eps):
    """The same math over a list of sources without stacking them. RMSNorm's gain folds into the query,
    q · (g ⊙ v / rms(v)) = (g ⊙ q) · v / rms(v), so each read keeps only per-token scalars besides the
    sources themselves, which every read shares: autograd saves each [..., D] source once (O(L) for L
    sublayers instead of a stacked copy per read, O(L²)). Float32 sources are not copied."""
    with torch.autocast(srcs[0].device.type, enabled=False):
        folded = query.float() * norm_weight.float()                           # [D]
        values = [v.float() for v in srcs]                                     # N x [..., D]
        logits = torch.stack([(v @ folded) * torch.rsqrt(v.pow(2).mean(-1) + eps) for v in values])  # [N, ...]
        weights = torch.softmax(logits, dim=0)
        out = sum(w.unsqueeze(-1) * v for w, v in zip(weights, values))       # [..., D]
    return out.to(srcs[0].dtype), weights


def attnres_ref(query, sources, norm_weight, eps=1e-6, return_weights=False):
    """h = Σ_i softmax_i(query · RMSNorm(v_i; norm_weight)) v_i.

    query [D], sources [N, ..., D] or a list of N tensors [..., D], norm_weight [D].
    Returns h [..., D] in the sources' dtype (and the weights [N, ...] in float32 if asked)."""
    srcs = _check_inputs(query, sources, norm_weight, eps, "ref")
    sources = sources if isinstance(sources, torch.Tensor) else torch.stack(srcs)   # [N, ..., D]
    out, weights = _attnres_math(query, sources, norm_weight, eps)
    return (out, weights) if return_weights else out


def attnres(query, sources, norm_weight, eps=1e-6, return_weights=False, backend="auto"):
    """Same as attnres_ref; backend 'triton' (default on CUDA) runs the fused forward and backward."""
    srcs = _check_inputs(query, sources, norm_weight, eps, backend)          # N x [..., D]
    if not _use_triton(backend, srcs[0]):
        out, weights = _attnres_math_list(query, srcs, norm_weight, eps)
        return (out, weights) if return_weights else out
    D = query.shape[0]
    folded = (query.float() * norm_weight.float()).unsqueeze(0)               # [1, D]: gain folded into q
    out, _, lse = attnres_kernels.attnres_triton([s.reshape(-1, D) for s in srcs], folded, eps)  # [1, M, D]
    out = out.reshape(srcs[0].shape)                                         # [..., D]
    if not return_weights:
        return out
    sources = torch.stack(srcs).detach()                                     # [N, ..., D]
    with torch.no_grad(), torch.autocast(sources.device.type, enabled=False):
        # for plots only: recompute the logits, reuse the kernel's log-sum-exp
        keys = F.rms_norm(sources.float(), (D,), eps=eps)
        weights = torch.exp(keys @ folded[0] - lse.reshape(sources.shape[1:-1]))
    return out, weights


def attnres_stats(queries, sources, norm_weights, eps=1e-6, backend="auto"):
    """Phase 1 of two-phase AttnRes: S queries against the same sources in one pass.

    queries [S, D], sources [N, ..., D] or a list, norm_weights [S, D] (one key gain per query).
    Returns (out [S, ..., D] normalised, max [S, ...], lse [S, ...]); max and lse in float32."""
    srcs = _check_inputs(queries, sources, norm_weights, eps, backend, many=True)   # N x [..., D]
    S, D = queries.shape
    folded = queries.float() * norm_weights.float()                          # [S, D]
    lead = srcs[0].shape[:-1]
    if _use_triton(backend, srcs[0]):
        out, mx, lse = attnres_kernels.attnres_triton([s.reshape(-1, D) for s in srcs], folded, eps)
        return out.reshape(S, *lead, D), mx.reshape(S, *lead), lse.reshape(S, *lead)
    sources = torch.stack(srcs)                                              # [N, ..., D]
    with torch.autocast(sources.device.type, enabled=False):
        values = sources.float()                                              # [N, ..., D]
        keys = F.rms_norm(values, (D,), eps=eps)
        logits = torch.einsum("n...d,sd->sn...", keys, folded)               # [S, N, ...]
        mx = logits.amax(dim=1)
        lse = torch.logsumexp(logits, dim=1)
        weights = torch.exp(logits - lse.unsqueeze(1))
        out = torch.einsum("sn...,n...d->s...d", weights, values)            # [S, ..., D]
    return out.to(sources.dtype), mx.detach(), lse


def merge_partial_attention(out1, lse1, out2, lse2):
    """Phase 2: combine two softmax-normalised partial results over disjoint source sets.

    (e^{lse1} out1 + e^{lse2} out2) / (e^{lse1} + e^{lse2}) = out1 + σ(lse2 - lse1) (out2 - out1)."""
    gate = torch.sigmoid(lse2.float() - lse1.float()).unsqueeze(-1)
    merged = out1.float() + gate * (out2.float() - out1.float())
    return merged.to(out1.dtype), torch.logaddexp(lse1.float(), lse2.float())


# ----------------------------------------------------------------------------------------------------
# The residual stream


class AttnResStream(nn.Module):
    """Runs a list of sublayers with Attention Residuals in place of x = x + f(x).

    stream(embedding [B, T, D], sublayers) -> h [B, T, D], the aggregated representation before the
    final norm. sublayers: n_sublayers callables f(h [B, T, D]) -> [B, T, D], each with its own PreNorm.
    block_size None = full AttnRes; an int = Block AttnRes with that many sublayers per block.
    two_phase groups the queries of a block (full: of `two_phase_group` sublayers) in one pass.
    Depth attention is per token, so the same call serves one-token decode steps (the sublayers keep
    their own caches)."""

    def __init__(self, n_sublayers: int, d_model: int, block_size: int | None = None, eps: float = 1e-6,
                 backend: str = "auto", two_phase_group: int = 4):
        super().__init__()
        if not (isinstance(n_sublayers, int) and n_sublayers >= 1):
            raise ValueError(f"n_sublayers must be a positive int, got {n_sublayers!r}")
        if not (isinstance(d_model, int) and d_model >= 1):
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if block_size is not None and not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"block_size must be None (full AttnRes) or a positive int, got {block_size!r}")
        if not (isinstance(two_phase_group, int) and two_phase_group >= 1):
            raise ValueError(f"two_phase_group must be a positive int, got {two_phase_group!r}")
        _check_common(eps, backend)
        self.n_sublayers, self.d_model, self.block_size = n_sublayers, d_model, block_size
        self.eps, self.backend, self.two_phase_group = eps, backend, two_phase_group
        # one query and one key gain per sublayer, plus one pair for the final read; kept as 1-D
        # parameters so optimizers that route matrices to Muon send these to AdamW
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(d_model)) for _ in range(n_sublayers + 1))
        self.key_norms = nn.ParameterList(nn.Parameter(torch.ones(d_model)) for _ in range(n_sublayers + 1))

    def extra_repr(self):
        kind = "full" if self.block_size is None else f"block_size={self.block_size}"
        return f"n_sublayers={self.n_sublayers}, d_model={self.d_model}, {kind}, eps={self.eps}"

    def sources_per_read(self) -> list[int]:
        """How many sources each of the n_sublayers + 1 depth-attention reads mixes (for FLOP counts)."""
        if self.block_size is None:
            return list(range(1, self.n_sublayers + 2))                  # read l sees v_0 .. v_l
        return [1 + l // self.block_size + (l % self.block_size > 0) for l in range(self.n_sublayers)] + \
               [1 + math.ceil(self.n_sublayers / self.block_size)]

    def flops_per_token(self) -> int:
        """Forward FLOPs per token of all reads: per source a D-long logit and a D-long weighted sum."""
        return sum(4 * n * self.d_model for n in self.sources_per_read())

    def _read(self, l: int, sources: list, weights: list | None):
        """Sublayer l's depth attention over `sources` (list of [B, T, D])."""
        if weights is None:
            return attnres(self.queries[l], sources, self.key_norms[l], self.eps, backend=self.backend)
        h, w = attnres(self.queries[l], sources, self.key_norms[l], self.eps, True, self.backend)
        weights.append(w.detach().flatten(1).mean(dim=1))                    # [N_sources], token average
        return h

    @staticmethod
    def _call(l, f, h, like):
        """Sublayer l on h. Its output joins the stream in the embedding's dtype: under bf16 autocast
        the embedding is float32 and so is the sum a standard residual would keep."""
        out = f(h)
        if not isinstance(out, torch.Tensor) or out.shape != like.shape:
            raise ValueError(f"sublayer {l} returned {getattr(out, 'shape', type(out).__name__)}, "
                             f"expected {tuple(like.shape)}")
        return out.to(like.dtype)

    def forward(self, embedding, sublayers, return_weights=False, two_phase=False):
        if not isinstance(embedding, torch.Tensor) or embedding.dim() < 2 or embedding.shape[-1] != self.d_model:
            raise ValueError(f"embedding must be [..., {self.d_model}], got {getattr(embedding, 'shape', None)}")
        if len(sublayers) != self.n_sublayers:
            raise ValueError(f"expected {self.n_sublayers} sublayers, got {len(sublayers)}")
        weights = [] if return_weights else None
        if two_phase:
            h = self._forward_two_phase(embedding, sublayers, weights)
        elif self.block_size is None:
            h = self._forward_full(embedding, sublayers, weights)
        else:
            h = self._forward_block(embedding, sublayers, weights)
        return (h, weights) if return_weights else h

    def _forward_full(self, embedding, sublayers, weights):
        sources = [embedding]                                                # v_0, v_1, ..., v_l
        for l, f in enumerate(sublayers):
            sources.append(self._call(l, f, self._read(l, sources, weights), embedding))
        return self._read(self.n_sublayers, sources, weights)

    def _forward_block(self, embedding, sublayers, weights):
        completed, partial = [embedding], None                               # [b_0, ..., b_{n-1}], b_n^i
        for l, f in enumerate(sublayers):
            if l > 0 and l % self.block_size == 0:                           # a block just finished
                completed, partial = completed + [partial], None
            sources = completed if partial is None else completed + [partial]
            out = self._call(l, f, self._read(l, sources, weights), embedding)
            partial = out if partial is None else partial + out
        return self._read(self.n_sublayers, completed + [partial], weights)

    def _forward_two_phase(self, embedding, sublayers, weights):
        """Phase 1 per group: all its queries against the sources before the group, in one pass.
        Phase 2 per sublayer: merge with the sources produced inside the group (online softmax).
        Block AttnRes: a group is a block and its only intra-group source is the partial sum.
        Full AttnRes: groups of two_phase_group sublayers; intra-group sources are their outputs."""
        group = self.block_size or self.two_phase_group
        before = [embedding]                        # sources visible to every sublayer of the group
        for start in range(0, self.n_sublayers, group):
            ids = list(range(start, min(start + group, self.n_sublayers)))
            q = torch.stack([self.queries[l] for l in ids])                  # [S, D]
            g = torch.stack([self.key_norms[l] for l in ids])                # [S, D]
            out1, _, lse1 = attnres_stats(q, before, g, self.eps, self.backend)  # [S, B, T, D], [S, B, T]
            inside = []                             # sources produced inside this group so far
            for j, l in enumerate(ids):
                if not inside:
                    h = out1[j]
                else:
                    out2, _, lse2 = attnres_stats(q[j:j + 1], inside, g[j:j + 1], self.eps, self.backend)
                    h, _ = merge_partial_attention(out1[j], lse1[j], out2[0], lse2[0])
                if weights is not None:
                    self._record_weights(l, before + inside, weights)
                out = self._call(l, sublayers[l], h, embedding)
                if self.block_size is None:
                    inside.append(out)
                else:
                    inside = [out if not inside else inside[0] + out]        # the block's partial sum
            before = before + inside
        return self._read(self.n_sublayers, before, weights)

    @torch.no_grad()
    def _record_weights(self, l, sources, weights):
        _, w = attnres_ref(self.queries[l].detach(), [s.detach() for s in sources], self.key_norms[l].detach(),
                           self.eps, return_weights=True)
        weights.append(w.flatten(1).mean(dim=1))
