"""Triton kernel sources: fused dequant + decode attention, its split reduction, and quantize-and-pack.

The functions below are plain Python until :func:`build` hands them to ``triton.jit`` (and rebinds the
module names to the jitted objects, so kernels find their jitted helpers). Importing this module therefore
never imports triton; the first launch does. Whether the kernels run compiled (CUDA) or in Triton's CPU
interpreter is decided at that moment by ``TRITON_INTERPRET`` (Triton decides at decoration time), and
is fixed for the process: :func:`interpreted` says which.

Numerics that matter for bit-exactness with :mod:`kvq_export.reference.codec`:

* divisions use ``tl.div_rn`` (IEEE round-to-nearest; a plain ``/`` is approximate on NVIDIA GPUs);
* round-half-to-even is ``(y + 1.5 * 2**23) - 1.5 * 2**23`` on a value already clamped to a small range
  (exact in fp32; libdevice's ``rint`` does not exist in the interpreter);
* float8 e4m3fn codes travel as uint8 bits and are decoded/encoded with integer arithmetic. Under the
  interpreter (triton 3.9) the native ``.to(tl.float8e4nv)`` conversion is wrong for values whose
  mantissa rounding carries into the exponent (125.97 -> 64 instead of 128) and decoding maps 0x7F to 480
  instead of NaN; the integer path is exact everywhere and works on GPUs without native fp8 (sm < 89);
* the quantize kernels are launched with ``enable_fp_fusion=False`` on GPU so ``mid - half`` (clip) is not
  contracted into an FMA.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from kvq_export._lazy import require

tl: Any = None  # triton.language, bound by build()

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}

LOG2E = 1.4426950408889634
#: fp32 magic number: (y + M) - M rounds y to the nearest integer, ties to even, for |y| < 2**22.
ROUND_MAGIC = 12582912.0


# ---------------------------------------------------------------------------------------------- helpers
# Reductions go through tl.reduce with triton's own combine functions (bound by build()): tl.max/min/sum
# are @triton.jit library functions jitted when triton is imported, which may have happened before the
# interpreter was chosen; tl.reduce is a builtin, and the interpreter runs these combine functions as numpy.
MAX_COMBINE: Any = None
MIN_COMBINE: Any = None
SUM_COMBINE: Any = None


def _rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, MAX_COMBINE)


def _rmin(x, axis: tl.constexpr):
    return tl.reduce(x, axis, MIN_COMBINE)


def _rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, SUM_COMBINE)


def _fp8_decode(raw):
    """uint8 e4m3fn bits -> fp32 (exact; no NaN codes are ever stored: codes are clamped to +-448)."""
    b = raw.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2 ** (max(e, 1) - 10)
    val = tl.where(e == 0, m, m + 8).to(tl.float32) * pow2
    return tl.where((b >> 7) != 0, -val, val)


def _fp8_encode(y):
    """fp32 in [-448, 448] -> e4m3fn bits (int32), round to nearest even, like torch's conversion."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = tl.abs(y)
    au = a.to(tl.int32, bitcast=True)
    r = (au + 0x7FFFF + ((au >> 20) & 1)) & -1048576  # keep 3 mantissa bits, ties to even
    normal = ((((r >> 23) - 120) << 3) | ((r >> 20) & 7))
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # subnormals: multiples of 2**-9 (ROUND_MAGIC)
    code = tl.where(a < 0.015625, sub, normal)
    return code | (sign << 7)


