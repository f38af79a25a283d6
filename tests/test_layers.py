"""Fused layers (lanekit.layers) beyond the registry's samples, which tests/test_check.py runs on every
lane: PyTorch's and transformers' own modules as clients, the widest rows, in-place and out= writes,
gradients through the fused residual, torch.compile, bad input, more than 2^31 elements (GPU)."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lanekit
import lanekit.layers as L
from lanekit.layers.registry import LAYERS_BWD, NORM
from lanekit.reference import layers as ref
from lanekit.testing import assert_close, poisoned_outputs, randn

LANES = ["triton", "reference"]


def f64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("lane", LANES)
def test_rms_norm_and_layer_norm_match_pytorchs_modules(device, lane):
    g = gen()
    x = randn(17, 300, dtype=torch.float32, device=device, generator=g)
    rms = torch.nn.RMSNorm(300, eps=1e-6).to(device)
    ln = torch.nn.LayerNorm(300, eps=1e-5).to(device)
    with torch.no_grad():
        rms.weight.copy_(randn(300, dtype=torch.float32, device=device, generator=g))
        ln.weight.copy_(randn(300, dtype=torch.float32, device=device, generator=g))
        ln.bias.copy_(randn(300, dtype=torch.float32, device=device, generator=g))
    with poisoned_outputs():
        ours_rms = L.rms_norm(x, rms.weight, 1e-6, lane=lane)
        ours_ln = L.layer_norm(x, ln.weight, ln.bias, 1e-5, lane=lane)
    assert_close(ours_rms, rms(x), NORM)
    assert_close(ours_ln, ln(x), NORM)


def test_gemma_rms_norm_is_the_offset_form(device):
    """transformers' Gemma RMSNorm stores w - 1 and scales by (1 + w): offset=1.0."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = gen(1)
    x = randn(5, 96, dtype=torch.float32, device=device, generator=g)
    norm = GemmaRMSNorm(96, eps=1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(randn(96, dtype=torch.float32, device=device, generator=g, scale=0.1))
    with poisoned_outputs():
        ours = L.rms_norm(x, norm.weight, 1e-6, offset=1.0, lane="triton")
    assert_close(ours, norm(x), NORM)


@pytest.mark.parametrize("N", [16384, 65536])
def test_rms_norm_of_the_widest_rows_launches_and_matches(device, N):
    """Rows wider than a register tile are walked in blocks: no shared-memory launch failure."""
    g = gen(N)
    x = randn(2, N, dtype=torch.bfloat16, device=device, generator=g)
    w = randn(N, dtype=torch.bfloat16, device=device, generator=g)
    r = randn(2, N, dtype=torch.bfloat16, device=device, generator=g)
    with poisoned_outputs():
        y, h = L.rms_norm(x, w, 1e-6, residual=r, lane="triton")
    y_ref, h_ref = ref.rms_norm(f64(x), f64(w), 1e-6, residual=f64(r))
    assert_close(y, y_ref, NORM)
    assert_close(h, h_ref)


def test_the_residual_sums_gradient_flows_into_x_and_residual(device):
    """y and h = x + residual both used downstream: d(x) = d(residual) = dy through the norm + dh."""
    g = gen(2)
    x, r = (randn(9, 70, dtype=torch.float32, device=device, generator=g) for _ in range(2))
    w = randn(70, dtype=torch.float32, device=device, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, h = L.rms_norm(leaves[0], leaves[2], 1e-6, residual=leaves[1], lane="triton")
    (y.square().sum() + (h * 3).sum()).backward()
    ref_leaves = [f64(t).requires_grad_() for t in (x, r, w)]
    y_r, h_r = ref.rms_norm(ref_leaves[0], ref_leaves[2], 1e-6, residual=ref_leaves[1])
    (y_r.square().sum() + (h_r * 3).sum()).backward()
    for ours, theirs in zip(leaves, ref_leaves):
        assert_close(ours.grad, theirs.grad, LAYERS_BWD)
    assert torch.equal(leaves[0].grad, leaves[1].grad)


@pytest.mark.parametrize("lane", LANES)
def test_adaln_per_batch_rows_broadcast_over_their_tokens(device, lane):
    g = gen(3)
    x = randn(3, 7, 160, dtype=torch.bfloat16, device=device, generator=g)
    scale, shift = (randn(3, 160, dtype=torch.bfloat16, device=device, generator=g) for _ in range(2))
    y = L.adaln(x, scale, shift, lane=lane)
    for b in range(3):  # each batch entry as its own (rows, N) call with its row repeated
        rows = L.adaln(x[b], scale[b].expand(7, 160), shift[b].expand(7, 160), lane=lane)
        assert torch.equal(y[b], rows)
    assert_close(y, ref.adaln(f64(x), f64(scale), f64(shift)), NORM)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_matches_transformers_rotate_half_and_inplace_matches_out_of_place(device, interleaved):
    g = gen(4)
    x = randn(2, 9, 3, 96, dtype=torch.float32, device=device, generator=g)
    theta = torch.rand(16, 48, generator=g).to(device) * 6.3
    cos, sin = theta.cos(), theta.sin()
    out = L.apply_rotary(x, cos, sin, interleaved=interleaved, lane="triton")
    if not interleaved:  # Llama's apply_rotary_pos_emb with its duplicated (S, D) cos/sin
        def rotate_half(t):
            return torch.cat((-t[..., 48:], t[..., :48]), dim=-1)
        c, s = torch.cat((cos, cos), -1)[:9, None], torch.cat((sin, sin), -1)[:9, None]
        assert_close(out, x * c + rotate_half(x) * s, "eltwise")
    inplace = x.clone()
    returned = L.apply_rotary(inplace, cos, sin, interleaved=interleaved, inplace=True, lane="triton")
    assert returned.data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace, out)


@pytest.mark.parametrize("lane", LANES)
def test_inplace_rotary_is_differentiable(device, lane):
    g = gen(5)
    x = randn(1, 5, 2, 64, dtype=torch.float32, device=device, generator=g).requires_grad_()
    theta = torch.rand(8, 32, generator=g).to(device)
    dy = randn(1, 5, 2, 64, dtype=torch.float32, device=device, generator=g)
    y = L.apply_rotary(x * 1.0, theta.cos(), theta.sin(), inplace=True, lane=lane)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = f64(x.detach()).requires_grad_()
    (dx_ref,) = torch.autograd.grad(ref.apply_rotary(x64, f64(theta.cos()), f64(theta.sin())), x64, f64(dy))
    assert_close(dx, dx_ref, "eltwise")


def _unwritable(case, device):
    """A tensor (1, 5, 2, 64) that autograd refuses to see written in place, with grad mode on."""
    x = torch.randn(2, 5, 2, 64, device=device)
    if case == "leaf that requires grad":
        return x[:1].clone().requires_grad_()
    if case == "view of such a leaf":
        return x.requires_grad_()[:1]
    if case == "one of unbind's views":
        return (x.requires_grad_() * 1).split(1)[0]
    if case == "view made under no_grad":
        y = x.requires_grad_() * 1
        with torch.no_grad():
            return y[:1]
    with torch.inference_mode():   # "inference tensor"
        return x[:1].clone()


_UNWRITABLE = ["leaf that requires grad", "view of such a leaf", "one of unbind's views",
               "view made under no_grad", "inference tensor"]


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", _UNWRITABLE)
def test_inplace_rotary_of_a_tensor_autograd_may_not_write_is_refused_before_it_runs(device, lane, case):
    # the Triton lane used to rotate x, then autograd raised: a failed call that changed its input
    x = _unwritable(case, device)
    before = x.detach().clone()
    theta = torch.rand(8, 32, device=device)
    with pytest.raises(ValueError, match=r"^x: expected a tensor (autograd lets be written in place|that can be "
                                         r"written in place) \(inplace=True\), got an? "):
        L.apply_rotary(x, theta.cos(), theta.sin(), inplace=True, lane=lane)
    assert torch.equal(x.detach(), before)
    out = L.apply_rotary(x.detach().clone(), theta.cos(), theta.sin(), lane=lane)   # what the call would give
    if case != "inference tensor":    # as PyTorch, an in-place write of a leaf under no_grad goes
        with torch.no_grad():
            L.apply_rotary(x, theta.cos(), theta.sin(), inplace=True, lane=lane)
        assert torch.equal(x.detach(), out)


@pytest.mark.parametrize("lane", LANES)
def test_swiglu_out_that_requires_grad_is_refused_and_left_alone(device, lane):
    gate = torch.randn(4, 16, device=device)
    out = torch.zeros(4, 8, device=device, requires_grad=True)
    with pytest.raises(ValueError, match=r"^out: expected a tensor that does not require grad \(out= writes it"):
        L.swiglu(gate, out=out, lane=lane)
    assert (out.detach() == 0).all()
    with torch.no_grad():
        L.swiglu(gate, out=out, lane=lane)
    assert torch.equal(out.detach(), L.swiglu(gate, lane=lane))


def test_rotary_takes_numpy_and_0d_tensor_ints_and_bools_and_refuses_other_types(device):
    x = torch.randn(7, 2, 32, device=device)
    cs = torch.rand(16, 16, device=device)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    want = L.apply_rotary(x, cs, cs, cu_seqlens=cu, max_seqlen=4, seqlen_offsets=2, rotary_dim=32,
                          interleaved=True)
    for ints in (dict(max_seqlen=np.int64(4), seqlen_offsets=np.int32(2), rotary_dim=np.int64(32),
                      interleaved=np.bool_(True)),
                 dict(max_seqlen=torch.tensor(4), seqlen_offsets=torch.tensor(2, dtype=torch.int32),
                      rotary_dim=torch.tensor(32), interleaved=torch.tensor(True))):
        assert torch.equal(L.apply_rotary(x, cs, cs, cu_seqlens=cu, **ints), want)
    for kwargs, arg in ((dict(rotary_dim=32.0), "rotary_dim"), (dict(max_seqlen=4.0), "max_seqlen"),
                        (dict(seqlen_offsets=2.0), "seqlen_offsets"), (dict(interleaved=1), "interleaved"),
                        (dict(inplace="no"), "inplace"), (dict(max_seqlen=True), "max_seqlen")):
        with pytest.raises(TypeError, match=rf"^{arg}: expected an? "):
            L.apply_rotary(x, cs, cs, cu_seqlens=cu, **kwargs)
    with pytest.raises(TypeError, match="^interleaved: expected a bool, got int"):
        L.rms_norm_rope(x[None], x[None], None, None, cs, cs, interleaved=0)


def test_swiglu_writes_a_noncontiguous_out_slice_and_nothing_else(device):
    g = gen(6)
    gate, up = (randn(7, 24, dtype=torch.bfloat16, device=device, generator=g) for _ in range(2))
    buf = torch.full((7, 48), 5.0, dtype=torch.bfloat16, device=device)
    returned = L.swiglu(gate, up, out=buf[:, :24], lane="triton")
    assert returned.data_ptr() == buf.data_ptr()
    assert_close(buf[:, :24], ref.swiglu(f64(gate), f64(up)), "eltwise")
    assert torch.equal(buf[:, 24:], torch.full((7, 24), 5.0, dtype=torch.bfloat16, device=device))


def test_fused_swiglu_gradient_comes_back_fused_and_matches_silu(device):
    g = gen(7)
    fused = randn(5, 2, 80, dtype=torch.float32, device=device, generator=g).requires_grad_()
    dy = randn(5, 2, 40, dtype=torch.float32, device=device, generator=g)
    (d,) = torch.autograd.grad(L.swiglu(fused, lane="triton"), fused, dy)
    gate, up = fused.detach()[..., :40], fused.detach()[..., 40:]
    s = torch.sigmoid(gate)
    assert_close(d[..., 40:], dy * gate * s, "eltwise")                         # d(up) = dy * silu(g)
    assert_close(d[..., :40], dy * up * s * (1 + gate * (1 - s)), "eltwise")    # the formula


@pytest.mark.parametrize("N, block", [(100, 64), (96, 32), (80, 16), (48, 64)],
                         ids=["none divides", "half", "quarter", "one block"])
def test_fused_glu_rows_take_a_block_that_divides_them(device, N, block, monkeypatch):
    """Rows that cannot be flattened (a fused (rows, 2N) input and its fused gradient) of several
    blocks take the largest block down to a quarter of the row's (64 here) that divides N, with
    warps in proportion, or the row's own block where none does or the row is one block: forward
    and backward launch with that block and give the oracle's values and gradients."""
    from lanekit.layers import tuning
    from lanekit.layers.kernels import glu as kernels
    from lanekit.runtime.tuning import arch_id
    arch = arch_id(torch.device(device))
    monkeypatch.setitem(tuning.GLU, arch, tuning.EltwiseConfig(64, 4))
    chosen = []
    grid_of = kernels._glu_grid
    monkeypatch.setattr(kernels, "_glu_grid", lambda *a: chosen.append(grid_of(*a)) or chosen[-1])
    g = gen(17)
    fused = randn(3, 2 * N, dtype=torch.bfloat16, device=device, generator=g).requires_grad_()
    dy = randn(3, N, dtype=torch.bfloat16, device=device, generator=g)
    with poisoned_outputs():   # the output and the fused gradient start as NaN
        y = L.swiglu(fused, lane="triton")
        (d,) = torch.autograd.grad(y, fused, dy)
    expected = ((3 * -(-N // block),), block, max(1, 4 * block // 64))
    assert chosen == [expected, expected]                                   # forward, backward
    x64 = f64(fused.detach()).requires_grad_()
    y_ref = ref.swiglu(x64)
    (d_ref,) = torch.autograd.grad(y_ref, x64, f64(dy))
    assert_close(y, y_ref, "eltwise")
    assert_close(d, d_ref, "eltwise")


def _dequantization_errors(got, args, eps=1e-6):
    """For q's and k's codes and scales in ``got`` (qk_norm_rope_quant of ``args``): (codes, scale,
    |codes * scale - n|, its bound) on the CPU, n the oracle's RMSNorm-then-RoPE of ``args`` in
    fp64. The bound: half a code (int8), and 2^-10 of one for the fp32 roundings; or half an e4m3
    step, 2^-4 of the value, or 2^-10 (in codes) below its normal range."""
    n = ref.rms_norm_rope(*(f64(t) for t in args), eps=eps)
    for codes, scale, want in ((got[0], got[1], n[0]), (got[2], got[3], n[1])):
        codes, scale, want = codes.cpu(), scale.cpu(), want.cpu()
        deq = codes.double() * scale.double()[..., None]
        if codes.dtype == torch.int8:
            bound = (0.5 + 2.0 ** -10) * scale.double()[..., None]
        else:
            bound = torch.maximum(deq.abs() * 2 ** -4, 2 ** -10 * scale.double()[..., None])
        yield codes, scale, (deq - want).abs(), bound


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_quantized_qk_dequantizes_to_the_normalized_rotated_values(device, dtype):
    """codes * scale is the norm-then-RoPE result to within half a code (int8) or a step of e4m3."""
    g = gen(8)
    q = randn(2, 5, 4, 64, dtype=torch.bfloat16, device=device, generator=g)
    k = randn(2, 5, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g)
    theta = torch.rand(8, 32, generator=g).to(device) * 6.3
    args = (q, k, w, w, theta.cos(), theta.sin())
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, quant_dtype=dtype, lane="triton")
    for codes, scale, err, bound in _dequantization_errors(got, args):
        assert codes.dtype == dtype and scale.shape == err.shape[:-1]
        assert (err <= bound * 1.0001).all()


def _wide_rows(g, shape, dtype, low, span, zeros=0.1):
    """Values of random sign, |x| = m * 2^e with e uniform in [low, low + span): rows whose squares
    span up to 2 * span binades; about a fraction ``zeros`` of exact zeros."""
    mant = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    e = torch.randint(low, low + span, shape, generator=g).double()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * mant * torch.exp2(e)).to(dtype)
    return torch.where(torch.rand(shape, generator=g) < zeros, torch.zeros_like(x), x)


def _assert_quant_matches(got, expected):
    """Codes equal to the oracle's bit for bit; scales (fp32) within the "norm" rule, each at its own
    magnitude (a tensor's rows may span many binades here), NaN where the oracle's is. Codes of a
    row with a NaN scale (inf or NaN in x) are compared too: the NaN code (e4m3) or 0 (int8)."""
    for i, (name, o, e) in enumerate(zip(("q_codes", "q_scale", "k_codes", "k_scale"), got, expected,
                                         strict=True)):
        assert o.dtype == e.dtype and o.shape == e.shape, name
        o, e = o.cpu(), e.cpu()
        if i % 2 == 0:
            same = o.view(torch.uint8) == e.view(torch.uint8)
            assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} differ"
        else:
            assert torch.equal(o.isnan(), e.isnan()), f"{name}: NaN where the oracle has none, or not"
            o, e = o.double()[~e.isnan()], e.double()[~e.isnan()]
            inf = e.isinf()
            assert torch.equal(o[inf], e[inf]), f"{name}: infinities differ from the oracle's"
            o, e = o[~inf], e[~inf]
            # one step of fp32 at each scale's own magnitude (at least its smallest normal's: ulp())
            tiny = torch.finfo(torch.float32).tiny
            unit = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(tiny)))) * 2.0 ** -23
            steps = ((o - e).abs() / unit).max().item() if e.numel() else 0.0
            allowed = NORM.steps_for(torch.float32)
            assert steps <= allowed, f"{name}: {steps:.2f} steps off (allowed {allowed})"


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       low=st.integers(-125, 112), span=st.integers(1, 15), eps=st.sampled_from([1e-6, 0.0]),
       quant=st.sampled_from([torch.float8_e4m3fn, torch.int8]), seed=st.integers(0, 2 ** 16))
