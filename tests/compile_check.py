"""Ahead-of-time compile check: every Triton kernel, in every launch configuration a GPU run uses, built
for sm_90 and sm_80 with Triton's own compiler on a machine without a GPU.

    python tests/compile_check.py            # the table, then PASS/FAIL; exit status 1 on a failure
    python tests/compile_check.py --jobs=1   # compile processes (default 2)

Where the launches come from: the launch wrappers themselves. Each workload below calls the wrappers of
kernels/ with `meta` tensors (shapes and strides only) inside kernels.launch.record(), which makes them
take their GPU configuration and captures every `kernel[grid](*args, **kwargs)` instead of running it;
an autotuned kernel contributes each of its configs. So a new block size, autotune config or kernel
variant is checked without editing this file. What this file lists is the workloads (shapes and dtypes):
the GPU default training config (read from train.py), the benchmark shapes (bench.py) and the GPU test shapes. Every
@triton.jit kernel found in kernels/ must appear in at least one recorded launch.

Each launch is specialised as a real launch would be (Triton's own argument binder: pointer and integer
divisibility by 16, integers equal to 1 folded into constants), compiled with triton.compile for
GPUTarget("cuda", 90 | 80, 32), and read back: shared memory from the compiled metadata, registers and
spill bytes from the `ptxas -v` report of Triton's bundled ptxas (knobs.nvidia.dump_ptxas_log), and the
tensor-core instruction mix from the PTX: mma.sync / wgmma counted by operand type (bf16, f16, tf32, ...).

Fails on: a compile error; shared memory above the card's per-block limit (H100/H200 232,448 B,
A100 166,912 B); any spill, except in the KDA kernels' float32 accuracy path (PLAN_FP32: float32 inputs,
which only tests use; reported); a KDA kernel that the precision plan gives bf16 products
(kernels.kda.BF16_TENSOR_CORE_KERNELS), or a fused-attention kernel (kernels/attention.py) on bf16 inputs,
compiling to no bf16 tensor-core instruction on the 16-bit path.
Works with Triton 3.6 and 3.9 (both expose create_function_from_signature and JITFunction._pack_args).
"""
import argparse
import contextlib
import importlib
import io
import itertools
import os
import pkgutil
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kernels.launch import record  # noqa: E402

TARGETS = {90: 232_448, 80: 166_912}   # compute capability -> max dynamic shared memory per block (bytes)
# tests/test_attention.py's bf16 shapes (B, H, Hkv, T, Dh), restated: importing a test module would switch
# Triton to its interpreter
ATTENTION_GPU_TESTS = [(2, 4, 4, 1, 64), (2, 8, 2, 1000, 64), (1, 4, 1, 777, 128), (2, 6, 3, 130, 60)]
# ... and its float32 tests, which a GPU runs on CUDA tensors (and the model/ViT wiring tests), plus Dh = 128
ATTENTION_FP32_TESTS = [(2, 2, 2, 1, 16), (2, 4, 2, 63, 32), (1, 4, 1, 100, 60), (1, 2, 2, 130, 64),
                        (2, 4, 2, 37, 16), (3, 2, 2, 17, 16), (1, 2, 2, 100, 128)]
BF16, FP32 = torch.bfloat16, torch.float32


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


# ------------------------------------------------------------------------------------------------
# Workloads: (name, function that calls the launch wrappers with meta tensors)

def _kda(B, T, H, K, V, dtype, gate_dtype, state=True):
    """Forward and backward (with initial and final state if `state`) of the chunked KDA kernels, as autograd runs them."""
    import kernels.kda as kk

    def run():
        q, k, v = _meta(B, T, H, K, dtype=dtype), _meta(B, T, H, K, dtype=dtype), _meta(B, T, H, V, dtype=dtype)
        g, beta = _meta(B, T, H, K, dtype=gate_dtype), _meta(B, T, H, dtype=gate_dtype)
        h0 = _meta(B, H, K, V, dtype=FP32) if state else None
        kk._forward(q, k, v, g, beta, K ** -0.5, h0, state)
        dht = _meta(B, H, K, V, dtype=FP32) if state else None
        kk._backward(q, k, v, g, beta, K ** -0.5, h0, _meta(B, T, H, V, dtype=dtype), dht)
    return run


