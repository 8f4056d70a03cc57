"""Convolution and pooling over 2 spatial dims (the 1-d forms are these with a height of 1) and einsum.

conv2d builds strided windows of the zero-padded input (``sliding_window_view``: no copy) and contracts them
with the weight per group in one einsum; backward contracts the same windows for the weight gradient and adds
the window gradients back into the padded input one kernel position at a time (kh * kw strided adds).
max_pool2d pads with -inf and routes each window's gradient to its (first) maximum; avg_pool2d divides by the
count of positions a window covers inside the padded (``count_include_pad``) or the original input.
"""

from __future__ import annotations

import numpy as np
from blutensor.errors import ArgumentError, ShapeError
from blutensor.ops._util import xp_of


def _windows(x, kh, kw, sh, sw, dh, dw, oh, ow):
    """(N, C, oh, ow, kh, kw) windows of ``x`` (N, C, H, W), strides (sh, sw), dilation (dh, dw)."""
    xp = xp_of(x)
    if xp is np:
        from numpy.lib.stride_tricks import as_strided
    else:
        from cupy.lib.stride_tricks import as_strided
    n, c = x.shape[:2]
    s0, s1, s2, s3 = x.strides
    return as_strided(x, (n, c, oh, ow, kh, kw), (s0, s1, s2 * sh, s3 * sw, s2 * dh, s3 * dw))


def _out_size(n, k, s, p, d, op, ceil_mode=False):
    span = d * (k - 1) + 1
    num = n + 2 * p - span
    if num < 0:
        raise ShapeError(f"{op}: kernel (span {span}) is larger than the padded input ({n + 2 * p})")
    o = -(-num // s) + 1 if ceil_mode else num // s + 1
    if ceil_mode and (o - 1) * s >= n + p:  # the last window must start inside the input or the left padding
        o -= 1
    return o


def _pad_hw(x, ph, pw, extra_h=0, extra_w=0, value=0.0):
    xp = xp_of(x)
    if not (ph or pw or extra_h or extra_w):
        return x
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph + extra_h), (pw, pw + extra_w)), constant_values=value)


