"""Attention Residuals (AttnRes, Kimi Team, arXiv 2603.15031): softmax attention over depth, per token.

A PreNorm stream sums every output, h_l = v_0 + Σ_{i<l} v_i (v_0 the embedding, v_i sublayer i's raw
output). AttnRes weighs them with a learned pseudo-query w_l = queries[l] (zero init) against the
RMS-normalised sources with gain g_l = key_norms[l]; no 1/sqrt(D), no temperature:

    h_l = Σ_{i<l} α_{i→l} v_i        α_{·→l} = softmax_i( w_l · RMSNorm(v_i; g_l) )

At zero init α is uniform and h_l = (PreNorm stream) / l: the model is the PreNorm baseline. Block
AttnRes (block_size S) reads b_0 = v_0, the completed block sums b_n = Σ_{i in block n} v_i and the
current block's partial sum (S = 1: full AttnRes). Two-phase (decoding): one read of the completed
blocks for all of a block's queries (attnres_stats -> o1, lse1), then each sublayer merges its
intra-block part (o2, lse2): h = o1 + σ(lse2 - lse1) (o2 - o1). kernels/attnres.py is the fused op.

Run:   python experiments/attnres_compare.py --jobs 2   (the README table: ~2 h on 2 CPU cores; --quick: seconds)
Test:  python -m pytest tests/test_attnres.py -q
Bench: python bench.py attnres
"""
import math

import torch
import torch.nn as nn

from kernels import attnres as attnres_kernels
from kernels.launch import BACKENDS, require, use_triton


# ----------------------------------------------------------------------------------------------------
# The op: reference (plain PyTorch, float32 math) and the fused path


def attnres_ref(query, sources, norm_weight, eps=1e-6, return_weights=False, return_stats=False):
    """h = Σ_i softmax_i(query · RMSNorm(v_i; norm_weight)) v_i; query [D], norm_weight [D], sources
    [N, ..., D] or a list of N [..., D]. Returns h [..., D] in the sources' dtype, and the weights
    [N, ...] (return_weights) or the logits' max and log-sum-exp [...] (return_stats), float32."""
    srcs = _checked(query, sources, norm_weight, eps)                        # N x [..., D]
    # bf16 autocast would round the logits. The gain folds into the query, q · (g ⊙ v / rms(v)) =
    # (g ⊙ q) · v / rms(v), so a read keeps per-token scalars besides the sources, which every read
    # shares: autograd saves each source once (O(L) for L sublayers, not a stacked copy per read)
    with torch.autocast(srcs[0].device.type, enabled=False):
        folded = query.float() * norm_weight.float()                           # [D]
        values = [v.float() for v in srcs]                                     # float32 sources not copied
        logits = torch.stack([(v @ folded) * torch.rsqrt(v.pow(2).mean(-1) + eps) for v in values])  # [N, ...]
        weights = torch.softmax(logits, dim=0)
        out = sum(w.unsqueeze(-1) * v for w, v in zip(weights, values))       # [..., D]
    out = out.to(srcs[0].dtype)
    if return_stats:
        return out, logits.detach().amax(0), torch.logsumexp(logits, 0)
    return (out, weights) if return_weights else out


def _fused(queries, norm_weights, srcs, eps):
    # the Triton op for S queries [S, D]: (out [S, M, D], max [S, M], lse [S, M]) over M tokens
    D = queries.shape[-1]
    folded = queries.float() * norm_weights.float()                          # [S, D]: gain folded into q
    return attnres_kernels.attnres_triton([s.reshape(-1, D) for s in srcs], folded, eps)


def _triton(backend, srcs) -> bool:
    D = srcs[0].shape[-1]
    return use_triton(backend, srcs[0].is_cuda, D <= attnres_kernels.MAX_D, "attnres",
                      f"D <= {attnres_kernels.MAX_D}, got D={D}")


