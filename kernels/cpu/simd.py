"""Vector loops that Numba cannot be made to write: the integer core of the quantized GEMV, and the
float16 (or float32) KV cache rows of decode attention (to_cache / as_float, cache_dots,
cache_axpy4, fmax at the end of the file).

Numba types integer arithmetic in 64 bits, and LLVM's vectorizer then multiplies the codes by
activations in 64-bit lanes. Written directly as LLVM vector IR, the loop takes one of two forms,
chosen by the CPU Numba compiles for (GEMV_FORM; benchmarks/arm_static.py shows what each
lowers to, compiled for Arm and x86 on any machine):
- "pairs" (x86 and any other CPU, _pair_sums): 16-bit multiply-adds of pairs, 32 code/activation
  pairs per instruction: vpdpwssd where AVX-512 VNNI or AVX-VNNI exist, else pmaddwd and adds.
- "neon" (64-bit Arm, _neon_sums): the widening multiply-accumulates of Armv8.0, smlal and
  smlal2 (4 int16 products into 4 int32 sums each), both halves of the activation pair kept as
  separate sums and added after a block (addp), with tiles sized so that the sums stay in the
  32 NEON registers. The same integer sums as "pairs", to the bit.

The layout it reads, "pair-planar tiles", for values of b = 1, 2 or 4 bits (a plane of the codes
of kernels.quant: their low 4 bits, or their high 1, 2 or 4 bits): a layer's outputs go in
tiles of LANES, each tile an int32 array [in b/32, LANES], one after the other (int32
[out/LANES, in b/32, LANES]); word [k, r, j] holds the values of output LANES k + j for the
n = 32/b inputs nr .. nr+n-1, input nr + 2m at bit b m and input nr + 2m + 1 at bit 16 + b m
(m < n/2). So (word >> b m) & (2**b - 1) * 0x00010001 is two 16-bit integers, the values of a
pair of inputs, ready for a pairwise multiply-add with the pair's two int16 activations; the
high plane's values are shifted up by 4 and joined to the low plane's, so a code takes one
multiply-add. A GEMV
reads each tile from start to end, the whole layer in the order it lies in memory.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16          # outputs per vector: int32 lanes of a 512-bit register (LLVM splits if narrower)
PREFETCH_BYTES = 2048   # how far ahead of its loads tile_dot asks for memory (best of 0.5-8 KiB)
HALF_MAX = 65504.0     # the largest finite float16


def gemv_form(triple: str) -> str:
    """The form of the GEMV's integer loop for an LLVM target triple: "neon" on 64-bit Arm (Linux's
    aarch64, Apple's arm64), "pairs" elsewhere (see the module's docstring)."""
    return "neon" if triple.split("-")[0] in ("aarch64", "arm64") else "pairs"


GEMV_FORM = gemv_form(llvm.get_process_triple())    # the CPU Numba compiles for: this one


@njit(cache=True, inline="always")
def pair_shift(t, bits):
    """The bit at which a word of the pair-planar layout of `bits`-bit codes holds the code of
    its input t (t < 32 / bits)."""
    return bits * (t // 2) + 16 * (t % 2)


def _splat(builder, value):
    """IR: a vector of LANES copies of the scalar `value`."""
    vec = ir.VectorType(value.type, LANES)
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                  ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))


def _prefetch(builder, address):
    """IR: ask for the cache line at `address` (an i8 pointer): read, to all cache levels, data.
    A hint, which never faults past an array."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]),
        "llvm.prefetch.p0i8")
    builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _pair_sums(context, builder, lo, high, xp_ptrs):
    """IR: for each token's pairs xp_ptrs[i] (pointing at its int32 [in/2]), the int32 vector
    [LANES] of sums, over the word rows r in [r0, r1) of the codes' low plane lo = (w_ptr, r0,
    r1) (w_ptr pointing at the tile's row 0, int32 [rows, LANES]) and m < 4, of
    lo(c) * lo(xp[4 r + m]) + hi(c) * hi(xp[4 r + m]), c = (w[r, j] >> 4 m) & 0xF
    (lo and hi: the 16-bit halves of a word). `high` (or None) = (h_ptr, h0, b): the plane of
    the codes' high b bits (5-, 6- and 8-bit codes), whose row h0 + (r - r0) / (4 / b) holds
    the high bits of low row r's inputs; they join c as c | (high value << 4), so that a whole
    code takes one multiply-add (values up to 255 times int16 activations: a block's sum stays
    within int32), the same integer sums as a multiply-add per plane, in half the work. A
    word's codes are taken apart once for all the tokens. Each row's load asks for the memory
    PREFETCH_BYTES ahead: a GEMV streams through its tiles, and the hardware's prefetch alone
    leaves it waiting on memory (measured: 0.7x the time with it)."""
    intp = context.get_value_type(types.intp)
    i8, i32 = ir.IntType(8), ir.IntType(32)
    vec = ir.VectorType(i32, LANES)                      # 16 x i32: one lane per output
    halves = ir.VectorType(ir.IntType(16), 2 * LANES)    # the same bits as 32 x i16
    wide = ir.VectorType(i32, 2 * LANES)
    even = ir.Constant(vec, list(range(0, 2 * LANES, 2)))
    odd = ir.Constant(vec, list(range(1, 2 * LANES, 2)))
    undef = ir.Constant(wide, ir.Undefined)
    # independent sums in flight: a multiply-add waits for the one before it into the same sum
    chains = max(1, 4 // len(xp_ptrs))
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(chains)]
            for _ in xp_ptrs]
    for acc in sum(accs, []):
        builder.store(ir.Constant(vec, None), acc)

    def const(v):
        return ir.Constant(intp, v)

    def splat32(v):
        return ir.Constant(vec, [v] * LANES)

    def shifted(words, shift):     # words >> shift (<< -shift where negative)
        return words if shift == 0 else (builder.lshr(words, splat32(shift)) if shift > 0
                                          else builder.shl(words, splat32(-shift)))

    def row(base, r):              # the row's words, its memory PREFETCH_BYTES ahead asked for
        ptr = builder.gep(base, [builder.mul(r, const(LANES))])
        _prefetch(builder, builder.gep(builder.bitcast(ptr, i8.as_pointer()),
                                       [const(PREFETCH_BYTES)]))
        return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)

    w_ptr, r0, r1 = lo
    mask = splat32(0xF * 0x10001)
    per = 1 if high is None else 4 // high[2]       # low rows per row of the high plane
    with cgutils.for_range(builder, builder.udiv(builder.sub(r1, r0), const(per))) as loop:
        if high is not None:
            h_ptr, h0, b = high
            high_words = row(h_ptr, builder.add(h0, loop.index))
            high_mask = splat32((((1 << b) - 1) << 4) * 0x10001)
        for q in range(per):
            r = builder.add(r0, builder.add(builder.mul(loop.index, const(per)), const(q)))
            words = row(w_ptr, r)
            for m in range(4):
                codes = builder.and_(shifted(words, 4 * m), mask)
                if high is not None:     # this pair's high bits, to bits 4.. of each half
                    codes = builder.or_(codes, builder.and_(
                        shifted(high_words, b * (4 * q + m) - 4), high_mask))
                codes = builder.sext(builder.bitcast(codes, halves), wide)
                at = builder.add(builder.mul(r, const(4)), const(m))
                for xp_ptr, token_accs in zip(xp_ptrs, accs):
                    acc = token_accs[(4 * q + m) % chains]
                    x = _splat(builder, builder.load(builder.gep(xp_ptr, [at])))
                    prod = builder.mul(codes, builder.sext(builder.bitcast(x, halves), wide))
                    total = builder.add(builder.load(acc), builder.shuffle_vector(prod, undef, even))
                    builder.store(builder.add(total, builder.shuffle_vector(prod, undef, odd)), acc)
    sums = []
    for token_accs in accs:
        a = [builder.load(acc) for acc in token_accs]
        while len(a) > 1:
            a = [builder.add(a[i], a[i + 1]) for i in range(0, len(a), 2)]
        sums.append(a[0])
    return sums


