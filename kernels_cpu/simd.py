"""The CPU kernels' SIMD layer: LLVM IR written through numba @intrinsic functions.

numba's loop vectorizer does not vectorize the kernels' short per-block loops over array-of-
struct blocks, nor a fully unrolled 32-value loop mixing int8 loads and float32 stores, so the
kernels say what vectors they want. The IR is target-neutral except for a few x86 integer-
product instructions chosen from the host's features, each with a generic fallback; LLVM picks
AVX-512/AVX2/NEON code.

- Vec(dtype, n): an LLVM <n x dtype> value held in registers; loads and stores at flat offsets
  (ld, st, ld_f16, half, bits, ...), lane-wise arithmetic, shuffles, horizontal sums, and the
  integer products (madd, maddubs, dot4: pmaddwd, pmaddubsw, vpdpbusd) the matmuls are built on
- scalars: widen (float16 bits -> float32), narrow (float32 -> float16 bits), bits_as_f32
- KV rows: deq32_f16, deq32_f16_eo, deq32_i8, deq32_i4 (one group of 32 values to float32)
"""
from __future__ import annotations

import platform

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

_I32 = ir.IntType(32)
try:  # what numba compiles for: the host CPU
    _FEATURES = dict(llvm.get_host_cpu_features())
except RuntimeError:  # LLVM cannot tell on some hosts: generic code only
    _FEATURES = {}
try:
    ZEN = llvm.get_host_cpu_name().startswith("znver")  # AMD Zen: see qmatmul._PF_K
except RuntimeError:
    ZEN = False
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
# Vector layer: Vec(dtype, n) is an LLVM <n x dtype> value; the functions below are intrinsics.
# ---------------------------------------------------------------------------------------------
class Vec(types.Type):
    def __init__(self, dtype, n):
        self.dtype, self.n = dtype, n
        super().__init__(name=f"Vec({dtype}x{n})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(elem, fe_type.n))


_FAST = ("fast",)


@intrinsic
def ld(typingctx, arr, i, n):
    """Vec of n elements arr[i:i+n]."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    vt = Vec(arr.dtype, n.literal_value)

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _load(builder, ptr, context.get_value_type(vt))

    return vt(arr, i, n), codegen


@intrinsic
def at(typingctx, arr, i):
    """arr[i] for a non-negative i (no wraparound test: hot loops index with computed offsets)."""

    def codegen(context, builder, sig, args):
        return builder.load(_elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]))

    return arr.dtype(arr, i), codegen


@intrinsic
def st(typingctx, arr, i, v):
    """arr[i:i+n] = v."""

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store(args[2], builder.bitcast(ptr, args[2].type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def prefetch(typingctx, arr, i):
    """Hint: the cache line of arr[i] will be read soon (never faults, even past the end). Into L2
    (prefetcht2): into L1 the Q4_K_M 7B matvecs streamed at 0.81x, Q4_0's the same."""

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(_elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]), i8p)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 1), ir.Constant(_I32, 1)])  # read, to L2
        return context.get_dummy_value()

    return types.none(arr, i), codegen


