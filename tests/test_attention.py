"""Tests for kernels/attention.py: the fused attention that returns each head's max logit (QK-Clip).

Against SDPA (output and the gradients of q, k, v) and against muonclip.max_logit_ref (the max logit), for
causal and bidirectional attention, grouped KV heads and odd T. CPU: the Triton interpreter in float32;
bf16 checks are marked gpu. Also: the model's attention layer and the ViT block take the fused path when
QK-Clip records max logits on the Triton backend (and only then), with the results of SDPA + max_logit.
"""
import pytest
import torch
import torch.nn.functional as F

import kernels.attention as ka
from kernels.launch import use_triton
import model
import muonclip
from conftest import DEVICE, HAS_CUDA, assert_close
from muonclip import attention_max_logit, max_logit_ref
from vision import _EncoderBlock

# (B, H, Hkv, T, Dh, layout): odd T (one token; a partial tile; several tiles with a partial diagonal),
# head dims 16 / 32 / 60 (padded to 64) / 64, GQA ratios 1, 2, 4. layout "model": q, k, v are [B, H, T, Dh]
# views of [B, T, H, Dh] projections, as model.py passes them; "vit": slices of one fused qkv output,
# as vision.py passes them; "contiguous": plain [B, H, T, Dh] tensors
CASES = [(2, 2, 2, 1, 16, "contiguous"), (2, 4, 2, 63, 32, "model"), (1, 4, 1, 100, 60, "vit"),
         (1, 2, 2, 130, 64, "model")]


def _inputs(B, H, Hkv, T, Dh, layout, dtype=torch.float32, spread=2.0):
    """q, k, v leaves in the given memory layout; `spread` widens the logits so softmax is far from uniform."""
    if layout == "vit":   # [B, T, 3, H, Dh] -> three [B, H, T, Dh] views (MHA only, like the ViT)
        qkv = torch.randn(B, T, 3, H, Dh, device=DEVICE, dtype=dtype) * spread
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        k, v = k[:, :Hkv], v[:, :Hkv]
    elif layout == "model":
        q, k, v = (torch.randn(B, T, n, Dh, device=DEVICE, dtype=dtype).transpose(1, 2) * spread for n in (H, Hkv, Hkv))
    else:
        q, k, v = (torch.randn(B, n, T, Dh, device=DEVICE, dtype=dtype) * spread for n in (H, Hkv, Hkv))
    return [x.detach().requires_grad_() for x in (q, k, v)]


def _sdpa(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=causal)


def _compare(B, H, Hkv, T, Dh, layout, causal, dtype=torch.float32, tol=2e-5):
    q, k, v = _inputs(B, H, Hkv, T, Dh, layout, dtype)
    scale = Dh ** -0.5
    o, mx = attention_max_logit(q, k, v, scale, causal)
    assert o.shape == q.shape and o.dtype == dtype and mx.shape == (B, H) and mx.dtype == torch.float32
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))   # the float32 reference
    ref = _sdpa(qf, kf, vf, causal)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    assert_close(ref, o, tol, "o")
    for name, r, g in zip(("dq", "dk", "dv"), ref_grads, grads):
        assert g.shape == r.shape and g.dtype == dtype, name
        if name in ("dq", "dk") and T == 1:   # one key: softmax is 1 whatever q·k, so dq = dk = 0 (the
            assert g.abs().max() <= 1e-5, g.abs().max()  # reference's are rounding noise)
        else:
            assert_close(r, g, 2 * tol, name)
    # the max logit is the exact statistic QK-Clip compares with τ
    torch.testing.assert_close(mx, max_logit_ref(qf, kf, scale, causal), rtol=1e-5 if dtype == torch.float32 else 1e-4,
                               atol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("B, H, Hkv, T, Dh, layout", CASES)
def test_matches_sdpa_and_max_logit_ref(B, H, Hkv, T, Dh, layout, causal):
    _compare(B, H, Hkv, T, Dh, layout, causal)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU, test_bf16_gpu runs these tiles for real")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_gpu_tiles_in_the_interpreter(monkeypatch, causal):
    # the bf16 GPU launch configuration (128-query forward tiles over 64-key tiles, 16-query dK/dV steps,
    # 32-key dQ steps), run in float32: the tile arithmetic of a GPU launch, checked on CPU
    gpu_tiles = ka.launch_config(64, torch.bfloat16, True)
    monkeypatch.setattr(ka, "launch_config", lambda Dh, dtype, gpu: gpu_tiles)
    _compare(1, 4, 2, 130, 64, "model", causal)


def test_max_logit_is_the_largest_masked_in_logit():
    # one planted pair: query 5 against key 2 (causal pair) in head 1; a larger logit at the future key 9
    # must count only without the causal mask
    q, k, v = (torch.zeros(1, 2, 12, 16, device=DEVICE) for _ in range(3))
    q[0, 1, 5, 0], k[0, 1, 2, 0], k[0, 1, 9, 0] = 3.0, 4.0, 5.0
    _, causal = attention_max_logit(q, k, v, 0.5, causal=True)
    _, bidir = attention_max_logit(q, k, v, 0.5, causal=False)
    assert causal.tolist() == [[0.0, 6.0]] and bidir.tolist() == [[0.0, 7.5]]


def test_errors():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    for args, match in [((q, k, k[:, :, :7], 0.1), "must be \\[B, Hkv, T, Dh\\]"),
                        ((q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), 0.1), "multiple of n_kv_head"),
                        ((q[0], k, k, 0.1), "must be \\[B, H, T, Dh\\]"),
                        ((torch.randn(1, 2, 8, 256), torch.randn(1, 2, 8, 256), torch.randn(1, 2, 8, 256), 0.1),
                         "Dh <= 128"),
                        ((q.double(), k.double(), k.double(), 0.1), "dtype"),
                        ((q, k.half(), k, 0.1), "dtype"),
                        ((q, k, k, 0.0), "scale")]:
        with pytest.raises(ValueError, match=match):
            ka.attention_max_logit_triton(*args)


