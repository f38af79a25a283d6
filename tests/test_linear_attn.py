"""Linear attention (lanekit.linear_attn): the hand-over between the chunked and the step-by-step
forms, gradients through it, bad input, the custom ops.

Every registered sample is also checked on every lane against the float64 oracle by
tests/test_check.py (lanekit.check); here the public functions are checked against the oracle
(lanekit.reference.linear_attn, the prefix recurrence in float64) under the registry's tolerances,
with the outputs poisoned (NaN) so that an unwritten element fails.
"""

import pytest
import torch
import torch.nn.functional as F

import lanekit
import lanekit.linear_attn as la
from lanekit.linear_attn import (chunk_linear_attn, chunk_simple_gla, fused_recurrent_linear_attn,
                                 fused_recurrent_simple_gla)
from lanekit.linear_attn.registry import LINEAR_ATTN_BWD, LINEAR_ATTN_DG, LINEAR_ATTN_FWD, LINEAR_ATTN_STATE
from lanekit.reference import linear_attn as ref
from lanekit.testing import assert_close, poisoned_outputs, randn

ON_GPU = torch.cuda.is_available()


def inputs(device, B=2, T=29, H=2, K=24, V=40, dtype=torch.bfloat16, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (randn(B, T, H, K, dtype=dtype, device=device, generator=g) for _ in range(2))
    v = randn(B, T, H, V, dtype=dtype, device=device, generator=g)
    if positive:
        q, k = (F.elu(t.float()).add(1).to(dtype) for t in (q, k))
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g)).to(device)
    h0 = randn(B, H, K, V, dtype=torch.float32, device=device, generator=g, scale=0.5)
    return q, k, v, gate, h0


def f64(*ts):
    return [t.detach().double() if t is not None else None for t in ts]


def _assert_grads(got, want):
    """dq, dk, dv, dg and dh0 against the float64 oracle's, each with its tolerance, named on failure."""
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, want):
        tol = {"dg": LINEAR_ATTN_DG, "dh0": LINEAR_ATTN_STATE}.get(name, LINEAR_ATTN_BWD)
        try:
            assert_close(a, b, tol)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("decay", [True, False], ids=["simple_gla", "linear_attn"])
def test_prefill_with_chunk_then_decode_with_recurrent_equals_one_run(decay, device):
    # 23 tokens chunked, then 6 tokens step by step from the chunked final state: the outputs and
    # the final state of one run over all 29 (the same state layout (B, H, K, V) both ways)
    q, k, v, g, h0 = inputs(device)
    cut = 23
    with poisoned_outputs():
        if decay:
            o1, s1 = chunk_simple_gla(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], initial_state=h0,
                                      output_final_state=True, lane="triton")
            o2, s2 = fused_recurrent_simple_gla(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], initial_state=s1,
                                                output_final_state=True, lane="triton")
            o_all, s_all = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, lane="triton")
        else:
            o1, s1 = chunk_linear_attn(q[:, :cut], k[:, :cut], v[:, :cut], initial_state=h0,
                                       output_final_state=True, lane="triton")
            o2, s2 = fused_recurrent_linear_attn(q[:, cut:], k[:, cut:], v[:, cut:], initial_state=s1,
                                                 output_final_state=True, lane="triton")
            o_all, s_all = chunk_linear_attn(q, k, v, initial_state=h0, output_final_state=True, lane="triton")
    assert s1.shape == (2, 2, 24, 40) and s1.dtype == torch.float32
    o_ref, s_ref, _ = ref.recurrence(*f64(q, k, v, g if decay else None), None, h0.double())
    o = torch.cat((o1, o2), 1)
    assert_close(o, o_ref, LINEAR_ATTN_FWD)
    assert_close(o_all, o_ref, LINEAR_ATTN_FWD)
    assert_close(s2, s_ref, LINEAR_ATTN_STATE)
    assert_close(s_all, s_ref, LINEAR_ATTN_STATE)
    # and the other way round: decode the first tokens step by step, then chunk the rest
    with poisoned_outputs():
        fn_r, fn_c = ((fused_recurrent_simple_gla, chunk_simple_gla) if decay
                      else (fused_recurrent_linear_attn, chunk_linear_attn))
        extra = (lambda s: (g[:, s],)) if decay else (lambda s: ())
        o3, s3 = fn_r(q[:, :5], k[:, :5], v[:, :5], *extra(slice(0, 5)), initial_state=h0,
                      output_final_state=True, lane="triton")
        o4, s4 = fn_c(q[:, 5:], k[:, 5:], v[:, 5:], *extra(slice(5, None)), initial_state=s3,
                      output_final_state=True, lane="triton")
    assert_close(torch.cat((o3, o4), 1), o_ref, LINEAR_ATTN_FWD)
    assert_close(s4, s_ref, LINEAR_ATTN_STATE)