NEON_SUM_REGS = 16   # of Arm's 32 vector registers, those a pass's sums may take
NEON_TOKENS = 4      # tokens per pass at most: more would leave too few registers for the rest


def _neon_sums(context, builder, lo, high, xp_ptrs):
    """IR: _pair_sums's sums (the same integers: int32 sums are exact in any order), in the form
    that lowers to Arm's widening multiply-accumulates smlal and smlal2 (four int16 products
    added to four int32 sums, from the low or the high halves of two 128-bit registers), where
    x86 multiplies and adds pairs. A word's two 16-bit codes (an even input's and an odd one's)
    go into sums of their own, times the same side of the input pair's int16 activations, and
    each output's two sums are added once, after the block's rows (addp).

    smlal2 takes the high halves of both registers: the activations' high half must differ from
    their low half, or LLVM takes it for the low half and moves the codes' high half down (ext)
    for an smlal. So each 128-bit vector of 4 outputs holds pair m for its first two outputs
    (side 0) and pair m + 1 for the other two (side 1), with activations [x_m, x_m, x_m+1,
    x_m+1], and a second vector the other way round; the codes are shifted into place lane by
    lane (ushl by a vector).

    An output holds two int32 sums, so 4 outputs take 2 registers a token. The tokens go
    NEON_TOKENS at a time and the tile's LANES outputs in passes, so that a pass's sums fit in
    NEON_SUM_REGS registers (16 outputs for 1 or 2 tokens, 8 for 3 or 4) beside the codes, the
    activations and the shifts (x86 keeps 16 outputs in one register: LANES); the 5-, 6- and
    8-bit codes' high plane has shifts and masks of its own, and their passes half as many
    sums. A later pass reads the block's rows (64 bytes each) from L1; only the first asks for
    memory ahead."""
    sums = []
    for t in range(0, len(xp_ptrs), NEON_TOKENS):
        sums += _neon_group(context, builder, lo, high, xp_ptrs[t:t + NEON_TOKENS])
    return sums


