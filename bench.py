"""Benchmarks, one section per op: the plain-PyTorch reference, the Triton path, and the strongest
alternative a user would reach for, as markdown tables of time, rate and peak memory.

    python bench.py all                  # every section
    python bench.py kda [--threads=N]    # Triton chunk kernel vs SDPA flash attention (and fla when installed)
    python bench.py attnres              # eager vs torch.compile vs the fused Triton op, GB/s
    python bench.py muonclip             # Newton-Schulz, the max-logit kernel, attention + max logit fused,
                                         # the optimizer step's share
    python bench.py swarm                # the sub-agent runtime's overhead per step

On CUDA each section runs the full shapes in bf16; on CPU small shapes in float32, without the Triton
rows (the interpreter is a correctness tool, not a speed path; the one exception, the fused attention,
runs there for its error column). A rate is followed by its share of the device's peak: dense bf16
FLOP/s from kernels.launch.PEAK_TFLOPS (the table MFU uses), or memory bandwidth from
kernels.launch.PEAK_GBS; no share is shown where the peak is unknown (CPU).
"""
import argparse
import concurrent.futures as cf
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:  # the fused-attention row runs its kernel in Triton's interpreter on CPU: a correctness check
    os.environ.setdefault("TRITON_INTERPRET", "1")
from kernels.launch import PEAK_GBS, peak_flops  # noqa: E402 (Triton reads TRITON_INTERPRET when first imported)
DEVICE = "cuda" if CUDA else "cpu"
PEAK_TFLOPS_FLAG = 0.0   # --peak_tflops: the device's peak when kernels.launch.PEAK_TFLOPS does not know it

# The CUDA shapes (tests/compile_check.py compiles every kernel launch these make, for sm_90 and sm_80)
KDA_CUDA = dict(H=16, K=128, tokens=32768, lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768])
ATTNRES_CUDA = [(4, 768, 8192), (8, 1024, 16384), (8, 2048, 16384), (16, 2048, 8192), (8, 4096, 32768),
                (16, 4096, 32768)]                                            # (N sources, D, tokens)
NS_CUDA = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (1024, 4096), (4096, 1024), (2048, 8192),
           (8 * 768, 768)]
MAX_LOGIT_CUDA = [(8, 12, 12, 1024, 64), (4, 16, 4, 2048, 128), (1, 16, 16, 8192, 64)]   # B, H, Hkv, T, Dh
# attention + max logit, fused vs SDPA + the separate pass: (B, H, Hkv, T, Dh, causal); the last is the ViT's
ATTENTION_CUDA = [(16, 8, 8, 512, 64, True), (8, 12, 12, 1024, 64, True), (4, 16, 4, 2048, 128, True),
                  (1, 16, 16, 8192, 64, True), (256, 4, 4, 64, 32, False)]
OPTIMIZER_STAND_IN_CUDA = (768, 12, 16 * 1024)                               # width, blocks, tokens


# -----------------------------------------------------------------------------------------------------
# The shared helper: time, peak memory, and the table cells

def measure(fn, budget_s=0.5, max_iters=20):
    """(seconds per call, peak MiB above what was allocated before or None on CPU) of fn(); or (the
    reason it could not run, None), so that a broken or oversized row shows in the table instead of
    ending the run. One warm-up call (compiles and autotunes kernels), one timed call, then as many
    repeats as fill about budget_s."""
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    try:
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds = time.perf_counter() - start
        iters = max(1, min(max_iters, int(budget_s / max(seconds, 1e-6))))
        if seconds < budget_s:    # slower than that, one more call adds little accuracy
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            seconds = (time.perf_counter() - start) / iters
        return seconds, ((torch.cuda.max_memory_allocated() - base) / 2**20 if CUDA else None)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "out of memory", None
    except Exception as e:
        return f"failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]})", None


def ms(seconds) -> str:
    return seconds if isinstance(seconds, str) else f"{seconds * 1e3:.3f}"