def test_quantized_qk_codes_are_exact_for_rows_of_wide_dynamic_range(device, dtype, low, span, eps,
                                                                      quant, seed):
    """Rows of any magnitude bf16 holds, 2^-125 to 2^127 (where max |u| leaves [2^-100, 2^100) and
    the tile is redone from x scaled, and where the squares over- or underflow fp32 and the scale
    is taken in fp64), with elements spanning up to 15 binades, and eps 0: codes bit for bit."""
    g = gen(seed)
    if dtype == torch.float16:  # fp16: |x| from 2^-24 to 2^15
        low = max(-24, min(low, 15 - span))
    q = _wide_rows(g, (1, 5, 4, 64), dtype, low, span).to(device)
    k = _wide_rows(g, (1, 5, 3, 64), dtype, low, span).to(device)
    w = randn(64, dtype=dtype, device=device, generator=g)
    theta = torch.rand(8, 32, generator=g).to(device) * 6.3
    args = (q, k, w, w, theta.cos(), theta.sin())
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, eps=eps, quant_dtype=quant, lane="triton")
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, eps=eps32, quant_dtype=quant))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Triton's interpreter passes a float argument of -0.0 to the kernel as +0.0")
@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
def test_quantized_qk_codes_keep_the_sign_of_zero_weights(device, quant):
    """A weight of -0.0 with offset -0.0 gives (offset + w) = -0.0 and codes of -0.0 on the features
    it scales (e4m3 0x80 where x > 0), as in the oracle: the kernel's per-feature weight step
    (w + -0.0, see layers.kernels.qk_norm._per_feature) must not turn it into +0.0. Some weights are +0.0,
    and the rotary range is partial, so both the rotated and the passed-through features see it."""
    g = gen(11)
    q = randn(2, 3, 4, 64, dtype=torch.bfloat16, device=device, generator=g)
    k = randn(2, 3, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g)
    w[::3] = -0.0
    w[1::6] = 0.0
    theta = torch.rand(8, 16, generator=g).to(device) * 6.3
    args = (q, k, w, w, theta.cos(), theta.sin())
    kw = dict(offset=-0.0, rotary_dim=32, quant_dtype=quant)
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, **kw, lane="triton")
    want = ref.qk_norm_rope_quant(*args, **kw)
    _assert_quant_matches(got, want)
    if quant == torch.float8_e4m3fn:   # the case can fail: some codes are -0.0
        assert (want[0].view(torch.uint8) == 0x80).any()