def conv2d_forward(ctx, x, w, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    xp = xp_of(x)
    if x.ndim != 4 or w.ndim != 4:
        raise ShapeError(f"conv2d: input (N, C, H, W) and weight (O, C/groups, kh, kw) must be 4-D, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if c % groups or o % groups or cg * groups != c:
        raise ShapeError(f"conv2d: input channels {c} and weight {tuple(w.shape)} do not fit groups={groups} "
                         f"(weight dim 1 must be C/groups)")
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh = _out_size(h, kh, sh, ph, dh, "conv2d")
    ow = _out_size(wd, kw, sw, pw, dw, "conv2d")
    xpad = _pad_hw(x, ph, pw)
    win = _windows(xpad, kh, kw, sh, sw, dh, dw, oh, ow).reshape(n, groups, cg, oh, ow, kh, kw)
    wg = w.reshape(groups, o // groups, cg, kh, kw)
    out = xp.einsum("ngchwij,gocij->ngohw", win, wg, optimize=True).reshape(n, o, oh, ow)
    ctx.saved = (x, w, xpad.shape, (sh, sw, ph, pw, dh, dw, groups, oh, ow))
    return out.astype(x.dtype, copy=False)


def conv2d_backward(ctx, g):
    x, w, pshape, (sh, sw, ph, pw, dh, dw, groups, oh, ow) = ctx.saved
    xp = xp_of(g)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    gg = g.reshape(n, groups, o // groups, oh, ow)
    gx = gw = None
    if ctx.needs[1]:
        xpad = _pad_hw(x, ph, pw)
        win = _windows(xpad, kh, kw, sh, sw, dh, dw, oh, ow).reshape(n, groups, cg, oh, ow, kh, kw)
        gw = xp.einsum("ngohw,ngchwij->gocij", gg, win, optimize=True).reshape(w.shape).astype(g.dtype, copy=False)
    if ctx.needs[0]:
        wg = w.reshape(groups, o // groups, cg, kh, kw)
        gwin = xp.einsum("ngohw,gocij->ngchwij", gg, wg, optimize=True).reshape(n, c, oh, ow, kh, kw)
        gpad = xp.zeros(pshape, dtype=g.dtype)
        for i in range(kh):
            for j in range(kw):
                gpad[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw] += \
                    gwin[..., i, j]
        gx = gpad[:, :, ph: ph + h, pw: pw + wd]
    return gx, gw


def max_pool2d_forward(ctx, x, kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                       ceil_mode=False):
    """Max over each window; saves the flat (H*W) position of each window's first maximum (its indices)."""
    xp = xp_of(x)
    n, c, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel_size, stride, padding, dilation
    if ph > kh // 2 or pw > kw // 2:
        raise ArgumentError(f"max_pool2d: padding {padding} must be at most half the kernel size {kernel_size}")
    oh = _out_size(h, kh, sh, ph, dh, "max_pool2d", ceil_mode)
    ow = _out_size(wd, kw, sw, pw, dw, "max_pool2d", ceil_mode)
    eh = max((oh - 1) * sh + dh * (kh - 1) + 1 - (h + 2 * ph), 0)
    ew = max((ow - 1) * sw + dw * (kw - 1) + 1 - (wd + 2 * pw), 0)
    lo = -xp.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    xpad = _pad_hw(x, ph, pw, eh, ew, lo)
    win = _windows(xpad, kh, kw, sh, sw, dh, dw, oh, ow).reshape(n, c, oh, ow, kh * kw)
    arg = win.argmax(axis=-1)
    if x.dtype.kind == "f":  # a NaN is the maximum of its window, as in PyTorch
        isn = xp.isnan(win)
        arg = xp.where(isn.any(axis=-1), isn.argmax(axis=-1), arg)
    out = xp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    ki, kj = arg // kw, arg % kw
    rows = xp.arange(oh)[:, None] * sh + ki * dh - ph
    cols = xp.arange(ow)[None, :] * sw + kj * dw - pw
    flat = (rows * wd + cols).astype(np.int64)
    ctx.saved = (x.shape, flat)
    return out, flat


def max_pool2d_values_forward(ctx, x, **attrs):
    out, flat = max_pool2d_forward(ctx, x, **attrs)
    return out


def max_pool2d_backward(ctx, g):
    shape, flat = ctx.saved
    xp = xp_of(g)
    n, c, h, wd = shape
    out = xp.zeros((n, c, h * wd), dtype=g.dtype)
    from blutensor.ops._util import scatter_add

    ni = xp.arange(n)[:, None, None]
    ci = xp.arange(c)[None, :, None]
    scatter_add(out, (ni, ci, flat.reshape(n, c, -1)), g.reshape(n, c, -1))
    return (out.reshape(shape),)


def max_pool2d_indices_forward(ctx, x, **attrs):
    out, flat = max_pool2d_forward(ctx, x, **attrs)
    return flat


def avg_pool2d_forward(ctx, x, kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), ceil_mode=False,
                       count_include_pad=True, divisor_override=None):
    xp = xp_of(x)
    n, c, h, wd = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    if ph > kh // 2 or pw > kw // 2:
        raise ArgumentError(f"avg_pool2d: padding {padding} must be at most half the kernel size {kernel_size}")
    oh = _out_size(h, kh, sh, ph, 1, "avg_pool2d", ceil_mode)
    ow = _out_size(wd, kw, sw, pw, 1, "avg_pool2d", ceil_mode)
    eh = max((oh - 1) * sh + kh - (h + 2 * ph), 0)
    ew = max((ow - 1) * sw + kw - (wd + 2 * pw), 0)
    xpad = _pad_hw(x, ph, pw, eh, ew)
    win = _windows(xpad, kh, kw, sh, sw, 1, 1, oh, ow)
    s = win.sum(axis=(-2, -1))
    if divisor_override:
        div = xp.asarray(float(divisor_override), dtype=x.dtype)
    else:
        cover = xp.zeros((1, 1) + xpad.shape[2:], dtype=x.dtype)
        if count_include_pad:
            cover[..., : h + 2 * ph, : wd + 2 * pw] = 1
        else:
            cover[..., ph: ph + h, pw: pw + wd] = 1
        div = _windows(cover, kh, kw, sh, sw, 1, 1, oh, ow).sum(axis=(-2, -1))
    ctx.saved = (x.shape, xpad.shape, div, (kh, kw, sh, sw, ph, pw, oh, ow))
    return (s / div).astype(x.dtype, copy=False)


def avg_pool2d_backward(ctx, g):
    shape, pshape, div, (kh, kw, sh, sw, ph, pw, oh, ow) = ctx.saved
    xp = xp_of(g)
    gd = (g / div).astype(g.dtype, copy=False)
    gpad = xp.zeros(pshape, dtype=g.dtype)
    for i in range(kh):
        for j in range(kw):
            gpad[:, :, i: i + sh * (oh - 1) + 1: sh, j: j + sw * (ow - 1) + 1: sw] += gd
    return (gpad[:, :, ph: ph + shape[2], pw: pw + shape[3]],)


# ---- einsum ----

def _explicit(eq, shapes):
    """Equation with '...' spelled out in unused letters and the output given explicitly."""
    import string

    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(shapes):
        raise ArgumentError(f"einsum: equation {eq!r} names {len(subs)} operands, got {len(shapes)}")
    used = set(c for c in eq if c.isalpha())
    free = [c for c in string.ascii_letters if c not in used]
    nell = 0
    for s, shp in zip(subs, shapes):
        if "..." in s:
            nell = max(nell, len(shp) - (len(s) - 3))
    ell = "".join(free[:nell])
    out_subs = []
    for s, shp in zip(subs, shapes):
        if "..." in s:
            k = len(shp) - (len(s) - 3)
            s = s.replace("...", ell[nell - k:] if k else "")
        if len(s) != len(shp):
            raise ShapeError(f"einsum: subscripts {s!r} do not fit an operand of shape {tuple(shp)}")
        out_subs.append(s)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(out_subs)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return out_subs, out


def einsum_forward(ctx, *ops, equation=""):
    xp = xp_of(ops[0])
    subs, out = _explicit(equation, [o.shape for o in ops])
    try:
        res = xp.einsum(",".join(subs) + "->" + out, *ops, optimize=len(ops) > 2)
    except ValueError as e:
        raise ShapeError(f"einsum {equation!r} on shapes {[tuple(o.shape) for o in ops]}: {e}") from None
    ctx.saved = (ops, subs, out)
    return res


def einsum_backward(ctx, g):
    """Gradient of operand i: the output gradient contracted with the other operands onto operand i's letters;
    letters only operand i has (summed away) broadcast back."""
    ops, subs, out = ctx.saved
    xp = xp_of(g)
    grads = []
    for i, (op, s) in enumerate(zip(ops, subs)):
        if not ctx.needs[i]:
            grads.append(None)
            continue
        if len(set(s)) != len(s):
            raise ArgumentError(f"einsum: no gradient for an operand with a repeated subscript ({s!r}); take "
                                f"the diagonal with diagonal() first")
        others = [(o, t) for j, (o, t) in enumerate(zip(ops, subs)) if j != i]
        have = set(out).union(*[set(t) for _, t in others]) if others else set(out)
        tgt = "".join(c for c in s if c in have)
        eq = ",".join([out] + [t for _, t in others]) + "->" + tgt
        gi = xp.einsum(eq, g, *[o for o, _ in others], optimize=len(others) > 1)
        if tgt != s:
            shape = [op.shape[k] if c in tgt else 1 for k, c in enumerate(s)]
            gi = xp.broadcast_to(gi.reshape(shape), op.shape)
        grads.append(gi.astype(g.dtype, copy=False))
    return tuple(grads)