def _make_ld_float(kind):
    @intrinsic
    def ldf(typingctx, arr, byte, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        cnt = n.literal_value
        vt = Vec(types.float32, cnt)

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            if kind == "f32":
                return _load(builder, ptr, ir.VectorType(ir.FloatType(), cnt))
            h = _load(builder, ptr, ir.VectorType(ir.IntType(16), cnt))
            if kind == "f16":
                return _half_to_float(builder, h)
            i32v = ir.VectorType(_I32, cnt)
            wide = builder.shl(builder.zext(h, i32v), ir.Constant(i32v, [16] * cnt))  # bf16: top half
            return builder.bitcast(wide, ir.VectorType(ir.FloatType(), cnt))

        return vt(arr, byte, n), codegen

    return ldf


ld_f32 = _make_ld_float("f32")  # n float32 at byte offset of a uint8 array
ld_f16 = _make_ld_float("f16")  # n float16 -> float32
ld_bf16 = _make_ld_float("bf16")  # n bfloat16 -> float32


@intrinsic
def half(typingctx, arr, byte):
    """The float16 at arr[byte:byte+2] (little-endian) as float32."""

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _half_to_float(builder, _load(builder, ptr, ir.IntType(16)))

    return types.float32(arr, byte), codegen


@intrinsic
def half2(typingctx, arr, byte):
    """The two float16 at arr[byte:byte+4] as a pair of float32 (one conversion)."""

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        f = _half_to_float(builder, _load(builder, ptr, ir.VectorType(ir.IntType(16), 2)))
        pair = [builder.extract_element(f, ir.Constant(_I32, i)) for i in range(2)]
        return context.make_tuple(builder, sig.return_type, pair)

    return types.UniTuple(types.float32, 2)(arr, byte), codegen


@intrinsic
def word(typingctx, arr, byte):
    """The little-endian uint32 at arr[byte:byte+4]."""

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _load(builder, ptr, ir.IntType(32))

    return types.uint32(arr, byte), codegen


@intrinsic
def pack2(typingctx, a, b):
    """Vec(uint64, 2) of two integers (their low 64 bits)."""

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        v = ir.Constant(ir.VectorType(i64, 2), ir.Undefined)
        for j, (x, t) in enumerate(zip(args, sig.args)):
            v = builder.insert_element(v, context.cast(builder, x, t, types.uint64), ir.Constant(_I32, j))
        return v

    return Vec(types.uint64, 2)(a, b), codegen


@intrinsic
def bits(typingctx, arr, byte, n):
    """Vec(uint8, n): lane j = bit j of the little-endian bit string at arr[byte:]."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    cnt = n.literal_value
    vt = Vec(types.uint8, cnt)

    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        raw = _load(builder, ptr, ir.VectorType(i8, cnt // 8))
        spread = builder.shuffle_vector(raw, raw, _lanes(cnt, lambda j: j >> 3))
        mask = ir.Constant(ir.VectorType(i8, cnt), [1 << (j & 7) for j in range(cnt)])
        hit = builder.icmp_unsigned("!=", builder.and_(spread, mask), ir.Constant(ir.VectorType(i8, cnt), [0] * cnt))
        return builder.zext(hit, ir.VectorType(i8, cnt))

    return vt(arr, byte, n), codegen


def testbits(*mask):
    """An intrinsic f(v) -> Vec(uint8): lane i = 1 if v[i] & mask[i] else 0 (v: uint8 lanes)."""

    @intrinsic
    def test(typingctx, v):
        def codegen(context, builder, sig, args):
            vt = ir.VectorType(ir.IntType(8), len(mask))
            picked = builder.and_(args[0], ir.Constant(vt, list(mask)))
            hit = builder.icmp_unsigned("!=", picked, ir.Constant(vt, [0] * len(mask)))
            return builder.zext(hit, vt)

        return v(v), codegen

    return test


def _cast(builder, val, src, dst, llty):
    if isinstance(dst, types.Float):
        if isinstance(src, types.Float):
            return builder.fpext(val, llty) if dst.bitwidth > src.bitwidth else val
        return builder.sitofp(val, llty) if src.signed else builder.uitofp(val, llty)
    if isinstance(src, types.Float):  # float -> int: truncation toward zero (round first: vrint)
        return builder.fptosi(val, llty)
    if src.bitwidth < dst.bitwidth:
        return builder.sext(val, llty) if src.signed else builder.zext(val, llty)
    if src.bitwidth > dst.bitwidth:
        return builder.trunc(val, llty)
    return val


@intrinsic
def cvt(typingctx, v, dtype):
    """Element-wise conversion: integer widening/narrowing (sign from the source), int -> float,
    float -> int (toward zero)."""
    dst = dtype.dtype if isinstance(dtype, types.NumberClass) else dtype
    vt = Vec(dst, v.n)

    def codegen(context, builder, sig, args):
        return _cast(builder, args[0], v.dtype, dst, context.get_value_type(vt))

    return vt(v, dtype), codegen


@intrinsic
def view(typingctx, v, dtype):
    """The same bits as a Vec of another element type (lane count scales)."""
    dst = dtype.dtype if isinstance(dtype, types.NumberClass) else dtype
    vt = Vec(dst, v.n * v.dtype.bitwidth // dst.bitwidth)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(vt))

    return vt(v, dtype), codegen


@intrinsic
def lane(typingctx, v, i):
    """Lane i of v (a constant i after inlining lets LLVM fold lane + splat into one shuffle)."""

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))

    return v.dtype(v, i), codegen


def shuffler(*mask):
    """An intrinsic f(v) -> Vec whose lane i is v's lane mask[i] (a constant permutation)."""

    @intrinsic
    def shuffle(typingctx, v):
        vt = Vec(v.dtype, len(mask))

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, len(mask)), list(mask)))

        return vt(v), codegen

    return shuffle


