"""Triton's interpreter (TRITON_INTERPRET=1: the kernels on CPU tensors, as CI tests them and a CPU triton_paged
run uses them), prepared once by `prepare_interpreter`: every `tl.dot` computed one row at a time, the language's
builtins found by name rather than by listing whole modules at every call, and a Triton dtype's numpy dtype looked
up in a table built once.

The interpreter computes a `tl.dot` as numpy's matmul of the whole tile. OpenBLAS's AVX2 (Haswell, Zen) sgemm
kernel sums a row's products in an order that depends on the row's place in the tile, so a row's bits changed with
what else shared its tile (found on an AMD EPYC with AVX2; its AVX-512 kernel does not): the interpreter then broke
the batch invariance the kernels keep on a GPU, where every row of a tile is summed alike. As a stack of one-row
products each row is summed the same way wherever it sits, as on the device; the cost is small (a tile's dot took
6.8 us against 4.2 for a 32x64 by 64x32 tile).

Before every kernel launch, and again at every call of a `@triton.jit` helper from a kernel, the interpreter
swaps triton.language's builtins for interpreted ones: it lists every member of triton.language, its core, math
and tensor class (inspect.getmembers: dir, a getattr of each, a sort) to find the builtins among them. A module's
or class's builtin names never change, so they are listed once per module and each call only looks those names
up, patching the same members in the same order (measured: a launch's patching 1.1 ms before, 0.5 after; a
helper call's 0.5 ms, 0.13 after; the interpreted attention calls a helper per key tile, thousands a test).
Likewise the numpy dtype of a Triton dtype, which the interpreter looks up at most of its operations in a table
of 18 numpy dtypes it built anew at each lookup (16 us, 0.7 after; 70k lookups in a test of a few decode steps):
the same table, built once.

Two more costs the interpreter pays for nothing. Its options ask for integer overflow checks (sanitize_overflow,
as a GPU compile's do) but not for debug, without which device_assert does nothing: every integer add, sub and mul
was recomputed in int64, compared with its type's bounds and the result thrown away (37% of a split decode's
interpreted time); its builder's options turn the checks off when debug is off, which changes no value. And a
helper's every call patched the language anew (`_patch_lang`) though its first call's patches stay in place to the
end of the launch: a helper is patched for at its first call in each launch only (12% of the same time).

Every operation makes a tensor, and most a block type, whose constructors rebuild the shape's language tuple (a
type object per dimension), its element count and its printed form each time (a third of what was left): those
are built once per shape (`_shapes_built_once`). Then the operands of most binary operations share one shape
object, and broadcasting them is nothing to do: it is skipped without comparing their shapes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from tokenmill import envs

_applied = False


def prepare_interpreter() -> None:
    """Replace the interpreter's dot by the row-by-row one, its builtin patching by the one that remembers the
    builtins' names, its numpy dtype lookup by the one with a lasting table, its helpers' patching by one a
    launch, its types' and tensors' shapes by ones built once, and turn off its discarded overflow checks (once,
    for the whole process;
    nothing when Triton compiles for a GPU). Call it after importing Triton, in every module whose kernels take
    `tl.dot`."""
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
    interpreter._patch_builtin = _builtin_patcher(interpreter, tl.core.is_builtin)
    interpreter._get_np_dtype = _np_dtype_lookup(interpreter, tl, np)
    _patch_helpers_once_a_launch(interpreter)
    _shapes_built_once(tl.core, interpreter.interpreter_semantic)
    builder = interpreter.interpreter_builder
    if not builder.options.debug:  # device_assert does nothing: the overflow checks' work is thrown away
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    _applied = True


def _shapes_built_once(core, semantic) -> None:
    """`block_type(element_ty, shape)` and `tensor(handle, type)` with the parts that depend on the shape alone
    built once per shape of plain ints: a block type's shape (a language tuple), its element count and the shape
    in its name; a tensor's element count and its shape as constexprs. These objects are never changed once
    built (an interpreted kernel cannot assign into a shape), so every type and tensor of a shape shares them;
    any other shape (constexpr elements, a bad size) takes the language's own constructor, which checks it."""
    block_type, tensor, constexpr, language_tuple = core.block_type, core.tensor, core.constexpr, core.tuple
    block_init, tensor_init = block_type.__init__, tensor.__init__
    block_parts: dict[tuple, tuple] = {}
    tensor_parts: dict[tuple, tuple] = {(): (constexpr(1), language_tuple([]))}

    def plain(key: tuple) -> bool:
        for d in key:
            if d.__class__ is not int:
                return False
        return True

    def init_block_type(self, element_ty, shape):
        key = tuple(shape) if isinstance(shape, (list, language_tuple)) else None  # (as its assert takes)
        parts = block_parts.get(key) if key is not None and plain(key) else None
        if parts is None:
            block_init(self, element_ty, shape)
            if key and plain(key):
                block_parts[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, shown = parts
        self.name = f'<{shown}, {element_ty}>'

    def init_tensor(self, handle, type):
        key = tuple(type.shape) if type.is_block() else ()
        parts = tensor_parts.get(key) if plain(key) else None
        if parts is None:
            tensor_init(self, handle, type)
            if plain(key):
                tensor_parts[key] = (self.numel, self.shape)
            return
        self.handle = handle
        self.numel, self.shape = parts
        self.type = type
        self.dtype = type.scalar

    block_type.__init__ = init_block_type
    tensor.__init__ = init_tensor
    broadcast = semantic.broadcast_impl_value

    def broadcast_impl_value(lhs, rhs):
        """(lhs, rhs) as they are where both are blocks of one shape object (one shape: nothing to broadcast, as
        the language's own finds comparing them dimension by dimension), else the language's broadcast."""
        if lhs.type.is_block() and rhs.type.is_block() and lhs.type.shape is rhs.type.shape:
            return lhs, rhs
        return broadcast(lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value  # (the interpreter's semantic object's own)


def _patch_helpers_once_a_launch(interpreter) -> None:
    """The interpreter's `_patch_lang(fn)` run at a helper's first call in a launch only: the patches it makes
    stay in place until the launch ends (only the launch's own scope is ever restored, and the helper's scope
    never), so a later call of the same helper in the same launch would set the same stand-ins again."""
    original_patch_lang = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    state = SimpleNamespace(patched=None)  # the functions patched for in the running launch

    def patch_lang(fn):
        if state.patched is not None:
            if fn in state.patched:
                return interpreter._LangPatchScope()  # (a helper's call discards it)
            state.patched.add(fn)
        return original_patch_lang(fn)

    def launch(self, *args, **kwargs):
        state.patched = set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state.patched = None

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


def _np_dtype_lookup(interpreter, tl, np):
    """The interpreter's `_get_np_dtype(tt_dtype)` with its table built once: the same branches, the table's
    entries taken from the interpreter's own function, which still answers any dtype the table lacks."""
    original = interpreter._get_np_dtype
    table = {dtype: original(dtype) for dtype in (
        tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
        tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer, block, address = tl.pointer_type, tl.block_type, np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return address
        element = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(element, pointer):
            return address
        found = table.get(element)
        return found if found is not None else original(tt_dtype)

    return get_np_dtype


def _builtin_patcher(interpreter, is_builtin):
    """The interpreter's `_patch_builtin(pkg, builder, scope)` (patch each builtin member of `pkg`, in name
    order), with the names listed once per `pkg`: those of its builtins and of members already patched (a
    helper's call patches inside its kernel's launch, and the interpreter leaves some of those patches in
    place), so that a name is looked up wherever the interpreter's own listing would find a builtin there."""
    import inspect

    patch_attr = interpreter._patch_attr
    probe = SimpleNamespace()
    patch_attr(probe, "member", len, None, interpreter._LangPatchScope())
    patched_code = probe.member.__code__  # the code of every interpreted stand-in _patch_attr makes
    names: dict[object, list[str]] = {}

    def patched(member) -> bool:
        return is_builtin(member) or getattr(member, "__code__", None) is patched_code

    def patch_builtin(pkg, builder, scope) -> None:
        known = names.get(pkg)
        if known is None:  # (inspect.getmembers lists them in name order)
            known = names[pkg] = [name for name, member in inspect.getmembers(pkg) if patched(member)]
        for name in known:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    return patch_builtin
