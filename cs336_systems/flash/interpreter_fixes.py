"""Fixes for Triton 3.6's CPU interpreter (TRITON_INTERPRET=1), applied by flash_triton.

The interpreter stores bf16 as uint16 bit patterns, and
  1. `tl.dot` on bf16 operands multiplies those bit patterns as integers (garbage), and
  2. fp32 -> bf16 casts truncate, where the GPU rounds to nearest even (a bias that doubles the
     error of long bf16 sums).
  3. It has no `create_descriptor_reduce`, so a TMA descriptor's `atomic_add` fails; it is added
     here as the masked atomic add the GPU's bulk reduction performs.
All are patched in the interpreter's builder so that the kernels stay free of interpreter cases
and the CPU tests see the arithmetic the GPU does: bf16 products are exact in fp32, so upcasting
the dot operands matches tensor-core math. Nothing here runs unless the interpreter is in use.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime import interpreter


def _bf16_to_fp32(builder: interpreter.InterpreterBuilder, x: interpreter.TensorHandle) -> interpreter.TensorHandle:
    return builder.create_fp_ext(x, tl.float32)


def _fp32_to_bf16_rtne(x: np.ndarray) -> np.ndarray:
    """Round fp32 to the nearest bf16 (ties to even) and return the uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def apply() -> None:
    """Patch the interpreter's builder once; later calls do nothing."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_cs336_bf16_fixed", False):
        return
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = _bf16_to_fp32(self, a)
        if b.dtype.scalar == tl.bfloat16:
            b = _bf16_to_fp32(self, b)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_rtne(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduction {kind} is not patched into the interpreter")
        ptrs, mask = desc.materialize_pointers(indices)
        return self.create_atomic_rmw(
            ir.ATOMIC_OP.FADD, ptrs, value, interpreter.TensorHandle(mask, tl.int1), ir.MEM_SEMANTIC.RELAXED, None)

    builder.create_dot, builder.cast_impl = dot, cast
    builder.create_descriptor_reduce = descriptor_reduce
    builder._cs336_bf16_fixed = True