def shuffler2(*mask):
    """An intrinsic f(a, b) -> Vec whose lane i is lane mask[i] of a's lanes followed by b's."""

    @intrinsic
    def shuffle(typingctx, a, b):
        vt = Vec(a.dtype, len(mask))

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, len(mask)), list(mask)))

        return vt(a, b), codegen

    return shuffle


@intrinsic
def opaque(typingctx, v):
    """v, through an empty asm statement where vpermw exists (AVX-512 BW): LLVM cannot see where
    it came from. Scale vectors widened from bytes and then shuffled per use would otherwise have
    each shuffle moved before the widening: a byte shuffle plus a widening per use, not one vpermw."""

    def codegen(context, builder, sig, args):
        x = args[0]
        return builder.asm(ir.FunctionType(x.type, [x.type]), "", "=v,0", [x], False) if _PERMW else x

    return v(v), codegen


@intrinsic
def h2f(typingctx, v):
    """Vec(uint16 or int16) of float16 bit patterns -> Vec(float32)."""
    vt = Vec(types.float32, v.n)

    def codegen(context, builder, sig, args):
        return _half_to_float(builder, args[0])

    return vt(v), codegen


@intrinsic
def splat(typingctx, s, n):
    """Vec of n copies of scalar s."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    vt = Vec(s, n.literal_value)

    def codegen(context, builder, sig, args):
        return _splat_ir(builder, args[0], vt.n)

    return vt(s, n), codegen


def _make_binop(fop, iop, flags=_FAST):
    @intrinsic
    def op(typingctx, a, b):
        if not isinstance(a, Vec):
            return None

        def codegen(context, builder, sig, args):
            x, y = args
            if not isinstance(sig.args[1], Vec):  # scalar operand: broadcast in a's type
                y = _splat_ir(builder, context.cast(builder, y, sig.args[1], a.dtype), a.n)
            if isinstance(a.dtype, types.Float):
                return getattr(builder, fop)(x, y, flags=flags)
            return getattr(builder, iop)(x, y)

        return a(a, b), codegen

    return op


vadd = _make_binop("fadd", "add")
vsub = _make_binop("fsub", "sub")
vmul = _make_binop("fmul", "mul")
# A product rounded by itself wherever it is inlined: LLVM may neither reassociate it with the
# product it feeds (x * vmul_kept(a, b) stays x * (a * b)) nor fuse it into the sum it feeds. The
# decode kernels' batched tiles and their one-token loop then round alike (else a tile sharing b
# between rows got (x * a) * b in some rows: another last bit than the token alone).
_KEPT = ("nnan", "ninf", "nsz", "arcp", "afn")
vmul_kept = _make_binop("fmul", "mul", _KEPT)


def _scalar_kept(fop, doc):
    @intrinsic
    def op(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, fop)(args[0], args[1], flags=_KEPT)

        return types.float32(a, b), codegen

    op.__doc__ = doc
    return op


mul_kept = _scalar_kept("fmul", "a * b for float32 scalars, rounded by itself (vmul_kept's rule)")
add_kept = _scalar_kept("fadd", "a + b for float32 scalars in this order, rounded by itself")
vand = _make_binop(None, "and_")
vor = _make_binop(None, "or_")
vxor = _make_binop(None, "xor")
vshr = _make_binop(None, "lshr")  # logical shift: use on unsigned lanes
vshl = _make_binop(None, "shl")
vsar = _make_binop(None, "ashr")  # arithmetic shift: signed lanes


def _make_float_fn(name, doc):
    @intrinsic
    def fn(typingctx, a):
        def codegen(context, builder, sig, args):
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(args[0].type, [args[0].type]),
                                               f"llvm.{name}.v{a.n}f{a.dtype.bitwidth}")
            return builder.call(f, [args[0]])

        return a(a), codegen

    fn.__doc__ = doc
    return fn


vabs = _make_float_fn("fabs", "|a| (float lanes)")
vrint = _make_float_fn("rint", "a rounded to the nearest integer, ties to even (float lanes; np.rint)")


def _pick_by(cmp, doc):
    """An intrinsic f(a, b): lane-wise a where a `cmp` b holds, else b (float lanes; no NaN handling)."""

    @intrinsic
    def pick(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return builder.select(builder.fcmp_ordered(cmp, args[0], args[1], flags=_FAST), args[0], args[1])

        return a(a, b), codegen

    pick.__doc__ = doc
    return pick


vmax = _pick_by(">", "Lane-wise maximum (float lanes; no NaN handling).")
vmin = _pick_by("<", "Lane-wise minimum (float lanes; no NaN handling).")


def _tree(builder, x, n, combine):
    """Lane 0 of x (n lanes) folded in halves with combine(builder, lo, hi) (tree order)."""
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(x, x, _lanes(n, lambda i: i))
        hi = builder.shuffle_vector(x, x, _lanes(n, lambda i: i + n))
        x = combine(builder, lo, hi)
    return builder.extract_element(x, ir.Constant(_I32, 0))


@intrinsic
def hmax(typingctx, v):
    """Largest lane (float lanes, tree order)."""

    def codegen(context, builder, sig, args):
        def bigger(b, lo, hi):
            return b.select(b.fcmp_ordered(">", lo, hi, flags=_FAST), lo, hi)

        return _tree(builder, args[0], v.n, bigger)

    return v.dtype(v), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c (fast-math: LLVM fuses it)."""

    def codegen(context, builder, sig, args):
        return builder.fadd(builder.fmul(args[0], args[1], flags=_FAST), args[2], flags=_FAST)

    return a(a, b, c), codegen


