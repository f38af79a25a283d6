"""flash_attn_func backward: the pinned behaviours, against the float64 oracle.

Every registered sample of ``flash_attn_func.backward`` (the forward's samples with a dout) is
checked on every lane by tests/test_check.py; here are the cases issue 3 pins, the gradient of the
LSE and of a broadcast bias, determinism, strides, the packed variants and torch.compile.
"""

import pytest
import torch

import lanekit
from lanekit.attention.registry import ATTENTION_BWD, ATTENTION_DBIAS
from lanekit.reference import attention as ref
from lanekit.testing import assert_close, compare, poisoned_outputs, randn, upcast

ON_GPU = torch.cuda.is_available()


def inputs(B, Sq, Sk, Hq, Hkv, D, device, dtype=torch.bfloat16, seed=0, Dv=None):
    """q, k, v as leaves that require grad, and a dout, all from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    q = randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g)
    k = randn(B, Sk, Hkv, D, dtype=dtype, device=device, generator=g)
    v = randn(B, Sk, Hkv, Dv or D, dtype=dtype, device=device, generator=g)
    dout = randn(B, Sq, Hq, Dv or D, dtype=dtype, device=device, generator=g)
    return [t.requires_grad_() for t in (q, k, v)], dout


def grads(q, k, v, dout, *extra, **kw):
    """(dq, dk, dv, *d(extra)) of the Triton lane, with every output it allocates poisoned."""
    with poisoned_outputs():
        out = lanekit.flash_attn_func(q, k, v, lane="triton", **kw)
        return torch.autograd.grad(out, (q, k, v, *extra), dout)


def oracle_grads(q, k, v, dout, *, softmax_scale=None, **kw):
    """The float64 oracle's (dq, dk, dv, dbias) for the same call (normalized arguments)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return ref.flash_attn_backward(*map(upcast, (dout, q, k, v)), softmax_scale=scale,
                                   **{n: upcast(t) for n, t in kw.items()})


def assert_grads_close(ours, expected):
    for name, a, b in zip(("dq", "dk", "dv"), ours, expected):
        assert a.abs().amax() > 0, f"{name} is all zeros"
        c = compare(a, b, ATTENTION_BWD)
        assert c.ok, f"{name}: {c.detail}"


def test_non_causal_backward_is_not_silently_causal(device):
    (q, k, v), dout = inputs(1, 128, 128, 2, 2, 32, device)
    full = grads(q, k, v, dout)
    causal = grads(q, k, v, dout, causal=True)
    expected_full = oracle_grads(q, k, v, dout)
    expected_causal = oracle_grads(q, k, v, dout, window_size=(-1, 0))
    assert_grads_close(full, expected_full)
    assert_grads_close(causal, expected_causal)
    assert not compare(full[1], expected_causal[1], ATTENTION_BWD).ok  # the two really differ


def test_causal_gqa_8_to_2_with_sq_128_sk_512(device):
    (q, k, v), dout = inputs(1, 128, 512, 8, 2, 32, device)
    ours = grads(q, k, v, dout, causal=True)
    assert_grads_close(ours, oracle_grads(q, k, v, dout, window_size=(-1, 0)))
    # keys before position 384 are seen by every query (bottom-right causal): all get gradients
    assert (ours[1][0, :384].abs().amax(dim=-1) > 0).all()


def test_length_129_with_bias_and_causal_gives_finite_oracle_gradients(device):
    (q, k, v), dout = inputs(2, 129, 129, 2, 2, 64, device, dtype=torch.float16)
    bias = randn(2, 2, 129, 129, dtype=torch.float16, device=device, scale=2.0).requires_grad_()
    ours = grads(q, k, v, dout, bias, causal=True, attn_bias=bias)
    expected = oracle_grads(q, k, v, dout, window_size=(-1, 0), attn_bias=bias)
    assert all(torch.isfinite(g).all() for g in ours)
    assert_grads_close(ours[:3], expected[:3])
    assert_close(ours[3], expected[3], ATTENTION_DBIAS)
    # above the diagonal the bias is masked: its gradient is exactly 0 there
    upper = torch.ones(129, 129, dtype=torch.bool, device=device).triu(1)
    assert (ours[3][..., upper] == 0).all()


