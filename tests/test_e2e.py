"""End to end: a tiny model with every idea, trained two steps through all Triton kernels and through the
references, must agree.

The model: Kimi Linear's KKKA pattern (3 KDA layers + 1 attention layer), block Attention Residuals,
early-fusion image rows, MuonClip with τ below the initial max logit so QK-Clip fires. Built twice from
one seed, backend="triton" (KDA, AttnRes, Newton-Schulz and the attention layers, whose max logits come
from the fused attention kernel, all through kernels/) and backend="ref"; compared after each of two
optimizer steps: the loss, every recorded max logit, every parameter's gradient and every updated weight.

On CPU the kernels run in the Triton interpreter in float32 (relative RMS error <= 1e-4). On a CUDA
device (tests/gpu.sh) the same test runs the model in bf16 autocast, whose tolerances are per dtype:
bf16 rounds each op's inputs to 8 bits of mantissa, and the two backends round at different places.
"""
import pytest
import torch

import model
from conftest import DEVICE, HAS_CUDA, rel_rms
from muonclip import MuonClip
from vision import IMAGE_END, IMAGE_PAD, IMAGE_START, image_token_count

# relative RMS error allowed per compared quantity, per compute dtype
TOLERANCE = {
    torch.float32: dict(loss=1e-4, max_logit=1e-4, grad=1e-4, weight=1e-4),
    # bf16 autocast: logits and grads carry ~3e-3 relative rounding per op; the weights move by lr-sized
    # steps from identical starting values, so they stay much closer than the grads
    torch.bfloat16: dict(loss=2e-2, max_logit=3e-2, grad=5e-2, weight=5e-3),
}


def _config(backend: str) -> model.Config:
    cfg = model.Config(vocab_size=50304, block_size=80, n_layer=4, n_head=2, n_embd=32, pattern="KKKA",
                       residual="attnres_block", attnres_block_size=2, vision=True, backend=backend)
    cfg.vision_n_embd, cfg.vision_n_layer, cfg.vision_n_head = 16, 1, 2
    return cfg