def test_normalized_prefill_hands_its_state_and_key_sum_to_decode(device):
    q, k, v, _, h0 = inputs(device, positive=True, seed=1)
    z0 = torch.rand(2, 1, 2, 24, generator=torch.Generator().manual_seed(2)).to(device)
    cut = 20
    with poisoned_outputs():
        o1, (s1, z1) = chunk_linear_attn(q[:, :cut], k[:, :cut], v[:, :cut], initial_state=(h0, z0),
                                         output_final_state=True, normalize=True, lane="triton")
        o2, (s2, z2) = fused_recurrent_linear_attn(q[:, cut:], k[:, cut:], v[:, cut:], initial_state=(s1, z1),
                                                   output_final_state=True, normalize=True, lane="triton")
    assert z1.shape == (2, 1, 2, 24) and s1.shape == (2, 2, 24, 40)
    o_ref, s_ref, z_ref = ref.recurrence(*f64(q, k, v), None, None, h0.double(), None, z0.double(), normalize=True)
    assert_close(torch.cat((o1, o2), 1), o_ref, LINEAR_ATTN_FWD)
    assert_close(s2, s_ref, LINEAR_ATTN_STATE)
    assert_close(z2, z_ref, LINEAR_ATTN_STATE)


def test_gradients_flow_through_the_handed_over_state(device):
    # a loss on the decoded outputs and the last state reaches the prefill's q, k, v, g and h0
    # through final_state -> initial_state (dht of the chunked op, d initial_state of the recurrent)
    q, k, v, g, h0 = inputs(device, seed=3)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, h0)]
    q_, k_, v_, g_, h0_ = leaves
    cut = 21
    gen = torch.Generator().manual_seed(4)
    do = randn(2, 29 - cut, 2, 40, dtype=torch.bfloat16, device=device, generator=gen)
    w = randn(2, 2, 24, 40, dtype=torch.float32, device=device, generator=gen)
    with poisoned_outputs():
        _, s1 = chunk_simple_gla(q_[:, :cut], k_[:, :cut], v_[:, :cut], g_[:, :cut], initial_state=h0_,
                                 output_final_state=True, lane="triton")
        o2, s2 = fused_recurrent_simple_gla(q_[:, cut:], k_[:, cut:], v_[:, cut:], g_[:, cut:], initial_state=s1,
                                            output_final_state=True, lane="triton")
        got = torch.autograd.grad((o2.float() * do.float()).sum() + (s2 * w).sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, g, h0)]
    o_ref, s_ref, _ = ref.recurrence(*leaves64[:4], None, leaves64[4])
    want = torch.autograd.grad((o_ref[:, cut:] * do.double()).sum() + (s_ref * w.double()).sum(), leaves64)
    _assert_grads(got, want)



@pytest.mark.parametrize("fn", [chunk_simple_gla, fused_recurrent_simple_gla], ids=["chunk", "recurrent"])
def test_a_decay_of_minus_infinity_or_far_below_resets_the_state_as_the_oracle(fn, device):
    # a g of -inf (a full reset) gave NaN on the chunked kernels (inf - inf of in-chunk cumulative
    # sums), and one of -1e30 wrong outputs for every later token of its chunk; the oracle gives
    # the reset. Both functions' backward is the chunked one.
    q, k, v, g, h0 = inputs(device, seed=5)
    g = g.clone()
    g[0, 3, 0], g[1, 10, 1], g[0, 20, 1] = float("-inf"), -1e30, -100.0
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, h0)]
    gen = torch.Generator().manual_seed(6)
    do = randn(2, 29, 2, 40, dtype=torch.bfloat16, device=device, generator=gen)
    with poisoned_outputs():
        o, s = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, lane="triton")
        got = torch.autograd.grad((o.float() * do.float()).sum() + s.sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, g, h0)]
    o_ref, s_ref, _ = ref.recurrence(*leaves64[:4], None, leaves64[4])
    want = torch.autograd.grad((o_ref * do.double()).sum() + s_ref.sum(), leaves64)
    assert_close(o, o_ref, LINEAR_ATTN_FWD)
    assert_close(s, s_ref, LINEAR_ATTN_STATE)
    with torch.no_grad(), poisoned_outputs():         # the recurrent forward without grad: g as given
        o_ng, s_ng = fn(q, k, v, g, initial_state=h0, output_final_state=True, lane="triton")
    assert_close(o_ng, o_ref, LINEAR_ATTN_FWD)
    assert_close(s_ng, s_ref, LINEAR_ATTN_STATE)
    _assert_grads(got, want)


