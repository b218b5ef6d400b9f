"""Tests for muonclip.py and its kernels (kernels/newton_schulz.py, kernels/max_logit.py).

CPU: Triton kernels run under the interpreter in float32; bf16 checks are marked gpu.
"""
import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_close, rel_rms

import muonclip
from muonclip import MuonClip, max_logit, max_logit_ref, newton_schulz, newton_schulz_ref

HAS_TORCH_MUON = hasattr(torch.optim, "Muon")


# ------------------------------------------------------------------ helpers

class ToyAttention(nn.Module):
    """Duck-typed stand-in for model.CausalSelfAttention (same attributes, same max_logit contract)."""

    def __init__(self, d_model, n_head, n_kv_head, head_dim, bias=False):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.q_proj = nn.Linear(d_model, n_head * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * head_dim, d_model, bias=bias)
        self.record_max_logit = False
        self.max_logit = None

    def qk(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # [B, H, T, Dh]
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)   # [B, Hkv, T, Dh]
        return q, k

    def forward(self, x):
        B, T, _ = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.record_max_logit:
            self.max_logit = max_logit_ref(q.detach(), k.detach(), self.head_dim ** -0.5).amax(0)  # [H]
        g = self.n_head // self.n_kv_head
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyGate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4))
        self.dt_bias = nn.Parameter(torch.zeros(4))
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)


class ToyLM(nn.Module):
    def __init__(self, vocab=50, d=32, n_head=4, n_kv_head=4, head_dim=8, tie=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.norm = RMSNorm(d)
        self.attn = ToyAttention(d, n_head, n_kv_head, head_dim)
        self.fc = nn.Linear(d, 2 * d)           # with a bias
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.gate = ToyGate(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.attn(self.norm(x))
        x = x + self.proj(F.gelu(self.fc(x)))
        conv = self.gate.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        x = x + conv * torch.sigmoid(self.gate.dt_bias.mean() - self.gate.A_log.exp().mean())
        return self.lm_head(x)


def ns_scalar_map(s, steps=5, coeffs=muonclip.NS_COEFFS):
    a, b, c = coeffs
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


# ------------------------------------------------------------------ Newton-Schulz

@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256)])
def test_ns_singular_values_in_band(shape):
    G = torch.randn(*shape, dtype=torch.float64).float()
    out = newton_schulz_ref(G, dtype=torch.float32)
    s_out = torch.linalg.svdvals(out.double())
    # the band of the (a, b, c) quintic: measured 0.682-1.134 in float32 for this Gaussian
    assert s_out.min() > 0.67 and s_out.max() < 1.14, (s_out.min().item(), s_out.max().item())
    # stronger: NS acts on each singular value through the scalar polynomial
    s_in = torch.linalg.svdvals(G.double()) / G.double().norm()
    expected = ns_scalar_map(s_in).sort().values
    assert_close(expected, s_out.sort().values, 1e-4, "singular values vs scalar polynomial")
    # the singular vectors are G's: O ≈ U·diag(f(s))·Vᵀ
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    assert_close(U @ torch.diag(ns_scalar_map(S / G.double().norm())) @ Vh, out.double(), 1e-4, "NS vs U f(S) Vᵀ")