def _neon_group(context, builder, lo, high, xp_ptrs):
    """_neon_sums for at most NEON_TOKENS tokens."""
    intp = context.get_value_type(types.intp)
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    # the high plane's shifts and masks take registers of their own: half as many for sums
    budget = NEON_SUM_REGS if high is None else NEON_SUM_REGS // 2
    width = next(n for n in (LANES, 8, 4) if len(xp_ptrs) * n // 2 <= budget)
    vec = ir.VectorType(i32, width)
    wide = ir.VectorType(i32, 2 * width)              # each output's even and odd sums
    halves = ir.VectorType(i16, 2 * width)
    side = [(j // 2) % 2 for j in range(width)]

    def const(v):
        return ir.Constant(intp, v)

    def lanes(values):
        return ir.Constant(vec, list(values))

    def shifted(words, shifts):    # words >> shifts[j] in lane j (<< -shifts[j] where negative)
        if any(s > 0 for s in shifts):
            words = builder.lshr(words, lanes(max(s, 0) for s in shifts))
        if any(s < 0 for s in shifts):
            words = builder.shl(words, lanes(max(-s, 0) for s in shifts))
        return words

    def widened(v):                # int32 lanes as their two int16 halves, each sign-extended
        return builder.sext(builder.bitcast(v, halves), wide)

    w_ptr, r0, r1 = lo
    mask = lanes([0xF * 0x10001] * width)
    per = 1 if high is None else 4 // high[2]       # low rows per row of the high plane
    passes = []
    for p in range(LANES // width):
        def row(base, r, at=p * width):    # the pass's words of row r (the first pass asks ahead)
            ptr = builder.gep(base, [builder.add(builder.mul(r, const(LANES)), const(at))])
            if at == 0:
                _prefetch(builder, builder.gep(builder.bitcast(ptr, i8.as_pointer()),
                                               [const(PREFETCH_BYTES)]))
            return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)

        accs = [cgutils.alloca_once_value(builder, ir.Constant(wide, None)) for _ in xp_ptrs]
        for acc in accs:
            builder.store(ir.Constant(wide, None), acc)
        with cgutils.for_range(builder, builder.udiv(builder.sub(r1, r0), const(per))) as loop:
            if high is not None:
                h_ptr, h0, b = high
                high_words = row(h_ptr, builder.add(h0, loop.index))
                high_mask = lanes([(((1 << b) - 1) << 4) * 0x10001] * width)
            for q in range(per):
                r = builder.add(r0, builder.add(builder.mul(loop.index, const(per)), const(q)))
                words = row(w_ptr, r)
                # each token's four activation pairs of the row
                quads = [builder.load(builder.bitcast(
                    builder.gep(xp_ptr, [builder.mul(r, const(4))]),
                    ir.VectorType(i32, 4).as_pointer()), align=4) for xp_ptr in xp_ptrs]
                for m in (0, 2):
                    for flip in (0, 1):
                        picks = [m + (s ^ flip) for s in side]     # each lane's pair
                        codes = builder.and_(shifted(words, [4 * t for t in picks]), mask)
                        if high is not None:     # the high bits, to bits 4.. of each half
                            codes = builder.or_(codes, builder.and_(shifted(
                                high_words, [b * (4 * q + t) - 4 for t in picks]), high_mask))
                        codes = widened(codes)
                        for quad, acc in zip(quads, accs):
                            x = widened(builder.shuffle_vector(quad, quad, lanes(picks)))
                            builder.store(builder.add(builder.load(acc), builder.mul(codes, x)),
                                          acc)
        # each output's even and odd sums added (addp)
        even, odd = lanes(range(0, 2 * width, 2)), lanes(range(1, 2 * width, 2))
        passes.append([builder.add(builder.shuffle_vector(a, a, even),
                                   builder.shuffle_vector(a, a, odd))
                       for a in (builder.load(acc) for acc in accs)])
    sums = []
    for parts in zip(*passes):     # each token's passes, joined into one LANES vector
        parts = list(parts)
        while len(parts) > 1:
            n = 2 * parts[0].type.count
            parts = [builder.shuffle_vector(parts[i], parts[i + 1],
                                            ir.Constant(ir.VectorType(i32, n), list(range(n))))
                     for i in range(0, len(parts), 2)]
        sums.append(parts[0])
    return sums


def _int8_vector(builder, ptr):
    """IR: the LANES int8 at ptr as a float32 vector."""
    v = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(8), LANES).as_pointer()),
                     align=1)
    return builder.sitofp(v, ir.VectorType(ir.FloatType(), LANES))