def test_varlen_equals_each_sequence_alone(device):
    # three sequences of 11, 0 and 18 tokens packed along T: each one's output and final state are
    # those of a batch of one over it alone (the empty one passes its initial state through)
    q, k, v, g, _ = inputs(device, B=1, seed=5)
    h0 = randn(3, 2, 24, 40, dtype=torch.float32, device=device, generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 11, 11, 29], dtype=torch.int64, device=device)
    with poisoned_outputs():
        o, s = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu, lane="triton")
    for n, (a, b) in enumerate(((0, 11), (11, 11), (11, 29))):
        with poisoned_outputs():
            o_n, s_n = fused_recurrent_simple_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=h0[n:n + 1],
                                                  output_final_state=True, lane="triton")
        o_ref, s_ref, _ = ref.recurrence(*f64(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b]), None, h0[n:n + 1].double())
        assert_close(o[:, a:b], o_ref, LINEAR_ATTN_FWD)
        assert_close(o_n, o_ref, LINEAR_ATTN_FWD)
        assert_close(s[n:n + 1], s_ref, LINEAR_ATTN_STATE)
        assert_close(s_n, s_ref, LINEAR_ATTN_STATE)
    assert torch.equal(s[1], h0[1])


def test_no_token_returns_the_initial_state_and_its_gradient(device):
    q, k, v, g, h0 = inputs(device, T=0)
    h0 = h0.requires_grad_()
    w = torch.randn(h0.shape, generator=torch.Generator().manual_seed(1)).to(device)
    with poisoned_outputs():
        o, s = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, lane="triton")
        (dh0,) = torch.autograd.grad((s * w).sum(), [h0])
    assert o.shape == (2, 0, 2, 40) and torch.equal(s, h0.detach())
    assert torch.equal(dh0, w)


def test_default_scale_is_k_to_the_minus_half_and_cpu_runs_the_reference(monkeypatch):
    from lanekit.linear_attn import op

    monkeypatch.delenv("LANEKIT_LANE", raising=False)
    calls, original = [], op.chunk_linear_attn_reference
    monkeypatch.setattr(op, "chunk_linear_attn_reference", lambda **kw: calls.append(kw["scale"]) or original(**kw))
    q, k, v, _, _ = inputs("cpu", T=9, dtype=torch.float32)
    o, s = chunk_linear_attn(q, k, v)
    assert calls == [24 ** -0.5] and s is None
    assert_close(o, ref.recurrence(*f64(q, k, v))[0], LINEAR_ATTN_FWD)


def test_invalid_cu_seqlens_on_the_device_are_clamped_and_reported(device):
    # the Triton launchers do not read cu_seqlens back: values out of order or past T are clamped
    # on the device (no out-of-bounds access) and recorded for lanekit.check_errors()
    from lanekit.linear_attn.kernels import chunk_fwd

    lanekit.check_errors()
    q, k, v, g, _ = inputs(device, B=1, seed=7)
    for bad in ([0, 20, 11, 29], [0, 11, 40], [3, 11, 29]):
        cu = torch.tensor(bad, dtype=torch.int32, device=device)
        with poisoned_outputs():   # every state written, and finite
            o, s = chunk_fwd(q=q, k=k, v=v, g=g, initial_state=None, cu_seqlens=cu, scale=0.2,
                             output_final_state=True, out_dtype=q.dtype)
        assert torch.isfinite(s).all()
        with pytest.raises(ValueError, match="cu_seqlens not non-decreasing from 0 to T"):
            lanekit.check_errors()
    cu = torch.tensor([0, 11, 29], dtype=torch.int32, device=device)
    chunk_fwd(q=q, k=k, v=v, g=g, initial_state=None, cu_seqlens=cu, scale=0.2, output_final_state=False,
              out_dtype=q.dtype)
    lanekit.check_errors()  # valid offsets record nothing