@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
def test_quantized_qk_codes_pin_the_division_and_its_rounding(device, quant):
    """fp32 rows, with RoPE the identity (cos 1, sin 0) and no weights so that u = x, picked from
    2^18 random rows as those whose codes round(u * (qmax / amax)) differ from both nearby
    formulas, round(u * (1 / (amax / qmax))) and round(u / (amax / qmax)): the kernel's codes must
    be the oracle's there, which pins its one correctly rounded division per row (random rows
    alone do not: those formulas change about one code in 10^6)."""
    qmax = ref.QUANT_MAX[quant]
    x = torch.randn(1 << 18, 64, generator=gen(23))
    amax = x.abs().amax(-1, keepdim=True)
    qm = torch.full_like(amax, qmax)
    want = ref.to_codes(x * (qm / amax), quant).view(torch.uint8)
    differ = ((want != ref.to_codes(x * (torch.ones_like(amax) / (amax / qm)), quant).view(torch.uint8))
              & (want != ref.to_codes(x / (amax / qm), quant).view(torch.uint8))).any(-1)
    rows = differ.nonzero().flatten()
    assert len(rows) >= 4, len(rows)    # the premise: such rows exist (21 for int8, 7 for e4m3)
    q = x[rows[: min(len(rows), 8) // 4 * 4]].view(1, -1, 4, 64).to(device)
    k = randn(1, q.shape[1], 2, 64, dtype=torch.float32, device=device, generator=gen(24))
    cos, sin = torch.ones(q.shape[1], 32, device=device), torch.zeros(q.shape[1], 32, device=device)
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(q, k, None, None, cos, sin, quant_dtype=quant, lane="triton")
    _assert_quant_matches(got, ref.qk_norm_rope_quant(q, k, None, None, cos, sin, quant_dtype=quant))


@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
def test_quantized_qk_codes_do_not_depend_on_the_norm(device, quant):
    """The codes of x * 2^j are x's at every j bf16 holds exactly, 2^-118 to 2^120: the norm
    divides out, through the direct path (max |u| within [2^-100, 2^100)) and through the redone
    one (outside it, u from x brought to [1, 2)); with eps 0 the scales are x's too. Each against
    the oracle, and all against j = 0's."""
    g = gen(19)
    x = randn(2, 6, 64, dtype=torch.float32, device="cpu", generator=g)
    x = (x.sign() * x.abs().clamp(2.0 ** -8, 4.0)).to(torch.bfloat16)    # exact in bf16 at every j
    # weights of about 2^7: at j = 120 some products overflow fp32 unless redone
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g, scale=128.0)
    theta = torch.rand(8, 32, generator=g).to(device) * 6.3
    first = None
    for j in (0, -118, -105, -60, 60, 100, 120):
        xj = (x.double() * 2.0 ** j).to(torch.bfloat16)
        assert torch.equal(xj.double(), x.double() * 2.0 ** j)
        q, k = xj[:1, None].to(device), xj[1:, None].to(device)
        args = (q, k, w, w, theta.cos(), theta.sin())
        with poisoned_outputs():
            got = L.qk_norm_rope_quant(*args, eps=0.0, quant_dtype=quant, lane="triton")
        _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, eps=0.0, quant_dtype=quant))
        if first is None:
            first = got
        _assert_quant_matches(got, first)