def rate(amount: float, seconds, peak: float | None, unit: float = 1e12) -> str:
    """amount per second in `unit`s (TFLOP/s by default), with the share of `peak` (per second) if known."""
    if isinstance(seconds, str):
        return "-"
    share = f" ({100 * amount / seconds / peak:.1f}%)" if peak else ""
    return f"{amount / seconds / unit:.3g}{share}"


def mib(peak) -> str:
    return "-" if peak is None else f"{peak:.0f}"


def table(header: list, rows: list):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()


def device_line(title: str) -> tuple[float | None, str]:
    """Print the section's title with the device; return (peak FLOP/s or None, the device's name)."""
    name = torch.cuda.get_device_name() if CUDA else f"CPU ({torch.get_num_threads()} thread(s))"
    peak, note = peak_flops(DEVICE, PEAK_TFLOPS_FLAG)
    print(f"## {title}\n\n{name}, torch {torch.__version__}; peak {note}\n")
    if not CUDA:
        print("CPU: small shapes, Triton rows skipped (the interpreter is a correctness tool, not a speed path)\n")
    return peak, name


# -----------------------------------------------------------------------------------------------------
# KDA: python bench.py kda

def attention_flops(B, T, H, K):
    """Causal attention forward: QKᵀ and PV over the T²/2 causal pairs, 2·T²·K per head."""
    return 2 * B * H * T * T * K