def _bad_call(case, device):
    """(function, args, kwargs) of a call that is wrong in the way ``case`` names."""
    q, k, v, g, h0 = inputs(device, T=9)
    q1, k1, v1, g1, _ = inputs(device, B=1, T=9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    meta = torch.device("meta")
    return {
        "q rank 3": (chunk_simple_gla, (q[0], k[0], v[0], g[0]), {}),
        "q not a tensor": (chunk_linear_attn, (q.tolist(), k, v), {}),
        "q int": (chunk_linear_attn, (q.to(torch.int32), k, v), {}),
        "k shape": (chunk_simple_gla, (q, k[..., :16], v, g), {}),
        "k dtype": (chunk_linear_attn, (q, k.float(), v), {}),
        "v length": (fused_recurrent_linear_attn, (q, k, v[:, :5]), {}),
        "v device": (chunk_linear_attn, (q, k, torch.zeros(2, 9, 2, 40, device=meta, dtype=q.dtype)), {}),
        "K over 256": (chunk_linear_attn, (*(torch.zeros(1, 2, 1, 300, device=device),) * 2,
                                           torch.zeros(1, 2, 1, 8, device=device)), {}),
        "g shape": (chunk_simple_gla, (q, k, v, g[..., None]), {}),
        "g int": (fused_recurrent_simple_gla, (q, k, v, g.to(torch.int64)), {}),
        "scale str": (chunk_simple_gla, (q, k, v, g), {"scale": "0.1"}),
        "scale inf": (chunk_linear_attn, (q, k, v), {"scale": float("inf")}),
        "initial_state shape": (chunk_simple_gla, (q, k, v, g), {"initial_state": h0[:, :, :, :39]}),
        "initial_state batch": (fused_recurrent_simple_gla, (q, k, v, g), {"initial_state": h0[:1]}),
        "output_final_state int": (chunk_linear_attn, (q, k, v), {"output_final_state": 1}),
        "normalize str": (chunk_linear_attn, (q, k, v), {"normalize": "yes"}),
        "pair state without normalize": (chunk_linear_attn, (q, k, v), {"initial_state": (h0, None)}),
        "z shape": (chunk_linear_attn, (q, k, v), {"normalize": True, "initial_state": (h0, h0)}),
        "cu_seqlens with B=2": (chunk_simple_gla, (q, k, v, g), {"cu_seqlens": cu}),
        "cu_seqlens float": (chunk_simple_gla, (q1, k1, v1, g1), {"cu_seqlens": cu.float()}),
        "cu_seqlens 2-D": (chunk_simple_gla, (q1, k1, v1, g1), {"cu_seqlens": cu[None]}),
        "cu_seqlens one entry": (chunk_simple_gla, (q1, k1, v1, g1), {"cu_seqlens": cu[:1]}),
        "cu_seqlens decreasing": (chunk_linear_attn, (q1, k1, v1), {"cu_seqlens": cu[[0, 2, 1]]}),
        "cu_seqlens short of T": (chunk_linear_attn, (q1, k1, v1), {"cu_seqlens": cu[:2]}),
        "initial_state per sequence": (chunk_simple_gla, (q1, k1, v1, g1), {"cu_seqlens": cu, "initial_state": h0[:1]}),
        "unknown lane": (chunk_linear_attn, (q, k, v), {"lane": "cuda"}),
    }[case]


BAD_INPUTS = {
    "q rank 3": (ValueError, r"q: expected 4 dimensions, got shape \(9, 2, 24\)"),
    "q not a tensor": (TypeError, "q: expected a torch.Tensor, got list"),
    "q int": (TypeError, "q: expected dtype in .*, got torch.int32"),
    "k shape": (ValueError, r"k: expected shape \(2, 9, 2, 24\) \(that of q: \(B, T, H, K\)\), got \(2, 9, 2, 16\)"),
    "k dtype": (TypeError, r"k: expected the dtype of q \(torch.bfloat16\), got torch.float32"),
    "v length": (ValueError, r"v: expected shape \(2, 9, 2, V\) \(q's B, T, H\), got \(2, 5, 2, 40\)"),
    "v device": (ValueError, "v: expected the device of q"),
    "K over 256": (ValueError, r"q: expected a key head dim K in \[1, 256\], got 300"),
    "g shape": (ValueError, r"g: expected shape \(2, 9, 2\) \(\(B, T, H\): one log decay per token and head\)"),
    "g int": (TypeError, "g: expected dtype in .*, got torch.int64"),
    "scale str": (TypeError, r"scale: expected a finite float or None \(K \*\* -0.5\), got str"),
    "scale inf": (ValueError, r"scale: expected a finite float or None \(K \*\* -0.5\), got inf"),
    "initial_state shape": (ValueError, r"initial_state: expected shape \(2, 2, 24, 40\) \(\(B, H, K, V\)\), got "
                                        r"\(2, 2, 24, 39\)"),
    "initial_state batch": (ValueError, r"initial_state: expected shape \(2, 2, 24, 40\)"),
    "output_final_state int": (TypeError, "output_final_state: expected a bool, got int"),
    "normalize str": (TypeError, "normalize: expected a bool, got str"),
    "pair state without normalize": (TypeError, r"initial_state: expected a tensor \(N, H, K, V\) or None, got tuple"),
    "z shape": (ValueError, r"initial_state\[1\]: expected shape \(2, 1, 2, 24\) \(\(N, 1, H, K\): the key sum z"),
    "cu_seqlens with B=2": (ValueError, r"q: expected batch size 1 with cu_seqlens"),
    "cu_seqlens float": (TypeError, r"cu_seqlens: expected dtype in \['torch.int32', 'torch.int64'\], got torch.float32"),
    "cu_seqlens 2-D": (ValueError, r"cu_seqlens: expected 1 dimensions, got shape \(1, 3\)"),
    "cu_seqlens one entry": (ValueError, r"cu_seqlens: expected shape \(N \+ 1,\) with N >= 1 sequences, got \(1,\)"),
    "cu_seqlens decreasing": (ValueError, r"cu_seqlens: expected non-decreasing values from 0 to T=9 \(q's length\), "
                                          r"got \[0, 9, 4\]"),
    "cu_seqlens short of T": (ValueError, r"cu_seqlens: expected non-decreasing values from 0 to T=9"),
    "initial_state per sequence": (ValueError, r"initial_state: expected shape \(2, 2, 24, 40\) \(\(N, H, K, V\), one "
                                               r"per sequence of cu_seqlens\), got \(1, 2, 24, 40\)"),
    "unknown lane": (ValueError, "lane: expected one of"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error_and_launches_nothing(case, device, monkeypatch):
    from lanekit.linear_attn import op

    exc, message = BAD_INPUTS[case]
    if case in ("cu_seqlens decreasing", "cu_seqlens short of T"):
        monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # a GPU tensor's values: read back only in the debug mode
    fn, args, kwargs = _bad_call(case, device)
    tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, tuple) else (a,))
               if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    snapshot = [t.clone() for t in tensors]

    def no_launch(**_):
        raise AssertionError("a lane ran on bad input")

    for name in ("chunk_linear_attn", "fused_recurrent_linear_attn", "chunk_simple_gla", "fused_recurrent_simple_gla"):
        for lane in ("triton", "reference"):
            monkeypatch.setattr(op, f"{name}_{lane}", no_launch)
    with pytest.raises(exc, match=message):
        fn(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, snapshot))