@pytest.mark.parametrize("rows", ["one row of squares past fp32", "one row past 2^100",
                                  "all tiny, eps 0", "all past 2^-100", "a zero row", "inf and NaN",
                                  "normal"])
def test_quantized_qk_tiles_at_the_ends_of_the_range_are_redone_and_exact(device, rows):
    """Tiles holding a row whose max |u| lies outside [2^-100, 2^100) (redone from x scaled), or
    whose sum of squares overflows or underflows fp32 (the scale from fp64), or a zero row (scale
    1), or inf and NaN (NaN scale): codes and scales as the oracle's, the tile's other rows too;
    and every finite row's codes * scale within half a code of RMSNorm-then-RoPE in fp64."""
    g = gen(10)
    q = randn(1, 4, 8, 64, dtype=torch.float32, device="cpu", generator=g)
    if rows == "one row of squares past fp32":
        q[0, 1, 3] = _wide_rows(g, (64,), torch.float32, 63, 3, zeros=0.0)
    elif rows == "one row past 2^100":
        q[0, 1, 3] = _wide_rows(g, (64,), torch.float32, 117, 10, zeros=0.0)
    elif rows == "all tiny, eps 0":
        q[0, 2] = _wide_rows(g, (8, 64), torch.float32, -90, 6)
    elif rows == "all past 2^-100":
        q[0, 2] = _wide_rows(g, (8, 64), torch.float32, -124, 10)
    elif rows == "a zero row":
        q[0, 2, 5] = 0.0
    elif rows == "inf and NaN":
        q[0, 2, 5, 7] = float("inf")
        q[0, 3, 0, 60] = float("nan")
    q = q.to(torch.bfloat16).to(device)
    k = randn(1, 4, 8, 64, dtype=torch.bfloat16, device=device, generator=g)
    # weights up to about 2^6: some products of rows past 2^100 overflow fp32 unless redone
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g, scale=16.0)
    theta = torch.rand(8, 32, generator=g).to(device)
    eps = 0.0 if rows in ("all tiny, eps 0", "all past 2^-100") else 1e-6
    args = (q, k, w, w, theta.cos(), theta.sin())
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, eps=eps, quant_dtype=torch.int8, lane="triton")
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, eps=eps32, quant_dtype=torch.int8))
    for _, scale, err, bound in _dequantization_errors(got, args, eps32):
        assert (err <= bound)[scale.isfinite()].all()
    if rows == "a zero row":
        assert got[1][0, 2, 5] == 1.0 and not got[0][0, 2, 5].any()
    if rows == "inf and NaN":
        assert got[1][0, 2, 5].isnan() and got[1][0, 3, 0].isnan()
        assert not got[0][0, 2, 5].any() and not got[0][0, 3, 0].any()     # int8: codes 0


@pytest.mark.parametrize("lane", ["triton", "reference"])
@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
def test_quantized_qk_a_head_with_a_nan_or_inf_gets_a_nan_scale_and_nan_codes(device, quant, lane):
    """The NaN-visible rule (docs/semantics.md): a head vector holding a NaN or inf, in q or k, gets a
    NaN scale and every code the NaN code (e4m3 0x7F) or 0 (int8), on both lanes alike; the other
    heads of its token and tile are as without it."""
    g = gen(37)
    q = randn(1, 3, 4, 64, dtype=torch.bfloat16, device=device, generator=g)
    k = randn(1, 3, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    q[0, 1, 2, 5] = float("nan")
    q[0, 2, 0, 60] = float("-inf")
    k[0, 0, 1, 0] = float("inf")
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g)
    theta = torch.rand(8, 32, generator=g).to(device)
    args = (q, k, w, w, theta.cos(), theta.sin())
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, quant_dtype=quant, lane=lane)
    _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, quant_dtype=quant))
    want_code = 0x7F if quant == torch.float8_e4m3fn else 0
    for codes, scale, bad in ((got[0], got[1], [(0, 1, 2), (0, 2, 0)]), (got[2], got[3], [(0, 0, 1)])):
        mask = torch.zeros(scale.shape, dtype=torch.bool)
        for i in bad:
            mask[i] = True
        assert torch.equal(scale.cpu().isnan(), mask)
        assert (codes.cpu().view(torch.uint8)[mask] == want_code).all()
        if quant == torch.float8_e4m3fn:
            assert not (codes.cpu().view(torch.uint8)[~mask] == 0x7F).any()