def test_head_dim_80_writes_every_column_of_every_gradient(device):
    (q, k, v), dout = inputs(1, 33, 40, 2, 1, 80, device)
    ours = grads(q, k, v, dout)  # gradients start as NaN (poisoned)
    for g in ours:
        assert not torch.isnan(g).any()
        assert (g.abs().amax(dim=(0, 1, 2)) > 0).all()  # no column left at zero either
    assert_grads_close(ours, oracle_grads(q, k, v, dout))


@pytest.mark.parametrize("dims", [(1, 16, 17), (31, 33, 59), (64, 65, 72), (80, 111, 128),
                                  (129, 160, 192), (193, 224, 256)], ids=lambda d: f"D{d[0]}-{d[-1]}")
def test_head_dims_of_every_bucket_with_a_different_value_dim(dims, device):
    # Views into storage padded to 256 columns, as in the forward's sweep: on the GPU the dims of
    # one bucket share a compiled kernel. Dv is D's neighbour, so Dv != D in every call.
    g = torch.Generator().manual_seed(dims[0])
    store = [randn(1, n, 2, 256, dtype=torch.float16, device=device, generator=g) for n in (21, 30, 30, 21)]
    for D in dims:
        Dv = D - 1 if D > 1 else 2
        q, k, v, dout = store[0][..., :D], store[1][..., :D], store[2][..., :Dv], store[3][..., :Dv]
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        ours = grads(q, k, v, dout, causal=True)
        for name, grad in zip(("dq", "dk", "dv"), ours):
            assert not torch.isnan(grad).any(), f"D={D}, Dv={Dv}: {name} has unwritten elements"
        assert_grads_close(ours, oracle_grads(q, k, v, dout, window_size=(-1, 0)))


def test_rows_that_see_no_key_get_zero_dq_and_keys_no_query_sees_get_zero_dk_dv(device):
    (q, k, v), dout = inputs(1, 20, 4, 2, 2, 16, device, dtype=torch.float16)
    dq, dk, dv = grads(q, k, v, dout, causal=True)  # bottom-right: rows 0..15 see no key
    assert torch.equal(dq[:, :16], torch.zeros_like(dq[:, :16]))
    assert_grads_close((dq, dk, dv), oracle_grads(q, k, v, dout, window_size=(-1, 0)))

    (q, k, v), dout = inputs(1, 4, 20, 2, 2, 16, device, dtype=torch.float16, seed=1)
    dq, dk, dv = grads(q, k, v, dout, window_size=(2, 0))  # query i sees keys i+14 .. i+16
    assert torch.equal(dk[:, :14], torch.zeros_like(dk[:, :14]))
    assert torch.equal(dv[:, :14], torch.zeros_like(dv[:, :14]))
    assert_grads_close((dq, dk, dv), oracle_grads(q, k, v, dout, window_size=(2, 0)))