def attnres(query, sources, norm_weight, eps=1e-6, return_weights=False, backend="auto"):
    """attnres_ref, or (backend 'triton', the default on CUDA) the fused forward and backward."""
    srcs = _checked(query, sources, norm_weight, eps)
    if not _triton(backend, srcs):
        return attnres_ref(query, srcs, norm_weight, eps, return_weights)
    out = _fused(query[None], norm_weight[None], srcs, eps)[0].reshape(srcs[0].shape)   # [..., D]
    if not return_weights:
        return out
    with torch.no_grad():                                                    # for plots only
        return out, attnres_ref(query, srcs, norm_weight, eps, return_weights=True)[1]


def attnres_stats(queries, sources, norm_weights, eps=1e-6, backend="auto"):
    """Phase 1 of two-phase AttnRes: queries [S, D] with key gains norm_weights [S, D] read the same
    sources -> (out [S, ..., D], max [S, ...], lse [S, ...]); gradients flow through out and lse."""
    srcs = _checked(queries, sources, norm_weights, eps, many=True)
    if not _triton(backend, srcs):
        reads = [attnres_ref(q, srcs, g, eps, return_stats=True) for q, g in zip(queries, norm_weights)]
        return tuple(torch.stack(parts) for parts in zip(*reads))
    lead = (queries.shape[0], *srcs[0].shape[:-1])                           # [S, ...]
    out, mx, lse = _fused(queries, norm_weights, srcs, eps)
    return out.reshape(*lead, queries.shape[-1]), mx.reshape(lead), lse.reshape(lead)


def merge_partial_attention(out1, lse1, out2, lse2):
    """Phase 2, two softmax-normalised reads of disjoint sources -> (one read over both, its lse):
    (e^{lse1} out1 + e^{lse2} out2) / (e^{lse1} + e^{lse2}) = out1 + σ(lse2 - lse1) (out2 - out1)."""
    gate = torch.sigmoid(lse2.float() - lse1.float()).unsqueeze(-1)
    merged = out1.float() + gate * (out2.float() - out1.float())
    return merged.to(out1.dtype), torch.logaddexp(lse1.float(), lse2.float())


def _checked(query, sources, norm_weight, eps, many=False) -> list:
    # the ops' checks at the API boundary; returns the sources as a list of N tensors [..., D]
    q_name, g_name, want = ("queries", "norm_weights", "a 2-D tensor [S, D]") if many else \
        ("query", "norm_weight", "a 1-D tensor [D]")
    require(isinstance(eps, (int, float)) and eps > 0, f"eps must be a positive number, got {eps!r}")
    require(isinstance(query, torch.Tensor) and query.dim() == 1 + many,
            f"{q_name} must be {want}, got {getattr(query, 'shape', type(query).__name__)}")
    if isinstance(sources, torch.Tensor):
        require(sources.dim() >= 2, f"sources must be [N, ..., D] with at least 2 dims, got {tuple(sources.shape)}")
        sources = sources.unbind(0)
    require(isinstance(sources, (list, tuple)) and all(isinstance(s, torch.Tensor) for s in sources),
            "sources must be a tensor [N, ..., D] or a list of tensors [..., D]", TypeError)
    require(len(sources) > 0, "sources is empty: AttnRes needs at least one source")
    s0, D = sources[0], query.shape[-1]
    for i, s in enumerate(sources):
        if (s.shape, s.dtype, s.device) != (s0.shape, s0.dtype, s0.device):
            raise ValueError(f"sources[{i}] is {tuple(s.shape)} {s.dtype} on {s.device}, but sources[0] is "
                             f"{tuple(s0.shape)} {s0.dtype} on {s0.device}")
    require(s0.dtype in (torch.float32, torch.bfloat16, torch.float16),
            f"sources dtype {s0.dtype} is not supported; use float32, bfloat16 or float16", TypeError)
    require(s0.dim() >= 1, "each source must have a last dimension D")
    require(s0.shape[-1] == D, f"sources last dim {s0.shape[-1]} != query dim {D}")
    for name, t in ((q_name, query), (g_name, norm_weight)):
        require(isinstance(t, torch.Tensor) and t.is_floating_point(), f"{name} must be a floating-point "
                f"tensor, got {getattr(t, 'dtype', type(t).__name__)}", TypeError)
        require(t.shape == query.shape and t.device == s0.device, f"{name} must have shape "
                f"{tuple(query.shape)} on {s0.device}, got {tuple(t.shape)} on {t.device}")
    return list(sources)