# (x's magnitude, weight, cos and sin, eps): rows whose max |u| the weights or cos and sin put out of
# [2^-100, 2^100), or whose fp32 scale would overflow or fall below fp32's normal range, though x
# lies well inside it
_PUT_OUT_OF_RANGE = {
    "tiny weights": (2.0 ** 20, 2.0 ** -125, None, 1e-6),
    "tiny weights, tiny x": (2.0 ** -60, 2.0 ** -60, None, 0.0),
    "subnormal weights": (2.0 ** 60, 2.0 ** -140, None, 1e-6),
    "huge weights": (1.0, 2.0 ** 110, None, 1e-6),
    "huge weights, huge x": (2.0 ** 60, 2.0 ** 60, None, 1e-6),
    "huge cos and sin": (2.0 ** 20, 1.0, 2.0 ** 100, 1e-6),
    "tiny cos and sin": (1.0, 1.0, 2.0 ** -110, 1e-6),
    "scale past fp32, eps 0": (2.0 ** -46, 2.0 ** 127, 1.0, 0.0),
    "subnormal scale": (2.0 ** 30, 2.0 ** -124, None, 1e-6),
    "u past fp32 from x * p": (2.0 ** 10, 2.0 ** 127, 1.0, 1e-6),
}


@pytest.mark.parametrize("quant", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
@pytest.mark.parametrize("case", list(_PUT_OUT_OF_RANGE))
def test_quantized_qk_rows_put_out_of_range_by_the_weights(device, case, quant):
    """fp32 rows of ordinary x whose weights (or cos and sin) near fp32's ends put max |u| out of
    [2^-100, 2^100), or make the fp32 scale overflow (eps 0 and two nonzero features: the norm
    multiplies by 2^49) or fall below fp32's normal range: codes as the oracle's, and as precise
    as any row's (the largest is qmax: p follows max |u| where it is finite, not max |x| alone);
    where the scale is a normal number, codes * scale within half a code of RMSNorm-then-RoPE in
    fp64; and a row whose u overflows even from x * p gets a NaN scale, the others finite ones."""
    magnitude, weight, rope, eps = _PUT_OUT_OF_RANGE[case]
    g = gen(29)
    q = randn(1, 3, 4, 64, dtype=torch.float32, device="cpu", generator=g) * magnitude
    k = randn(1, 3, 2, 64, dtype=torch.float32, device="cpu", generator=g) * magnitude
    w = torch.full((64,), weight)
    w[::5] *= 1.5                                           # not one weight for all
    if case == "scale past fp32, eps 0":
        q = torch.zeros_like(q)
        q[..., 0], q[..., 1] = magnitude, -magnitude / 2
    if case == "u past fp32 from x * p":
        # huge weights on the pair (0, 32) alone, zero x there but in one row, where cos = sin = 1
        # rotate x * p = (1.5, -1.5) to (a - b) * w = 3 * 2^127
        w = torch.ones(64)
        w[0] = w[32] = weight
        q[..., 0] = q[..., 32] = k[..., 0] = k[..., 32] = 0.0
        q[0, 1, 2] *= 0.1
        q[0, 1, 2, 0], q[0, 1, 2, 32] = 1.5 * magnitude, -1.5 * magnitude
    theta = torch.rand(3, 32, generator=g) * 6.3
    cos, sin = (theta.cos(), theta.sin()) if rope is None else (torch.full((3, 32), rope),) * 2
    args = [t.to(device) for t in (q, k, w, w, cos, sin)]
    with poisoned_outputs():
        got = L.qk_norm_rope_quant(*args, eps=eps, quant_dtype=quant, lane="triton")
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, eps=eps32, quant_dtype=quant))
    for codes, scale, err, bound in _dequantization_errors(got, args, eps32):
        assert (codes.float().abs().amax(-1)[scale.isfinite()] == ref.QUANT_MAX[quant]).all()
        assert (err <= bound)[scale.abs() >= torch.finfo(torch.float32).tiny].all()
    if case == "u past fp32 from x * p":
        assert got[1][0, 1, 2].isnan() and int(got[1].isnan().sum()) == 1
    else:
        assert got[1].isfinite().all() and got[3].isfinite().all()


@pytest.mark.parametrize("call, arg, error", [
    (lambda x, w: L.rms_norm(x, w[:-1]), "weight", ValueError),
    (lambda x, w: L.rms_norm(x, w, eps=-1.0), "eps", ValueError),
    (lambda x, w: L.rms_norm(x.int(), w), "x", TypeError),
    (lambda x, w: L.rms_norm(x, w, residual=x.half()), "residual", TypeError),
    (lambda x, w: L.layer_norm(x, w, w[:3]), "bias", ValueError),
    (lambda x, w: L.adaln(x, x[:1], x[:1]), "scale", ValueError),
    (lambda x, w: L.adaln(x, x, x, gate=x), "gate", ValueError),
    (lambda x, w: L.swiglu(x[:, :5]), "gate", ValueError),
    (lambda x, w: L.swiglu(x, x[:2]), "up", ValueError),
    (lambda x, w: L.geglu(x, x, approximate="erf"), "approximate", ValueError),
    (lambda x, w: L.swiglu(x, x, out=x.t()[:4]), "out", ValueError),
    (lambda x, w: L.layer_norm(x, w, None, eps="1e-5"), "eps", TypeError),
    (lambda x, w: L.rms_norm(x, w, offset="1"), "offset", TypeError),
    (lambda x, w: L.rms_norm(x, w, eps=True), "eps", TypeError),
], ids=["weight shape", "eps", "x dtype", "residual dtype", "bias shape", "adaln scale shape",
        "gate without residual", "odd fused width", "up shape", "gelu approximation", "out shape",
        "eps a str", "offset a str", "eps a bool"])
def test_bad_input_names_the_argument(device, call, arg, error):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    before = x.clone()
    with pytest.raises(error, match=rf"^{arg}: "):
        call(x, w)
    assert torch.equal(x, before)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(rotary_dim=5), "rotary_dim"),
    (dict(rotary_dim=128), "rotary_dim"),
    (dict(seqlen_offsets=60), "cos"),
    (dict(position_ids=torch.tensor([[0, 1, 2, 99]])), "position_ids"),
    (dict(seqlen_offsets=-1), "seqlen_offsets"),
    (dict(cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)), "cu_seqlens"),
], ids=["odd rotary_dim", "rotary_dim over D", "positions past cos", "position id past cos",
        "negative offset", "cu_seqlens with 4-d x"])