def bench_kda():
    from kda import kda_chunk_ref, kda_flops_per_token, kda_recurrent_ref
    peak, _ = device_line("KDA: chunked Triton kernel vs references vs SDPA flash attention")
    if CUDA:
        dtype = torch.bfloat16
        H, K, tokens, lengths = (KDA_CUDA[key] for key in ("H", "K", "tokens", "lengths"))
        recurrent_max_T = 2048      # a Python loop over tokens, ~10 kernel launches each, a state per token
    else:
        dtype, H, K, tokens = torch.float32, 2, 32, 1024
        lengths, recurrent_max_T = [128, 256, 512, 1024], 1024
    methods, notes = {}, []        # name -> fn(q, k, v, g, beta) -> o
    methods["recurrent ref"] = lambda q, k, v, g, b: kda_recurrent_ref(q, k, v, g, b)[0]
    methods["chunk ref"] = lambda q, k, v, g, b: kda_chunk_ref(q, k, v, g, b)[0]
    if CUDA:
        from kda import kda
        methods["triton (this repo)"] = lambda q, k, v, g, b: kda(q, k, v, g, b, backend="triton")[0]
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            methods["fla chunk_kda"] = lambda q, k, v, g, b: fla_chunk_kda(q, k, v, g, b)[0]
        except Exception:
            notes.append("fla (flash-linear-attention) not installed: no fla chunk_kda row")

    def attention(q, k, v, g, b):                                        # SDPA takes [B, H, T, d]
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if not CUDA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    methods["SDPA flash (full attention)" if CUDA else "SDPA (full attention)"] = attention

    print(f"{str(dtype).replace('torch.', '')}, B·T = {tokens}, H = {H}, K = V = {K}\n")
    rows, fwdbwd = [], {}          # fwdbwd: (T, method) -> seconds, for the ratios below
    for T in lengths:
        B = max(1, tokens // T)
        gen = torch.Generator().manual_seed(0)
        make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
        q, k = (F.normalize(make(B, T, H, K), dim=-1).to(dtype) for _ in range(2))
        v, do = make(B, T, H, K).to(dtype), make(B, T, H, K).to(dtype)
        g, beta = F.logsigmoid(make(B, T, H, K)), make(B, T, H).sigmoid()  # float32 log decay, β
        for method, fn in methods.items():
            if method == "recurrent ref" and T > recurrent_max_T:
                continue
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            flops = attention_flops(B, T, H, K) if method.startswith("SDPA") else B * T * kda_flops_per_token(H, K, K)
            with torch.no_grad():
                fwd, _ = measure(lambda: fn(q, k, v, g, beta))
            fb, fb_mib = measure(lambda: fn(*leaves).backward(do))
            if not isinstance(fb, str):
                fwdbwd[T, method] = fb
            # the backward counted as twice the forward's FLOPs: fwd+bwd = 3 x forward
            rows.append([T, B, method, ms(fwd), rate(flops, fwd, peak), ms(fb), rate(3 * flops, fb, peak), mib(fb_mib)])
    table(["T", "B", "method", "fwd ms", "fwd TFLOP/s (% of peak)", "fwd+bwd ms", "fwd+bwd TFLOP/s (% of peak)",
           "fwd+bwd peak MiB"], rows)
    ours = "triton (this repo)"
    if any(m == ours for _, m in fwdbwd):
        # the goals: faster than flash attention from T ≈ 4k, >= 3x at 32k, within 1.5x of fla
        def ratio(T, a, b):
            return f"{fwdbwd[T, a] / fwdbwd[T, b]:.2f}" if (T, a) in fwdbwd and (T, b) in fwdbwd else "-"
        table(["T", "SDPA flash / triton (fwd+bwd time)", "triton / fla chunk_kda (fwd+bwd time)"],
              [[T, ratio(T, "SDPA flash (full attention)", ours), ratio(T, ours, "fla chunk_kda")] for T in lengths])
    notes.append(f"recurrent ref runs up to T = {recurrent_max_T} (a Python loop over tokens)")
    notes.append("FLOPs: KDA forward per token kda.kda_flops_per_token (the count MFU uses: per head 4CK for the "
                 "two decayed C x C score matrices, C(K+V) for the triangular solve, 2CV for the intra-chunk "
                 "output, 6KV for the three state products; C = 64); causal attention 2T²·K per head; "
                 "fwd+bwd = 3 x forward for both. Peak memory on CUDA only.")
    print("\n".join(f"- {n}" for n in notes) + "\n")


# -----------------------------------------------------------------------------------------------------
# Attention Residuals: python bench.py attnres

def bench_attnres():
    from attnres import attnres, attnres_ref
    _, name = device_line("AttnRes: eager vs torch.compile vs the fused Triton op")
    dtype = torch.bfloat16 if CUDA else torch.float32
    shapes = ATTNRES_CUDA if CUDA else [(4, 256, 2048), (8, 512, 1024)]   # (N sources, D, tokens)
    bandwidth = next((bw for key, bw in PEAK_GBS if key in name), None)
    eager = lambda q, v, g: attnres_ref(q, v, g, 1e-6)  # noqa: E731
    impls = [("eager reference", eager), ("torch.compile reference", torch.compile(eager))]
    if CUDA:
        impls.append(("Triton fused", lambda q, v, g: attnres(q, v, g, 1e-6, backend="triton")))
    print(f"{str(dtype).replace('torch.', '')}; GB/s counts the minimum traffic (fwd: read N·M·D + write M·D; "
          "bwd adds read N·M·D + 2·M·D, write N·M·D)\n")
    rows = []
    for N, D, M in shapes:
        esize = torch.finfo(dtype).bits // 8
        fwd_bytes = (N * M * D + M * D) * esize
        fb_bytes = fwd_bytes + (2 * N * M * D + 2 * M * D) * esize
        sources = torch.randn(N, M, D, device=DEVICE, dtype=dtype, requires_grad=True)
        query = (0.1 * torch.randn(D, device=DEVICE)).requires_grad_()
        gain = torch.ones(D, device=DEVICE, requires_grad=True)
        dout = torch.randn(M, D, device=DEVICE, dtype=dtype)

        def zero_grads():
            sources.grad = query.grad = gain.grad = None
        for label, fn in impls:
            with torch.no_grad():
                fwd, _ = measure(lambda: fn(query, sources, gain))
            fb, fb_mib = measure(lambda: (fn(query, sources, gain).backward(dout), zero_grads()))
            rows.append([N, D, M, label, ms(fwd), rate(fwd_bytes, fwd, bandwidth, 1e9), ms(fb),
                         rate(fb_bytes, fb, bandwidth, 1e9), mib(fb_mib)])
        del sources, dout
    table(["N", "D", "tokens", "impl", "fwd ms", "fwd GB/s (% of peak)", "fwd+bwd ms", "fwd+bwd GB/s (% of peak)",
           "fwd+bwd peak MiB"], rows)


# -----------------------------------------------------------------------------------------------------
# MuonClip: python bench.py muonclip

def bench_muonclip():
    from muonclip import NS_COEFFS, NS_EPS, MuonClip, max_logit, max_logit_ref, newton_schulz, newton_schulz_ref
    peak, _ = device_line("MuonClip: Newton-Schulz, the max-logit kernel, the optimizer step")
    torch_ns = getattr(getattr(torch.optim, "_muon", None), "_zeropower_via_newtonschulz", None)
    shapes = NS_CUDA if CUDA else [(256, 256), (512, 512), (256, 1024), (1024, 256)]
    rows = []
    for r, c in shapes:
        G = torch.randn(r, c, device=DEVICE)
        m, n = min(r, c), max(r, c)
        flops = 5 * (4 * m * m * n + 2 * m ** 3)               # 5 steps of X·Xᵀ, A·A and B·X, dense
        ref, ref_mib = measure(lambda: newton_schulz_ref(G))
        tri, tri_mib = measure(lambda: newton_schulz(G, backend="triton")) if CUDA else ("skipped (CPU)", None)
        routine = measure(lambda: torch_ns(G, NS_COEFFS, 5, NS_EPS))[0] if torch_ns else "n/a (torch < 2.9)"
        speedup = f"{ref / tri:.2f}x" if not isinstance(tri, str) and not isinstance(ref, str) else "-"
        rows.append([f"{r}x{c}", *(t if isinstance(t, str) else f"{ms(t)} ({rate(flops, t, peak)})"
                                   for t in (ref, tri, routine)), speedup, f"{mib(ref_mib)} / {mib(tri_mib)}"])
    print("### Newton-Schulz, 5 steps: ms (TFLOP/s, % of peak)\n")
    table(["shape", "reference", "Triton (symmetric)", "torch.optim.Muon routine", "Triton speed-up",
           "peak MiB ref / Triton"], rows)

    dt = torch.bfloat16 if CUDA else torch.float32
    rows = []
    for B, H, Hkv, T, Dh in MAX_LOGIT_CUDA if CUDA else [(2, 4, 4, 256, 32)]:
        q, v = (torch.randn(B, H, T, Dh, device=DEVICE, dtype=dt) for _ in range(2))
        k = torch.randn(B, Hkv, T, Dh, device=DEVICE, dtype=dt)
        kk, scale = k.repeat_interleave(H // Hkv, dim=1), Dh ** -0.5
        ref, ref_mib = measure(lambda: max_logit_ref(q, k, scale))
        tri, tri_mib = measure(lambda: max_logit(q, k, scale, backend="triton")) if CUDA else ("skipped (CPU)", None)
        sdpa, _ = measure(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True))
        rows.append([f"{B}, {H}, {Hkv}, {T}, {Dh}", ms(ref), ms(tri), ms(sdpa), f"{mib(ref_mib)} / {mib(tri_mib)}"])
    print("### Per-head max logit (ms): explicit logits vs the online Triton kernel vs an SDPA forward for scale\n")
    table(["B, H, Hkv, T, Dh", "reference (T x T)", "Triton (online)", "SDPA causal forward",
           "peak MiB ref / Triton"], rows)
    _attention_max_logit_rows(max_logit, max_logit_ref)
    _optimizer_step_share(MuonClip)


def _attention_max_logit_rows(max_logit, max_logit_ref):
    """Attention + max logit as a training forward needs them: SDPA + the separate max-logit pass (what
    model.py runs without the fused kernel: the Triton max-logit kernel on CUDA, the reference on CPU) vs the
    fused kernel (kernels/attention.py), forward and forward+backward, and the fused path's largest error."""
    from muonclip import attention_max_logit
    dt = torch.bfloat16 if CUDA else torch.float32
    rows = []
    for B, H, Hkv, T, Dh, causal in ATTENTION_CUDA if CUDA else [(2, 4, 2, 96, 32, True), (8, 2, 2, 16, 16, False)]:
        gen = torch.Generator().manual_seed(0)
        q, do = (torch.randn(B, H, T, Dh, generator=gen).to(DEVICE, dt) for _ in range(2))
        k, v = (torch.randn(B, Hkv, T, Dh, generator=gen).to(DEVICE, dt) for _ in range(2))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        scale = Dh ** -0.5

        def separate(q, k, v):
            kk, vv = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))         # as model._attend does
            y = F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)
            return y, max_logit(q.detach(), k.detach(), scale, "triton" if CUDA else "ref", causal)

        def fused(q, k, v):
            return attention_max_logit(q, k, v, scale, causal)
        times = []
        for fn in (separate, fused):
            with torch.no_grad():
                fwd, _ = measure(lambda: fn(q, k, v))
            fb, fb_mib = measure(lambda: fn(*leaves)[0].backward(do))
            times.append((fwd, fb, fb_mib))
        # the fused path's error against the float32 reference (SDPA, max_logit_ref) on the same inputs
        ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        for x in leaves:
            x.grad = None                                                            # the timed calls added up
        (o_ref, _), (o, m) = separate(*ref_leaves), fused(*leaves)
        o_ref.backward(do.float())
        o.backward(do)
        m_ref = max_logit_ref(ref_leaves[0], ref_leaves[1], scale, causal)
        err = [(a.float() - b).abs().max().item() for a, b in ((o, o_ref), (m, m_ref), (leaves[0].grad, ref_leaves[0].grad))]
        (sep_fwd, sep_fb, sep_mib), (fused_fwd, fused_fb, fused_mib) = times
        speedup = "-" if isinstance(sep_fb, str) or isinstance(fused_fb, str) else f"{sep_fb / fused_fb:.2f}x"
        rows.append([f"{B}, {H}, {Hkv}, {T}, {Dh}, {'causal' if causal else 'bidir'}", ms(sep_fwd), ms(fused_fwd),
                     ms(sep_fb), ms(fused_fb), speedup if CUDA else "- (interpreter)", f"{mib(sep_mib)} / {mib(fused_mib)}",
                     " / ".join(f"{e:.1e}" for e in err)])
    print("### attention + max logit: fused vs SDPA + separate pass (ms)\n")
    if not CUDA:
        print("CPU: the fused kernel runs in Triton's interpreter, so its times say nothing; the error column checks it\n")
    table(["B, H, Hkv, T, Dh, mask", "SDPA + separate pass fwd", "fused fwd", "SDPA + separate pass fwd+bwd",
           "fused fwd+bwd", "fwd+bwd speed-up", "fwd+bwd peak MiB separate / fused",
           f"fused max abs error o / max logit / dq ({str(dt).replace('torch.', '')} vs float32 reference)"], rows)