def test_the_custom_ops_pass_torch_library_opcheck(device):
    # fakes, schemas and the autograd registration, on strided inputs, with and without decay and states
    from lanekit.linear_attn import op

    q, k, v, g, h0 = inputs(device, B=1, T=18, H=1, K=16, V=16, seed=8)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, T, H, K) with T and H strides swapped
    cu = torch.tensor([0, 7, 18], dtype=torch.int32, device=device)
    h02 = torch.cat((h0, h0 * 2))
    for fwd in (op._chunk_fwd_op, op._recurrent_fwd_op):
        for args in ((q, k, v, g, h0, None, 0.25, True, False), (q, k, v, None, None, None, 0.25, False, True),
                     (q, k, v, g, h02, cu, 0.25, True, False)):
            leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                      for a in args]
            torch.library.opcheck(fwd, tuple(leaves))
    o, s = op._chunk_fwd_op(q, k, v, g, h0, None, 0.25, True, False)
    torch.library.opcheck(op._chunk_bwd_op, (q, k, v, g, h0, None, torch.randn_like(o), torch.randn_like(s), 0.25))


def test_works_under_torch_compile_fullgraph(device):
    # the public functions traced whole (validation, lane choice) around the custom ops. On the CPU
    # the kernels run interpreted, so the graph runs eagerly (aot_eager) at small sizes; on the GPU,
    # inductor compiles everything around the custom ops
    sizes = dict(B=2, T=200, H=4, K=64, V=64) if ON_GPU else dict(B=1, T=21, H=2, K=16, V=16)
    q, k, v, g, h0 = inputs(device, seed=9, **sizes)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, h0)]

    def step(q, k, v, g, h0):
        o, s = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, lane="triton")
        o2, s2 = fused_recurrent_linear_attn(q, k, v, initial_state=s, output_final_state=True, lane="triton")
        return o.float().square().sum() + o2.float().sum() + s2.sum()

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    with poisoned_outputs():
        got = torch.autograd.grad(compiled(*leaves), leaves)
        eager = torch.autograd.grad(step(*leaves), leaves)
    # the kernels are the same; the loss's ops around them are inductor's own
    for a, b, tol in zip(got, eager, (LINEAR_ATTN_BWD,) * 3 + (LINEAR_ATTN_DG, LINEAR_ATTN_STATE)):
        assert_close(a, b.double(), tol)