# ---------------------------------------------------------------------------------------------------
# Wiring: which forwards take the fused kernel

def _count_fused(monkeypatch):
    calls = []
    original = ka.attention_fwd
    monkeypatch.setattr(ka, "attention_fwd", lambda *a: calls.append(a[4]) or original(*a))
    return calls


def _no_separate_pass(monkeypatch):
    def fail(*a, **kw):
        raise AssertionError("the separate max-logit pass ran")
    monkeypatch.setattr(muonclip, "max_logit", fail)     # softmax_attention's separate pass


def test_model_attention_uses_the_fused_kernel_when_recording(monkeypatch):
    cfg = dict(vocab_size=64, block_size=40, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, pattern="A")
    torch.manual_seed(0)
    ref = model.GPT(model.Config(**cfg, backend="ref")).to(DEVICE)
    tri = model.GPT(model.Config(**cfg, backend="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    for m in ref.attention_layers() + tri.attention_layers():
        m.record_max_logit = True
    idx = torch.randint(0, 64, (2, 37), device=DEVICE)
    _, loss_ref = ref(idx, idx)
    loss_ref.backward()
    calls = _count_fused(monkeypatch)
    _no_separate_pass(monkeypatch)
    _, loss = tri(idx, idx)
    loss.backward()
    assert calls == [True]                                          # one causal fused forward, no max_logit
    assert_close(loss_ref.detach(), loss.detach(), 1e-5, "loss")
    assert_close(ref.attention_layers()[0].max_logit, tri.attention_layers()[0].max_logit, 1e-5, "max logit")
    for (name, p_ref), p in zip(ref.named_parameters(), tri.parameters()):
        assert_close(p_ref.grad, p.grad, 1e-4, name)
    # decoding (eval, a KV cache) and forwards that record nothing keep SDPA: the kernel is for training
    monkeypatch.undo()
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        tri.eval()
        tri.generate(idx[:, :5], 3)
        tri.train()
        tri.attention_layers()[0].record_max_logit = False
        tri(idx)
    assert calls == []


def test_vit_block_uses_the_fused_kernel_when_recording(monkeypatch):
    torch.manual_seed(0)
    ref, tri = _EncoderBlock(32, 2, backend="ref").to(DEVICE), _EncoderBlock(32, 2, backend="triton").to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    ref.record_max_logit = tri.record_max_logit = True
    x = torch.randn(3, 17, 32, device=DEVICE)
    cos, sin = torch.ones(17, 8, device=DEVICE), torch.zeros(17, 8, device=DEVICE)   # RoPE at angle 0
    ref(x, cos, sin).square().sum().backward()
    calls = _count_fused(monkeypatch)
    _no_separate_pass(monkeypatch)
    tri(x, cos, sin).square().sum().backward()
    assert calls == [False]                                         # one bidirectional fused forward
    assert_close(ref.max_logit, tri.max_logit, 1e-5, "max logit")
    for (name, p_ref), p in zip(ref.named_parameters(), tri.parameters()):
        assert_close(p_ref.grad, p.grad, 1e-4, name)


def test_the_one_backend_rule(monkeypatch):
    # kernels.launch.use_triton decides for every op with a kernel (attention, max logit, Newton-Schulz, KDA, AttnRes)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not use_triton("ref", on_cuda=True) and not use_triton("auto", on_cuda=False)
    assert use_triton("auto", on_cuda=True) and not use_triton("auto", on_cuda=True, fits=False)  # past the kernel: ref
    assert use_triton("triton", on_cuda=False)                                 # CPU tensors, under the interpreter
    with pytest.raises(ValueError, match="attention: the Triton path supports head dim <= 128"):
        use_triton("triton", True, False, "attention", "head dim <= 128")
    with pytest.raises(ValueError, match="backend must be 'auto', 'ref' or 'triton', got 'cuda'"):
        use_triton("cuda", True, op="attention")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton("triton", on_cuda=False, op="attention")


# ---------------------------------------------------------------------------------------------------
# bf16 on a GPU (tensor cores)

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("B, H, Hkv, T, Dh", [(2, 4, 4, 1, 64), (2, 8, 2, 1000, 64), (1, 4, 1, 777, 128),
                                             (2, 6, 3, 130, 60)])   # tests/compile_check.py ATTENTION_GPU_TESTS
def test_bf16_gpu(B, H, Hkv, T, Dh, causal):
    # bf16 rounds P and dS to 8 bits of mantissa before their products, as flash attention does
    _compare(B, H, Hkv, T, Dh, "model", causal, dtype=torch.bfloat16, tol=1e-2)