def _optimizer_step_share(MuonClip):
    """Optimizer step vs a training step, on a stand-in with GPT-2-small's matrices: 12 blocks of (q, k, v,
    o, fc 4x, proj) Linear layers in sequence, whose forward+backward costs ~6·N·tokens FLOPs like a
    transformer's matmuls (attention itself excluded)."""
    d, n_layer, tokens = OPTIMIZER_STAND_IN_CUDA if CUDA else (128, 2, 1024)
    layers = []
    for _ in range(n_layer):
        layers += [nn.Linear(d, d, bias=False) for _ in range(4)]
        layers += [nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False)]
    model = nn.Sequential(*layers).to(DEVICE)
    x = torch.randn(tokens, d, device=DEVICE)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if CUDA else torch.autocast("cpu", enabled=False)

    def train_step():
        with amp:
            model(x).float().square().mean().backward()
    fb, _ = measure(train_step)
    rows = []
    for name in ["adamw"] + [f"muon ({b})" for b in (["ref", "triton"] if CUDA else ["ref"])]:
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, fused=CUDA) if name == "adamw" else
               MuonClip.from_model(model, lr=1e-4, ns_backend=name.split("(")[1][:-1]))
        step, _ = measure(opt.step)
        share = "-" if isinstance(step, str) or isinstance(fb, str) else f"{100 * step / (fb + step):.1f}%"
        rows.append([name, ms(step), ms(fb), share])
    print(f"### Optimizer step vs training step (stand-in: {n_layer} blocks of d={d} Linear layers, "
          f"{tokens} tokens per step)\n")
    table(["optimizer", "step (ms)", "fwd+bwd (ms)", "step / (fwd+bwd+step)"], rows)