def test_bad_rotary_input_names_the_argument_and_leaves_x_alone(device, kwargs, arg, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # position values checked on the host too
    x = torch.randn(1, 4, 2, 64, device=device)
    before = x.clone()
    theta = torch.rand(62, 32)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises((ValueError, TypeError), match=rf"^{arg}: "):
        L.apply_rotary(x, theta.cos().to(device), theta.sin().to(device), inplace=True, **kwargs)
    assert torch.equal(x, before)


def test_writes_that_would_overlap_are_refused(device):
    """An expanded output, or one that partly overlaps an input, would be written in an order
    that decides the result: refused with a ValueError; exactly an input (in place) is fine."""
    x = torch.randn(6, 48, device=device)
    with pytest.raises(ValueError, match="^out: .*expanded"):
        L.swiglu(x, out=torch.empty(1, 24, device=device).expand(6, 24))
    with pytest.raises(ValueError, match="^out: .*overlaps"):
        L.swiglu(x, out=x[:, 12:36])
    gate, up = x[:, :24].clone(), x[:, 24:].clone()
    expected = L.swiglu(gate, up)
    L.swiglu(gate, up, out=gate)
    assert torch.equal(gate, expected)
    theta = torch.rand(8, 16, device=device)
    with pytest.raises(ValueError, match="^x: .*expanded"):
        L.apply_rotary(torch.randn(1, 1, 2, 32, device=device).expand(1, 4, 2, 32), theta.cos(),
                       theta.sin(), inplace=True)


def test_strided_cu_seqlens_and_offsets_are_read_as_their_values(device):
    x = torch.randn(7, 2, 32, device=device)
    cs = torch.rand(16, 16, device=device)
    spaced = lambda v: torch.tensor([[a, 999] for a in v], dtype=torch.int32, device=device).flatten()[::2]  # noqa: E731
    plain = dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32, device=device),
                 seqlen_offsets=torch.tensor([2, 5], dtype=torch.int32, device=device))
    with poisoned_outputs():
        want = L.apply_rotary(x, cs, cs, **plain, lane="triton")
        got = L.apply_rotary(x, cs, cs, cu_seqlens=spaced([0, 3, 7]), seqlen_offsets=spaced([2, 5]), lane="triton")
    assert_close(want, ref.apply_rotary(x.double(), cs.double(), cs.double(), **plain), "eltwise")
    assert torch.equal(got, want)