def _plane_at(codes_ptr, base, r, mask, BYTE0: tl.constexpr, WIDTH: tl.constexpr):
    """The ``WIDTH``-bit fields of codes ``r`` [BLOCK_D] in a plane starting at byte ``base + BYTE0`` (int32)."""
    PER: tl.constexpr = 8 // WIDTH
    raw = tl.load(codes_ptr + base + (BYTE0 + r // PER)[None, :], mask=mask, other=0).to(tl.int32)
    return (raw >> ((r % PER) * WIDTH)[None, :]) & ((1 << WIDTH) - 1)


def _code_at(codes_ptr, base, d, mask, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, HIGH: tl.constexpr):
    """int32 codes at stored positions ``d`` [BLOCK_D] of the code rows starting at byte ``base`` [N, 1].

    Stored order (:mod:`kvq_export.reference.codec`): HIGH one-byte codes, then the other ``HEAD_DIM - HIGH``
    codes packed lowest bits first (3/5/6 bits: a plane of the low bits, then a plane of the higher bits).
    """
    W: tl.constexpr = HEAD_DIM - HIGH
    r = tl.maximum(d - HIGH, 0)
    rest = mask & (d >= HIGH)[None, :]
    if BITS == 3:
        code = _plane_at(codes_ptr, base, r, rest, HIGH, 2) | (
            _plane_at(codes_ptr, base, r, rest, HIGH + W // 4, 1) << 2)
    elif BITS == 5 or BITS == 6:
        code = _plane_at(codes_ptr, base, r, rest, HIGH, 4) | (
            _plane_at(codes_ptr, base, r, rest, HIGH + W // 2, BITS - 4) << 4)
    else:
        code = _plane_at(codes_ptr, base, r, rest, HIGH, BITS)
    if HIGH > 0:
        high = tl.load(codes_ptr + base + d[None, :], mask=mask & (d < HIGH)[None, :], other=0).to(tl.int32)
        code = tl.where((d < HIGH)[None, :], high, code)
    return code


def _channels(order_ptr, h, d, HEAD_DIM: tl.constexpr, HIGH: tl.constexpr):
    """The channel at each stored position ``d`` of kv head ``h`` (``channel_order``; identity without it)."""
    if HIGH > 0:
        return tl.load(order_ptr + h * HEAD_DIM + d, mask=d < HEAD_DIM, other=0)
    return d


def _stream_tile(sinks_ptr, codes_ptr, scales_ptr, zeros_ptr, recent_ptr, order_ptr, b, h, pos, d, n,
                 S_LEN, Q_LEN, R_LEN,
                 KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 QUANT: tl.constexpr, FP8: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr,
                 CHANNEL: tl.constexpr, GROUP: tl.constexpr, META: tl.constexpr, STATIC: tl.constexpr,
                 HAS_ZERO: tl.constexpr, SINKS: tl.constexpr, RESIDUAL: tl.constexpr, UNIT: tl.constexpr,
                 HIGH: tl.constexpr, HIGH_OFFSET: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_D]`` values of one stream at logical positions ``pos`` of row ``b``, head ``h``.

    Each position is read from the region holding it (sinks / quantized / recent, right-aligned per row,
    counts from ``n`` as in ``RegionSplit.lengths``); quantized entries are unpacked and dequantized here, in
    registers. Positions outside ``[0, n)`` read as 0. Column ``d`` is stored position ``d``: the channel
    ``d`` itself, or for a stream with HIGH high channels the channel ``channel_order[h, d]`` (sinks and
    recent rows are read in that order too, so the whole tile is in the stream's stored order). The high
    channels' 8-bit codes have their own offset, HIGH_OFFSET.
    """
    bh = (b * KV_HEADS + h).to(tl.int64)
    dmask = d < HEAD_DIM
    ch = _channels(order_ptr, h, d, HEAD_DIM, HIGH)
    if QUANT:
        s = tl.minimum(n, SINKS)
        qn = tl.maximum(n - s - RESIDUAL, 0) // UNIT * UNIT
    else:
        s = n * 0
        qn = n * 0
    r = n - s - qn
    pr = pos - s - qn
    in_r = (pr >= 0) & (pos < n)
    x = tl.load(recent_ptr + (bh * R_LEN + (R_LEN - r + pr))[:, None] * HEAD_DIM + ch[None, :],
                mask=in_r[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    if QUANT:
        in_s = (pos >= 0) & (pos < s)
        xs = tl.load(sinks_ptr + (bh * S_LEN + (S_LEN - s + pos))[:, None] * HEAD_DIM + ch[None, :],
                     mask=in_s[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        pq = pos - s
        in_q = (pq >= 0) & (pq < qn)
        slot = Q_LEN - qn + pq
        m2 = in_q[:, None] & dmask[None, :]
        if FP8:
            raw = tl.load(codes_ptr + (bh * Q_LEN + slot)[:, None] * HEAD_DIM + d[None, :], mask=m2, other=0)
            val = _fp8_decode(raw)
        else:
            PACKED: tl.constexpr = HIGH + (HEAD_DIM - HIGH) * BITS // 8
            code = _code_at(codes_ptr, (bh * Q_LEN + slot)[:, None] * PACKED, d, m2, HEAD_DIM, BITS, HIGH)
            val = code.to(tl.float32) - tl.where((d < HIGH)[None, :], HIGH_OFFSET, OFFSET)
        if STATIC:
            midx = h * META + ch // GROUP
            sc = tl.load(scales_ptr + midx, mask=dmask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZERO:
                zp = tl.load(zeros_ptr + midx, mask=dmask, other=0.0).to(tl.float32)[None, :]
        else:
            if CHANNEL:
                moff = (bh * (Q_LEN // GROUP) + slot // GROUP)[:, None] * HEAD_DIM + ch[None, :]
            else:
                moff = (bh * Q_LEN + slot)[:, None] * META + (ch // GROUP)[None, :]
            sc = tl.load(scales_ptr + moff, mask=m2, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zp = tl.load(zeros_ptr + moff, mask=m2, other=0.0).to(tl.float32)
        xq = val * sc
        if HAS_ZERO:
            xq = xq + zp
        x = tl.where(in_s[:, None], xs, tl.where(in_q[:, None], xq, x))
    return x


# ---------------------------------------------------------------------------------------------- attention
def _decode_attention_kernel(
    q_ptr, seqlens_ptr,
    ks_ptr, kc_ptr, kscale_ptr, kzero_ptr, kr_ptr, ko_ptr,
    vs_ptr, vc_ptr, vscale_ptr, vzero_ptr, vr_ptr, vo_ptr,
    T, KS_LEN, KQ_LEN, KR_LEN, VS_LEN, VQ_LEN, VR_LEN,
    out_ptr, part_o_ptr, part_ml_ptr,
    SM_SCALE: tl.constexpr, WINDOW: tl.constexpr, NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_F16: tl.constexpr, SINKS: tl.constexpr,
    K_QUANT: tl.constexpr, K_FP8: tl.constexpr, K_BITS: tl.constexpr, K_OFFSET: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr, K_META: tl.constexpr, K_STATIC: tl.constexpr,
    K_HAS_ZERO: tl.constexpr, K_UNIT: tl.constexpr, K_HIGH: tl.constexpr, K_HIGH_OFFSET: tl.constexpr,
    K_RESIDUAL: tl.constexpr,
    V_QUANT: tl.constexpr, V_FP8: tl.constexpr, V_BITS: tl.constexpr, V_OFFSET: tl.constexpr,
    V_CHANNEL: tl.constexpr, V_GROUP: tl.constexpr, V_META: tl.constexpr, V_STATIC: tl.constexpr,
    V_HAS_ZERO: tl.constexpr, V_UNIT: tl.constexpr, V_HIGH: tl.constexpr, V_HIGH_OFFSET: tl.constexpr,
    V_RESIDUAL: tl.constexpr,
):
    """One (row, kv head, query block, sequence split): all GROUPS query heads of the kv head at once.

    Grid ``(B * KV_HEADS, cdiv(GROUPS * T, BLOCK_M), NUM_SPLITS)``. Query row ``r`` of the block is token
    ``r // GROUPS`` of head ``h * GROUPS + r % GROUPS`` at position ``max(n - T + token, 0)`` (this call's
    tokens are the last T of the row, as the graph lays them out); it sees keys at positions <= its own
    (and > position - WINDOW). With one split the normalized output is written; otherwise the unnormalized
    accumulator and (max, sum) go to the partial buffers for :func:`_reduce_kernel`. Every output element
    of the query block is written, also for rows that see no key (0).

    Streams with high channels are attended in their stored channel order: q is read in the key stream's
    order (scores are sums over channels, so any common order gives the same scores) and the output
    columns are written back through the value stream's order.
    """
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // KV_HEADS
    h = pid_bh % KV_HEADS
    n = tl.load(seqlens_ptr + b).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = rows // GROUPS
    row_ok = j < T
    head = h * GROUPS + rows % GROUPS
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qrow = (b * NUM_HEADS + head).to(tl.int64) * T + j
    io_mask = row_ok[:, None] & dmask[None, :]
    qd = _channels(ko_ptr, h, d, HEAD_DIM, K_HIGH)
    od = _channels(vo_ptr, h, d, HEAD_DIM, V_HIGH)
    q = tl.load(q_ptr + qrow[:, None] * HEAD_DIM + qd[None, :], mask=io_mask, other=0.0).to(tl.float32)
    q = q * (SM_SCALE * 1.4426950408889634)  # exp2-based softmax
    qpos = tl.maximum(n - T + j, 0)

    j_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, GROUPS * T - 1) // GROUPS
    kv_end = tl.minimum(tl.maximum(n - T + j_last, 0) + 1, n)
    kv_start = n * 0
    if WINDOW > 0:
        j_first = (pid_m * BLOCK_M) // GROUPS
        kv_start = tl.maximum(tl.maximum(n - T + j_first, 0) - WINDOW + 1, 0)
    span = tl.maximum(kv_end - kv_start, 0)
    chunk = ((span + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # (no tl.cdiv: see build)
    lo = kv_start + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k = _stream_tile(ks_ptr, kc_ptr, kscale_ptr, kzero_ptr, kr_ptr, ko_ptr, b, h, pos, d, n, KS_LEN, KQ_LEN,
                         KR_LEN, KV_HEADS, HEAD_DIM, K_QUANT, K_FP8, K_BITS, K_OFFSET, K_CHANNEL, K_GROUP, K_META,
                         K_STATIC, K_HAS_ZERO, SINKS, K_RESIDUAL, K_UNIT, K_HIGH, K_HIGH_OFFSET)
        v = _stream_tile(vs_ptr, vc_ptr, vscale_ptr, vzero_ptr, vr_ptr, vo_ptr, b, h, pos, d, n, VS_LEN, VQ_LEN,
                         VR_LEN, KV_HEADS, HEAD_DIM, V_QUANT, V_FP8, V_BITS, V_OFFSET, V_CHANNEL, V_GROUP, V_META,
                         V_STATIC, V_HAS_ZERO, SINKS, V_RESIDUAL, V_UNIT, V_HIGH, V_HIGH_OFFSET)
        if DOT_F16:
            s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        ok = (pos[None, :] < hi) & (pos[None, :] <= qpos[:, None])
        if WINDOW > 0:
            ok = ok & (pos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, _rmax(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + _rsum(p, 1)
        if DOT_F16:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + qrow[:, None] * HEAD_DIM + od[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        prow = qrow * NUM_SPLITS + split
        tl.store(part_o_ptr + prow[:, None] * HEAD_DIM + od[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=row_ok)


def _reduce_kernel(part_o_ptr, part_ml_ptr, out_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the splits of one query row (grid ``B * NUM_HEADS * T``): rescale by exp2(m - max), divide by l."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < NUM_SPLITS
    idx = row * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + idx * 2, mask=smask, other=float("-inf"))
    el = tl.load(part_ml_ptr + idx * 2 + 1, mask=smask, other=0.0)
    top = _rmax(m, 0)
    w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))
    total = _rsum(w * el, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    o = tl.load(part_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = _rsum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


# ---------------------------------------------------------------------------------------------- quantize
def _round_even(y):
    """Round to nearest integer, ties to even (``torch.round``), for |y| < 2**22."""
    return (y + 12582912.0) - 12582912.0  # ROUND_MAGIC (a plain global is not visible to compiled kernels)


def _encode(x, sc, zp, FP8: tl.constexpr, HAS_ZERO: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
            OFFSET: tl.constexpr):
    """Codes (int32) of fp32 ``x`` against stored metadata, exactly as :func:`kvq_export.reference.codec.quantize`."""
    safe = tl.where(sc == 0.0, 1.0, sc)
    if FP8:
        y = tl.div_rn(x, safe)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        return _fp8_encode(y)
    if HAS_ZERO:
        x = x - zp
    y = tl.div_rn(x, safe)
    y = tl.minimum(tl.maximum(y, LO - 1.0), HI + 1.0)  # rounding after this clamp == clamp after rounding
    y = tl.minimum(tl.maximum(_round_even(y), LO * 1.0), HI * 1.0)
    return y.to(tl.int32) + OFFSET


def _group_meta(x, mask, axis: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr, steps,
                CLIP: tl.constexpr, HALF_CLIP: tl.constexpr):
    """(scale, minimum) of each group along ``axis``, in fp32 before rounding to the scale dtype.

    ``steps``: what the scale divides (a scalar, or per channel with high channels): the code steps over an
    asymmetric group's range, or the highest code a symmetric group's max |x| maps to.
    """
    if HAS_ZERO:
        mn = _rmin(tl.where(mask, x, float("inf")), axis)
        mx = _rmax(tl.where(mask, x, float("-inf")), axis)
        if CLIP != 1.0:
            mid = (mx + mn) * 0.5
            half = (mx - mn) * HALF_CLIP
            mn = mid - half
            mx = mid + half
        return tl.div_rn(mx - mn, steps), mn
    amax = _rmax(tl.where(mask, tl.abs(x), 0.0), axis)
    if CLIP != 1.0:
        amax = amax * CLIP
    return tl.div_rn(amax, steps), amax


def _head_tile(x_ptr, row, ok, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, PER: tl.constexpr):
    """Each token's head vector as fp32 ``[T, BLOCK_P, PER]`` (element ``p * PER + k``), for packing codes.

    ``row`` [T] indexes tokens of ``x [rows, HEAD_DIM]``; ``ok`` [T] masks them. Returns the lane indices
    ``p``, ``k``, the element index ``el`` [BLOCK_P, PER], the load mask and the values.
    """
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, PER)
    el = p[:, None] * PER + k[None, :]
    m3 = ok[:, None, None] & (el < HEAD_DIM)[None, :, :]
    x = tl.load(x_ptr + row[:, None, None] * HEAD_DIM + el[None, :, :], mask=m3, other=0.0).to(tl.float32)
    return p, k, el, m3, x


def _store_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, xrow, ok, mbase, h,
                 START: tl.constexpr, COUNT: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                 BYTE0: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr, PACKED: tl.constexpr,
                 GROUP: tl.constexpr, HIGH: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                 LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr):
    """Encode stored positions ``START .. START + COUNT`` of tokens ``xrow`` [T] and store one plane of them.

    The plane is bits ``SHIFT .. SHIFT + WIDTH`` of each code, ``8 // WIDTH`` codes per byte (lowest bits
    first) from byte ``BYTE0`` of each token's ``PACKED``-byte code row. A stored position's channel comes
    from ``channel_order`` (HIGH > 0) or is the position itself; its metadata is at ``mbase + channel // GROUP``
    (``mbase`` [T]). Codes are computed against the stored metadata, as the codec does.
    """
    PER: tl.constexpr = 8 // WIDTH
    p = tl.arange(0, BLOCK_P)
    k = tl.arange(0, PER)
    el = p[:, None] * PER + k[None, :]
    ch = _channels(order_ptr, h, START + el, HEAD_DIM, HIGH)
    m3 = ok[:, None, None] & (el < COUNT)[None, :, :]
    x = tl.load(x_ptr + xrow[:, None, None] * HEAD_DIM + ch[None, :, :], mask=m3, other=0.0).to(tl.float32)
    moff = mbase[:, None, None] + (ch // GROUP)[None, :, :]
    sc = tl.load(scales_ptr + moff, mask=m3, other=0.0).to(tl.float32)
    zp = sc
    if HAS_ZERO:
        zp = tl.load(zeros_ptr + moff, mask=m3, other=0.0).to(tl.float32)
    code = (_encode(x, sc, zp, FP8, HAS_ZERO, LO, HI, OFFSET) >> SHIFT) & ((1 << WIDTH) - 1)
    packed = _rsum(code << (k * WIDTH)[None, None, :], 2)
    tl.store(codes_ptr + xrow[:, None] * PACKED + BYTE0 + p[None, :], packed.to(tl.uint8),
             mask=ok[:, None] & (p < COUNT // PER)[None, :])


def _store_row_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, xrow, ok, mbase, h,
                     HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HIGH: tl.constexpr,
                     FP8: tl.constexpr, HAS_ZERO: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
                     OFFSET: tl.constexpr, HIGH_LO: tl.constexpr, HIGH_HI: tl.constexpr, HIGH_OFFSET: tl.constexpr,
                     LOW_BITS: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_U: tl.constexpr):
    """Every stored byte of the code rows of tokens ``xrow``: high channels, then the packed planes.

    ``LOW_BITS``: width of the first plane (``BITS`` for one-plane codes; 2 or 4 for 3/5/6-bit codes);
    ``HIGH_LO``, ``HIGH_HI``, ``HIGH_OFFSET``: the high channels' 8-bit levels (``LO``, ``HI``, ``OFFSET``: the rest's).
    """
    W: tl.constexpr = HEAD_DIM - HIGH
    PACKED: tl.constexpr = HIGH + W * BITS // 8
    if HIGH > 0:
        _store_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, xrow, ok, mbase, h, 0, HIGH, 0, 8, 0,
                     BLOCK_HI, HEAD_DIM, PACKED, GROUP, HIGH, FP8, HAS_ZERO, HIGH_LO, HIGH_HI, HIGH_OFFSET)
    _store_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, xrow, ok, mbase, h, HIGH, W, 0, LOW_BITS, HIGH,
                 BLOCK_P, HEAD_DIM, PACKED, GROUP, HIGH, FP8, HAS_ZERO, LO, HI, OFFSET)
    if LOW_BITS < BITS:  # the plane of the higher bits
        _store_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, xrow, ok, mbase, h, HIGH, W, LOW_BITS,
                     BITS - LOW_BITS, HIGH + W * LOW_BITS // 8, BLOCK_U, HEAD_DIM, PACKED, GROUP, HIGH, FP8, HAS_ZERO,
                     LO, HI, OFFSET)


def _quantize_token_kernel(
    x_ptr, counts_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, F_LEN,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, META: tl.constexpr,
    BITS: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr, STATIC: tl.constexpr, HIGH: tl.constexpr,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, TOP: tl.constexpr, HIGH_LO: tl.constexpr,
    HIGH_HI: tl.constexpr, HIGH_OFFSET: tl.constexpr, CLIP: tl.constexpr,
    HALF_CLIP: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """Token-axis (and static) streams: quantize BLOCK_T tokens of one (row, head); grid ``(B*H, cdiv(F, BLOCK_T))``.

    The block ``x [B, H, F, D]`` holds each row's ``counts[b]`` tokens right-aligned. Pass 1 writes each
    token's per-group scale (and minimum) in the stored dtype; pass 2 reads them back (so codes are computed
    against exactly the stored metadata, like the codec), quantizes and packs along head_dim.
    Static streams read the ``[H, META]`` metadata instead (channel-axis static: GROUP 1, META head_dim), by
    channel: with HIGH high channels the stored positions map to channels through ``channel_order``.
    """
    pid_bh = tl.program_id(0)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    c = tl.load(counts_ptr + b).to(tl.int32)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = (t < F_LEN) & (t >= F_LEN - c)
    row = pid_bh.to(tl.int64) * F_LEN + t
    if STATIC:
        mbase = row * 0 + h * META
    else:
        g = tl.arange(0, BLOCK_G)
        e = tl.arange(0, BLOCK_E)
        m3 = tok_ok[:, None, None] & (g < META)[None, :, None] & (e < GROUP)[None, None, :]
        xg = tl.load(x_ptr + row[:, None, None] * HEAD_DIM + (g * GROUP)[None, :, None] + e[None, None, :],
                     mask=m3, other=0.0).to(tl.float32)
        if HAS_ZERO:
            steps = HI * 1.0 - LO * 1.0
        else:
            steps = TOP * 1.0
        scale, low = _group_meta(xg, m3, 2, FP8, HAS_ZERO, steps, CLIP, HALF_CLIP)
        moff = row[:, None] * META + g[None, :]
        mmask = tok_ok[:, None] & (g < META)[None, :]
        tl.store(scales_ptr + moff, scale.to(scales_ptr.dtype.element_ty), mask=mmask)
        if HAS_ZERO:
            tl.store(zeros_ptr + moff, low.to(zeros_ptr.dtype.element_ty), mask=mmask)
        tl.debug_barrier()
        mbase = row * META
    _store_row_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, row, tok_ok, mbase, h, HEAD_DIM, BITS,
                     GROUP, HIGH, FP8, HAS_ZERO, LO, HI, OFFSET, HIGH_LO, HIGH_HI, HIGH_OFFSET, LOW_BITS, BLOCK_HI,
                     BLOCK_P, BLOCK_U)


def _first_of(xg, hit, e):
    """Per group (axis 2), the element at the first lane where ``hit`` holds (sign of zero kept)."""
    first = _rmin(tl.where(hit, e[None, None, :], 1 << 20), 2)
    return _rmin(tl.where(e[None, None, :] == first[:, :, None], xg, float("inf")), 2)


def _ggml_code(x, d, mn, SYM: tl.constexpr, BITS: tl.constexpr):
    """int32 codes of fp32 ``x`` against the fp32 (unrounded) block scale ``d`` / minimum ``mn``, as ggml's C."""
    inv = tl.div_rn(1.0, tl.where(d == 0.0, 1.0, d))
    inv = tl.where((d == 0.0) | (tl.abs(inv) == float("inf")), 0.0, inv)  # 1/d overflows: id 0, as the codec
    if SYM and BITS == 8:  # roundf(x * id) from exact steps, stored + 128
        y = x * inv
        a = tl.abs(y)
        whole = tl.floor(a)
        r = whole + tl.where(a - whole >= 0.5, 1.0, 0.0)
        return tl.where(y < 0.0, -r, r).to(tl.int32) + 128
    if SYM:
        y = tl.floor(x * inv + ((1 << (BITS - 1)) + 0.5))
    else:
        y = tl.floor((x - mn) * inv + 0.5)
    return tl.minimum(y, (1 << BITS) - 1.0).to(tl.int32)


def _quantize_ggml_kernel(
    x_ptr, counts_ptr, codes_ptr, scales_ptr, zeros_ptr, d_ptr, m_ptr, F_LEN,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, META: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The ggml block formats (blocks of 32 along head_dim) on BLOCK_T tokens of one (row, head).

    Pass 1 finds each block's fp32 ``d`` (and minimum) as ggml's reference quantizers do (first element of
    largest magnitude for q4_0/q5_0, first minimum/maximum for q4_1/q5_1, max |x| / 127 for q8_0), stores them
    rounded to fp16 and keeps the fp32 values in the ``d``/``m`` scratch (ggml quantizes with the unrounded
    scale). Pass 2 computes codes per element and packs them (5 bits: nibbles, then the plane of fifth bits).
    """
    pid_bh = tl.program_id(0)
    b = pid_bh // HEADS
    c = tl.load(counts_ptr + b).to(tl.int32)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = (t < F_LEN) & (t >= F_LEN - c)
    row = pid_bh.to(tl.int64) * F_LEN + t
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, 32)
    m3 = tok_ok[:, None, None] & (g < META)[None, :, None] & (e < 32)[None, None, :]
    xg = tl.load(x_ptr + row[:, None, None] * HEAD_DIM + (g * 32)[None, :, None] + e[None, None, :],
                 mask=m3, other=0.0).to(tl.float32)
    if SYM and BITS == 8:
        d = tl.div_rn(_rmax(tl.abs(xg), 2), 127.0)
        mn = d
    elif SYM:
        ax = tl.abs(xg)
        amax = _rmax(ax, 2)
        v = _first_of(xg, ax == amax[:, :, None], e)
        d = tl.div_rn(tl.where(amax == 0.0, 0.0, v), -1.0 * (1 << (BITS - 1)))
        mn = d
    else:
        mn = _first_of(xg, xg == _rmin(xg, 2)[:, :, None], e)
        mx = _first_of(xg, xg == _rmax(xg, 2)[:, :, None], e)
        d = tl.div_rn(mx - mn, (1 << BITS) - 1.0)
    moff = row[:, None] * META + g[None, :]
    mmask = tok_ok[:, None] & (g < META)[None, :]
    tl.store(scales_ptr + moff, d.to(scales_ptr.dtype.element_ty), mask=mmask)
    tl.store(d_ptr + moff, d, mask=mmask)
    if not SYM:
        tl.store(zeros_ptr + moff, mn.to(zeros_ptr.dtype.element_ty), mask=mmask)
        tl.store(m_ptr + moff, mn, mask=mmask)
    tl.debug_barrier()
    PACKED: tl.constexpr = HEAD_DIM * BITS // 8
    PER: tl.constexpr = 1 if BITS == 8 else 2
    p, k, el, m3, x = _head_tile(x_ptr, row, tok_ok, HEAD_DIM, BLOCK_P, PER)
    moff3 = row[:, None, None] * META + (el // 32)[None, :, :]
    dd = tl.load(d_ptr + moff3, mask=m3, other=0.0)
    mm = dd
    if not SYM:
        mm = tl.load(m_ptr + moff3, mask=m3, other=0.0)
    code = _ggml_code(x, dd, mm, SYM, BITS)
    if BITS == 5:
        code = code & 15
    packed = _rsum(code << (k * 4)[None, None, :], 2)
    tl.store(codes_ptr + row[:, None] * PACKED + p[None, :], packed.to(tl.uint8),
             mask=tok_ok[:, None] & (p < HEAD_DIM // PER)[None, :])
    if BITS == 5:
        p8, k8, el8, m8, x8 = _head_tile(x_ptr, row, tok_ok, HEAD_DIM, BLOCK_H, 8)
        moff8 = row[:, None, None] * META + (el8 // 32)[None, :, :]
        d8 = tl.load(d_ptr + moff8, mask=m8, other=0.0)
        mn8 = d8
        if not SYM:
            mn8 = tl.load(m_ptr + moff8, mask=m8, other=0.0)
        high = _ggml_code(x8, d8, mn8, SYM, BITS) >> 4
        packed8 = _rsum(high << k8[None, None, :], 2)
        tl.store(codes_ptr + row[:, None] * PACKED + HEAD_DIM // 2 + p8[None, :], packed8.to(tl.uint8),
                 mask=tok_ok[:, None] & (p8 < HEAD_DIM // 8)[None, :])


def _quantize_channel_kernel(
    x_ptr, counts_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, F_LEN,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr, HIGH: tl.constexpr,
    LO: tl.constexpr, HI: tl.constexpr, OFFSET: tl.constexpr, TOP: tl.constexpr, HIGH_LO: tl.constexpr,
    HIGH_HI: tl.constexpr, HIGH_OFFSET: tl.constexpr, CLIP: tl.constexpr,
    HALF_CLIP: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HI: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """Dynamic channel-axis streams: one group of GROUP tokens of one (row, head); grid ``(B*H, F // GROUP)``.

    Pass 1 writes the group's per-channel scale (and minimum); pass 2 reads them back, quantizes every
    token of the group and packs along head_dim. Groups left of the row's right-aligned ``counts[b]``
    tokens are skipped (F and the counts are whole groups). With HIGH high channels the channels are
    visited in stored order (``channel_order``), the first HIGH of them with their 8-bit levels (``HIGH_*``).
    """
    pid_bh = tl.program_id(0)
    gs = tl.program_id(1)
    b = pid_bh // HEADS
    h = pid_bh % HEADS
    c = tl.load(counts_ptr + b).to(tl.int32)
    first = F_LEN - c  # first valid token slot of this row
    tt = tl.arange(0, BLOCK_G)
    # (scalar & vector masks are broadcast by hand: the interpreter rejects a scalar-bool & vector mask)
    tmask = (tt < GROUP) & (tt * 0 + gs * GROUP >= first)
    trow = pid_bh.to(tl.int64) * F_LEN + gs * GROUP + tt
    d = tl.arange(0, BLOCK_D)
    ch = _channels(order_ptr, h, d, HEAD_DIM, HIGH)
    dmask = d < HEAD_DIM
    m2 = tmask[:, None] & dmask[None, :]
    xg = tl.load(x_ptr + trow[:, None] * HEAD_DIM + ch[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_ZERO:
        steps = tl.where(d < HIGH, HIGH_HI * 1.0 - HIGH_LO * 1.0, HI * 1.0 - LO * 1.0)
    else:
        steps = tl.where(d < HIGH, HIGH_HI * 1.0, TOP * 1.0)
    scale, low = _group_meta(xg, m2, 0, FP8, HAS_ZERO, steps, CLIP, HALF_CLIP)
    mrow = pid_bh.to(tl.int64) * (F_LEN // GROUP) + gs
    mmask = dmask & (d * 0 + gs * GROUP >= first)
    tl.store(scales_ptr + mrow * HEAD_DIM + ch, scale.to(scales_ptr.dtype.element_ty), mask=mmask)
    if HAS_ZERO:
        tl.store(zeros_ptr + mrow * HEAD_DIM + ch, low.to(zeros_ptr.dtype.element_ty), mask=mmask)
    tl.debug_barrier()
    _store_row_codes(x_ptr, codes_ptr, scales_ptr, zeros_ptr, order_ptr, trow, tmask, tt * 0 + mrow * HEAD_DIM, h,
                     HEAD_DIM, BITS, 1, HIGH, FP8, HAS_ZERO, LO, HI, OFFSET, HIGH_LO, HIGH_HI, HIGH_OFFSET, LOW_BITS,
                     BLOCK_HI, BLOCK_P, BLOCK_U)


# ---------------------------------------------------------------------------------------------- build
#: every function handed to triton.jit, helpers first
JIT_NAMES = ("_rmax", "_rmin", "_rsum", "_fp8_decode", "_fp8_encode", "_plane_at", "_code_at", "_channels",
             "_stream_tile", "_decode_attention_kernel", "_reduce_kernel", "_round_even", "_encode", "_group_meta",
             "_head_tile", "_store_codes", "_store_row_codes", "_first_of", "_ggml_code", "_quantize_token_kernel",
             "_quantize_channel_kernel", "_quantize_ggml_kernel")
SOURCES = {name: globals()[name] for name in JIT_NAMES}


def _max_combine(a, b):
    return tl.maximum(a, b)


def _min_combine(a, b):
    return tl.minimum(a, b)


def _sum_combine(a, b):
    return a + b


_FALLBACK_COMBINES = {"MAX_COMBINE": _max_combine, "MIN_COMBINE": _min_combine, "SUM_COMBINE": _sum_combine}


def build() -> dict[str, Any]:
    """Jit every kernel once per process (mode from ``TRITON_INTERPRET`` now) and return them by name.

    The kernels use only builtins and ``tl.reduce``, never ``@triton.jit`` library functions such as
    ``tl.cdiv`` or ``tl.max``: those are jitted when triton is imported, so under an interpreter chosen
    after that import (torch may import triton first) they would not run.
    """
    with _LOCK:
        if "kernels" in _STATE:
            return _STATE["kernels"]
        triton = require("triton")
        language = require("triton.language")
        interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
        globals()["tl"] = language
        standard = require("triton.language.standard")
        for name, attr in (("MAX_COMBINE", "_elementwise_max"), ("MIN_COMBINE", "_elementwise_min"),
                           ("SUM_COMBINE", "_sum_combine")):
            combine = getattr(standard, attr, None)
            if combine is None:  # another triton: our own combine function (the interpreter runs it slowly)
                combine = triton.jit(_FALLBACK_COMBINES[name])
            globals()[name] = combine
        kernels = {}
        for name in JIT_NAMES:
            kernels[name] = triton.jit(SOURCES[name])
            globals()[name] = kernels[name]  # kernels resolve their helpers through the module globals
        _STATE.update(kernels=kernels, interpret=interpret)
        return kernels


def compile_kernel(name: str, types: dict[str, str], constexprs: dict[str, Any], *,
                   target: tuple[str, int] | None = None, num_warps: int = 4, **options: Any):
    """Compile kernel ``name`` ahead of time (``triton.compile``) for ``target``, e.g. ``("cuda", 90)``.

    ``target`` defaults to the current GPU. ``types`` gives the runtime parameters (``*fp16``, ``i32``...);
    every other parameter is a constexpr from ``constexprs`` (``None`` removes an unused pointer). Needs
    compiled kernels (``TRITON_INTERPRET`` unset when they were built).
    """
    import inspect

    from kvq_export.errors import KVQError

    triton = require("triton")
    kernels = build()
    if interpreted():
        raise KVQError("compiling ahead of time needs compiled Triton kernels; this process built them for the "
                       "CPU interpreter (unset TRITON_INTERPRET)")
    from triton.backends.compiler import GPUTarget

    order = inspect.signature(SOURCES[name]).parameters
    signature = {param: types.get(param, "constexpr") for param in order}
    missing = [p for p, kind in signature.items() if kind == "constexpr" and p not in constexprs]
    if missing:
        raise KVQError(f"{name}: no value for constexpr(s) {', '.join(missing)}")
    gpu = GPUTarget(target[0], target[1], 32) if target else triton.runtime.driver.active.get_current_target()
    src = triton.compiler.ASTSource(fn=kernels[name], signature=signature, constexprs=constexprs)
    return triton.compile(src, target=gpu, options={"num_warps": num_warps, **options})


def interpreted() -> bool:
    """Whether the built kernels run in Triton's CPU interpreter (builds them if needed)."""
    build()
    return bool(_STATE["interpret"])


@contextlib.contextmanager
def launch_context() -> Iterator[None]:
    """Context for every launch; under the interpreter it keeps Triton's view consistent with the build.

    Triton reads ``TRITON_INTERPRET`` again while launching (its first launch imports modules that check
    it), so interpreted launches run with it set, and restore it afterwards. numpy's warnings about inf
    arithmetic in masked-off lanes (which never reach memory) are silenced there too.
    """
    if not interpreted():
        yield
        return
    import numpy as np

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with np.errstate(all="ignore"):
            yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def device_type() -> str:
    """``cpu`` under the interpreter, else ``cuda``: where the kernels' tensors must live."""
    return "cpu" if interpreted() else "cuda"