# ----------------------------------------------------------------------------------------------------
# The residual stream


class AttnResStream(nn.Module):
    """Sublayers with AttnRes in place of x = x + f(x): stream(embedding [B, T, D], sublayers) -> h
    [B, T, D] before the final norm; each f(h) applies its own PreNorm. block_size None = full AttnRes.
    two_phase reads a block (full: two_phase_group sublayers) at once; per token, so decode steps too."""

    def __init__(self, n_sublayers: int, d_model: int, block_size: int | None = None, eps: float = 1e-6,
                 backend: str = "auto", two_phase_group: int = 4):
        super().__init__()
        require(isinstance(n_sublayers, int) and n_sublayers >= 1,
                f"n_sublayers must be a positive int, got {n_sublayers!r}")
        require(isinstance(d_model, int) and d_model >= 1, f"d_model must be a positive int, got {d_model!r}")
        require(block_size is None or (isinstance(block_size, int) and block_size >= 1),
                f"block_size must be None (full AttnRes) or a positive int, got {block_size!r}")
        require(isinstance(two_phase_group, int) and two_phase_group >= 1,
                f"two_phase_group must be a positive int, got {two_phase_group!r}")
        require(isinstance(eps, (int, float)) and eps > 0, f"eps must be a positive number, got {eps!r}")
        require(backend in BACKENDS, f"AttnResStream: backend must be 'auto', 'ref' or 'triton', got {backend!r}")
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
        # how many sources each of the n_sublayers + 1 reads mixes (for FLOP counts)
        if self.block_size is None:
            return list(range(1, self.n_sublayers + 2))                  # read l sees v_0 .. v_l
        return [1 + l // self.block_size + (l % self.block_size > 0) for l in range(self.n_sublayers)] + \
               [1 + math.ceil(self.n_sublayers / self.block_size)]

    def flops_per_token(self) -> int:
        # forward FLOPs of all reads: per source a D-long logit and a D-long weighted sum
        return sum(4 * n * self.d_model for n in self.sources_per_read())

    def _read(self, l: int, sources: list, weights: list | None):
        # sublayer l's depth attention over `sources` (list of [B, T, D])
        if weights is None:
            return attnres(self.queries[l], sources, self.key_norms[l], self.eps, backend=self.backend)
        h, w = attnres(self.queries[l], sources, self.key_norms[l], self.eps, True, self.backend)
        weights.append(w.detach().flatten(1).mean(dim=1))                    # [N_sources], token average
        return h

    @staticmethod
    def _call(l, f, h, like):
        # the output joins the stream in the embedding's dtype: under bf16 autocast the embedding is
        # float32 and so is the sum a standard residual would keep
        out = f(h)
        require(isinstance(out, torch.Tensor) and out.shape == like.shape, f"sublayer {l} returned "
                f"{getattr(out, 'shape', type(out).__name__)}, expected {tuple(like.shape)}")
        return out.to(like.dtype)

    def forward(self, embedding, sublayers, return_weights=False, two_phase=False):
        require(isinstance(embedding, torch.Tensor) and embedding.dim() >= 2 and embedding.shape[-1] == self.d_model,
                f"embedding must be [..., {self.d_model}], got {getattr(embedding, 'shape', None)}")
        require(len(sublayers) == self.n_sublayers, f"expected {self.n_sublayers} sublayers, got {len(sublayers)}")
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
        # phase 1 per group: all its queries read the sources before the group in one pass; phase 2 per
        # sublayer: merge with the sources produced inside the group. Block AttnRes: a group is a block
        # and its one intra-group source the partial sum; full: two_phase_group sublayers' outputs
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
                    with torch.no_grad():
                        _, w = attnres_ref(self.queries[l], before + inside, self.key_norms[l], self.eps, True)
                    weights.append(w.flatten(1).mean(dim=1))
                out = self._call(l, sublayers[l], h, embedding)
                if self.block_size is None:
                    inside.append(out)
                else:
                    inside = [out if not inside else inside[0] + out]        # the block's partial sum
            before = before + inside
        return self._read(self.n_sublayers, before, weights)