@intrinsic
def fma_kept(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma): LLVM may neither reassociate it nor choose which product
    of a sum to fuse, so a kernel inlined in another loop keeps its bits (see vmul_kept). A scalar
    b is broadcast in a's type."""
    if not (isinstance(a, Vec) and a == c and isinstance(a.dtype, types.Float)
            and (b == a or b == a.dtype)):
        return None

    def codegen(context, builder, sig, args):
        ty = args[0].type
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]),
                                            f"llvm.fma.v{ty.count}{'f32' if str(ty.element) == 'float' else 'f64'}")
        y = args[1] if isinstance(sig.args[1], Vec) else _splat_ir(builder, args[1], a.n)
        return builder.call(fn, [args[0], y, args[2]])

    return a(a, b, c), codegen


@intrinsic
def cat(typingctx, a, b):
    """Concatenation of two Vecs of the same type."""
    vt = Vec(a.dtype, 2 * a.n)

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], _lanes(vt.n, lambda i: i))

    return vt(a, b), codegen


# Integer products. On x86 they call the instructions' intrinsics (written as generic IR, LLVM
# sees e.g. that Q4_K's products are non-negative, rewrites the sign extensions and loses the
# pmaddwd pattern); elsewhere generic IR with the same results (no saturation occurs: every
# caller keeps |pair sums| < 2**15).
def _x86(*needs):
    return all(_FEATURES.get(f) for f in needs)


# operand lanes -> the instruction's LLVM intrinsic, where the host has it
_PMADDWD = {n: name for n, name, ok in (
    (32, "llvm.x86.avx512.pmaddw.d.512", _x86("avx512bw")),
    (16, "llvm.x86.avx2.pmadd.wd", _x86("avx2")),
) if ok}
_PMADDUBSW = {n: name for n, name, ok in (
    (64, "llvm.x86.avx512.pmaddubs.w.512", _x86("avx512bw")),
    (32, "llvm.x86.avx2.pmadd.ub.sw", _x86("avx2")),
) if ok}
_VPDPBUSD = {n: name for n, name, ok in (
    (64, "llvm.x86.avx512.vpdpbusd.512", _x86("avx512vnni", "avx512bw")),
    (32, "llvm.x86.avx512.vpdpbusd.256", _x86("avx512vnni", "avx512vl") or _x86("avxvnni")),
) if ok}
_VPDPWSSD = {n: name for n, name, ok in (
    (32, "llvm.x86.avx512.vpdpwssd.512", _x86("avx512vnni", "avx512bw")),
) if ok}
_PERMW = {n: "vpermw" for n, ok in ((32, _x86("avx512bw")),) if ok}  # see opaque
_PSHUFB = {n: name for n, name, ok in (
    (64, "llvm.x86.avx512.pshuf.b.512", _x86("avx512bw")),
    (32, "llvm.x86.avx2.pshuf.b", _x86("avx2")),
    (16, "llvm.x86.ssse3.pshuf.b.128", _x86("ssse3")),
) if ok}