def test_ns_bf16_on_cpu_and_zero_input():
    G = torch.randn(64, 96)
    out = newton_schulz_ref(G, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close(newton_schulz_ref(G, dtype=torch.float32), out.float(), 2e-2, "bf16 vs fp32 NS")
    zero = newton_schulz_ref(torch.zeros(8, 16))
    assert torch.equal(zero, torch.zeros(8, 16))  # clamp-normalised: no NaN for a zero gradient


@pytest.mark.parametrize("shape", [(48, 48), (70, 40), (40, 70), (3, 33, 50), (2, 2, 45, 20), (1, 17)])
def test_ns_triton_matches_reference(shape):
    G = torch.randn(*shape)
    ref = newton_schulz_ref(G, dtype=torch.float32)
    out = newton_schulz(G, backend="triton", dtype=torch.float32)
    assert out.shape == G.shape and out.dtype == torch.float32
    assert_close(ref, out, 1e-4, f"triton NS {shape}")


@pytest.mark.parametrize("seed, shape", [(0, (2, 45, 70)), (1, (2, 45, 70)), (2, (2, 45, 70)), (3, (1, 33, 17)),
                                         (4, (3, 64, 40)), (5, (1, 70, 130))])
def test_sym_gram_is_exactly_symmetric_and_correct(seed, shape):
    # (2, 45, 70) is the shape that broke the exact assertion on one CPU's BLAS path when diagonal tiles
    # were stored whole: symmetry must come from the construction, not from the backend's sum order
    from kernels.newton_schulz import sym_gram
    P = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    A = sym_gram(P)
    assert torch.equal(A, A.mT)  # mirrored, not recomputed
    assert_close(P.double() @ P.double().mT, A.double(), 1e-6, "P·Pᵀ")
    B = sym_gram(A, alpha=2.0315, beta=-4.775, add=A)
    ref = 2.0315 * (A.double() @ A.double()) - 4.775 * A.double()
    assert_close(ref, B.double(), 1e-6, "c·A·A + b·A")


def test_sym_gram_takes_every_value_from_the_upper_triangle():
    # A stand-in for a dot whose (i, j) and (j, i) entries differ in the last bit: an `add` that is not
    # symmetric. The result must still be exactly symmetric, each pair taken from the upper triangle
    # (a kernel that stored its diagonal tiles whole would copy the asymmetry through).
    from kernels.newton_schulz import sym_gram
    P = torch.randn(1, 45, 30)
    noise = torch.triu(torch.randn(1, 45, 45), diagonal=1) * 1e-3      # upper-only: add is not symmetric
    C = sym_gram(P, alpha=1.0, beta=1.0, add=P @ P.mT + noise)
    assert torch.equal(C, C.mT)
    upper = torch.triu(torch.ones(45, 45, dtype=torch.bool))
    want = (2 * (P.double() @ P.double().mT) + noise.double())
    assert_close(want[:, upper], C.double()[:, upper], 1e-6, "upper triangle")


def test_ns_errors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        newton_schulz(torch.randn(5))
    with pytest.raises(TypeError, match="floating point"):
        newton_schulz(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend"):
        newton_schulz(torch.randn(4, 4), backend="cuda")
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.randn(4, 4), steps=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 1024), (768, 3072), (3072, 768), (6, 256, 384), (300, 200)])
def test_ns_triton_bf16_gpu(shape):
    G = torch.randn(*shape, device="cuda")
    ref = newton_schulz_ref(G)                        # bf16 on CUDA
    out = newton_schulz(G, backend="triton")
    assert out.dtype == torch.bfloat16
    assert_close(ref.float(), out.float(), 3e-2, "bf16 triton NS")
    assert_close(newton_schulz_ref(G, dtype=torch.float32), newton_schulz(G, backend="triton", dtype=torch.float32),
                 1e-4, "fp32 (ieee) triton NS")


# ------------------------------------------------------------------ max logit

# every T with both head dims, each pair once with plain and once with grouped KV heads across the list
@pytest.mark.parametrize("T,Dh,H,Hkv", [(1, 32, 4, 4), (1, 48, 4, 2), (37, 32, 4, 2), (37, 48, 4, 4),
                                        (130, 32, 4, 4), (130, 48, 6, 2)])