def test_fifty_backward_runs_are_bit_identical(device):
    shape = (2, 512, 1024, 8, 2, 128) if ON_GPU else (1, 20, 24, 2, 1, 16)
    (q, k, v), dout = inputs(*shape, device)
    first = grads(q, k, v, dout, causal=True, deterministic=True)
    assert_grads_close(first, oracle_grads(q, k, v, dout, window_size=(-1, 0)))
    for _ in range(49):
        again = grads(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("case", [
    dict(Sq=45, Sk=70, Hq=4, Hkv=2, kw=dict(causal=True)),
    dict(Sq=70, Sk=45, Hq=3, Hkv=1, kw=dict(window_size=(9, 4), alibi=True)),
    dict(Sq=50, Sk=50, Hq=2, Hkv=2, kw=dict(softcap=5.0, dropout_p=0.2, dropout_seed=3, bias=True)),
    dict(Sq=33, Sk=97, Hq=2, Hkv=1, kw=dict(window_size=(20, -1), mask=True)),
], ids=["causal-gqa", "window-alibi-mqa", "softcap-dropout-bias", "left-window-mask"])
def test_feature_combinations_match_the_oracle(case, device):
    (q, k, v), dout = inputs(1, case["Sq"], case["Sk"], case["Hq"], case["Hkv"], 32, device, seed=5)
    kw, ref_kw = dict(case["kw"]), {}
    g = torch.Generator().manual_seed(6)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(case["Hq"], generator=g).to(device)
    if kw.pop("bias", False):
        kw["attn_bias"] = randn(1, case["Hq"], case["Sq"], case["Sk"], dtype=torch.bfloat16, device=device)
    if kw.pop("mask", False):
        kw["attn_mask"] = (torch.rand(case["Sq"], case["Sk"], generator=g) > 0.2).to(device)
    for name in ("window_size", "softcap", "alibi_slopes", "attn_bias", "attn_mask", "dropout_p"):
        if name in kw:
            ref_kw[name] = kw[name]
    if kw.get("causal"):
        ref_kw["window_size"] = (-1, 0)
    if "dropout_p" in kw:
        ref_kw.update(seed=kw["dropout_seed"], offset=0)
    assert_grads_close(grads(q, k, v, dout, **kw), oracle_grads(q, k, v, dout, **ref_kw))


def test_non_contiguous_dout_gives_the_gradients_of_its_contiguous_copy(device):
    (q, k, v), _ = inputs(2, 37, 45, 4, 2, 48, device)
    wide = randn(2, 45, 6, 64, dtype=torch.bfloat16, device=device)
    dout = wide[:, 3:40, 1:5, 8:56].transpose(0, 0)  # a slice of a larger tensor
    assert not dout.is_contiguous()
    strided = grads(q, k, v, dout, causal=True)
    contiguous = grads(q, k, v, dout.contiguous(), causal=True)
    assert all(torch.equal(a, b) for a, b in zip(strided, contiguous))
    assert_grads_close(strided, oracle_grads(q, k, v, dout, window_size=(-1, 0)))


def test_gradient_of_the_returned_lse_is_honoured(device):
    (q, k, v), dout = inputs(1, 30, 50, 2, 1, 32, device, dtype=torch.float32)
    dlse = randn(1, 2, 30, dtype=torch.float32, device=device)

    def loss(lane):
        with poisoned_outputs():
            out, lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, lane=lane)
            return torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))

    ours = loss("triton")
    leaves = [upcast(t).requires_grad_() for t in (q, k, v)]
    out, lse = ref.flash_attn(*leaves, softmax_scale=32 ** -0.5, window_size=(-1, 0))
    expected = torch.autograd.grad((out * upcast(dout)).sum() + (lse * upcast(dlse)).sum(), leaves)
    assert_grads_close(ours, expected)
    assert_grads_close(ours, loss("reference"))


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_a_non_contiguous_gradient_of_the_lse_is_read_by_its_strides(layout, device):
    # Ring attention merges partial outputs with lse.transpose(1, 2); lse.sum() gives a stride-0 grad.
    (q, k, v), _ = inputs(1, 33, 40, 2, 1, 16, device, dtype=torch.float32)
    w = torch.linspace(-1, 1, 66, device=device).reshape(1, 33, 2, 1)

    def loss(lane, leaves):
        out, lse, _ = lanekit.flash_attn_func(*leaves, causal=True, return_attn_probs=True, lane=lane)
        if layout == "transposed":
            return (out * torch.exp(lse.transpose(1, 2).unsqueeze(-1)) * w).sum()
        return out.sum() + lse.sum()

    with poisoned_outputs():
        ours = torch.autograd.grad(loss("triton", (q, k, v)), (q, k, v))
    leaves = [upcast(t).requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(loss("reference", leaves), leaves)
    assert_grads_close(ours, expected)


def test_the_backward_op_passes_torch_library_opcheck_on_transposed_inputs(device):
    # The fake must promise the real kernel's (contiguous) strides, or inductor asserts on them.
    from lanekit.attention.op import _flash_attn_bwd_op

    q, k, v, out, dout = (randn(1, 2, 17, 16, dtype=torch.float16, device=device).transpose(1, 2)
                          for _ in range(5))
    lse = torch.zeros(1, 2, 17, device=device)
    torch.library.opcheck(_flash_attn_bwd_op, (dout, q, k, v, out, lse, None, None, None, None,
                                               0.25, -1, 0, 0.0, 0.0, 0, 0, False))


def test_kvpacked_names_kv_when_its_dtype_differs_from_q():
    with pytest.raises(TypeError, match="kv: expected the dtype of q"):
        lanekit.flash_attn_kvpacked_func(torch.zeros(2, 5, 4, 8, dtype=torch.float16),
                                         torch.zeros(2, 5, 2, 4, 8, dtype=torch.bfloat16))


# (A bias constant along the keys has gradient 0: softmax ignores it. Not a case to measure.)
@pytest.mark.parametrize("bias_shape", [(1, 2, 1, 45), (45,), (3, 1, 37, 45), (1, 2, 37, 45)], ids=str)
def test_bias_gradient_is_summed_over_its_broadcast_dimensions(bias_shape, device):
    (q, k, v), dout = inputs(3, 37, 45, 2, 2, 32, device)
    bias = randn(*bias_shape, dtype=torch.bfloat16, device=device).requires_grad_()
    ours = grads(q, k, v, dout, bias, attn_bias=bias)[3]
    assert ours.shape == bias.shape and ours.dtype == bias.dtype
    leaves = [upcast(t).requires_grad_() for t in (q, k, v, bias)]
    out, _ = ref.flash_attn(*leaves[:3], softmax_scale=32 ** -0.5, attn_bias=leaves[3])
    expected = torch.autograd.grad(out, leaves[3], upcast(dout))[0]
    assert_close(ours, expected, ATTENTION_DBIAS)


def test_dropout_backward_regenerates_the_forward_mask(device):
    (q, k, v), dout = inputs(2, 33, 47, 2, 1, 32, device, dtype=torch.float16)
    kw = dict(dropout_p=0.3, dropout_seed=77, dropout_offset=5)
    ours = grads(q, k, v, dout, **kw)
    expected = oracle_grads(q, k, v, dout, dropout_p=0.3, seed=77, offset=5)
    assert_grads_close(ours, expected)


def test_within_three_times_pytorch_same_precision_error(device):
    # FlashAttention's rule for gradients, checked directly on a long causal GQA case
    (q, k, v), dout = inputs(*((1, 1000, 1500, 4, 2, 64) if ON_GPU else (1, 70, 100, 2, 1, 64)), device)
    ours = grads(q, k, v, dout, causal=True, softcap=20.0)
    kw = dict(softmax_scale=0.125, window_size=(-1, 0), softcap=20.0)
    same = ref.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), **kw)
    exact = ref.flash_attn_backward(*map(upcast, (dout, q, k, v)), **kw)
    for name, a, s, e in zip(("dq", "dk", "dv"), ours, same, exact):
        err, same_err = (a.double() - e).abs().max(), (s.double() - e).abs().max()
        assert err <= 3 * same_err, f"{name}: {err:.3g} > 3 x PyTorch's {same_err:.3g}"


