"""How the kernel wrappers in kernels/ decide on a GPU launch configuration, and a recorder for it.

Every wrapper picks its tile sizes, warps and autotune configs from the device of its tensors: the GPU
configuration for CUDA tensors, small interpreter tiles otherwise. `gpu_config(x)` is that test. The
ahead-of-time compile check (tests/compile_check.py) needs the exact launches a GPU run makes without
having a GPU: inside `record()` it calls the same wrappers with `meta` tensors (shapes and strides,
no storage, so even a 32k-token benchmark shape costs nothing), `gpu_config` answers True for them,
and every `kernel[grid](*args, **kwargs)` is appended to a list instead of being run. The checker
then compiles each recorded launch for sm_90 and sm_80 with Triton's own compiler.

Nothing here changes what a real launch does: outside `record()` gpu_config(x) is x.is_cuda.
It also holds what every concept file shares: the backend rule (`use_triton`: "auto" | "ref" | "triton"),
the one-line argument check (`require`), and the devices' peak tables (PEAK_TFLOPS, PEAK_GBS, peak_flops)
that train.py's MFU and bench.py's % of peak both read. This file imports no concept file.
"""
import contextlib
import os
from dataclasses import dataclass

import torch
from triton.runtime.jit import KernelInterface

BACKENDS = ("auto", "ref", "triton")


def require(ok: bool, message: str, error=ValueError):
    """Stop with `message`, one line, at an API boundary unless ok."""
    if not ok:
        raise error(message)


def use_triton(backend: str, on_cuda: bool, fits: bool = True, op: str = "", limit: str = "") -> bool:
    """The one backend rule of every op with a kernel: "ref" never runs it; "auto" runs it on CUDA tensors
    that fit the kernel's limits (`fits`), else the reference; "triton" always, or one clear ValueError if
    it cannot: CPU tensors need the interpreter (TRITON_INTERPRET=1), and the shapes must fit (`limit`)."""
    require(backend in BACKENDS, f"{op}: backend must be 'auto', 'ref' or 'triton', got {backend!r}")
    if backend == "ref":
        return False
    if backend == "auto":
        return on_cuda and fits
    require(on_cuda or os.environ.get("TRITON_INTERPRET") == "1", f"{op}: backend='triton' on CPU tensors needs "
            "CUDA, or TRITON_INTERPRET=1 set before triton is imported (the interpreter runs the kernels on CPU)")
    require(fits, f"{op}: the Triton path supports {limit}; use backend='ref'")
    return True


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) for MFU (train.py) and the benchmarks' % of
# peak (bench.py), matched against the CUDA device name; the first match wins, so the more specific names
# come first. Unknown devices report n/a.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("H800", 989.0),
               ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
               ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0))
# HBM bandwidth (bytes/s) for memory-bound ops (bench.py's AttnRes section); first match wins
PEAK_GBS = (("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12))


def peak_flops(device: str, override_tflops: float) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it came from) for MFU."""
    if override_tflops > 0:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak_tflops)"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS:
            if key in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s ({name}, dense bf16)"
        return None, f"n/a (no peak known for {name}; set --peak_tflops)"
    return None, "n/a on CPU (set --peak_tflops to compute one)"


# SMs of an H100/H200 SXM: the persistent AttnRes backward sizes its grid by it. Used only while
# recording (a real launch asks the device); it matters to the compile only through Triton's integer
# specialisation (== 1, divisible by 16), which 8 * 132 and 8 * 108 (A100) share.
RECORD_SM_COUNT = 132

_recording: list | None = None


@dataclass
class Launch:
    """One recorded `kernel[grid](*args, **kwargs)`; kernel is a JITFunction or an Autotuner, grid a
    tuple or (autotuned launches) a function of the chosen config's meta-parameters."""
    kernel: object
    grid: object
    args: tuple
    kwargs: dict


def gpu_config(x: torch.Tensor) -> bool:
    """Use the GPU launch configuration for tensor x: it is on CUDA, or it is a meta tensor being recorded."""
    return x.is_cuda or (_recording is not None and x.device.type == "meta")


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return RECORD_SM_COUNT


@contextlib.contextmanager
def record():
    """Within this block, kernel launches are recorded (not run); yields the list of Launch."""
    global _recording
    if _recording is not None:
        raise RuntimeError("kernels.launch.record() does not nest")
    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def recorder(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(self, grid, args, kwargs))

    _recording = launches
    KernelInterface.__getitem__ = recorder  # JITFunction and Autotuner both launch through this
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original
        _recording = None
