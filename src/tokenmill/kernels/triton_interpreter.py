"""Triton's interpreter (TRITON_INTERPRET=1: the kernels on CPU tensors, as CI tests them and a CPU triton_paged
run uses them) with every `tl.dot` computed one row at a time.

The interpreter computes a `tl.dot` as numpy's matmul of the whole tile. OpenBLAS's AVX2 (Haswell, Zen) sgemm
kernel sums a row's products in an order that depends on the row's place in the tile, so a row's bits changed with
what else shared its tile (found on an AMD EPYC with AVX2; its AVX-512 kernel does not): the interpreter then broke
the batch invariance the kernels keep on a GPU, where every row of a tile is summed alike. As a stack of one-row
products each row is summed the same way wherever it sits, as on the device; the cost is small (a tile's dot took
6.8 us against 4.2 for a 32x64 by 64x32 tile).
"""

from __future__ import annotations

from tokenmill import envs

_applied = False


def make_dots_row_exact() -> None:
    """Replace the interpreter's dot by the row-by-row one (once; nothing when Triton compiles for a GPU). Call it
    after importing Triton, in every module whose kernels take `tl.dot`."""
    global _applied
    if _applied or not envs.triton_interpreted():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
                (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # (as the interpreter's own)
            a_data = convert(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = convert(b_data, b.dtype, tl.float16, None).view(np.float16)
        rows = np.matmul(a_data[..., :, None, :], b_data[..., None, :, :], dtype=d.data.dtype)[..., 0, :]
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _applied = True