def test_packed_variants_give_the_gradients_of_the_unpacked_call(device):
    g = torch.Generator().manual_seed(3)
    qkv = randn(2, 21, 3, 4, 40, dtype=torch.bfloat16, device=device, generator=g).requires_grad_()
    dout = randn(2, 21, 4, 40, dtype=torch.bfloat16, device=device, generator=g)
    kw = dict(causal=True)
    with poisoned_outputs():
        out = lanekit.flash_attn_qkvpacked_func(qkv, lane="triton", **kw)
        (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    assert dqkv.shape == qkv.shape
    assert all(torch.equal(dqkv[:, :, i], gi) for i, gi in enumerate(grads(q, k, v, dout, **kw)))

    kv = torch.stack((k.detach(), v.detach()), dim=2).requires_grad_()
    with poisoned_outputs():
        out = lanekit.flash_attn_kvpacked_func(q, kv, lane="triton", **kw)
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    expected = grads(q, k, v, dout, **kw)
    assert torch.equal(dq, expected[0])
    assert torch.equal(dkv[:, :, 0], expected[1]) and torch.equal(dkv[:, :, 1], expected[2])


@pytest.mark.parametrize("args, message", [
    (dict(qkv=(2, 5, 2, 4, 8)), "qkv: expected shape \\(B, S, 3, H, D\\)"),
    (dict(qkv=(2, 5, 3, 4)), "qkv: expected 5 dimensions"),
    (dict(kv=(2, 5, 3, 4, 8)), "kv: expected shape \\(B, Sk, 2, Hkv, D\\)"),
])
def test_packed_variants_reject_bad_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        if "qkv" in args:
            lanekit.flash_attn_qkvpacked_func(torch.zeros(args["qkv"], dtype=torch.float16))
        else:
            lanekit.flash_attn_kvpacked_func(torch.zeros(2, 5, 4, 8, dtype=torch.float16),
                                             torch.zeros(args["kv"], dtype=torch.float16))


def test_mask_strides_past_int32_use_int64_offsets_in_the_backward(device):
    # As the forward's test: a mask row stride S with S * BLOCK >= 2^31 (2.1 GB of bools).
    S = 143_165_584
    storage = torch.zeros(15 * S + 8, dtype=torch.bool, device=device)
    mask = storage.as_strided((1, 1, 16, 8), (0, 0, S, 1))
    mask[:] = torch.rand(16, 8, generator=torch.Generator().manual_seed(0)).to(device) > 0.3
    (q, k, v), dout = inputs(1, 16, 8, 1, 1, 16, device, dtype=torch.float16)
    ours = grads(q, k, v, dout, attn_mask=mask)
    assert_grads_close(ours, oracle_grads(q, k, v, dout, attn_mask=mask.clone()))


@pytest.mark.bigmem
@pytest.mark.skipif(not ON_GPU, reason="over 2^31 elements: GPU memory only")
def test_tensors_over_2_to_the_31_elements(device):
    # q, dout and dq each hold 2^31 + 2^23 elements; the gradients of the last rows are checked
    Sq, H, D = 2**17 + 2**13, 128, 128
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, Sq, H, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, 64, H, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, 64, H, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(1, Sq, H, D, device=device, dtype=torch.bfloat16, generator=g)
    dq, dk, dv = grads(q, k, v, dout)
    tail = slice(Sq - 64, Sq)
    part = oracle_grads(q[:, tail], k, v, dout[:, tail])
    assert_close(dq[:, tail], part[0], ATTENTION_BWD)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_works_under_torch_compile_fullgraph(device):
    (q, k, v), dout = inputs(2, 64, 80, 4, 2, 64, device)
    bias = randn(1, 4, 1, 80, dtype=torch.bfloat16, device=device).requires_grad_()

    def step(q, k, v, bias):
        out = lanekit.flash_attn_func(q, k, v, causal=True, attn_bias=bias, softcap=30.0, lane="triton")
        return (out.float() * dout.float()).sum()

    # on the CPU the kernels run interpreted, so the graph runs eagerly (aot_eager); on the GPU,
    # inductor compiles everything around the custom ops
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    with poisoned_outputs():
        ours = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    eager = torch.autograd.grad(step(q, k, v, bias), (q, k, v, bias))
    # the kernels' outputs are bit-identical; the bias's broadcast sum is inductor's own
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], eager[:3]))
    expected = oracle_grads(q, k, v, dout, window_size=(-1, 0), softcap=30.0, attn_bias=bias)
    assert_grads_close(ours[:3], expected[:3])
    assert_close(ours[3], expected[3], ATTENTION_DBIAS)
