"""The CPU kernels' SIMD layer: LLVM IR written through numba @intrinsic functions.

numba's loop vectorizer does not vectorize the kernels' short per-block loops over array-of-
struct blocks, nor a fully unrolled 32-value loop mixing int8 loads and float32 stores, so the
kernels say what vectors they want. The IR is target-neutral except for a few x86 integer-
product instructions chosen from the host's features, each with a generic fallback; LLVM picks
AVX-512/AVX2/NEON code.

- scalars: widen (float16 bits -> float32), narrow (float32 -> float16 bits), bits_as_f32
- KV rows: deq32_f16, deq32_f16_eo, deq32_i8, deq32_i4 (one group of 32 values to float32)
"""
from __future__ import annotations

import platform

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I32 = ir.IntType(32)
try:  # what numba compiles for: the host CPU
    _FEATURES = dict(llvm.get_host_cpu_features())
except RuntimeError:  # LLVM cannot tell on some hosts: generic code only
    _FEATURES = {}
# Use the hardware half->float conversion (vcvtph2ps, fcvt) where LLVM lowers it inline.
_machine = platform.machine().lower()
_NATIVE_F16 = (_machine in ("x86_64", "amd64") and bool(_FEATURES.get("f16c"))) or _machine in ("arm64", "aarch64")


def _lanes(n, fn):
    return ir.Constant(ir.VectorType(_I32, n), [fn(i) for i in range(n)])


def _elem_ptr(context, builder, arrty, arr, idx, idxty):
    """Pointer to element idx of a C-contiguous array, counted flat (no wraparound, no bounds)."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [context.cast(builder, idx, idxty, types.intp)])


def _splat_ir(builder, val, n):
    vt = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), _lanes(n, lambda i: 0))


def _half_to_float(builder, h):
    """h: i16 or <n x i16> holding IEEE halves -> float / <n x float>."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else None
    vec = (lambda t: ir.VectorType(t, n)) if n else (lambda t: t)
    if _NATIVE_F16:
        return builder.fpext(builder.bitcast(h, vec(ir.HalfType())), vec(ir.FloatType()))
    c = (lambda v: ir.Constant(vec(_I32), [v] * n)) if n else (lambda v: ir.Constant(_I32, v))
    x = builder.zext(h, vec(_I32))
    sign = builder.shl(builder.and_(x, c(0x8000)), c(16))
    em = builder.and_(x, c(0x7FFF))
    normal = builder.add(builder.shl(em, c(13)), c(112 << 23))
    special = builder.or_(builder.shl(em, c(13)), c(0x7F800000))
    bits = builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), special, normal)
    fvec = vec(ir.FloatType())
    sub = builder.fmul(builder.uitofp(em, fvec), builder.bitcast(c(103 << 23), fvec))  # em * 2**-24
    sub_bits = builder.bitcast(sub, vec(_I32))
    bits = builder.select(builder.icmp_unsigned("<", em, c(0x400)), sub_bits, bits)
    return builder.bitcast(builder.or_(bits, sign), fvec)


def _load(builder, ptr, llty, align=1):
    return builder.load(builder.bitcast(ptr, llty.as_pointer()), align=align)


def _store(builder, ptr, val, align=1):
    builder.store(val, builder.bitcast(ptr, val.type.as_pointer()), align=align)


# ---------------------------------------------------------------------------------------------
# Scalars
# ---------------------------------------------------------------------------------------------
@intrinsic
def widen(typingctx, x):
    """float32 from a float16 held as its IEEE bits in a uint16 (numba has no float16 type on
    CPU; vcvtph2ps, exact for every half value); a float32 as it is."""
    if x == types.uint16:

        def codegen(context, builder, sig, args):
            return _half_to_float(builder, args[0])

        return types.float32(x), codegen
    if x == types.float32:

        def codegen(context, builder, sig, args):
            return args[0]

        return types.float32(x), codegen
    return None


@intrinsic
def narrow(typingctx, x):
    """IEEE half bits (uint16) of a float32, rounded to nearest even like numpy's
    astype(float16); LLVM emits vcvtps2ph."""
    if x == types.float32:

        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(x), codegen
    return None


@intrinsic
def bits_as_f32(typingctx, x):
    """Reinterpret int32 bits as float32 (builds 2**n for ops._expf)."""
    if x == types.int32:

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(x), codegen
    return None


# ---------------------------------------------------------------------------------------------
# KV rows: one group of 32 values of a ring row -> float32, dst.flat[do:do+32] (offsets flat).
# ---------------------------------------------------------------------------------------------
_VF32 = ir.VectorType(ir.FloatType(), 32)


def _deq32_halves(eo):
    @intrinsic
    def deq(typingctx, src, so, dst, do):
        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            y = _half_to_float(builder, _load(builder, ptr, ir.VectorType(ir.IntType(16), 32), align=2))
            if eo:
                y = builder.shuffle_vector(y, ir.Constant(_VF32, ir.Undefined),
                                           _lanes(32, lambda i: 2 * i if i < 16 else 2 * (i - 16) + 1))
            _store(builder, _elem_ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3]), y, align=4)
            return context.get_dummy_value()

        return types.void(src, so, dst, do), codegen

    return deq


deq32_f16 = _deq32_halves(False)  # src uint16 half bits
deq32_f16_eo = _deq32_halves(True)  # into kernel order for int4 rows: the 16 even values, then the 16 odd ones


@intrinsic
def deq32_i8(typingctx, src, so, d, dst, do):
    """dst.flat[do:do+32] = src.flat[so:so+32] * d, src int8."""

    def codegen(context, builder, sig, args):
        x = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]),
                  ir.VectorType(ir.IntType(8), 32))
        y = builder.fmul(builder.sitofp(x, _VF32), _splat_ir(builder, args[2], 32))
        _store(builder, _elem_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4]), y, align=4)
        return context.get_dummy_value()

    return types.void(src, so, d, dst, do), codegen


@intrinsic
def deq32_i4(typingctx, src, so, d, dst, do):
    """dst.flat[do:do+16] = (low nibbles - 8) * d and dst.flat[do+16:do+32] = (high
    nibbles - 8) * d of the 16 bytes src.flat[so:so+16] (kernel order)."""

    def codegen(context, builder, sig, args):
        vi32 = ir.VectorType(_I32, 16)
        vf = ir.VectorType(ir.FloatType(), 16)
        x = _load(builder, _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]),
                  ir.VectorType(ir.IntType(8), 16))
        x = builder.zext(x, vi32)
        eight = ir.Constant(vi32, [8] * 16)
        lo = builder.sub(builder.and_(x, ir.Constant(vi32, [15] * 16)), eight)
        hi = builder.sub(builder.lshr(x, ir.Constant(vi32, [4] * 16)), eight)
        dv = _splat_ir(builder, args[2], 16)
        dst = builder.bitcast(_elem_ptr(context, builder, sig.args[3], args[3], args[4], sig.args[4]), vf.as_pointer())
        builder.store(builder.fmul(builder.sitofp(lo, vf), dv), dst, align=4)
        builder.store(builder.fmul(builder.sitofp(hi, vf), dv), builder.gep(dst, [ir.Constant(_I32, 1)]), align=4)
        return context.get_dummy_value()

    return types.void(src, so, d, dst, do), codegen
