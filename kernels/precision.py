"""The one matrix product of the kernels: `plan_dot(a, b, PLAN, PREC)`, a tl.dot under a precision plan.

The plan says what happens to the operands before the product (kernels/kda.py has the table of which
products take which plan):

    PLAN_FP32            the operands as they are (float32 in KDA; bf16/fp16 tiles in attention), products at
                         PREC: "ieee" exact float32 FMAs, None Triton's default (tensor cores)
    PLAN_BF16            rounded to bfloat16 for the tensor cores, float32 accumulation (16-bit inputs on a GPU)
    PLAN_BF16_EMULATED   the same rounding done on the bits, products in float32: the Triton interpreter, whose
                         bf16 tl.dot is wrong, then computes what the GPU does

This file imports no concept file.
"""
import triton
import triton.language as tl

PLAN_FP32 = tl.constexpr(0)
PLAN_BF16 = tl.constexpr(1)
PLAN_BF16_EMULATED = tl.constexpr(2)


@triton.jit
def round_bf16(x):
    # float32 -> nearest bfloat16 (ties to even, as the GPU's cvt.rn.bf16.f32), kept in float32: the
    # interpreter's own float32 -> bf16 cast truncates, so the rounding is done on the bits
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def plan_dot(a, b, PLAN: tl.constexpr, PREC: tl.constexpr):
    """a @ b with float32 accumulation, the operands treated as PLAN says."""
    if PLAN == PLAN_BF16:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PLAN == PLAN_BF16_EMULATED:
        c = tl.dot(round_bf16(a), round_bf16(b), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c