def test_bad_packed_rotary_input(device):
    x = torch.randn(7, 2, 32, device=device)
    cs = torch.rand(16, 16, device=device)
    with pytest.raises(ValueError, match="^x: a packed"):
        L.apply_rotary(x, cs, cs)
    with pytest.raises(ValueError, match="^cu_seqlens: "):
        L.apply_rotary(x, cs, cs, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="^quant_dtype: "):
        L.qk_norm_rope_quant(x[None], x[None], None, None, cs, cs, quant_dtype=torch.float16)
    with pytest.raises(TypeError, match="^interleaved: "):
        L.rms_norm_rope(x[None], x[None], None, None, cs, cs, interleaved="no")
    with pytest.raises(ValueError, match="^max_seqlen: "):
        L.apply_rotary(x[None], cs, cs, max_seqlen=7)
    with pytest.raises(ValueError, match="^seqlen_offsets: "):
        L.apply_rotary(x, cs, cs, position_ids=torch.zeros(7, dtype=torch.long, device=device),
                       seqlen_offsets=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of the Triton lane needs a GPU")
def test_layers_under_torch_compile_fullgraph(device):
    g = gen(9)
    x = randn(17, 256, dtype=torch.bfloat16, device=device, generator=g).requires_grad_()
    w = randn(256, dtype=torch.bfloat16, device=device, generator=g).requires_grad_()
    theta = torch.rand(32, 32, generator=g).to(device)

    def block(x, w):
        y, h = L.rms_norm(x, w, residual=x * 2)
        q = L.apply_rotary(y.view(1, 17, 4, 64), theta.cos(), theta.sin())
        return L.swiglu(q.reshape(17, 256)).float().sum() + h.float().sum()

    eager = block(x, w)
    eager_grads = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(block, fullgraph=True)(x, w)
    compiled_grads = torch.autograd.grad(compiled, (x, w))
    assert torch.allclose(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        assert torch.equal(a, b)


def _check_q_and_k_on_a_padded_layout(device, quant, B, S, HQ, HK, seed):
    """rms_norm_rope (quant None) or qk_norm_rope_quant against the oracle, on q padded in its
    heads and features (B, S, HQ of HQ + 2 heads, 64 of 80 features), with partial rotary (32 of
    64) and position ids."""
    g = gen(seed)
    q = randn(B, S, HQ + 2, 80, dtype=torch.bfloat16, device=device, generator=g)[:, :, :HQ, :64]
    k = randn(B, S, HK, 64, dtype=torch.bfloat16, device=device, generator=g)
    w = randn(64, dtype=torch.bfloat16, device=device, generator=g)
    theta = torch.rand(16, 16, generator=g).to(device) * 6.3
    pos = torch.randint(0, 16, (B, S), generator=g).to(device)
    args = (q, k, w, w, theta.cos(), theta.sin())
    kw = dict(rotary_dim=32, position_ids=pos)
    with poisoned_outputs():
        got = (L.rms_norm_rope(*args, **kw, lane="triton") if quant is None
               else L.qk_norm_rope_quant(*args, **kw, quant_dtype=quant, lane="triton"))
    if quant is None:
        want = ref.rms_norm_rope(*(f64(t) for t in args), **kw)
        for o, e in zip(got, want, strict=True):
            assert_close(o, e, NORM)
        return
    _assert_quant_matches(got, ref.qk_norm_rope_quant(*args, **kw, quant_dtype=quant))


@pytest.mark.parametrize("quant", [None, torch.float8_e4m3fn], ids=["rms_norm_rope", "quant e4m3"])
def test_q_and_k_kernel_int64_row_offsets(device, quant, monkeypatch):
    """The q-and-k kernel's int64 row offsets (taken where a tensor's offsets pass 2^31, on small
    tensors here by lowering that limit) give the int32 path's results: the oracle's."""
    from lanekit.layers.kernels import qk_norm as kernels
    monkeypatch.setattr(kernels, "ROW_OFFSET_LIMIT", 1)
    _check_q_and_k_on_a_padded_layout(device, quant, B=2, S=5, HQ=4, HK=2, seed=13)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="prefetches are PTX: NVIDIA GPUs only (the interpreter has none)")
@pytest.mark.parametrize("ahead", [1, 7, 12])
@pytest.mark.parametrize("quant", [None, torch.float8_e4m3fn], ids=["rms_norm_rope", "quant e4m3"])
def test_q_and_k_kernel_prefetches(device, quant, ahead, monkeypatch):
    """The q-and-k kernel with its prefetches on (cos and sin into L1; into L2 the rows of the
    tile of the same heads 1, 2 and 4 token blocks later: `ahead` programs rounded to token blocks
    of 3 head blocks each, past the end for the last tiles): the oracle's results, with masked
    tiles (37 tokens, 5 and 3 heads). A prefetch reads nothing into a register; this shows the
    addresses it takes change nothing. Prefetches of masked rows are predicated off in the kernel;
    whether compute-sanitizer's memcheck (scripts/gpu.sh sanitizer) checks a prefetch's address at
    all is not established, so a clean run there does not show them in bounds."""
    from lanekit.layers import tuning
    from lanekit.runtime.tuning import arch_id
    arch = arch_id(torch.device(device))
    row = dataclasses.replace(tuning.rotary_config(torch.device(device)), prefetch_rope=1,
                              norm_prefetch_ahead=ahead, quant_prefetch_ahead=ahead)
    monkeypatch.setitem(tuning.ROTARY, arch, row)
    _check_q_and_k_on_a_padded_layout(device, quant, B=3, S=37, HQ=5, HK=3, seed=14)


@pytest.mark.bigmem
@pytest.mark.skipif(not torch.cuda.is_available(), reason="more than 2^31 elements needs GPU memory")
def test_more_than_2_to_the_31_elements(device):
    """int64 offsets: the last rows of a 2^31 + 4096-element tensor are right."""
    N = 4096
    rows = 2 ** 31 // N + 1
    x = torch.empty(rows, N, dtype=torch.bfloat16, device=device).normal_()
    w = torch.randn(N, dtype=torch.bfloat16, device=device)
    tail = slice(rows - 3, rows)
    y = L.rms_norm(x, w)
    assert_close(y[tail], ref.rms_norm(f64(x[tail]), f64(w)), NORM)
    del y
    out = L.swiglu(x)
    assert_close(out[tail], ref.swiglu(f64(x[tail])), "eltwise")
    del out
    theta = torch.rand(rows, 32, device=device)
    xr = x.view(1, rows, 64, 64)
    r = L.apply_rotary(xr, theta.cos(), theta.sin())
    assert_close(r[:, -2:], ref.apply_rotary(f64(xr[:, -2:]), f64(theta.cos()), f64(theta.sin()),
                                             seqlen_offsets=rows - 2), "eltwise")
    del r
    k = xr[:, :, :8]   # q and k in one launch: k's rows sit past 2^31 elements of its buffer too
    qn, kn = L.rms_norm_rope(xr, k, w[:64], w[64:128], theta.cos(), theta.sin())
    expected = ref.rms_norm_rope(f64(xr[:, -2:]), f64(k[:, -2:]), f64(w[:64]), f64(w[64:128]),
                                 f64(theta.cos()), f64(theta.sin()), seqlen_offsets=rows - 2)
    assert_close(qn[:, -2:], expected[0], NORM)
    assert_close(kn[:, -2:], expected[1], NORM)
    del qn, kn
    eps = float(torch.tensor(1e-6, dtype=torch.float32))
    got = L.qk_norm_rope_quant(xr, k, w[:64], w[64:128], theta.cos(), theta.sin(), eps=eps)
    expected = ref.qk_norm_rope_quant(xr[:, -2:], k[:, -2:], w[:64], w[64:128], theta.cos(),
                                      theta.sin(), eps=eps, seqlen_offsets=rows - 2)
    _assert_quant_matches([t[:, -2:] for t in got], expected)


# ---- norms at the ends of fp32's range (issue 37): rows past ~1e19 or tiny ----

def _norm_call(op, x, params, lane, eps):
    """op's output(s) for x ((rows, N); for rms_norm_rope q of (1, rows, 1, N) and k = -q)."""
    if op == "rms_norm":
        return (L.rms_norm(x, params["w"], eps, lane=lane),)
    if op == "layer_norm":
        return (L.layer_norm(x, params["w"], params["b"], eps, lane=lane),)
    if op == "adaln":
        return (L.adaln(x[None], params["s"], params["t"], eps=eps, lane=lane),)
    q = x[None, :, None]
    return L.rms_norm_rope(q, -q, params["w"], params["w"], params["cos"], params["sin"], eps=eps, lane=lane)


def _norm_params(op, N, device, g):
    return dict(w=randn(N, dtype=torch.bfloat16, device=device, generator=g),
                b=randn(N, dtype=torch.bfloat16, device=device, generator=g),
                s=randn(1, N, dtype=torch.bfloat16, device=device, generator=g, scale=0.5),
                t=randn(1, N, dtype=torch.bfloat16, device=device, generator=g, scale=0.5),
                cos=torch.ones(8, N // 2, device=device), sin=torch.zeros(8, N // 2, device=device))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "adaln", "rms_norm_rope"])
def test_norms_of_x_times_a_power_of_two_are_x_s_bit_for_bit_at_either_end_of_fp32(device, op):
    """With eps 0 a norm does not see a power-of-two factor: its output for x * 2^j equals x's bit
    for bit, and its input gradient is x's times 2^-j, from j = -118 (values near fp32's smallest
    normal) to 120 (squares far past fp32's largest: the forward once gave 0 there, and inf or
    NaN for tiny rows). The weights' gradients do not change at all."""
    g = gen(37)
    N = 96
    x = randn(5, N, dtype=torch.float32, device="cpu", generator=g)
    x = (x.sign() * x.abs().clamp(2.0 ** -8, 4.0)).to(torch.bfloat16)     # exact in bf16 at every j
    params = _norm_params(op, N, device, g)
    dy = randn(5, N, dtype=torch.bfloat16, device=device, generator=g)

    def run(j):
        xj = (x.double() * 2.0 ** j).to(torch.bfloat16).to(device).requires_grad_()
        assert torch.equal(xj.detach().cpu().double(), x.double() * 2.0 ** j)
        w = params["w"].clone().requires_grad_()
        with poisoned_outputs():
            outs = _norm_call(op, xj, dict(params, w=w), "triton", 0.0)
        douts = (dy,) if op != "rms_norm_rope" else (dy[None, :, None], dy[None, :, None])
        torch.autograd.backward([o for o in outs], [d.view(o.shape) for o, d in zip(outs, douts)])
        return [o.detach() for o in outs], xj.grad, w.grad

    outs0, dx0, dw0 = run(0)
    expected = [ref_o.to(torch.bfloat16) for ref_o in
                (_norm_call(op, f64(x.to(device)), {k: f64(v) for k, v in params.items()}, "reference", 0.0))]
    for o, e in zip(outs0, expected):
        assert_close(o, e.to(o.dtype), NORM)
    for j in (-118, -100, -64, 40, 64, 100, 120):
        outs, dx, dw = run(j)
        for o, o0 in zip(outs, outs0):
            assert torch.equal(o, o0), f"j={j}: {int((o != o0).sum())} outputs differ from x's"
        if abs(j) <= 100:      # dx0 * 2^-j stays a normal bf16
            assert torch.equal(dx.double(), dx0.double() * 2.0 ** -j), f"j={j}: dx"
            if op != "adaln":
                assert torch.equal(dw, dw0), f"j={j}: dweight"


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "adaln", "rms_norm_rope"])
def test_norms_of_rows_past_1e19_and_of_tiny_rows_ruled_by_eps_match_the_oracle_row_by_row(device, op, lane):
    """eps 1e-6: rows of |x| ~ 1e30 come out near +-1, rows of |x| ~ 1e-30 as x / sqrt(eps); each row
    within one bf16 step of the oracle at its own magnitude."""
    g = gen(38)
    N = 64
    x = randn(4, N, dtype=torch.float32, device="cpu", generator=g)
    x = (x * torch.tensor([1e30, 1e-30, 3e38 / 5, 1.0])[:, None]).clamp(-3e38, 3e38).to(torch.bfloat16).to(device)
    params = _norm_params(op, N, device, g)
    got = _norm_call(op, x, params, lane, 1e-6)
    want = _norm_call(op, f64(x), {k: f64(v) for k, v in params.items()}, "reference", 1e-6)
    for o, e in zip(got, want):
        o, e = o.reshape(4, N), e.reshape(4, N)
        for r in range(4):
            assert_close(o[r], e[r].to(o.dtype), NORM)
def test_positions_past_cos_are_masked_and_recorded_not_read(device, monkeypatch):
    # no value read back on the Triton lane: the rotated features of such a token come out 0
    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    try:
        lanekit.check_errors()
    except ValueError:
        pass
    x = randn(1, 4, 2, 64, dtype=torch.float32, device=device, generator=gen(3))
    theta = torch.rand(62, 16, device=device)
    pos = torch.tensor([[0, 1, 2, 99]], device=device)
    with poisoned_outputs():
        got = L.apply_rotary(x, theta.cos(), theta.sin(), position_ids=pos, lane="triton")
    with pytest.raises(ValueError, match="rotary: a position"):
        lanekit.check_errors()
    want = ref.apply_rotary(x[:, :3].double(), theta.cos().double(), theta.sin().double(), position_ids=pos[:, :3])
    assert_close(got[:, :3], want, "eltwise")
    assert (got[0, 3, :, :32] == 0).all() and torch.equal(got[0, 3, :, 32:], x[0, 3, :, 32:])


# ---- apply_rotary_qk: q and k in one launch ----

def _qk(device, dtype=torch.bfloat16, B=2, S=7, Hq=6, Hkv=2, D=64, seed=4):
    g = gen(seed)
    q = randn(B, S, Hq, D, dtype=dtype, device=device, generator=g)
    k = randn(B, S, Hkv, D, dtype=dtype, device=device, generator=g)
    theta = torch.rand(32, D // 2, generator=g).to(device) * 6.3
    return q, k, theta.cos(), theta.sin()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_apply_rotary_qk_is_apply_rotary_of_each_in_one_launch(device, interleaved, monkeypatch):
    from lanekit.layers import kernels

    q, k, cos, sin = _qk(device)
    pos = torch.randint(0, 32, (2, 7), generator=gen(5)).to(device)
    launches = []
    real = kernels.rotary_qk_fwd
    monkeypatch.setattr(kernels, "rotary_qk_fwd", lambda **kw: launches.append(1) or real(**kw))
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    with poisoned_outputs():
        got_q, got_k = L.apply_rotary_qk(*leaves, cos, sin, interleaved, position_ids=pos, lane="triton")
    assert len(launches) == 1
    want_q = L.apply_rotary(q, cos, sin, interleaved, position_ids=pos, lane="triton")
    want_k = L.apply_rotary(k, cos, sin, interleaved, position_ids=pos, lane="triton")
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    ref_q, ref_k = ref.apply_rotary_qk(f64(q), f64(k), f64(cos), f64(sin), interleaved, position_ids=pos)
    assert_close(got_q, ref_q, "eltwise")
    assert_close(got_k, ref_k, "eltwise")
    dq, dk = randn(*q.shape, dtype=q.dtype, device=device, generator=gen(6)), randn(
        *k.shape, dtype=k.dtype, device=device, generator=gen(7))
    with poisoned_outputs():
        gq, gk = torch.autograd.grad((got_q, got_k), leaves, (dq, dk))
    assert len(launches) == 2                                  # the backward: one launch for both
    want_gq = ref.apply_rotary(f64(dq), f64(cos), f64(sin), interleaved, position_ids=pos, conjugate=True)
    want_gk = ref.apply_rotary(f64(dk), f64(cos), f64(sin), interleaved, position_ids=pos, conjugate=True)
    assert_close(gq, want_gq, "eltwise")
    assert_close(gk, want_gk, "eltwise")


def test_apply_rotary_qk_matches_llamas_apply_rotary_pos_emb(device):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = _qk(device, dtype=torch.float32, S=9)
    pos = torch.arange(9, device=device)
    full_cos, full_sin = torch.cat((cos, cos), -1)[pos][None], torch.cat((sin, sin), -1)[pos][None]   # (1, S, D)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), full_cos, full_sin)
    for lane in LANES:
        got_q, got_k = L.apply_rotary_qk(q, k, cos, sin, lane=lane)
        assert_close(got_q, want_q.transpose(1, 2), "eltwise")
        assert_close(got_k, want_k.transpose(1, 2), "eltwise")


@pytest.mark.parametrize("change, arg, error", [
    (lambda q, k: (q, k[:, :3]), "k", ValueError),
    (lambda q, k: (q, k.half()), "k", TypeError),
    (lambda q, k: (q[0], k), "q", ValueError),
    (lambda q, k: (q, k[..., :32]), "k", ValueError),
], ids=["k shorter", "k dtype", "q 3-d", "k head dim"])
def test_bad_apply_rotary_qk_input_names_the_argument(device, change, arg, error):
    q, k, cos, sin = _qk(device)
    q, k = change(q, k)
    with pytest.raises(error, match=rf"^{arg}: "):
        L.apply_rotary_qk(q, k, cos, sin)
    with pytest.raises(ValueError, match="^seqlen_offsets: "):
        L.apply_rotary_qk(*_qk(device)[:2], cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="^interleaved: "):
        L.apply_rotary_qk(*_qk(device)[:2], cos, sin, interleaved=1)


# ---- eager calls skip the dispatcher; eager training takes an autograd.Function of the same op ----

def test_eager_training_gives_the_custom_ops_gradients(device, monkeypatch):
    from lanekit.runtime import custom_ops

    g = gen(8)
    x = randn(5, 96, dtype=torch.bfloat16, device=device, generator=g)
    w = randn(96, dtype=torch.bfloat16, device=device, generator=g)
    gate = randn(5, 192, dtype=torch.bfloat16, device=device, generator=g)
    dy = randn(5, 96, dtype=torch.bfloat16, device=device, generator=g)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (x, w, gate)]
        y = L.rms_norm(leaves[0], leaves[1], lane="triton") + L.swiglu(leaves[2], lane="triton")
        return torch.autograd.grad(y, leaves, dy)

    used = []
    real = custom_ops.eager_function
    monkeypatch.setattr(custom_ops, "eager_function", lambda op: used.append(op) or real(op))
    eager = grads()
    assert len(used) == 2 and all(real(op) is not None for op in used)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)   # the custom ops' own autograd
    through_ops = grads()
    assert all(torch.equal(a, b) for a, b in zip(eager, through_ops))
