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
    # the four kernel files: 8 KDA kernels, 2 AttnRes, 1 max-logit, 1 Newton-Schulz Gram
    assert len(known) >= 12, sorted(known)
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
    # KDA on a GPU runs tf32 dots with 16-wide key slices; the interpreter uses ieee and whole rows
    kda = [j for j in jobs if j["name"] == "_intra_fwd"]
    assert kda and all("PREC=tf32" in j["config"] and "BKD=16" in j["config"] for j in kda if "bfloat16" in j["config"])


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


def test_verdict_fails_spills_outside_kda_and_smem_overflow():
    base = dict(regs=255, spill_st=8, spill_ld=8, smem=1024)
    assert cc.verdict(dict(module="kernels.attnres", capability=90), base) == "FAIL spill"
    assert cc.verdict(dict(module="kernels.kda", capability=90), base).startswith("spill")
    assert cc.verdict(dict(module="kernels.kda", capability=80), dict(base, smem=200_000)) == "FAIL smem"
    assert cc.verdict(dict(module="kernels.kda", capability=90), dict(base, spill_st=0, spill_ld=0)) == "ok"
    assert cc.verdict(dict(module="kernels.kda", capability=90), dict(error="x")) == "FAIL compile"
