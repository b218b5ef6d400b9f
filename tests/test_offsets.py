"""Pointer offsets stay exact at sizes where int32 index arithmetic wraps (T·H·K >= 2^31).

Nothing of that size is allocated. The launch wrappers are called with `meta` tensors of the huge shape
inside kernels.launch.record(), which captures the exact arguments a GPU launch gets. Then one program
of each recorded launch (the last one on every grid axis, where offsets are largest) runs in the Triton
interpreter with every memory access intercepted: each tensor argument gets a fake base address 2^44
bytes from the next, loads return zeros and stores are dropped, and every address a program touches
must fall inside its own tensor's extent. A wrapped int32 offset lands gigabytes before its base and
fails that check.
"""
import contextlib

import numpy as np
import pytest
import torch

from kernels.launch import record

if not __import__("os").environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the address probe needs the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

import triton.runtime.interpreter as interp  # noqa: E402

SPACING = 1 << 44  # 16 TiB between fake bases: no tensor here spans more than a few tens of GiB


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from the first to one past the last element a tensor of this shape and stride can address."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


@contextlib.contextmanager
def _probe(extents, pid):
    """Run under the interpreter with fake bases (tensor args in order) and pinned program ids; yields a
    list that collects (tensor index, byte offset) violations."""
    bad, accesses = [], [0]
    next_tensor = [0]
    orig_cvt, orig_pid, orig_lib = interp._implicit_cvt, interp.interpreter_builder.create_get_program_id, interp._interpreter

    def cvt(arg):
        out = orig_cvt(arg)
        if hasattr(arg, "data_ptr") and not isinstance(arg, (bool, int)):
            next_tensor[0] += 1
            out.handle.data[:] = np.uint64(next_tensor[0] * SPACING)
        return out

    def check(ptrs, mask):
        addrs = ptrs[np.broadcast_to(mask, ptrs.shape)].astype(np.uint64)
        accesses[0] += addrs.size
        idx = (addrs // np.uint64(SPACING)).astype(np.int64) - 1
        off = (addrs % np.uint64(SPACING)).astype(np.int64)
        for i in np.unique(idx):
            sel = idx == i
            if not 0 <= i < len(extents) or off[sel].max() >= extents[i]:
                bad.append((int(i), int(off[sel].max())))

    class Lib:  # stands in for the interpreter's C memory module: check, never touch memory
        @staticmethod
        def load(ptrs, mask, other, dtype):
            check(ptrs, mask)
            return np.array(other, dtype=dtype, copy=True)

        @staticmethod
        def store(ptrs, value, mask):
            check(ptrs, mask)

        def __getattr__(self, name):
            return getattr(orig_lib, name)

    def program_id(axis):
        return interp.TensorHandle(np.array([pid[axis]], dtype=np.int32), interp.tl.int32)

    interp._implicit_cvt, interp._interpreter = cvt, Lib()
    interp.interpreter_builder.create_get_program_id = program_id
    try:
        yield bad, accesses
    finally:
        interp._implicit_cvt, interp._interpreter = orig_cvt, orig_lib
        interp.interpreter_builder.create_get_program_id = orig_pid


def _run_last_program(launch, grid):
    """One program of a recorded launch, at the largest program id on every axis, with tiny stand-ins."""
    # positional and keyword arguments by name, in the kernel's signature order (the order the interpreter
    # converts tensors to pointers, so the order of the fake bases)
    given = {**dict(zip(launch.kernel.arg_names, launch.args)),
             **{k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")}}
    names = [n for n in launch.kernel.arg_names if n in given]
    extents = [_extent_bytes(given[n]) for n in names if isinstance(given[n], torch.Tensor)]
    stand_ins = {n: torch.zeros(1, dtype=given[n].dtype) if isinstance(given[n], torch.Tensor) else given[n] for n in names}
    pid = [g - 1 for g in grid] + [0] * (3 - len(grid))
    with _probe(extents, pid) as (bad, accesses):
        launch.kernel[(1, 1, 1)](**stand_ins)
    assert accesses[0] > 0, "the probe saw no memory access"
    return bad


def _record_with_grids(fn):
    """Record the launches fn makes, and the grid each used (recorded launches keep the grid)."""
    with record() as launches:
        fn()
    return launches


def test_max_logit_offsets_do_not_wrap():
    # q, k as [B, H, T, Dh] views of a [B, T, H, Dh] projection (what model.py passes): stride_t = H·Dh =
    # 2^20, so the last query's offset is ~3000 · 2^20 > 2^31
    from kernels.max_logit import max_logit_triton
    B, T, H, Dh = 1, 3000, 8192, 128
    x = torch.empty(B, T, H, Dh, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    launches = _record_with_grids(lambda: max_logit_triton(x, x, Dh ** -0.5))
    assert len(launches) == 1
    bad = _run_last_program(launches[0], launches[0].grid)
    assert not bad, f"out-of-extent accesses (tensor index, byte offset): {bad[:5]}"


@pytest.mark.slow
def test_kda_offsets_do_not_wrap():
    # H·K = 2^21 elements per token: rows past 1024 put q/k/v/g offsets above 2^31
    import kernels.kda as kk
    B, T, H, K, V = 1, 2000, 16384, 128, 128
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, g = (torch.empty(B, T, H, K, **meta) for _ in range(3))
    v, do = torch.empty(B, T, H, V, **meta), torch.empty(B, T, H, V, **meta)
    beta = torch.empty(B, T, H, **meta)
    h0 = torch.empty(B, H, K, V, device="meta", dtype=torch.float32)
    launches = _record_with_grids(lambda: (kk._forward(q, k, v, g, beta, K ** -0.5, h0, True),
                                           kk._backward(q, k, v, g, beta, K ** -0.5, h0, do, h0)))
    names = sorted({l.kernel.fn.__name__ for l in launches})
    assert len(names) == 9, names             # every KDA kernel: 5 forward, 4 backward
    failures = {}
    seen = set()
    for launch in launches:
        key = (launch.kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in launch.kwargs.items())),
               tuple(a for a in launch.args if not isinstance(a, torch.Tensor)))
        if key in seen:  # the backward recomputes the forward: same launch, probe once
            continue
        seen.add(key)
        bad = _run_last_program(launch, launch.grid)
        if bad:
            failures[launch.kernel.fn.__name__] = bad[:3]
    assert not failures, f"out-of-extent accesses per kernel (tensor index, byte offset): {failures}"