def test_max_logit_triton_matches_reference(T, Dh, H, Hkv):
    B = 2
    q = torch.randn(B, T, H, Dh).transpose(1, 2)  # non-contiguous, as a model's view gives it
    k = torch.randn(B, Hkv, T, Dh) * 2.0
    scale = Dh ** -0.5
    ref = max_logit_ref(q, k, scale)
    out = max_logit(q, k, scale, backend="triton")
    assert out.shape == (B, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_max_logit_reference_semantics():
    # a planted future logit must be ignored (causal), a planted past one found; GQA maps h -> h // group
    B, H, Hkv, T, Dh = 1, 4, 2, 6, 4
    q = torch.zeros(B, H, T, Dh)
    k = torch.zeros(B, Hkv, T, Dh)
    q[0, 1, 2, 0] = 10.0          # head 1 (kv head 0), query 2
    k[0, 0, 1, 0] = 3.0           # key 1 <= 2: counts -> 30·scale
    k[0, 0, 5, 0] = 100.0         # key 5 > 2: future, must not count
    q[0, 3, 4, 1] = 1.0           # head 3 (kv head 1)
    k[0, 1, 4, 1] = 7.0           # diagonal pair counts -> 7·scale
    out = max_logit_ref(q, k, 0.5)
    assert out[0, 1].item() == 15.0 and out[0, 3].item() == 3.5
    assert out[0, 0].item() == 0.0  # other heads: all-zero logits
    torch.testing.assert_close(max_logit(q, k, 0.5, backend="triton"), out)


def test_max_logit_errors():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="multiple"):
        max_logit(q, k, 0.1)
    with pytest.raises(ValueError, match="agree"):
        max_logit(q, torch.randn(1, 2, 6, 8), 0.1)
    with pytest.raises(ValueError, match="scale"):
        max_logit(q, torch.randn(1, 2, 5, 8), -1.0)
    with pytest.raises(TypeError, match="dtype"):
        max_logit(q, torch.randn(1, 2, 5, 8, dtype=torch.float64), 0.1)
    with pytest.raises(ValueError, match=r"\[B, H, T, Dh\]"):
        max_logit(q[0], k, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("T,Dh,H,Hkv", [(1, 64, 4, 4), (257, 64, 8, 2), (1000, 128, 4, 1), (130, 48, 6, 3)])
def test_max_logit_triton_gpu(T, Dh, H, Hkv):
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, H, T, Dh, device="cuda", dtype=dtype)
        k = torch.randn(2, Hkv, T, Dh, device="cuda", dtype=dtype)
        for causal in (True, False):
            torch.testing.assert_close(max_logit(q, k, Dh ** -0.5, causal=causal),
                                       max_logit_ref(q, k, Dh ** -0.5, causal=causal), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ the optimizer: Muon and AdamW parts

@pytest.mark.skipif(not HAS_TORCH_MUON, reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_matches_torch_muon(shape, adjust):
    W0 = torch.randn(*shape)
    p_torch, p_bf16, p_fp32 = (nn.Parameter(W0.clone()) for _ in range(3))
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt_torch = torch.optim.Muon([p_torch], adjust_lr_fn=adjust, **kw)
    # torch's routine runs NS in bf16 even on CPU; with the same working dtype we match it bit for bit
    opt_bf16 = MuonClip([p_bf16], adjust_lr=adjust, ns_dtype=torch.bfloat16, qk_clip_tau=None, **kw)
    opt_fp32 = MuonClip([p_fp32], adjust_lr=adjust, qk_clip_tau=None, **kw)
    for _ in range(4):
        g = torch.randn(*shape)
        for p, opt in ((p_torch, opt_torch), (p_bf16, opt_bf16), (p_fp32, opt_fp32)):
            p.grad = g.clone()
            opt.step()
        assert torch.equal(p_torch, p_bf16)
    assert torch.equal(opt_torch.state[p_torch]["momentum_buffer"], opt_bf16.state[p_bf16]["momentum_buffer"])
    # CPU default (float32 NS) differs from torch's bf16 only by bf16 rounding of the update
    assert_close(p_torch.detach() - W0, p_fp32.detach() - W0, 3e-2, "fp32 Muon vs torch Muon (bf16)")
    assert not torch.equal(p_torch, W0)


def test_adamw_part_matches_torch_adamw():
    W0, b0 = torch.randn(10, 7), torch.randn(7)
    ours = [nn.Parameter(W0.clone()), nn.Parameter(b0.clone())]
    ref = [nn.Parameter(W0.clone()), nn.Parameter(b0.clone())]
    opt = MuonClip([dict(params=ours, use_muon=False)], lr=3e-3, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        grads = [torch.randn_like(W0), torch.randn_like(b0)]
        for ps, o in ((ours, opt), (ref, opt_ref)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tie", [False, True])
def test_from_model_routing(tie):
    model = ToyLM(tie=tie)
    opt = MuonClip.from_model(model, lr=1e-3, weight_decay=0.1)
    by_id = {}
    for g in opt.param_groups:
        for p in g["params"]:
            assert id(p) not in by_id, "a parameter is in two groups"
            by_id[id(p)] = ("muon" if g["use_muon"] else "adamw", g["weight_decay"])
    assert len(by_id) == len(list(model.parameters()))
    muon = {model.attn.q_proj.weight, model.attn.k_proj.weight, model.attn.v_proj.weight,
            model.attn.o_proj.weight, model.fc.weight, model.proj.weight}
    decay = {model.wte.weight, model.lm_head.weight, model.gate.conv.weight}
    no_decay = {model.norm.weight, model.fc.bias, model.gate.A_log, model.gate.dt_bias, model.gate.conv.bias}
    for p in muon:
        assert by_id[id(p)] == ("muon", 0.1)
    for p in decay:
        assert by_id[id(p)] == ("adamw", 0.1)
    for p in no_decay:
        assert by_id[id(p)] == ("adamw", 0.0)
    assert model.attn.record_max_logit is True
    assert [n for n, _ in opt.attention_modules] == ["attn"]
    # the AdamW baseline through the same routing: nothing in Muon, same decay rules
    base = MuonClip.from_model(ToyLM(tie=tie), use_muon=False, qk_clip_tau=None)
    assert not any(g["use_muon"] for g in base.param_groups)
    assert sum(len(g["params"]) for g in base.param_groups if g["weight_decay"] == 0.0) == len(no_decay)


def test_optimizer_argument_errors():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="lr"):
        MuonClip([p], lr=-1.0)
    with pytest.raises(ValueError, match="adjust_lr"):
        MuonClip([p], adjust_lr="spectral")
    with pytest.raises(ValueError, match="qk_clip_tau"):
        MuonClip([p], qk_clip_tau=0.0)
    with pytest.raises(ValueError, match="fewer than 2 dims"):
        MuonClip([dict(params=[nn.Parameter(torch.randn(4))], use_muon=True)])
    with pytest.raises(ValueError, match="lacks"):
        MuonClip([p], attention_modules=[("x", nn.Linear(2, 2))])


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 50, (2, 12), generator=gen).to(next(model.parameters()).device)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())  # identity task: learnable fast
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


def test_training_decreases_loss_and_state_dict_round_trip():
    model = ToyLM()
    opt = MuonClip.from_model(model, lr=1e-2, weight_decay=0.01)
    first = _train(model, opt, 1, seed=5)
    _train(model, opt, 3)
    # resume: a fresh model + optimizer loaded from the state dicts continues bit-identically
    model2 = ToyLM()
    model2.load_state_dict(copy.deepcopy(model.state_dict()))
    opt2 = MuonClip.from_model(model2, lr=0.5, weight_decay=0.5)  # hyperparameters come from the state dict
    with tempfile.TemporaryDirectory() as d:
        torch.save(opt.state_dict(), os.path.join(d, "opt.pt"))
        opt2.load_state_dict(torch.load(os.path.join(d, "opt.pt"), weights_only=True))
    assert opt2.param_groups[0]["lr"] == 1e-2
    _train(model, opt, 3, seed=2)
    _train(model2, opt2, 3, seed=2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
    last = _train(model, opt, 30, seed=5)
    assert last < first - 1.0, (first, last)  # it learns the identity task
    assert opt.last_clip_stats is not None and opt.last_clip_stats["layers"] == ["attn"]
    assert model.attn.max_logit is None  # consumed by the clip


# ------------------------------------------------------------------ QK-Clip

@pytest.mark.parametrize("n_head,n_kv_head,bias", [(4, 4, False), (6, 2, False), (4, 4, True)])
def test_qk_clip_postcondition(n_head, n_kv_head, bias):
    d, Dh = 32, 16
    attn = ToyAttention(d, n_head, n_kv_head, Dh, bias=bias)
    with torch.no_grad():  # make some heads' logits large, leave the others small
        attn.q_proj.weight.view(n_head, Dh, d)[::2] *= 12.0
        attn.k_proj.weight.mul_(3.0)
    opt = MuonClip(list(attn.parameters()), lr=0.0, weight_decay=0.0,
                   qk_clip_tau=None, attention_modules=[("attn", attn)])
    attn.record_max_logit = True
    x = torch.randn(3, 20, d)
    attn(x)
    before = attn.max_logit.clone()
    tau = before.median().item()          # some heads above, some at or below
    opt.qk_clip_tau = tau
    clipped = before > tau
    assert 0 < clipped.sum() < n_head
    weights_before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    attn.zero_grad()
    opt.qk_clip()
    assert opt.last_clip_stats["clipped_heads"] == [int(clipped.sum())]
    assert opt.last_clip_stats["max_logit"] == [pytest.approx(before.max().item())]
    with torch.no_grad():
        q, k = attn.qk(x)
        after = max_logit_ref(q, k, Dh ** -0.5).amax(0)
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=0)
    assert torch.equal(after[~clipped], before[~clipped])
    group = n_head // n_kv_head
    for name in ("q_proj.weight", "k_proj.weight") + (("q_proj.bias", "k_proj.bias") if bias else ()):
        heads = n_head if name.startswith("q") else n_kv_head
        old = weights_before[name].view(heads, Dh, -1)
        new = dict(attn.named_parameters())[name].detach().view(heads, Dh, -1)
        # a head is untouched when it is unclipped; with GQA no key head is ever touched
        touched = clipped if name.startswith("q") else (clipped if group == 1 else torch.zeros(heads, dtype=torch.bool))
        for h in range(heads):
            assert torch.equal(old[h], new[h]) != bool(touched[h]), (name, h)
    for name in ("v_proj.weight", "o_proj.weight"):
        assert torch.equal(weights_before[name], dict(attn.named_parameters())[name])
    assert len(opt.state) == 0  # clip never creates or edits optimizer state
    assert attn.max_logit is None


def test_qk_clip_inside_step_leaves_state_and_uses_tau():
    model = ToyLM(n_head=4, n_kv_head=2)
    with torch.no_grad():
        model.attn.q_proj.weight.mul_(40.0)
        model.attn.k_proj.weight.mul_(40.0)
    opt = MuonClip.from_model(model, lr=1e-3, weight_decay=0.0, qk_clip_tau=5.0)
    _train(model, opt, 1)
    stats = opt.last_clip_stats
    assert stats["clipped_heads"][0] > 0 and stats["max_logit"][0] > 5.0
    bufs = {id(p): opt.state[p]["momentum_buffer"].clone() for p in opt.param_groups[0]["params"]}
    # the next forward starts from clipped weights: logits fall (they sat far above τ)
    _train(model, opt, 1, seed=7)
    assert opt.last_clip_stats["max_logit"][0] < stats["max_logit"][0]
    assert all(opt.state[p]["momentum_buffer"].shape == bufs[id(p)].shape for p in opt.param_groups[0]["params"])


def test_qk_clip_none_only_reports():
    model = ToyLM()
    with torch.no_grad():
        model.attn.q_proj.weight.mul_(40.0)
    opt = MuonClip.from_model(model, lr=0.0, weight_decay=0.0, qk_clip_tau=None)
    before = model.attn.q_proj.weight.detach().clone()
    _train(model, opt, 1)
    assert opt.last_clip_stats["clipped_heads"] == [0] and opt.last_clip_stats["max_logit"][0] > 0
    assert torch.equal(before, model.attn.q_proj.weight)


# ------------------------------------------------------------------ distributed Muon (2 processes, gloo)

def _dist_setup_model():
    torch.manual_seed(123)
    model = nn.ModuleDict(dict(
        a=nn.Linear(24, 24, bias=False), b=nn.Linear(24, 24, bias=False), c=nn.Linear(24, 24, bias=False),
        up=nn.Linear(24, 40), attn=ToyAttention(24, 4, 4, 6)))
    return model


def _dist_grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _dist_max_logit(rank, step):
    # each rank sees different logits; the clip must use the max over ranks
    base = torch.tensor([50.0, 150.0, 90.0, 300.0]) + 10.0 * step
    return base + torch.tensor([40.0, -20.0, 30.0, 0.0]) * rank


def _dist_run(rank, world, steps):
    model = _dist_setup_model()
    opt = MuonClip.from_model(model, lr=0.05, weight_decay=0.1, qk_clip_tau=100.0)
    for step in range(steps):
        _dist_grads(model, step)
        if world > 1:
            model.attn.max_logit = _dist_max_logit(rank, step)
        else:
            model.attn.max_logit = torch.stack([_dist_max_logit(r, step) for r in range(2)]).amax(0)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.last_clip_stats


def _dist_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params, stats = _dist_run(rank, world, steps=3)
        torch.save(dict(params=params, stats=stats), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_muon_matches_single_process():
    import torch.multiprocessing as mp
    expected, expected_stats = _dist_run(0, 1, steps=3)
    with tempfile.TemporaryDirectory() as d:
        # fork: the workers need no fresh interpreter (CPU only), and spawn's re-imports cost ~20 s here
        mp.start_processes(_dist_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True,
                           start_method="fork")
        results = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for name, ref in expected.items():
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), f"ranks differ: {name}"
        torch.testing.assert_close(results[0]["params"][name], ref, rtol=1e-6, atol=1e-6, msg=name)
    assert results[0]["stats"]["max_logit_per_head"] == expected_stats["max_logit_per_head"]
    assert results[0]["stats"]["clipped_heads"] == expected_stats["clipped_heads"] == [4]


# ------------------------------------------------------------------ GPU: the optimizer with the Triton path

@pytest.mark.gpu
def test_optimizer_triton_backend_gpu():
    model = ToyLM().cuda()
    model_ref = copy.deepcopy(model)
    opt = MuonClip.from_model(model, lr=1e-2, ns_backend="triton")
    opt_ref = MuonClip.from_model(model_ref, lr=1e-2, ns_backend="ref")
    _train(model, opt, 3)
    _train(model_ref, opt_ref, 3)
    for (n, a), b in zip(model.named_parameters(), model_ref.parameters()):
        assert rel_rms(b, a) < 2e-2, n


# ------------------------------------------------------------------ with the real model (model.py)

def _gpt(**kw):
    from model import GPT, Config
    cfg = dict(vocab_size=96, block_size=24, n_layer=2, n_head=4, n_embd=64, pattern="A")
    cfg.update(kw)
    return GPT(Config(**cfg))


def test_from_model_on_hybrid_gpt():
    model = _gpt(pattern="KA", tie_embeddings=False)
    opt = MuonClip.from_model(model, lr=1e-3, weight_decay=0.1)
    role = {}
    for g in opt.param_groups:
        for p in g["params"]:
            role[id(p)] = "muon" if g["use_muon"] else ("decay" if g["weight_decay"] else "no_decay")
    assert len(role) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if n.endswith(("A_log", "dt_bias")) or p.ndim == 1:
            assert role[id(p)] == "no_decay", n
        elif n in ("wte.weight", "lm_head.weight") or p.ndim != 2:
            assert role[id(p)] == "decay", n
        else:
            assert role[id(p)] == "muon", n
    assert any(n.endswith("A_log") for n in names.values())  # the KDA layer really is there
    # only the softmax-attention layer is clipped; KDA (L2-normalised q/k) is not an attention module here
    assert [m for _, m in opt.attention_modules] == model.attention_layers()


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_qk_clip_postcondition_on_gpt(n_kv_head):
    model = _gpt(n_kv_head=n_kv_head, n_layer=1)  # one layer: clipping it cannot change its own input
    attn = model.attention_layers()
    with torch.no_grad():
        for a in attn:  # heads 0 and 2 get large logits
            a.q_proj.weight.view(a.n_head, a.head_dim, -1)[::2] *= 60.0
            a.k_proj.weight.mul_(4.0)
    opt = MuonClip.from_model(model, lr=0.0, weight_decay=0.0, qk_clip_tau=None)
    idx = torch.randint(0, 96, (2, 24))
    model.train()
    model(idx)
    before = [a.max_logit.clone() for a in attn]
    tau = float(torch.cat(before).median())
    opt.qk_clip_tau = tau
    q_before = [a.q_proj.weight.detach().clone() for a in attn]
    k_before = [a.k_proj.weight.detach().clone() for a in attn]
    opt.qk_clip()
    assert sum(opt.last_clip_stats["clipped_heads"]) > 0
    model(idx)
    for a, s0, qw, kw in zip(attn, before, q_before, k_before):
        clipped = s0 > tau
        torch.testing.assert_close(a.max_logit[clipped], torch.full_like(a.max_logit[clipped], tau), rtol=1e-4, atol=0)
        assert torch.equal(a.max_logit[~clipped], s0[~clipped])
        qh, qh0 = a.q_proj.weight.detach().view(a.n_head, a.head_dim, -1), qw.view(a.n_head, a.head_dim, -1)
        for h in range(a.n_head):
            assert torch.equal(qh[h], qh0[h]) != bool(clipped[h])
        if n_kv_head < a.n_head:
            assert torch.equal(a.k_proj.weight, kw)


# ------------------------------------------------------------------ bidirectional max logit and a fused qkv (the ViT)

@pytest.mark.parametrize("T,Dh,H,Hkv", [(1, 32, 4, 4), (37, 48, 4, 2), (130, 32, 2, 2)])
def test_max_logit_non_causal_triton_matches_reference(T, Dh, H, Hkv):
    q = torch.randn(2, T, H, Dh).transpose(1, 2)
    k = torch.randn(2, Hkv, T, Dh) * 2.0
    ref = max_logit_ref(q, k, Dh ** -0.5, causal=False)
    out = max_logit(q, k, Dh ** -0.5, backend="triton", causal=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # all pairs include the causal ones, so the bidirectional max is never below the causal max
    assert (ref >= max_logit_ref(q, k, Dh ** -0.5) - 1e-6).all()


def test_max_logit_non_causal_counts_future_keys():
    q, k = torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4)
    q[0, 1, 2, 0], k[0, 1, 5, 0] = 10.0, 100.0          # query 2 against the later key 5
    for backend in ("ref", "triton"):
        assert max_logit(q, k, 0.5, backend=backend)[0, 1].item() == 0.0           # causal: ignored
        assert max_logit(q, k, 0.5, backend=backend, causal=False)[0, 1].item() == 500.0


def test_qk_clip_on_a_fused_qkv_vit_block():
    """The ViT block's bidirectional attention, with one fused qkv projection: clipped heads recompute
    to exactly τ over all patch pairs, every other row of qkv (other heads, all of v) is untouched."""
    import vision
    torch.manual_seed(0)
    dim, H = 32, 4
    Dh = dim // H
    block = vision._EncoderBlock(dim, H, backend="ref")
    with torch.no_grad():
        block.qkv.weight.view(3, H, Dh, dim)[0, ::2] *= 15.0    # heads 0 and 2 get large logits
    pos = vision.patch_positions(4, 5)
    cos, sin = vision.rope_2d(pos, Dh)
    x = torch.randn(3, 20, dim)

    def logits_now():
        q, k, _ = block.qkv(block.norm1(x)).view(3, 20, 3, H, Dh).permute(2, 0, 3, 1, 4)
        q, k = vision.apply_rope(q, cos, sin), vision.apply_rope(k, cos, sin)
        return max_logit_ref(q, k, Dh ** -0.5, causal=False).amax(0)

    opt = MuonClip.from_model(block, lr=0.0, weight_decay=0.0, qk_clip_tau=None)
    assert [n for n, _ in opt.attention_modules] == [""] and block.record_max_logit
    block.train()
    block(x, cos, sin)
    before = block.max_logit.clone()
    torch.testing.assert_close(before, logits_now().detach())
    tau = before.median().item()
    clipped = before > tau
    assert 0 < clipped.sum() < H
    w_before = block.qkv.weight.detach().clone().view(3, H, Dh, dim)
    opt.qk_clip_tau = tau
    opt.qk_clip()
    with torch.no_grad():
        after = logits_now()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=0)
    assert torch.equal(after[~clipped], before[~clipped])
    w_after = block.qkv.weight.detach().view(3, H, Dh, dim)
    assert torch.equal(w_after[2], w_before[2])                          # v rows never change
    for h in range(H):
        for part in (0, 1):                                               # q and k rows of head h
            assert torch.equal(w_after[part, h], w_before[part, h]) != bool(clipped[h]), (part, h)


def test_fused_qkv_with_grouped_heads_is_refused():
    import vision
    block = vision._EncoderBlock(32, 4)
    block.n_kv_head = 2
    with pytest.raises(ValueError, match="fused qkv"):
        MuonClip(list(block.parameters()), attention_modules=[("vit", block)])