def test_the_benchmark_checks_its_cases_at_tiny_shapes_on_the_reference_lane(monkeypatch):
    # benchmarks.linear_attn's inputs, check and runners (the fla peer only where fla imports)
    from benchmarks import linear_attn as bench, run

    assert set(run.GROUPS["linear_attn"]) == set(bench.FAMILIES) <= set(run.FAMILIES)
    names = [m.name(c) for m in bench.FAMILIES.values() for c in m.cases(False)]
    assert len(names) == len(set(names)) == 16     # 2 ops x fwd, fwd+bwd x T = 4k, 16k, twice (graphs, eager)
    monkeypatch.setenv("LANEKIT_LANE", "reference")
    c = next(c for c in bench.cases(shapes=bench.TINY) if c["backward"] and c["op"] == "chunk_simple_gla")
    inputs = bench.make_inputs(c, device="cpu")
    assert bench.check(c, *inputs) is None
    assert "lanekit" in bench.runners(c, *inputs)
    # a wrong result is refused: the forward of another decay (g / 2)
    monkeypatch.setattr(bench, "_lanekit", lambda c, q, k, v, g, do: lambda: la.chunk_simple_gla(q, k, v, g / 2)[0])
    assert bench.check(c, *inputs).startswith("dq: ")


@pytest.mark.bigmem
@pytest.mark.skipif(not ON_GPU, reason="over 2^31 elements: GPU memory only")
def test_tensors_over_2_to_the_31_elements(device):
    # 2048 sequences of 1024 tokens packed: q, k, v (1, 2^21, 8, 128) hold 2^31 elements each; the
    # last sequence's last head (offsets past 2^31) against the oracle, forward and backward
    T, H, D, L = 2 ** 21, 8, 128, 1024
    gen = torch.Generator(device=device).manual_seed(10)
    q, k, v = (torch.randn(1, T, H, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen, device=device))
    assert q.numel() >= 2 ** 31
    cu = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    with poisoned_outputs():
        o, s = chunk_simple_gla(q, k, v, g, output_final_state=True, cu_seqlens=cu)
        do = torch.randn(o.shape, generator=gen, device=device, dtype=o.dtype)
        grads = torch.autograd.grad(o, leaves, do)
    last, h = slice(T - L, T), slice(H - 1, H)
    x64 = [t.detach()[:, last, h].double().requires_grad_() for t in (q, k, v, g)]
    o_ref, s_ref, _ = ref.recurrence(*x64)
    assert_close(o[:, last, h], o_ref, LINEAR_ATTN_FWD)
    assert_close(s[-1:, h], s_ref, LINEAR_ATTN_STATE)
    want = torch.autograd.grad(o_ref, x64, do[:, last, h].double())
    for a, b, tol in zip(grads, want, (LINEAR_ATTN_BWD,) * 3 + (LINEAR_ATTN_DG,)):
        assert_close(a[:, last, h], b, tol)