def _batch(T: int):
    """Two text rows and one image-text row (two 16x16 images = 2 x 4 image tokens), T = 80: two KDA chunks."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50257, (3, T + 1), generator=g)
    n = image_token_count(16, 16)
    row = [IMAGE_START] + [IMAGE_PAD] * n + [IMAGE_END]
    idx[2, 5:5 + len(row)] = torch.tensor(row)
    idx[2, 30:30 + len(row)] = torch.tensor(row)
    images = [[], [], [torch.rand(3, 16, 16, generator=g), torch.rand(3, 16, 16, generator=g)]]
    targets = idx[:, 1:].clone()
    targets[2, :40] = -1  # no loss on the image prompt part, as vision.VisionTasks does
    return idx[:, :-1].to(DEVICE), targets.to(DEVICE), [[im.to(DEVICE) for im in r] for r in images]


def _train(backend: str, tau: float, steps: int, dtype: torch.dtype):
    torch.manual_seed(0)
    gpt = model.GPT(_config(backend)).to(DEVICE)
    idx, targets, images = _batch(gpt.config.block_size)
    opt = MuonClip.from_model(gpt, lr=2e-2, weight_decay=0.1, qk_clip_tau=tau)
    assert opt.ns_backend == backend, "model.Config.backend must govern Newton-Schulz too"
    record = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = gpt(idx, targets, images=images)
        loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in gpt.named_parameters() if p.grad is not None}
        opt.step()
        stats = opt.last_clip_stats
        record.append(dict(loss=loss.detach().float(), grads=grads,
                           max_logit=torch.tensor(stats["max_logit_per_head"]),
                           clipped=sum(stats["clipped_heads"]),
                           weights={n: p.detach().float().clone() for n, p in gpt.named_parameters()}))
    return record


@torch.no_grad()
def _initial_max_logit(dtype):
    """The largest logit of the first training forward (the reference model at init)."""
    torch.manual_seed(0)
    gpt = model.GPT(_config("ref")).to(DEVICE)
    idx, targets, images = _batch(gpt.config.block_size)
    for m in gpt.attention_layers():
        m.record_max_logit = True
    with torch.autocast(DEVICE, dtype=dtype, enabled=dtype != torch.float32):
        gpt(idx, targets, images=images)
    return max(m.max_logit.max().item() for m in gpt.attention_layers())


def compare_backends(dtype: torch.dtype, steps: int = 2):
    """Run both backends; return a list of failure lines (empty when they agree) and print a summary."""
    tau = 0.5 * _initial_max_logit(dtype)  # below the first forward's largest logit: QK-Clip fires
    ref, tri = _train("ref", tau, steps, dtype), _train("triton", tau, steps, dtype)
    tol = TOLERANCE[dtype]
    failures, worst = [], {}
    for step, (r, t) in enumerate(zip(ref, tri), start=1):
        assert r["clipped"] > 0, f"step {step}: QK-Clip did not fire at tau={tau:.4f}"
        items = [("loss", "loss", r["loss"], t["loss"]), ("max_logit", "max_logit", r["max_logit"], t["max_logit"])]
        assert r["grads"].keys() == t["grads"].keys()
        items += [(f"grad {n}", "grad", r["grads"][n], t["grads"][n]) for n in r["grads"]]
        items += [(f"weight {n}", "weight", r["weights"][n], t["weights"][n]) for n in r["weights"]]
        for name, kind, a, b in items:
            err = rel_rms(a, b) if torch.isfinite(b).all() else float("inf")
            if err > worst.get(kind, (0.0, ""))[0]:
                worst[kind] = (err, f"step {step} {name}")
            if err > tol[kind]:
                failures.append(f"step {step} {name}: relative RMS error {err:.2e} > {tol[kind]:.0e}")
    print(f"\ne2e {dtype}: tau={tau:.4f}, clipped heads per step ref {[r['clipped'] for r in ref]}, "
          f"triton {[t['clipped'] for t in tri]}; worst relative RMS error: "
          + ", ".join(f"{k} {e:.1e} ({where})" for k, (e, where) in worst.items()))
    return failures


@pytest.mark.slow
def test_every_idea_triton_matches_reference(monkeypatch):
    import kernels.attention
    import kernels.max_logit
    fused, separate = [], []   # the causal flag of each fused attention forward; separate max-logit passes
    fwd, pass_ = kernels.attention.attention_fwd, kernels.max_logit.max_logit_triton
    monkeypatch.setattr(kernels.attention, "attention_fwd", lambda *a: fused.append(a[4]) or fwd(*a))
    monkeypatch.setattr(kernels.max_logit, "max_logit_triton", lambda *a: separate.append(a) or pass_(*a))
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    failures = compare_backends(dtype)
    assert not failures, f"{len(failures)} mismatches, first 10:\n" + "\n".join(failures[:10])
    # the Triton model's max logits came from the fused kernel: per step the attention layer (causal) and
    # the ViT block (bidirectional), and no separate max-logit pass ran
    assert sorted(fused) == [False, False, True, True] and not separate


def test_config_backend_reaches_every_op():
    cfg = _config("triton")
    gpt = model.GPT(cfg)
    kinds = cfg.layer_kinds
    for block, kind in zip(gpt.blocks, kinds):
        assert block.mixer.backend == "triton", kind       # KDA layers and the attention's max logit
    assert gpt.attnres.backend == "triton"
    assert MuonClip.from_model(gpt).ns_backend == "triton"
    assert MuonClip.from_model(gpt, ns_backend="ref").ns_backend == "ref"   # an explicit choice wins


def test_auto_falls_back_to_reference_beyond_kernel_limits(monkeypatch):
    # kda()'s use of the backend rule (kernels.launch.use_triton), its tensors seen as if on CUDA: "auto"
    # takes the kernels within K <= 128, V <= 256 and the reference beyond them; "triton" beyond them stops
    import kda
    import kernels.kda
    from kernels import launch
    on_cuda = True
    monkeypatch.setattr(kda, "use_triton", lambda backend, _, *args: launch.use_triton(backend, on_cuda, *args))
    monkeypatch.setattr(kernels.kda, "chunk_kda_triton", lambda *args: ("kernels", None))

    def path(K, V, backend="auto"):
        q, v = torch.randn(1, 4, 1, K), torch.randn(1, 4, 1, V)
        o, _ = kda.kda(q, q, v, -q.abs(), torch.rand(1, 4, 1), backend=backend)
        return o if isinstance(o, str) else "ref"
    assert path(64, 64) == "kernels"
    assert path(256, 64) == "ref"           # head dim > 128: the kernels cannot hold it
    assert path(64, 512) == "ref"
    assert path(64, 64, "ref") == "ref"
    with pytest.raises(ValueError, match="kda: the Triton path supports K <= 128 and V <= 256, got K=256"):
        path(256, 64, "triton")             # asked explicitly: the clear error, not a silent fallback
    on_cuda = False
    assert path(64, 64) == "ref"            # CPU tensors: the reference
