"""The ahead-of-time compile check's machinery (tests/compile_check.py), fast enough for every run.

The full check (every launch configuration x sm_90/sm_80, a few minutes) runs in CI as
`python tests/compile_check.py`; these tests make sure it still finds every kernel, records a launch for
each, specialises them for both targets, and reads registers, spills and shared memory from a real compile.
"""
import json
import os
import subprocess
import sys

import pytest

import compile_check as cc

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def recorded():
    return cc.jobs(cc.workloads())


def test_every_kernel_has_a_recorded_gpu_launch(recorded):
    jobs, hit = recorded
    known = cc.all_kernels()
    # the five kernel files: 8 KDA kernels, 2 AttnRes, 1 max-logit, 1 Newton-Schulz Gram, 3 fused attention
    assert len(known) >= 15, sorted(known)
    assert set(known) <= hit, f"kernels no workload launches: {sorted(set(known) - hit)}"
    assert {j["capability"] for j in jobs} == set(cc.TARGETS)


def test_gpu_configuration_is_recorded_not_the_interpreter_one(recorded):
    jobs, _ = recorded
    # the Newton-Schulz Gram kernel is autotuned on a GPU: every autotune config must be compiled
    from kernels.newton_schulz import _GPU_CONFIGS, _GPU_CONFIGS_FP32
    ns = [j["config"] for j in jobs if j["name"] == "_sym_gram_kernel"]
    for c in _GPU_CONFIGS + _GPU_CONFIGS_FP32:
        want = (f"BLOCK={c.kwargs['BLOCK']} BLOCK_K={c.kwargs['BLOCK_K']}", f"w{c.num_warps} s{c.num_stages}")
        assert any(all(w in cfg for w in want) for cfg in ns), f"autotune config {c} not compiled"
    # KDA on a GPU: bf16 inputs take the precision plan's bf16 operands (PLAN=1) with 16-wide key slices;
    # the interpreter would use the emulated plan (PLAN=2) and whole rows
    kda = [j for j in jobs if j["name"] == "_intra_fwd"]
    assert kda and all(j["plan"] == 1 and "BKD=16" in j["config"] for j in kda if "bfloat16" in j["config"])
    assert {j["plan"] for j in kda} == {0, 1}   # bf16 training and the float32 GPU test


def test_compile_reads_registers_spills_and_shared_memory(tmp_path):
    # a process of its own: this one imported Triton in interpreter mode (conftest), where triton.language's
    # @jit helpers such as tl.max are interpreter objects the compiler cannot use
    code = ("import json, compile_check as cc; jobs, _ = cc.jobs(cc.workloads()); "
            "job = next(j for j in jobs if j['name'] == '_max_logit_kernel' and j['capability'] == 90); "
            "res = cc.compile_one(job); print(json.dumps([res, cc.verdict(job, res)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res, verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in res, res
    assert 16 <= res["regs"] <= 255 and res["smem"] > 0 and res["spill_st"] >= 0
    assert verdict in ("ok", "FAIL spill")


def test_verdict_fails_spills_smem_overflow_and_a_bf16_kda_kernel_without_bf16_tensor_cores():
    base = dict(regs=255, spill_st=8, spill_ld=8, smem=1024, mma={"mma.bf16": 4})
    kda = dict(module="kernels.kda", name="_intra_fwd", capability=90, plan=1)
    assert cc.verdict(dict(module="kernels.attnres", name="x", capability=90), base) == "FAIL spill"
    assert cc.verdict(kda, base) == "FAIL spill"                       # the bf16 path must not spill
    assert cc.verdict(dict(kda, plan=0), base).startswith("spill")     # float32 accuracy path: reported
    assert cc.verdict(dict(kda, capability=80), dict(base, smem=200_000)) == "FAIL smem"
    no_spill = dict(base, spill_st=0, spill_ld=0)
    assert cc.verdict(kda, no_spill) == "ok"
    assert cc.verdict(kda, dict(no_spill, mma={"wgmma.bf16": 2, "mma.tf32": 9})) == "ok"
    assert cc.verdict(kda, dict(no_spill, mma={"mma.tf32": 9})) == "FAIL no bf16 tensor cores"
    assert cc.verdict(dict(kda, name="_cumsum_fwd"), dict(no_spill, mma={})) == "ok"   # no products
    assert cc.verdict(dict(kda, plan=0), dict(no_spill, mma={"mma.tf32": 9})) == "ok"
    assert cc.verdict(kda, dict(error="x")) == "FAIL compile"
    attention = dict(module="kernels.attention", name="_attn_fwd_kernel", capability=80,
                     config="bfloat16/float32 IEEE_FP32=False CAUSAL=True BLOCK_M=64")
    assert cc.verdict(attention, dict(no_spill, mma={"mma.bf16": 64})) == "ok"
    assert cc.verdict(attention, dict(no_spill, mma={})) == "FAIL no bf16 tensor cores"
    assert cc.verdict(dict(attention, config="float32 IEEE_FP32=True"), dict(no_spill, mma={})) == "ok"


def test_tensor_core_mix_reads_operand_types_from_ptx():
    ptx = """
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2}, {%r1}, {%r2}, {%f3};
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f4, %f5}, {%r3}, {%r4}, {%f6};
    mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f7}, {%r5}, {%r6}, {%f8};
    wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%f9}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.fence.sync.aligned;
    """
    assert cc.tensor_core_mix(ptx) == {"mma.bf16": 2, "mma.tf32": 1, "wgmma.bf16": 1}