def make_tile_dot(bits: int, tokens: int = 1, form: str | None = None):
    """The intrinsic tile_dot{bits}(w, k, xp, sx, xsum, t, out) for a layer w (kernels.cpu
    QLinear) of `bits`-bit codes and `tokens` tokens t .. t+tokens-1: out[i, j] (float32
    [tokens, LANES], contiguous; [LANES] for one token) = output LANES k + j of the layer for
    token t + i, the sum over activation blocks b (in quantization group gi) of
        s[gi, j] * sx[t, b] * (integer dot of the block's codes and x_q)  +  m[gi, j] * xsum[t, b]
    xp int32 [T, in/2], sx and xsum float32 [T, blocks] (quantize_pairs). The integer dot
    multiplies 16-bit codes by int16 activations, in the `form` given (default GEMV_FORM, this
    CPU's): "pairs" (_pair_sums: x86's vpdpwssd or pmaddwd) or "neon" (_neon_sums: Arm's smlal,
    smlal2), the 4-bit plane of the codes' low bits joined with the plane of their high bits-4
    bits into one 16-bit code first. A group's s and m are computed from the
    tile's scale and offset arrays as kernels.quant defines them (a float times an optional
    int8; no offset array: m = -zero s), the arrays a layer lacks being empty (branches that
    go the same way for a whole layer). The LANES outputs stay in a register from the first
    block to the last. A token's outputs are the same sums in the same order whatever
    `tokens` (codes taken apart once serve them all: a prompt's GEMM)."""
    high = bits - 4
    sums = _neon_sums if (form or GEMV_FORM) == "neon" else _pair_sums

    @intrinsic
    def tile_dot(typingctx, w, k, xp, sx, xsum, t, out):
        sig = types.void(w, k, xp, sx, xsum, t, out)

        def codegen(context, builder, signature, args):
            w_ty, k_ty, xp_ty, sx_ty, xsum_ty, t_ty, out_ty = signature.args
            intp = context.get_value_type(types.intp)
            kv, tv = (context.cast(builder, v, ty, types.intp)
                      for v, ty in ((args[1], k_ty), (args[5], t_ty)))
            fvec = ir.VectorType(ir.FloatType(), LANES)
            fast = ["fast"]

            def const(v):
                return ir.Constant(intp, v)

            field = {name: (builder.extract_value(args[0], i), w_ty.types[i])
                     for i, name in enumerate(w_ty.fields)}

            def pointer(name, *index):
                value, ty = field[name] if isinstance(name, str) else name
                a = context.make_array(ty)(context, builder, value)
                return cgutils.get_item_pointer(context, builder, ty, a, list(index))

            def dim(name, axis):
                value, ty = field[name]
                return builder.extract_value(context.make_array(ty)(context, builder, value).shape,
                                             axis)

            n_blocks = builder.extract_value(
                context.make_array(sx_ty)(context, builder, args[3]).shape, 1)
            lo_rows = builder.udiv(dim("lo", 1), n_blocks)            # word rows per block
            hi_rows = builder.udiv(dim("hi", 1), n_blocks)
            group = context.cast(builder, field["group"][0], field["group"][1], types.intp)
            groups = builder.udiv(builder.mul(dim("lo", 1), const(8)), group)
            per_group = builder.udiv(n_blocks, groups)
            s_div = builder.udiv(groups, dim("s", 1))
            n_m = dim("m", 1)
            m_div = builder.udiv(groups, builder.select(
                builder.icmp_unsigned("==", n_m, const(0)), const(1), n_m))
            has = {name: builder.icmp_unsigned("!=", dim(name, 1), const(0))
                   for name in ("sq", "m", "mq")}
            zero = context.cast(builder, field["zero"][0], field["zero"][1], types.float32)
            minus_zero = _splat(builder, builder.fsub(ir.Constant(ir.FloatType(), 0.0), zero))
            lo_ptr = pointer("lo", kv, const(0), const(0))
            hi_ptr = pointer("hi", kv, const(0), const(0)) if high else None
            xp_ptrs = [pointer((args[2], xp_ty), builder.add(tv, const(i)), const(0))
                       for i in range(tokens)]
            totals = [cgutils.alloca_once_value(builder, ir.Constant(fvec, None))
                      for _ in range(tokens)]
            s_acc = cgutils.alloca_once_value(builder, ir.Constant(fvec, None))
            m_acc = cgutils.alloca_once_value(builder, ir.Constant(fvec, None))
            # where block b falls: group gi, scale block si, offset block mi, each with the
            # count of blocks (groups) it has been in so far (no division in the loop)
            at = {name: cgutils.alloca_once_value(builder, const(0))
                  for name in ("gi", "in_g", "si", "in_s", "mi", "in_m")}

            def step(index, count, size, by):    # count += by; at size: index += 1, count = 0
                n = builder.add(builder.load(at[count]), by)
                full = builder.icmp_unsigned("==", n, size)
                builder.store(builder.select(full, const(0), n), at[count])
                builder.store(builder.add(builder.load(at[index]), builder.zext(full, intp)),
                              at[index])
                return builder.zext(full, intp)

            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                r0 = builder.mul(b, lo_rows)
                dots = sums(context, builder, (lo_ptr, r0, builder.add(r0, lo_rows)),
                            (hi_ptr, builder.mul(b, hi_rows), high) if high else None, xp_ptrs)
                gi, si, mi = (builder.load(at[name]) for name in ("gi", "si", "mi"))
                builder.store(_vector_at(builder, pointer("s", kv, si, const(0)), const(0),
                                         _is_half(field["s"][1])), s_acc)
                with builder.if_then(has["sq"]):
                    sub = _int8_vector(builder, pointer("sq", kv, gi, const(0)))
                    builder.store(builder.fmul(builder.load(s_acc), sub, flags=fast), s_acc)
                scales = builder.load(s_acc)
                with builder.if_else(has["m"]) as (offsets, symmetric):
                    with offsets:
                        m = _vector_at(builder, pointer("m", kv, mi, const(0)), const(0),
                                       _is_half(field["m"][1]))
                        builder.store(m, m_acc)
                        with builder.if_then(has["mq"]):
                            sub = _int8_vector(builder, pointer("mq", kv, gi, const(0)))
                            builder.store(builder.fmul(builder.load(m_acc), sub, flags=fast),
                                          m_acc)
                    with symmetric:
                        builder.store(builder.fmul(scales, minus_zero, flags=fast), m_acc)
                offsets = builder.load(m_acc)
                for i, (dot, total) in enumerate(zip(dots, totals)):
                    ti = builder.add(tv, const(i))
                    f = _splat(builder, builder.load(pointer((args[3], sx_ty), ti, b)))
                    xs = _splat(builder, builder.load(pointer((args[4], xsum_ty), ti, b)))
                    part = builder.fmul(scales, builder.fmul(f, builder.sitofp(dot, fvec),
                                                             flags=fast), flags=fast)
                    part = builder.fadd(part, builder.fmul(offsets, xs, flags=fast), flags=fast)
                    builder.store(builder.fadd(builder.load(total), part, flags=fast), total)
                next_group = step("gi", "in_g", per_group, const(1))
                step("si", "in_s", s_div, next_group)
                step("mi", "in_m", m_div, next_group)
            out_ptr = builder.bitcast(context.make_array(out_ty)(context, builder, args[6]).data,
                                      fvec.as_pointer())
            for i, total in enumerate(totals):
                builder.store(builder.load(total), builder.gep(out_ptr, [const(i)]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


tile_dot4 = make_tile_dot(4)
tile_dot5 = make_tile_dot(5)
tile_dot6 = make_tile_dot(6)
tile_dot8 = make_tile_dot(8)
FEW_TOKENS = 4      # tokens per tile_dot of a draft's verification: the codes taken apart once
pair_dot4 = make_tile_dot(4, 2)     # two tokens (a verification's last two, or a draft of one)
pair_dot5 = make_tile_dot(5, 2)
pair_dot6 = make_tile_dot(6, 2)
pair_dot8 = make_tile_dot(8, 2)
few_dot4 = make_tile_dot(4, FEW_TOKENS)
few_dot5 = make_tile_dot(5, FEW_TOKENS)
few_dot6 = make_tile_dot(6, FEW_TOKENS)
few_dot8 = make_tile_dot(8, FEW_TOKENS)
GEMM_TOKENS = 8     # tokens per tile_dot of a prompt: their sums and outputs fill the registers
gemm_dot4 = make_tile_dot(4, GEMM_TOKENS)
gemm_dot5 = make_tile_dot(5, GEMM_TOKENS)
gemm_dot6 = make_tile_dot(6, GEMM_TOKENS)
gemm_dot8 = make_tile_dot(8, GEMM_TOKENS)


def _rows_dot(R: int, U: int = 1):
    """The intrinsic rows_dot{R}(w, r, x, t, dst): dst[u R + j] = sum over i < n of
    x[t + u, i] * w[r + j, i] in float32 for the R rows r .. r+R-1 of w [out, in] (float32, or
    int8 taken as its values) and the U tokens t .. t+U-1 of x float32 [T, in], n = in rounded
    down to a multiple of LANES (the caller adds the rest). Each row and token has a vector
    accumulator of LANES floats, summed at the end (llvm's reduction), so a row's sum for a token
    is the same whichever R and U compute it; a row's elements are loaded (and int8 converted)
    once for the U tokens. The loop asks for the next R rows (which a GEMV reads next) as it
    goes, each cache line once."""

    @intrinsic
    def rows_dot(typingctx, w, r, x, t, dst):
        sig = types.void(w, r, x, t, dst)

        def codegen(context, builder, signature, args):
            w_ty, r_ty, x_ty, t_ty, dst_ty = signature.args
            intp = context.get_value_type(types.intp)
            rv, tv = (context.cast(builder, v, ty, types.intp)
                      for v, ty in ((args[1], r_ty), (args[3], t_ty)))
            w_arr = context.make_array(w_ty)(context, builder, args[0])
            cols = builder.extract_value(w_arr.shape, 1)
            n = builder.mul(builder.udiv(cols, ir.Constant(intp, LANES)), ir.Constant(intp, LANES))
            f32, i8 = ir.FloatType(), ir.IntType(8)
            vec = ir.VectorType(f32, LANES)
            is_int8 = w_ty.dtype == types.int8
            element = i8 if is_int8 else f32
            rows = [_row_pointer(context, builder, w_ty, args[0],
                                 builder.add(rv, ir.Constant(intp, j))) for j in range(R)]
            x_rows = [_row_pointer(context, builder, x_ty, args[2],
                                   builder.add(tv, ir.Constant(intp, u))) for u in range(U)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(R)]
                    for _ in range(U)]
            zero, step = ir.Constant(intp, 0), ir.Constant(intp, LANES)
            size = 1 if is_int8 else 4
            # the R rows lie one after the other: the step at element d asks for the bytes the
            # same step of the next R rows will read, a cache line (64 bytes) at a time
            ahead = builder.gep(builder.bitcast(rows[0], i8.as_pointer()),
                                [builder.mul(cols, ir.Constant(intp, R * size))])
            with cgutils.for_range_slice(builder, zero, n, step) as (d, _):
                at = builder.mul(d, ir.Constant(intp, R * size))
                for line in range(max(1, R * size * LANES // 64)):
                    offset = builder.add(at, ir.Constant(intp, 64 * line))
                    _prefetch(builder, builder.gep(ahead, [offset]))
                xvs = [builder.load(builder.bitcast(builder.gep(x_row, [d]), vec.as_pointer()),
                                    align=4) for x_row in x_rows]
                for j, row in enumerate(rows):
                    ptr = builder.gep(row, [d])
                    wv = builder.load(builder.bitcast(ptr, ir.VectorType(element, LANES)
                                                      .as_pointer()), align=1 if is_int8 else 4)
                    if is_int8:
                        wv = builder.sitofp(wv, vec)
                    for xv, token_accs in zip(xvs, accs):
                        acc = token_accs[j]
                        builder.store(builder.fadd(builder.load(acc),
                                                   builder.fmul(xv, wv, flags=["fast"]),
                                                   flags=["fast"]), acc)
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, vec]),
                f"llvm.vector.reduce.fadd.v{LANES}f32")
            dst_arr = context.make_array(dst_ty)(context, builder, args[4])
            for u, token_accs in enumerate(accs):
                for j, acc in enumerate(token_accs):
                    total = builder.call(reduce, [ir.Constant(f32, 0), builder.load(acc)],
                                         fastmath=("fast",))
                    where = ir.Constant(intp, u * R + j)
                    builder.store(total, cgutils.get_item_pointer(context, builder, dst_ty,
                                                                  dst_arr, [where]))
            return context.get_dummy_value()

        return sig, codegen

    return rows_dot


