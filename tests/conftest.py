"""Shared test setup.

Runs before any test module is imported, so it can switch Triton to its CPU
interpreter (TRITON_INTERPRET=1) when no CUDA device exists: then every Triton
kernel in kernels/ runs on CPU tensors and is tested in CI.
"""
import os
import random
import sys

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the repository root on sys.path, so tests import the top-level files directly
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICE = "cuda" if HAS_CUDA else "cpu"

# Test shapes are tiny: one thread per process is faster than two fighting over small matmuls,
# and leaves the second core to a parallel worker.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """rms(ref - out) / rms(ref), in float64; 0 when both are all zeros."""
    ref, out = ref.detach().double().cpu(), out.detach().double().cpu()
    denom = ref.pow(2).mean().sqrt().item()
    err = (ref - out).pow(2).mean().sqrt().item()
    if denom == 0.0:
        return err
    return err / denom


def assert_close(ref: torch.Tensor, out: torch.Tensor, ratio: float, name: str = "tensor"):
    """Fail unless the relative RMS error of `out` against `ref` is at most `ratio`.

    The message gives both the relative RMS error and the max-abs error, so a
    failure says by how much, not just that it failed.
    """
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values in output"
    err = rel_rms(ref, out)
    max_abs = (ref.detach().double().cpu() - out.detach().double().cpu()).abs().max().item() if ref.numel() else 0.0
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs error {max_abs:.3e})"