def _max_logit(B, H, Hkv, T, Dh, dtype, transposed=True, causal=True):
    """q, k as model.py passes them: [B, H, T, Dh] views of [B, T, H, Dh] projections (or contiguous);
    causal=False is the ViT's bidirectional attention (vision.py)."""
    from kernels.max_logit import max_logit_triton

    def run():
        if transposed:
            q, k = _meta(B, T, H, Dh, dtype=dtype).transpose(1, 2), _meta(B, T, Hkv, Dh, dtype=dtype).transpose(1, 2)
        else:
            q, k = _meta(B, H, T, Dh, dtype=dtype), _meta(B, Hkv, T, Dh, dtype=dtype)
        max_logit_triton(q, k, Dh ** -0.5, causal)
    return run


def _attention(B, H, Hkv, T, Dh, dtype, causal=True, transposed=True):
    """The fused attention + max logit (kernels/attention.py), forward and backward as autograd runs them; q,
    k, v as model.py passes them ([B, H, T, Dh] views of [B, T, H, Dh] projections) or contiguous;
    causal=False is the ViT's bidirectional attention (vision.py)."""
    import kernels.attention as ka

    def run():
        if transposed:
            q, k, v = (_meta(B, T, n, Dh, dtype=dtype).transpose(1, 2) for n in (H, Hkv, Hkv))
        else:
            q, k, v = (_meta(B, n, T, Dh, dtype=dtype) for n in (H, Hkv, Hkv))
        o, lse, _ = ka.attention_fwd(q, k, v, Dh ** -0.5, causal)
        ka.attention_bwd(q, k, v, o, lse, _meta(B, T, H, Dh, dtype=dtype).transpose(1, 2), Dh ** -0.5, causal)
    return run


def _ns(shapes, dtype):
    """Newton-Schulz on matrices of these shapes (a leading batch dim allowed): the two Gram kernels."""
    from kernels.newton_schulz import newton_schulz_triton
    from muonclip import NS_COEFFS, NS_EPS

    def run():
        for shape in shapes:
            newton_schulz_triton(_meta(*shape, dtype=FP32), 1, NS_COEFFS, NS_EPS, dtype)
    return run


def _attnres(N, M, D, dtype, S=1, backward=True):
    from kernels.attnres import attnres_bwd, attnres_fwd

    def run():
        sources, queries = _meta(N, M, D, dtype=dtype), _meta(S, D, dtype=FP32)
        out, _, lse = attnres_fwd(sources, queries, 1e-6)
        if backward:
            attnres_bwd(sources, queries, out, lse, _meta(S, M, D, dtype=dtype), _meta(S, M, dtype=FP32), 1e-6)
    return run