rows_dot4 = _rows_dot(4)
rows_dot1 = _rows_dot(1)
rows_dot4_few = _rows_dot(4, FEW_TOKENS)     # 4 rows for FEW_TOKENS tokens (a verification)


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits` (a bit cast; Numba has none for scalars).
    LLVM vectorizes loops that use it."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# -- the KV cache's elements: float16 (stored as uint16 bits) or float32 --------------------------

def _is_half(array_type) -> bool:
    return array_type.dtype == types.uint16


def _to_float(builder, value, half: bool):
    """A loaded KV element or vector of them as float32."""
    if not half:
        return value
    count = value.type.count if isinstance(value.type, ir.VectorType) else None
    f16 = ir.HalfType() if count is None else ir.VectorType(ir.HalfType(), count)
    f32 = ir.FloatType() if count is None else ir.VectorType(ir.FloatType(), count)
    return builder.fpext(builder.bitcast(value, f16), f32)


@intrinsic
def to_cache(typingctx, x, buf):
    """The float32 `x` as an element of the KV buffer `buf` holds it: float16 bits (rounded to
    nearest, clamped to the largest finite half, so attention weights of 0 never meet an
    infinity) for a uint16 buffer, x itself for a float32 one."""
    sig = buf.dtype(types.float32, buf)

    def codegen(context, builder, signature, args):
        if not _is_half(signature.args[1]):
            return args[0]
        top, bottom = ir.Constant(ir.FloatType(), HALF_MAX), ir.Constant(ir.FloatType(), -HALF_MAX)
        x = args[0]
        x = builder.select(builder.fcmp_ordered(">", x, top), top, x)
        x = builder.select(builder.fcmp_ordered("<", x, bottom), bottom, x)
        return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def as_float(typingctx, e):
    """A KV buffer element (see to_cache), or any float16 stored as uint16 bits, as float32."""
    sig = types.float32(e)

    def codegen(context, builder, signature, args):
        return _to_float(builder, args[0], signature.args[0] == types.uint16)

    return sig, codegen


def _row_pointer(context, builder, array_type, array, row):
    """Pointer to element [row, 0] of a C-contiguous 2-D array."""
    arr = context.make_array(array_type)(context, builder, array)
    zero = ir.Constant(context.get_value_type(types.intp), 0)
    return cgutils.get_item_pointer(context, builder, array_type, arr, [row, zero])


def _vector_at(builder, base, offset, half: bool):
    """The LANES KV elements (uint16 float16 bits if half, else float32) at base + offset, as a
    float32 vector (an unaligned load)."""
    element = ir.IntType(16) if half else ir.FloatType()
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.VectorType(element, LANES).as_pointer())
    return _to_float(builder, builder.load(ptr, align=2 if half else 4), half)


HEADS = 4     # query heads per pass of cache_dots / cache_axpy4 over a KV row (sums in registers)


@intrinsic(prefer_literal=True)
def cache_dots(typingctx, q, h, k, s, n, out, r, c, heads):
    """out[r + i, c] = sum over d < n of q[h + i, d] * k[s, d] in float32 for i < heads (a
    constant, at most HEADS): q float32 [Q, D], k a KV buffer head [S, D] (uint16 float16 bits
    or float32), out float32 [R, C], n a multiple of LANES. The query heads of one KV head read
    its row once: each of its vectors is loaded and converted once for all of them. Each head's
    sum is the one it gets alone (the same products added in the same order)."""
    count = heads.literal_value
    sig = types.void(q, h, k, s, n, out, r, c, heads)

    def codegen(context, builder, signature, args):
        q_ty, h_ty, k_ty, s_ty, n_ty, out_ty, r_ty, c_ty = signature.args[:8]
        intp = context.get_value_type(types.intp)
        hv, sv, nv, rv, cv = (context.cast(builder, args[j], signature.args[j], types.intp)
                              for j in (1, 3, 4, 6, 7))
        half = _is_half(k_ty)
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, LANES)
        q_rows = [_row_pointer(context, builder, q_ty, args[0],
                               builder.add(hv, ir.Constant(intp, i))) for i in range(count)]
        k_row = _row_pointer(context, builder, k_ty, args[2], sv)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(count)]
        zero, step = ir.Constant(intp, 0), ir.Constant(intp, LANES)
        with cgutils.for_range_slice(builder, zero, nv, step) as (d, _):
            kv = _vector_at(builder, k_row, d, half)
            for q_row, acc in zip(q_rows, accs):
                qv = _vector_at(builder, q_row, d, False)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(qv, kv, flags=["fast"]),
                                           flags=["fast"]), acc)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vec]),
                                                f"llvm.vector.reduce.fadd.v{LANES}f32")
        out_arr = context.make_array(out_ty)(context, builder, args[5])
        for i, acc in enumerate(accs):
            total = builder.call(reduce, [ir.Constant(f32, 0), builder.load(acc)],
                                 fastmath=("fast",))
            row = builder.add(rv, ir.Constant(intp, i))
            builder.store(total, cgutils.get_item_pointer(context, builder, out_ty, out_arr,
                                                          [row, cv]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def cache_axpy4(typingctx, e, r, i, v, s, out, h, n, heads):
    """out[h + j, :n] += e[r + j, i] v[s] + e[r + j, i+1] v[s+1] + e[r + j, i+2] v[s+2]
    + e[r + j, i+3] v[s+3] (rows, d < n) in float32 for j < heads (a constant, at most HEADS):
    e float32 [R, m] (the heads' weights), v a KV buffer head [S, D] (uint16 float16 bits or
    float32), out float32 [Q, D], n a multiple of LANES. The four rows' vectors are loaded and
    converted once for all the heads; one load and store of a head's out per four rows."""
    count = heads.literal_value
    sig = types.void(e, r, i, v, s, out, h, n, heads)

    def codegen(context, builder, signature, args):
        e_ty, _, _, v_ty, _, out_ty = signature.args[:6]
        intp = context.get_value_type(types.intp)
        rv, iv, sv, hv, nv = (context.cast(builder, args[j], signature.args[j], types.intp)
                              for j in (1, 2, 4, 6, 7))
        half = _is_half(v_ty)
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, LANES)
        e_arr = context.make_array(e_ty)(context, builder, args[0])
        rows = [_row_pointer(context, builder, v_ty, args[3],
                             builder.add(sv, ir.Constant(intp, t))) for t in range(4)]
        weights, out_rows = [], []
        for j in range(count):
            er = builder.add(rv, ir.Constant(intp, j))
            weights.append([_splat(builder, builder.load(cgutils.get_item_pointer(
                context, builder, e_ty, e_arr, [er, builder.add(iv, ir.Constant(intp, t))])))
                for t in range(4)])
            out_rows.append(_row_pointer(context, builder, out_ty, args[5],
                                         builder.add(hv, ir.Constant(intp, j))))
        zero, step = ir.Constant(intp, 0), ir.Constant(intp, LANES)
        with cgutils.for_range_slice(builder, zero, nv, step) as (d, _):
            xs = [_vector_at(builder, row, d, half) for row in rows]
            for ws, out_row in zip(weights, out_rows):
                ptr = builder.bitcast(builder.gep(out_row, [d]), vec.as_pointer())
                total = builder.load(ptr, align=4)
                for w, x in zip(ws, xs):
                    total = builder.fadd(total, builder.fmul(w, x, flags=["fast"]),
                                         flags=["fast"])
                builder.store(total, ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fmax(typingctx, a, b):
    """max(a, b) of two float32 as LLVM's maxnum: a loop reducing with it vectorizes (Numba's
    max() does not)."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
        return builder.call(fn, args, fastmath=("fast",))

    return sig, codegen


# -- the quantized KV cache's codes (kernels.kv_quant) --------------------------------------------

@intrinsic(prefer_literal=True)
def codes_tile(typingctx, w, r0, codes, group, acc, heads, bits, narrow):
    """codes_tile(w, r0, codes, group, acc, heads, bits, narrow), the last three constants: for
    heads r in [r0, r0 + heads), acc[r, l] += sum over rows i of w[r, i, l // group] * code(i, l), where
    code(i, l) is value l of row i of `codes` (uint8 [n, W], C-contiguous, in kv_quant's planes
    of `bits`-bit values: byte l % W at bit (l // W) bits), w float32 [R, n, groups] and acc
    float32 [R, L] (L = W 8 / bits), both C-contiguous. W must be a multiple of 16 (or, if
    `narrow`, exactly 8, with bits <= 4) and `group` of LANES: decode attention over a
    quantized cache, keys (rows: channels, values: a block's slots) and values (rows: slots,
    values: channels) alike.

    A register tile: each row's 16 bytes are loaded and widened once and give every plane's
    values (of 8 bytes: planes two by two), so the tile's 8 / bits vectors (4 / bits narrow)
    of the heads' sums stay in registers over the rows, and a row's codes are taken apart
    once for all the heads."""
    heads_ty, bits_ty, narrow_ty = heads, bits, narrow
    heads, bits, narrow = (a.literal_value for a in (heads, bits, narrow))
    planes = 8 // bits
    vectors = planes // 2 if narrow else planes
    # the bit of each lane's value in its byte, per vector of the tile
    if narrow:
        shifts = [[2 * v * bits] * (LANES // 2) + [(2 * v + 1) * bits] * (LANES // 2)
                  for v in range(vectors)]
    else:
        shifts = [[v * bits] * LANES for v in range(vectors)]

    sig = types.void(w, r0, codes, group, acc, heads_ty, bits_ty, narrow_ty)

    def codegen(context, builder, signature, args):
        w_ty, r0_ty, c_ty, g_ty, a_ty = signature.args[:5]
        intp = context.get_value_type(types.intp)
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        vec, ivec = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
        r0, group = (context.cast(builder, args[j], signature.args[j], types.intp)
                     for j in (1, 3))
        w_arr = context.make_array(w_ty)(context, builder, args[0])
        c_arr = context.make_array(c_ty)(context, builder, args[2])
        a_arr = context.make_array(a_ty)(context, builder, args[4])
        n, W = cgutils.unpack_tuple(builder, c_arr.shape, 2)
        rows = [builder.add(r0, ir.Constant(intp, t)) for t in range(heads)]
        masks = [ir.Constant(ivec, [(1 << bits) - 1] * LANES) for _ in range(vectors)]
        step = ir.Constant(intp, LANES)
        load_ty = ir.VectorType(i8, LANES // 2 if narrow else LANES)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), W, step) as (w0, _):
            # vector v of the tile: the values acc[:, base_v : base_v + LANES)
            if narrow:
                bases = [ir.Constant(intp, LANES * v) for v in range(vectors)]
            else:
                bases = [builder.add(w0, builder.mul(W, ir.Constant(intp, v)))
                         for v in range(vectors)]
            groups = [builder.udiv(b, group) for b in bases]
            ptrs = [[builder.bitcast(cgutils.get_item_pointer(
                context, builder, a_ty, a_arr, [r, b]), vec.as_pointer()) for b in bases]
                for r in rows]
            sums = [[cgutils.alloca_once_value(builder, builder.load(p, align=4))
                     for p in row] for row in ptrs]
            with cgutils.for_range(builder, n) as loop:
                i = loop.index
                x = builder.load(builder.bitcast(cgutils.get_item_pointer(
                    context, builder, c_ty, c_arr, [i, w0]), load_ty.as_pointer()), align=1)
                if narrow:
                    x = builder.shuffle_vector(x, x, ir.Constant(
                        ivec, list(range(LANES // 2)) * 2))
                x = builder.zext(x, ivec)
                for v in range(vectors):
                    y = x
                    if any(shifts[v]):
                        y = builder.lshr(y, ir.Constant(ivec, shifts[v]))
                    if min(shifts[v]) + bits < 8:
                        y = builder.and_(y, masks[v])
                    y = builder.uitofp(y, vec)
                    for r, s in zip(rows, sums):
                        wv = builder.load(cgutils.get_item_pointer(
                            context, builder, w_ty, w_arr, [r, i, groups[v]]))
                        builder.store(builder.fadd(builder.load(s[v]), builder.fmul(
                            _splat(builder, wv), y, flags=["fast"]), flags=["fast"]), s[v])
            for row_ptrs, row_sums in zip(ptrs, sums):
                for p, s in zip(row_ptrs, row_sums):
                    builder.store(builder.load(s), p, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def codes_axpy_fits(W, bits, group):
    """Whether codes_axpy takes rows of W bytes of `bits`-bit codes in groups of `group`."""
    return (W % LANES == 0 or (W == LANES // 2 and bits <= 4)) and group % LANES == 0


@njit(inline="always")
def _heads(w, codes, group, acc, bits, narrow):
    """codes_tile over all the heads of acc [R, L], four at a time (bits, narrow: constants)."""
    R = acc.shape[0]
    r = 0
    while R - r >= 4:
        codes_tile(w, r, codes, group, acc, 4, bits, narrow)
        r += 4
    if R - r == 3:
        codes_tile(w, r, codes, group, acc, 3, bits, narrow)
    elif R - r == 2:
        codes_tile(w, r, codes, group, acc, 2, bits, narrow)
    elif R - r == 1:
        codes_tile(w, r, codes, group, acc, 1, bits, narrow)


@njit(cache=True)
def codes_axpy(w, codes, bits, group, acc):
    """acc[r, l] += sum over rows i of w[r, i, l // group] * code(i, l) for every head r
    (codes_tile; codes_axpy_fits must hold)."""
    narrow = codes.shape[1] < LANES
    if bits == 8:
        _heads(w, codes, group, acc, 8, False)
    elif bits == 4 and narrow:
        _heads(w, codes, group, acc, 4, True)
    elif bits == 4:
        _heads(w, codes, group, acc, 4, False)
    elif narrow:
        _heads(w, codes, group, acc, 2, True)
    else:
        _heads(w, codes, group, acc, 2, False)