# -----------------------------------------------------------------------------------------------------
# Agent Swarm runtime: python bench.py swarm

def _noop_worker(system_prompt, task):
    for _ in range(task["steps"]):
        yield
    return task["steps"]


def bench_swarm(n_agents=100, steps_each=15, sleep_s=0.001, repeats=3):
    """Runtime overhead at K2.5's scale: n_agents concurrent sub-agents, n_agents x steps_each steps."""
    from swarm_runtime import SwarmRuntime
    print(f"## Swarm runtime: {n_agents} concurrent sub-agents x {steps_each} steps = {n_agents * steps_each} steps "
          f"in one episode\n\n{os.cpu_count()} CPUs, torch {torch.__version__}. No Triton path here: the runtime is "
          "plain Python (concurrent.futures); nothing to compare against.\n")
    rows = []
    for step_cost in (0.0, sleep_s):
        for kind in ("inline", "thread", "process"):
            pool, width = None, 1
            if kind == "thread":
                pool, width = cf.ThreadPoolExecutor(n_agents), n_agents
            elif kind == "process":
                width = min(8, os.cpu_count() or 1)
                pool = cf.ProcessPoolExecutor(width)
            walls = []
            for _ in range(repeats + 1):     # the first warms the pool up
                rt = SwarmRuntime(_noop_worker, executor=pool or "inline", max_subagents=n_agents,
                                  sub_step_budget=steps_each, step_delay=step_cost)
                t0 = time.perf_counter()
                for i in range(n_agents):
                    rt.assign_task(rt.create_subagent(f"a{i}", "You are a worker."), {"steps": steps_each})
                trace = rt.answer(None)
                walls.append(time.perf_counter() - t0)
                assert trace.total_steps == n_agents * steps_each + 1 and trace.critical_steps == steps_each + 1
            if pool:
                pool.shutdown()
            wall = min(walls[1:])
            ideal = steps_each * step_cost * math.ceil(n_agents / width)   # waves of `width` at a time
            rows.append([f"{kind} ({width} at once)", f"{step_cost * 1e3:.0f} ms", f"{wall * 1e3:.1f}",
                         f"{ideal * 1e3:.1f}", f"{(wall - ideal) / (n_agents * steps_each) * 1e6:.1f}"])
    table(["executor", "step cost", "wall (ms)", "ideal (ms)", "overhead / step (us)"], rows)


SECTIONS = {"kda": bench_kda, "attnres": bench_attnres, "muonclip": bench_muonclip, "swarm": bench_swarm}


def main(argv=None, prog=None):
    from runs import bounded
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="+", choices=[*SECTIONS, "all"], metavar="OP",
                        help=f"{' | '.join(SECTIONS)} | all")
    parser.add_argument("--threads", type=bounded(int, 0, os.cpu_count()), default=0, help="CPU threads for torch (0: torch's default)")
    parser.add_argument("--peak_tflops", type=bounded(float, 0), default=0.0,
                        help="the device's dense bf16 peak for the %% of peak columns; 0 = look the GPU up in "
                             "kernels.launch.PEAK_TFLOPS")
    args = parser.parse_args(argv)
    global PEAK_TFLOPS_FLAG
    PEAK_TFLOPS_FLAG = args.peak_tflops
    if args.threads:
        torch.set_num_threads(args.threads)
    for op in SECTIONS if "all" in args.ops else dict.fromkeys(args.ops):
        SECTIONS[op]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