def _model(label, c, B, attnres=True):
    """The kernel launches of one training step of model.Config c at batch B under bf16 autocast: KDA
    layers (float32 gates), the attention layers (fused with their max logit: QK-Clip is on), Newton-Schulz
    on every Muon matrix, and (if `attnres`) block AttnRes reads over a growing number of sources."""
    from model import GPT
    T, D, H = c.block_size, c.n_embd, c.n_head
    Hkv, Dh = c.n_kv_head or H, D // H
    Hk, Kk = c.kda_n_head or H, c.kda_head_dim or D // H
    with torch.device("meta"):
        model = GPT(c)
    # Muon matrices: every 2-D Linear weight but the head, stacked by shape as MuonClip orthogonalises them
    mats = sorted({tuple(m.weight.shape) for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")})
    work = [(f"{label}: attention + max logit B={B} T={T} H={H} Hkv={Hkv} Dh={Dh}", _attention(B, H, Hkv, T, Dh, BF16)),
            (f"{label}: Newton-Schulz {len(mats)} shapes", _ns(mats, BF16))]
    if c.vision and c.vision_n_layer:  # the ViT's bidirectional max logit, over a 32 x 32 image's patches
        Hv, Dv = c.vision_n_head, c.vision_n_embd // c.vision_n_head
        Nv = (32 // c.vision_patch_size) ** 2
        work.append((f"{label}: ViT attention + max logit (bidirectional) G={B} N={Nv} H={Hv} Dh={Dv}",
                     _attention(B, Hv, Hv, Nv, Dv, BF16, causal=False)))
    if "K" in c.pattern:
        work.insert(0, (f"{label}: KDA B={B} T={T} H={Hk} K=V={Kk}", _kda(B, T, Hk, Kk, Kk, BF16, FP32, state=False)))
    if attnres:
        # sources grow from 1 to a few blocks; two-phase decoding reads S = two_phase_group queries at
        # once (forward only)
        for n in (1, 2, 3, 5):
            work.append((f"{label} + attnres_block: N={n} M={B * T} D={D}", _attnres(n, B * T, D, BF16)))
        work.append((f"{label}: generate() two-phase S=4, D={D}", _attnres(3, B, D, BF16, S=4, backward=False)))
    return work


def _gpu_default_model():
    """The GPU default of train.py (TrainConfig.model) with its batch, what `python train.py` launches on a
    GPU; its block-AttnRes variant; and the tiny model of tests/test_e2e.py, which tests/gpu.sh runs on
    a GPU (its config is restated here: importing the test would switch Triton to its interpreter)."""
    import train
    from model import Config
    tc = train.TrainConfig()
    work = _model("train.py GPU default", tc.model, tc.batch_size)
    e2e = Config(vocab_size=50304, block_size=80, n_layer=4, n_head=2, n_embd=32, pattern="KKKA",
                 residual="attnres_block", attnres_block_size=2, vision=True)
    e2e.vision_n_embd, e2e.vision_n_layer, e2e.vision_n_head = 16, 1, 2
    return work + _model("tests/test_e2e.py on a GPU", e2e, 3)


def workloads():
    # import kernels/ first: bench.py sets TRITON_INTERPRET=1 on a machine without CUDA, and a kernel module
    # imported after that would hand the compiler interpreter objects for its device functions (plan_dot)
    all_kernels()
    import bench   # the benchmark shapes on CUDA, as bench.py defines them
    work = _gpu_default_model()
    # python bench.py kda (CUDA): bf16 q/k/v, float32 g and beta, forward and backward at every length
    kb = bench.KDA_CUDA
    for T in kb["lengths"]:
        work.append((f"bench.py kda T={T}", _kda(kb["tokens"] // T, T, kb["H"], kb["K"], kb["K"], BF16, FP32,
                                                  state=False)))
    # python bench.py muonclip (CUDA): Newton-Schulz in bf16 (and MuonClip's step on the stand-in model's
    # stacked matrices); max logit (B, H, Hkv, T, Dh) in bf16
    work.append(("bench.py muonclip: Newton-Schulz", _ns(bench.NS_CUDA, BF16)))
    d, n_layer, _ = bench.OPTIMIZER_STAND_IN_CUDA
    work.append(("bench.py muonclip: optimizer step",
                 _ns([(4 * n_layer, d, d), (n_layer, 4 * d, d), (n_layer, d, 4 * d)], BF16)))
    for B, H, Hkv, T, Dh in bench.MAX_LOGIT_CUDA:
        work.append((f"bench.py muonclip: max logit Dh={Dh}", _max_logit(B, H, Hkv, T, Dh, BF16, transposed=False)))
    # ... and attention + max logit fused, forward and backward (B, H, Hkv, T, Dh, causal) in bf16
    for B, H, Hkv, T, Dh, causal in bench.ATTENTION_CUDA:
        work.append((f"bench.py muonclip: attention + max logit T={T} Dh={Dh} causal={causal}",
                     _attention(B, H, Hkv, T, Dh, BF16, causal, transposed=False)))
    # python bench.py attnres (CUDA): (N, D, tokens) in bf16
    for N, D, M in bench.ATTNRES_CUDA:
        work.append((f"bench.py attnres N={N} D={D}", _attnres(N, M, D, BF16)))
    # GPU tests (pytest -m gpu): tests/test_kda_triton.py, test_kda.py, test_muonclip.py, test_attnres.py
    work += [
        ("test_kda_triton bf16 T=4096 K=V=128", _kda(1, 4096, 2, 128, 128, BF16, BF16)),
        ("test_kda_triton bf16 T=500 K=100 V=60", _kda(1, 500, 2, 100, 60, BF16, BF16)),
        ("test_kda_triton fp32 T=300 K=V=128", _kda(2, 300, 2, 128, 128, FP32, FP32)),
        ("test_kda_triton strong decay H=4 K=V=128", _kda(2, 4096, 4, 128, 128, BF16, BF16)),
        ("test_kda layer bf16 autocast H=2 K=V=128", _kda(2, 130, 2, 128, 128, BF16, FP32)),
        ("test_muonclip NS bf16 + fp32",
         _ns([(1024, 1024), (768, 3072), (3072, 768), (6, 256, 384), (300, 200)], BF16)),
        ("test_muonclip NS fp32", _ns([(1024, 1024), (768, 3072), (3072, 768), (6, 256, 384), (300, 200)], FP32)),
    ]
    for T, Dh, H, Hkv in [(1, 64, 4, 4), (257, 64, 8, 2), (1000, 128, 4, 1), (130, 48, 6, 3)]:
        for dtype in (FP32, BF16):
            for causal in (True, False):
                work.append((f"test_muonclip max logit Dh={Dh} {dtype} causal={causal}",
                             _max_logit(2, H, Hkv, T, Dh, dtype, transposed=False, causal=causal)))
    for dtype, shapes in ((BF16, ATTENTION_GPU_TESTS), (FP32, ATTENTION_FP32_TESTS)):   # tests/test_attention.py
        for (B, H, Hkv, T, Dh), causal in itertools.product(shapes, (True, False)):
            work.append((f"test_attention {dtype} T={T} Dh={Dh} causal={causal}",
                         _attention(B, H, Hkv, T, Dh, dtype, causal)))
    for D in (64, 100, 768):
        work.append((f"test_attnres bf16 D={D}", _attnres(9, 3 * 257, D, BF16)))
    work.append(("test_attnres fp32 D=1024", _attnres(8, 4 * 2048, 1024, FP32)))
    work.append(("test_attnres two-phase fp32 backward S=3", _attnres(4, 3 * 257, 100, FP32, S=3)))
    return work


# ------------------------------------------------------------------------------------------------
# Launches -> compile jobs

_JIT = {}


def _jit(kernel) -> JITFunction:
    """A compilable JITFunction for a kernel object. Under TRITON_INTERPRET=1 (pytest on CPU) @triton.jit
    gives InterpretedFunction objects, so one is built from the same Python function."""
    if isinstance(kernel, Autotuner):
        kernel = kernel.fn
    if isinstance(kernel, JITFunction):
        return kernel
    if kernel.fn not in _JIT:
        _JIT[kernel.fn] = JITFunction(kernel.fn)
    return _JIT[kernel.fn]


def all_kernels() -> dict:
    """Every @triton.jit kernel defined in a module of kernels/: {"module.name": kernel object}. A jit
    function that another jit function of kernels/ calls (a device function, e.g. kernels/precision.py's
    plan_dot) is compiled into its callers, not launched, so it is not listed."""
    import inspect
    import kernels
    jitted = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, Autotuner):
                obj = obj.fn
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__module__ == module.__name__:
                jitted[f"{module.__name__}.{obj.fn.__name__}"] = obj
    sources = {key: inspect.getsource(obj.fn) for key, obj in jitted.items()}
    return {key: obj for key, obj in jitted.items()
            if not any(re.search(rf"\b{obj.fn.__name__}\(", src) for other, src in sources.items() if other != key)}


def _expand(launch):
    """(JITFunction, args, kwargs) per launch; an Autotuner gives one per config."""
    if isinstance(launch.kernel, Autotuner):
        for cfg in launch.kernel.configs:
            kw = dict(launch.kwargs)
            kw.update(cfg.all_kwargs())
            yield _jit(launch.kernel), launch.args, kw
    else:
        yield _jit(launch.kernel), launch.args, dict(launch.kwargs)


def specialise(fn: JITFunction, args, kwargs, capability: int):
    """What JITFunction.run would hand to the compiler for this call on this target."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def describe(fn, constexprs, options) -> str:
    """The launch configuration in words: the declared tl.constexpr arguments, warps and stages."""
    parts = [f"{fn.params[path[0]].name}={val}" for path, val in constexprs.items()
             if len(path) == 1 and fn.params[path[0]].is_constexpr]
    return " ".join(parts + [f"w{options['num_warps']}", f"s{options['num_stages']}"])


def jobs(work):
    """Record every workload, specialise every launch for both targets, and deduplicate."""
    seen, out, kernels_hit = {}, [], set()
    for wname, run in work:
        with record() as launches:
            run()
        for launch in launches:
            for fn, args, kwargs in _expand(launch):
                kname = f"{fn.fn.__module__}.{fn.fn.__name__}"
                kernels_hit.add(kname)
                dtypes = sorted({str(a.dtype).replace("torch.", "") for a in (*args, *kwargs.values())
                                 if isinstance(a, torch.Tensor)})
                for cap in TARGETS:
                    sig, constexprs, attrs, options = specialise(fn, args, kwargs, cap)
                    key = (kname, cap, repr(sig), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
                           options["num_warps"], options["num_stages"])
                    if key in seen:
                        continue
                    seen[key] = True
                    named = {fn.params[p[0]].name: v for p, v in constexprs.items() if len(p) == 1}
                    out.append(dict(kernel=kname, module=fn.fn.__module__, name=fn.fn.__name__, capability=cap,
                                    config=f"{'/'.join(dtypes)} {describe(fn, constexprs, options)}", workload=wname,
                                    plan=named.get("PLAN"), signature=sig, constexprs=constexprs, attrs=attrs,
                                    options=options))
    return out, kernels_hit


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_MMA = re.compile(r"\b(wgmma\.mma_async|mma)\.sync\.aligned\.(\S+)")
_TYPES = ("bf16", "f16", "tf32", "f32", "e4m3", "e5m2", "s8", "u8", "f64")


def tensor_core_mix(ptx: str) -> dict:
    """Tensor-core instructions in PTX, counted by kind and operand type: {"mma.bf16": 24, "wgmma.tf32": 6}.
    The operand (A/B) type is the second to last type in the instruction's suffix: mma.sync.aligned.
    m16n8k16.row.col.f32.bf16.bf16.f32 (D, A, B, C) and wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16
    (D, A, B) both read bf16."""
    mix = {}
    for kind, suffix in _MMA.findall(ptx):
        types = [t for t in suffix.rstrip(",;").split(".") if t in _TYPES]
        key = f"{'wgmma' if kind.startswith('wgmma') else 'mma'}.{types[-2] if len(types) >= 2 else '?'}"
        mix[key] = mix.get(key, 0) + 1
    return mix


def compile_one(job):
    """Compile one job in this process; returns regs, spill stores/loads, shared memory, or the error."""
    fn = _jit(getattr(importlib.import_module(job["module"]), job["name"]))
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, job["signature"], job["constexprs"], job["attrs"]),
                               target=GPUTarget("cuda", job["capability"], 32), options=job["options"])
    except Exception as e:  # noqa: BLE001 - a compile error is a result to report
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}",
                    seconds=time.time() - t0)
    text = log.getvalue()
    regs, spills = _PTXAS.search(text), _SPILL.search(text)
    if regs is None or spills is None:
        return dict(error=f"no ptxas -v report in the compiler output: {text[-200:]!r}", seconds=time.time() - t0)
    return dict(regs=int(regs.group(1)), spill_st=int(spills.group(1)), spill_ld=int(spills.group(2)),
                smem=int(k.metadata.shared), mma=tensor_core_mix(k.asm["ptx"]), seconds=time.time() - t0)


def verdict(job, res) -> str:
    from kernels.kda import BF16_TENSOR_CORE_KERNELS
    from kernels.precision import PLAN_BF16, PLAN_FP32
    kda = job["module"] == "kernels.kda"
    if "error" in res:
        return "FAIL compile"
    if res["smem"] > TARGETS[job["capability"]]:
        return "FAIL smem"
    if res["spill_st"] or res["spill_ld"]:
        # KDA's float32 inputs (PLAN_FP32) are the accuracy path tests use: exact float32 tiles at K = 128
        # do not fit the registers; reported, not failed
        fp32_path = kda and job.get("plan") == PLAN_FP32.value
        return "spill (KDA fp32 accuracy path, reported)" if fp32_path else "FAIL spill"
    # the KDA kernels that the precision plan gives bf16 products, and every fused-attention kernel on bf16
    # inputs, must multiply on bf16 tensor cores
    wants_bf16 = (kda and job.get("plan") == PLAN_BF16.value and job["name"] in BF16_TENSOR_CORE_KERNELS) or \
        (job["module"] == "kernels.attention" and job.get("config", "").startswith("bfloat16"))
    if wants_bf16 and not res.get("mma", {}).get("mma.bf16") and not res.get("mma", {}).get("wgmma.bf16"):
        return "FAIL no bf16 tensor cores"
    return "ok"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="compile processes")
    ap.add_argument("--only", default="", help="only kernels whose name contains one of these (comma-separated)")
    ap.add_argument("--progress", action="store_true", help="a line on stderr per finished compile")
    ap.add_argument("--workload", default="", help="only launches first seen in a workload containing one of these")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # triton.language's own @jit helpers (tl.max, tl.cumsum, ...) are interpreter objects then
        sys.exit("compile_check: unset TRITON_INTERPRET; Triton imported in interpreter mode cannot compile")
    # a private, empty cache: every compile then runs ptxas (a cache hit would leave no register report)
    cache = tempfile.mkdtemp(prefix="kimi_nano_compile_check_")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (3.10 changes it)
    try:
        return _run(a)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run(a):
    t0 = time.time()
    known = all_kernels()
    todo, hit = jobs(workloads())
    todo = [j for j in todo if any(part in j["kernel"] for part in a.only.split(","))
            and any(part in j["workload"] for part in a.workload.split(","))]
    print(f"Triton {triton.__version__}, torch {torch.__version__}: {len(known)} kernels in kernels/, "
          f"{len(todo)} compiles ({len(todo) // len(TARGETS)} launch configurations x sm_90a/sm_80), "
          f"{a.jobs} processes\n")
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = []
        for job, res in zip(todo, pool.map(compile_one, todo, chunksize=1)):
            results.append(res)
            if a.progress:
                print(f"  [{len(results)}/{len(todo)} {time.time() - t0:.0f} s] {job['name']} {job['config']} "
                      f"sm_{job['capability']}: {verdict(job, res)} {res}", file=sys.stderr, flush=True)
    print("| kernel | config | target | regs | spill st/ld B | smem B | tensor-core instructions | verdict "
          "| first workload |")
    print("|---|---|---|---|---|---|---|---|---|")
    order = sorted(range(len(todo)), key=lambda i: (todo[i]["kernel"], todo[i]["config"], -todo[i]["capability"]))
    counts = {}
    for i in order:
        job, res = todo[i], results[i]
        v = verdict(job, res)
        counts[v] = counts.get(v, 0) + 1
        if "error" in res:
            cells = ["-", "-", "-", "-", res["error"]]
        else:
            mix = " ".join(f"{k}x{n}" for k, n in sorted(res["mma"].items())) or "-"
            cells = [str(res["regs"]), f"{res['spill_st']}/{res['spill_ld']}", f"{res['smem']:,}", mix, v]
        print(f"| {job['name']} | {job['config']} | sm_{job['capability']} | " + " | ".join(cells)
              + f" | {job['workload']} |")
    missing = sorted(set(known) - hit)
    failed = sum(n for v, n in counts.items() if v.startswith("FAIL")) + len(missing)
    print(f"\n{len(todo)} compiles in {time.time() - t0:.0f} s: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    if missing:
        print(f"FAIL: kernels with no recorded launch (add a workload): {', '.join(missing)}")
    print("PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