def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _halves(builder, a, b, n, fn):
    """fn on the two halves of (a, b) -> concatenated results (AVX2: 256-bit at a time)."""
    pick = [_lanes(n // 2, lambda i, h=h: i + h * (n // 2)) for h in range(2)]
    r = [fn(builder, builder.shuffle_vector(a, a, p), builder.shuffle_vector(b, b, p), n // 2) for p in pick]
    return builder.shuffle_vector(r[0], r[1], _lanes(2 * r[0].type.count, lambda i: i))


def _pairs(builder, v, n):
    """Adjacent lanes of v (n lanes) summed -> n/2 lanes."""
    even = builder.shuffle_vector(v, v, _lanes(n // 2, lambda i: 2 * i))
    odd = builder.shuffle_vector(v, v, _lanes(n // 2, lambda i: 2 * i + 1))
    return builder.add(even, odd)


def _madd_ir(builder, a, b, n):
    """int16 x int16 (n lanes) -> int32 (n/2), adjacent products summed."""
    if n in _PMADDWD:
        return _call(builder, _PMADDWD[n], ir.VectorType(_I32, n // 2), [a, b])
    if n > 16 and 16 in _PMADDWD:
        return _halves(builder, a, b, n, _madd_ir)
    wide = ir.VectorType(_I32, n)
    return _pairs(builder, builder.mul(builder.sext(a, wide), builder.sext(b, wide)), n)


def _madd_acc_ir(builder, acc, a, b, n):
    """acc + _madd_ir(a, b) (vpdpwssd: LLVM does not always fuse the two)."""
    if n in _VPDPWSSD:
        i32v = ir.VectorType(_I32, n // 2)
        return _call(builder, _VPDPWSSD[n], i32v, [acc, builder.bitcast(a, i32v), builder.bitcast(b, i32v)])
    return builder.add(acc, _madd_ir(builder, a, b, n))


def _maddubs_ir(builder, a, b, n):
    """uint8 x int8 (n lanes) -> int16 (n/2), adjacent products summed."""
    if n in _PMADDUBSW:
        return _call(builder, _PMADDUBSW[n], ir.VectorType(ir.IntType(16), n // 2), [a, b])
    if n > 32 and 32 in _PMADDUBSW:
        return _halves(builder, a, b, n, _maddubs_ir)
    wide = ir.VectorType(ir.IntType(16), n)
    return _pairs(builder, builder.mul(builder.zext(a, wide), builder.sext(b, wide)), n)


def _dot4_ir(builder, a, b, n, acc=None):
    """uint8 x int8 (n lanes) -> int32 (n/4), groups of 4 adjacent products summed, plus acc
    (vpdpbusd)."""
    i32v = ir.VectorType(_I32, n // 4)
    if n in _VPDPBUSD:
        acc = acc if acc is not None else ir.Constant(i32v, [0] * (n // 4))
        return _call(builder, _VPDPBUSD[n], i32v, [acc, builder.bitcast(a, i32v), builder.bitcast(b, i32v)])
    if n > 32 and 32 in _VPDPBUSD:
        r = _halves(builder, a, b, n, _dot4_ir)
    else:  # exact for all uint8 x int8 (pmaddubsw could saturate): widen, pmaddwd, pair up
        wide = ir.VectorType(ir.IntType(16), n)
        r = _pairs(builder, _madd_ir(builder, builder.zext(a, wide), builder.sext(b, wide), n), n // 2)
    return r if acc is None else builder.add(acc, r)


def _lut_ir(builder, table, idx, n):
    """Lane i = table[idx[i]] for a 16-entry byte table and lanes idx < 16: pshufb (the table
    repeated in every 128-bit lane), elsewhere one lane at a time."""
    i8 = ir.IntType(8)
    vals = [v - 256 if v > 127 else v for v in table]
    if n in _PSHUFB:
        return _call(builder, _PSHUFB[n], ir.VectorType(i8, n), [ir.Constant(ir.VectorType(i8, n), vals * (n // 16)), idx])
    if n > 16 and n // 2 in _PSHUFB:
        parts = [_lut_ir(builder, table, builder.shuffle_vector(idx, idx, _lanes(n // 2, lambda i, h=h: i + h * (n // 2))),
                         n // 2) for h in range(2)]
        return builder.shuffle_vector(parts[0], parts[1], _lanes(n, lambda i: i))
    tv = ir.Constant(ir.VectorType(i8, 16), vals)
    out = ir.Constant(ir.VectorType(i8, n), ir.Undefined)
    for i in range(n):
        j = builder.extract_element(idx, ir.Constant(_I32, i))
        out = builder.insert_element(out, builder.extract_element(tv, j), ir.Constant(_I32, i))
    return out


def lut16(*table):
    """An intrinsic f(v) -> Vec(uint8) whose lane i is table[v[i]] (16 byte values; v's lanes < 16)."""
    assert len(table) == 16 and all(0 <= v < 256 for v in table)

    @intrinsic
    def lookup(typingctx, v):
        def codegen(context, builder, sig, args):
            return _lut_ir(builder, table, args[0], v.n)

        return v(v), codegen

    return lookup


def _make_product(ir_fn, out_type, div, doc):
    @intrinsic
    def product(typingctx, a, b):
        vt = Vec(out_type, a.n // div)

        def codegen(context, builder, sig, args):
            return ir_fn(builder, args[0], args[1], a.n)

        return vt(a, b), codegen

    product.__doc__ = doc
    return product


madd = _make_product(_madd_ir, types.int32, 2, "int16 x int16 -> int32 pair sums (pmaddwd; vpdpwssd when summed)")
maddubs = _make_product(_maddubs_ir, types.int16, 2, "uint8 x int8 -> int16 pair sums (pmaddubsw)")
dot4 = _make_product(_dot4_ir, types.int32, 4, "uint8 x int8 -> int32 sums of 4 (vpdpbusd)")


@intrinsic
def dot4acc(typingctx, acc, a, b):
    """acc + dot4(a, b) (the accumulating form of vpdpbusd)."""

    def codegen(context, builder, sig, args):
        return _dot4_ir(builder, args[1], args[2], a.n, args[0])

    return acc(acc, a, b), codegen


# Sums of 4 from pmaddubsw where there is no vpdpbusd (AVX2), for the quants it takes exactly:
# small unsigned ones (Q4 / Q5) and biased signed ones (Q8_0, IQ4_NL: see _dot4_biased_ir). Where
# this is False the exact dot4 runs, and the biased form keeps its bias (the caller's start value
# then holds -128 * sum(b): qmatmul's xoff).
PMADDUBSW_DOTS = not _VPDPBUSD and 32 in _PMADDUBSW


def _dot4_small_ir(builder, acc, pairs, n):
    """acc + the dot4 of each (a, b) in pairs, for a whose products cannot overflow int16 when
    pmaddubsw's pair sums of all the pairs are added (unsigned lanes < 64 for two pairs: Q4 / Q5
    quants): the pmaddubsw results summed, one pmaddwd by ones (2 + 1 products for two pairs,
    where the exact form widens each operand first)."""
    if not PMADDUBSW_DOTS:
        for a, b in pairs:
            acc = _dot4_ir(builder, a, b, n, acc)
        return acc
    s = _maddubs_ir(builder, *pairs[0], n)
    for a, b in pairs[1:]:
        s = builder.add(s, _maddubs_ir(builder, a, b, n))
    return builder.add(acc, _madd_ir(builder, s, ir.Constant(s.type, [1] * (n // 2)), n // 2))


_PSIGNB = {n: name for n, name, ok in (
    (32, "llvm.x86.avx2.psign.b", _x86("avx2")),
    (16, "llvm.x86.ssse3.psign.b.128", _x86("ssse3")),
) if ok}


def _psign_ir(builder, x, w, n):
    """x negated where w < 0, zero where w == 0 (int8 lanes; psignb)."""
    if n in _PSIGNB:
        return _call(builder, _PSIGNB[n], x.type, [x, w])
    if n > 32 and 32 in _PSIGNB:
        return _halves(builder, x, w, n, _psign_ir)
    zero = ir.Constant(x.type, [0] * n)
    neg = builder.select(builder.icmp_signed("<", w, zero), builder.neg(x), x)
    return builder.select(builder.icmp_signed("==", w, zero), zero, neg)


def _dot4_biased_ir(builder, acc, pairs, n):
    """acc + the dot4 of each (a - 128, b) in pairs: signed int8 weights stored biased times int8
    activations b > -128, as llama.cpp's AVX2 form, pmaddubsw(|w|, sign(b, w)) (pair sums <= 2 x
    128 x 127: no saturation) and pmaddwd by ones. Without PMADDUBSW_DOTS: the exact dot4 of the
    biased bytes (a, b), bias included."""
    if not PMADDUBSW_DOTS:
        for a, b in pairs:
            acc = _dot4_ir(builder, a, b, n, acc)
        return acc
    ones = ir.Constant(ir.VectorType(ir.IntType(16), n // 2), [1] * (n // 2))
    zero, bias = ir.Constant(pairs[0][0].type, [0] * n), ir.Constant(pairs[0][0].type, [128] * n)
    for a, b in pairs:
        w = builder.xor(a, bias)  # the signed weights' bits
        absw = builder.select(builder.icmp_signed("<", w, zero), builder.neg(w), w)  # pabsb; -128 -> 128
        p = _maddubs_ir(builder, absw, _psign_ir(builder, b, w, n), n)
        acc = builder.add(acc, _madd_ir(builder, p, ones, n // 2))
    return acc


def _make_acc_products(ir_fn, doc):
    """Two intrinsics over ir_fn(builder, acc, pairs, n): acc + one pair's products (a, b), and
    acc + two pairs' (a0, b0, a1, b1)."""

    @intrinsic
    def one(typingctx, acc, a, b):
        def codegen(context, builder, sig, args):
            return ir_fn(builder, args[0], [(args[1], args[2])], a.n)

        return acc(acc, a, b), codegen

    @intrinsic
    def two(typingctx, acc, a0, b0, a1, b1):
        def codegen(context, builder, sig, args):
            return ir_fn(builder, args[0], [(args[1], args[2]), (args[3], args[4])], a0.n)

        return acc(acc, a0, b0, a1, b1), codegen

    one.__doc__ = two.__doc__ = doc
    return one, two


def _maddubs_sum_ir(builder, acc, pairs, n):
    """acc (int16) + pmaddubsw's pair sums of each (a, b) in pairs: for sums the caller bounds
    below 2**15 (small unsigned a)."""
    for a, b in pairs:
        acc = builder.add(acc, _maddubs_ir(builder, a, b, n))
    return acc


maddubs2_acc = _make_acc_products(_maddubs_sum_ir, "acc (int16) + pmaddubsw's pair sums of two pairs (a, b)")[1]
dot4acc_small, dot8acc_small = _make_acc_products(
    _dot4_small_ir, "acc + dot4 of one pair (a < 128) or two (a < 64), pmaddubsw + pmaddwd where PMADDUBSW_DOTS")
dot4acc_biased, dot8acc_biased = _make_acc_products(
    _dot4_biased_ir, "acc + dot4(a - 128, b) of one pair or two where PMADDUBSW_DOTS, else dot4(a, b)")


@intrinsic
def madd_acc(typingctx, acc, a, b):
    """acc + madd(a, b) (the accumulating form of pmaddwd, vpdpwssd)."""

    def codegen(context, builder, sig, args):
        return _madd_acc_ir(builder, args[0], args[1], args[2], a.n)

    return acc(acc, a, b), codegen


@intrinsic
def hsum(typingctx, v):
    """Sum of the lanes (tree order)."""

    def codegen(context, builder, sig, args):
        flt = isinstance(v.dtype, types.Float)
        return _tree(builder, args[0], v.n, lambda b, lo, hi: b.fadd(lo, hi, flags=_FAST) if flt else b.add(lo, hi))

    return v.dtype(v), codegen


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
