"""The FlashAttention drop-in: ``lanekit.compat.install()`` and the ``flash_attn`` alias it makes,
FlashAttention 2's varlen packed functions against the oracle, ``bert_padding``'s round trip,
window sizes given as any integer pair, and argument errors catchable as RuntimeError as
FlashAttention's are."""

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import lanekit
import lanekit.compat
from lanekit.attention.registry import ATTENTION_BWD, ATTENTION_FWD
from lanekit.reference import attention as ref
from lanekit.runtime.validate import ArgumentError, ArgumentTypeError
from lanekit.testing import assert_close, poisoned_outputs, randn, upcast

LANES = ["triton", "reference"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def cu(lengths, device):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=device)


@pytest.fixture
def flash_attn():
    """The ``flash_attn`` alias, installed for one test and removed after it."""
    lanekit.compat.install()
    try:
        import flash_attn

        yield flash_attn
    finally:
        lanekit.compat.uninstall()


# ---- install / uninstall and the alias's modules ----

def test_install_makes_flash_attn_and_its_submodules_lanekits_and_uninstall_undoes_it():
    assert not lanekit.compat.installed()
    lanekit.compat.install()
    lanekit.compat.install()   # idempotent
    try:
        import flash_attn
        import flash_attn.layers.rotary as rotary
        from flash_attn import flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache
        from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
        from flash_attn.flash_attn_interface import USE_TRITON_ROCM, _flash_attn_varlen_forward, _get_block_size_n

        import lanekit.compat.flash_attn as ours
        assert flash_attn is ours and flash_attn.__spec__.name == "lanekit.compat.flash_attn"
        assert flash_attn.__version__.startswith("2.")
        assert flash_attn_varlen_qkvpacked_func is lanekit.flash_attn_varlen_qkvpacked_func
        assert flash_attn_varlen_kvpacked_func is lanekit.flash_attn_varlen_kvpacked_func
        assert flash_attn_with_kvcache is lanekit.flash_attn_with_kvcache
        assert rotary.__name__ == "lanekit.compat.flash_attn.layers.rotary"
        assert sys.modules["flash_attn.bert_padding"] is sys.modules["lanekit.compat.flash_attn.bert_padding"]
        assert USE_TRITON_ROCM is False and _get_block_size_n("cpu", 64, False, True) >= 16
        assert callable(index_first_axis) and callable(pad_input) and callable(unpad_input)
        assert callable(_flash_attn_varlen_forward)
        with pytest.raises(ModuleNotFoundError, match="flash_attn.modules"):
            import flash_attn.modules.mha  # noqa: F401 (a module lanekit does not provide)
    finally:
        lanekit.compat.uninstall()
    assert not lanekit.compat.installed()
    assert not [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]
    assert "lanekit.compat.flash_attn" in sys.modules   # lanekit's own names stay


def test_nothing_is_aliased_until_install_is_called():
    code = ("import importlib.util, lanekit, lanekit.compat, lanekit.compat.flash_attn; "
            "print(importlib.util.find_spec('flash_attn') is None or "
            "'lanekit' not in str(importlib.util.find_spec('flash_attn').origin))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def test_install_refuses_when_a_real_flash_attn_is_already_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    with pytest.raises(RuntimeError, match="flash_attn not yet imported"):
        lanekit.compat.install()
    assert not lanekit.compat.installed()


# ---- bert_padding ----

def test_unpad_input_returns_flash_attentions_five_tuple_and_pad_input_inverts_it(flash_attn):
    from flash_attn.bert_padding import pad_input, unpad_input

    g = gen(1)
    hidden = torch.randn(3, 7, 2, 4, generator=g, dtype=torch.float64).requires_grad_()
    lengths = torch.tensor([7, 0, 4])
    mask = torch.arange(7)[None] < lengths[:, None]
    unused = torch.zeros(3, 7, dtype=torch.bool)
    unused[2, 4:6] = True                         # allocated but unused: packed, not counted in seqused
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask, unused)
    assert packed.shape == (13, 2, 4)
    assert indices.tolist() == list(range(7)) + [14, 15, 16, 17, 18, 19]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 7, 7, 13]
    assert max_seqlen == 7 and type(max_seqlen) is int
    assert seqused.dtype == torch.int32 and seqused.tolist() == [7, 0, 4]
    assert torch.equal(packed, hidden.reshape(21, 2, 4)[indices])

    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    assert cu_seqlens.tolist() == [0, 7, 7, 11] and seqused.tolist() == [7, 0, 4]
    back = pad_input(packed, indices, 3, 7)
    assert back.shape == hidden.shape
    assert torch.equal(back, hidden * mask[:, :, None, None])
    (grad,) = torch.autograd.grad(back.sum(), hidden)
    assert torch.equal(grad, mask[:, :, None, None].expand_as(hidden).to(grad.dtype))


def test_bad_padding_arguments_name_themselves(flash_attn):
    from flash_attn.bert_padding import pad_input, unpad_input

    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 5\)"):
        unpad_input(torch.zeros(2, 5, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="indices: expected one per row of values"):
        pad_input(torch.zeros(4, 3), torch.arange(3), 2, 5)


# ---- the varlen packed functions against the oracle ----

@pytest.mark.parametrize("lane", LANES)
def test_varlen_qkvpacked_forward_and_backward_match_the_oracle(device, lane):
    lengths, H, D = [5, 0, 9], 2, 16
    cs = cu(lengths, device)
    qkv = randn(sum(lengths), 3, H, D, dtype=torch.float16, device=device, generator=gen(2)).requires_grad_()
    window = torch.tensor([4, 0])                # as FlashAttention's suite writes it
    with poisoned_outputs():
        out, lse, probs = lanekit.flash_attn_varlen_qkvpacked_func(qkv, cs, max(lengths), causal=True,
                                                                   window_size=window, return_attn_probs=True,
                                                                   lane=lane)
    kw = dict(cu_seqlens=cs.cpu(), max_seqlen=max(lengths), softmax_scale=D ** -0.5, window_size=(4, 0))
    want_out, want_lse = ref.flash_attn_varlen_qkvpacked(upcast(qkv).cpu(), **kw)
    assert out.shape == (14, H, D) and lse.shape == (H, 14) and probs is None
    assert_close(out, want_out, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen(3))
    with poisoned_outputs():
        (dqkv,) = torch.autograd.grad(out, qkv, dout)
    (want,) = ref.flash_attn_varlen_qkvpacked_backward(upcast(dout).cpu(), upcast(qkv).cpu(), **kw)
    assert dqkv.shape == qkv.shape
    assert_close(dqkv, want, ATTENTION_BWD)


@pytest.mark.parametrize("lane", LANES)
def test_varlen_kvpacked_gqa_forward_and_backward_match_the_oracle(device, lane):
    lq, lk, Hq, Hkv, D = [3, 8], [11, 8], 4, 2, 32
    cq, ck = cu(lq, device), cu(lk, device)
    q = randn(sum(lq), Hq, D, dtype=torch.bfloat16, device=device, generator=gen(4)).requires_grad_()
    kv = randn(sum(lk), 2, Hkv, D, dtype=torch.bfloat16, device=device, generator=gen(5)).requires_grad_()
    slopes = torch.rand(Hq, generator=gen(6)).to(device) * 0.5
    with poisoned_outputs():
        out = lanekit.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, max(lq), max(lk), softcap=20.0,
                                                      alibi_slopes=slopes, window_size=(np.int64(5), 2), lane=lane)
    kw = dict(cu_seqlens_q=cq.cpu(), cu_seqlens_k=ck.cpu(), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
              softmax_scale=D ** -0.5, window_size=(5, 2), softcap=20.0,
              alibi_slopes=upcast(slopes).cpu().expand(2, Hq))
    want_out, _ = ref.flash_attn_varlen_kvpacked(upcast(q).cpu(), upcast(kv).cpu(), **kw)
    assert_close(out, want_out, ATTENTION_FWD)
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen(7))
    with poisoned_outputs():
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    want_dq, want_dkv = ref.flash_attn_varlen_kvpacked_backward(upcast(dout).cpu(), upcast(q).cpu(),
                                                                upcast(kv).cpu(), **kw)
    assert dkv.shape == kv.shape
    assert_close(dq, want_dq, ATTENTION_BWD)
    assert_close(dkv, want_dkv, ATTENTION_BWD)


@pytest.mark.parametrize("lane", LANES)
def test_varlen_packed_functions_equal_the_unpacked_call(device, lane):
    lengths = [6, 2]
    cs = cu(lengths, device)
    qkv = randn(8, 3, 2, 16, dtype=torch.float16, device=device, generator=gen(8))
    q, k, v = qkv.unbind(1)
    with poisoned_outputs():
        want = lanekit.flash_attn_varlen_func(q, k, v, cs, cs, 6, 6, causal=True, lane=lane)
        assert torch.equal(lanekit.flash_attn_varlen_qkvpacked_func(qkv, cs, 6, causal=True, lane=lane), want)
        assert torch.equal(lanekit.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cs, cs, 6, 6, causal=True,
                                                                   lane=lane), want)
    oracle, _ = ref.flash_attn_varlen_qkvpacked(upcast(qkv).cpu(), cu_seqlens=cs.cpu(), max_seqlen=6,
                                                softmax_scale=16 ** -0.5, window_size=(-1, 0))
    assert_close(want, oracle, ATTENTION_FWD)


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


CU = torch.tensor([0, 8], dtype=torch.int32)
BAD_PACKED = {
    "qkv not 3 in dim 1": (lambda: lanekit.flash_attn_varlen_qkvpacked_func(_zeros(8, 2, 2, 16), CU, 8),
                           r"qkv: expected shape \(total, 3, H, D\)"),
    # the packed function's own argument names, not those of the unpacked call it makes
    "max_seqlen below a length": (lambda: lanekit.flash_attn_varlen_qkvpacked_func(_zeros(8, 3, 2, 16), CU, 7),
                                  r"^cu_seqlens: expected no sequence longer than its max_seqlen \(7\), got one of 8$"),
    "kv not 2 in dim 1": (lambda: lanekit.flash_attn_varlen_kvpacked_func(_zeros(8, 2, 16), _zeros(8, 3, 2, 16),
                                                                          CU, CU, 8, 8),
                          r"kv: expected shape \(total_k, 2, Hkv, D\)"),
}


@pytest.mark.parametrize("case", list(BAD_PACKED), ids=list(BAD_PACKED))
def test_varlen_packed_functions_reject_bad_shapes_as_value_and_runtime_errors(case):
    call, message = BAD_PACKED[case]
    with pytest.raises(ValueError, match=message):
        call()
    with pytest.raises(RuntimeError, match=message):
        call()


def test_qkvpacked_type_errors_name_its_own_arguments():
    qkv = _zeros(8, 3, 2, 16)
    with pytest.raises(TypeError, match=r"^max_seqlen: expected an int"):
        lanekit.flash_attn_varlen_qkvpacked_func(qkv, CU, 7.5)
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected dtype in \['torch.int32'\], got torch.int64$"):
        lanekit.flash_attn_varlen_qkvpacked_func(qkv, CU.long(), 8)


# ---- window_size as any pair of integers ----

WINDOW_FORMS = {
    "tuple": (3, 0),
    "list": [3, 0],
    "tensor of 2": torch.tensor([3, 0]),
    "int32 tensor of 2": torch.tensor([3, 0], dtype=torch.int32),
    "numpy array of 2": np.array([3, 0]),
    "numpy ints": (np.int64(3), np.int32(0)),
    "0-d tensors": (torch.tensor(3), torch.tensor(0)),
    "1-element tensor and array": (torch.tensor([3]), np.array([0])),
}


@pytest.mark.parametrize("form", list(WINDOW_FORMS), ids=list(WINDOW_FORMS))
def test_every_api_takes_a_window_as_any_pair_of_integers(form):
    window = WINDOW_FORMS[form]
    q = randn(2, 5, 2, 16, dtype=torch.float32, device="cpu", generator=gen(9))
    k = randn(2, 9, 2, 16, dtype=torch.float32, device="cpu", generator=gen(10))
    v = randn(2, 9, 2, 16, dtype=torch.float32, device="cpu", generator=gen(11))
    assert torch.equal(lanekit.flash_attn_func(q, k, v, window_size=window), lanekit.flash_attn_func(q, k, v, window_size=(3, 0)))
    assert not torch.equal(lanekit.flash_attn_func(q, k, v), lanekit.flash_attn_func(q, k, v, window_size=(3, 0)))
    cq, ck = cu([5, 5], "cpu"), cu([9, 9], "cpu")
    packed = [t.flatten(0, 1) for t in (q, k, v)]
    assert torch.equal(lanekit.flash_attn_varlen_func(*packed, cq, ck, 5, 9, window_size=window),
                       lanekit.flash_attn_varlen_func(*packed, cq, ck, 5, 9, window_size=(3, 0)))
    lens = torch.tensor([9, 6], dtype=torch.int32)
    assert torch.equal(lanekit.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, window_size=window),
                       lanekit.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, window_size=(3, 0)))


@pytest.mark.parametrize("window", [(1.5, 0), (3.0, 0), (True, 0), torch.tensor([3.0, 0.0]), np.array([3.0, 0.0]),
                                    (1, 2, 3), torch.tensor([[3, 0]]), 3, None, "30"],
                         ids=["float", "integral float", "bool", "float tensor", "float array", "three", "2-d tensor",
                              "an int", "None", "a str"])
def test_a_window_that_is_not_a_pair_of_integers_is_refused(window):
    q = torch.zeros(1, 3, 2, 16)
    with pytest.raises(TypeError, match=r"window_size: expected a pair of ints \(left, right\)"):
        lanekit.flash_attn_func(q, q, q, window_size=window)
    with pytest.raises(RuntimeError, match="window_size"):
        lanekit.flash_attn_func(q, q, q, window_size=window)


def test_window_values_below_minus_one_are_a_value_error_for_any_form():
    q = torch.zeros(1, 3, 2, 16)
    with pytest.raises(ValueError, match=r"window_size: expected values >= -1 \(-1 is unbounded\), got \(-2, 0\)"):
        lanekit.flash_attn_func(q, q, q, window_size=torch.tensor([-2, 0]))


# ---- argument errors: ValueError / TypeError and RuntimeError ----

def test_argument_error_classes_are_value_and_type_errors_that_are_runtime_errors():
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, RuntimeError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, RuntimeError)
    q = torch.zeros(1, 3, 2, 16)
    with pytest.raises(RuntimeError, match="q: expected dtype"):
        lanekit.flash_attn_func(q.to(torch.int32), q, q)
    with pytest.raises(RuntimeError, match=r"k: expected head dim 16 \(that of q\)"):
        lanekit.flash_attn_func(q, torch.zeros(1, 3, 2, 8), q)
    with pytest.raises(RuntimeError, match="dropout_p"):
        lanekit.flash_attn_func(q, q, q, dropout_p=1.0)


def _bad_calls():
    """One call per public attention function of FlashAttention's API, with softcap=-1: a plain
    ValueError raised in the family's own checks (not in runtime.validate, whose errors are of the
    argument classes already)."""
    q = torch.zeros(1, 3, 2, 16, dtype=torch.float16)
    flat, cu = torch.zeros(3, 2, 16, dtype=torch.float16), torch.tensor([0, 3], dtype=torch.int32)
    bad = {"softcap": -1.0}
    return {
        "flash_attn_func": lambda: lanekit.flash_attn_func(q, q, q, **bad),
        "flash_attn_qkvpacked_func": lambda: lanekit.flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), **bad),
        "flash_attn_kvpacked_func": lambda: lanekit.flash_attn_kvpacked_func(q, torch.stack([q] * 2, 2), **bad),
        "flash_attn_varlen_func": lambda: lanekit.flash_attn_varlen_func(flat, flat, flat, cu, cu, 3, 3, **bad),
        "flash_attn_varlen_qkvpacked_func":
            lambda: lanekit.flash_attn_varlen_qkvpacked_func(torch.stack([flat] * 3, 1), cu, 3, **bad),
        "flash_attn_varlen_kvpacked_func":
            lambda: lanekit.flash_attn_varlen_kvpacked_func(flat, torch.stack([flat] * 2, 1), cu, cu, 3, 3, **bad),
        "flash_attn_with_kvcache": lambda: lanekit.flash_attn_with_kvcache(q, q, q, **bad),
    }


def test_every_public_attention_function_raises_the_argument_error_classes():
    # FlashAttention raises RuntimeError where lanekit raises ValueError/TypeError: every entry point
    # must be wrapped (argument_errors) so that code written against either catches both.
    calls = _bad_calls()
    assert set(calls) == set(lanekit.attention.__all__) - {"flash_mla_with_kvcache", "get_mla_metadata"}
    for name, call in calls.items():
        with pytest.raises(ArgumentError, match="softcap: expected a finite float >= 0, got -1.0") as caught:
            call()
        assert isinstance(caught.value, RuntimeError), name


@pytest.mark.parametrize("append", [False, True], ids=["no append", "append"])
def test_a_block_table_too_narrow_for_cache_seqlens_is_a_runtime_error_naming_block_table(append, monkeypatch):
    # FlashAttention's case (its issue 2709): one page of 16 per sequence, 17 tokens asked for.
    # Index values are checked at the call with LANEKIT_CHECK_INDICES=1 (and, in lanekit's lazy
    # mode, by check_errors(), which raises the same class).
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float16)
    k_cache = torch.zeros(4, 16, 1, 16, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(1, 1, dtype=torch.int32)
    k_new = torch.zeros(1, 1, 1, 16, dtype=torch.float16) if append else None
    lens = torch.tensor([16 if append else 17], dtype=torch.int32)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="block_table"):
        lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=lens, block_table=table)
    with pytest.raises(ValueError, match="block_table"):
        lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=lens, block_table=table)
    assert torch.equal(k_cache, before)
    with poisoned_outputs():
        out = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([16], dtype=torch.int32),
                                              block_table=table)
    assert torch.equal(out, torch.zeros(1, 1, 1, 16, dtype=torch.float16))   # v is all 0


def test_check_errors_raises_an_argument_error():
    from lanekit.runtime import errors

    bit = errors.register("test_compat: a recorded invalid index (nothing was read)")
    errors.error_flag(torch.device("cpu")).fill_(bit)
    with pytest.raises(RuntimeError, match="a recorded invalid index"):
        lanekit.check_errors()
    errors.error_flag(torch.device("cpu")).fill_(bit)
    with pytest.raises(ValueError, match="a recorded invalid index"):
        lanekit.check_errors()
    lanekit.check_errors()   # cleared


def test_the_launch_grid_check_is_a_runtime_error_too():
    from lanekit.attention.kernels.common import MAX_GRID_YZ, _check_grid

    with pytest.raises(RuntimeError, match="grid dimensions 1 and 2"):
        _check_grid(MAX_GRID_YZ + 1, 1)
    with pytest.raises(ValueError, match="grid dimensions 1 and 2"):
        _check_grid(1, MAX_GRID_YZ + 1)


# ---- the rest of the alias: rotary, the private forward entry points ----

@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_emb_rotates_each_sequence_from_its_offset(flash_attn, interleaved):
    from flash_attn.layers.rotary import apply_rotary_emb

    x = randn(2, 3, 2, 8, dtype=torch.float64, device="cpu", generator=gen(12))
    angles = torch.rand(10, 2, generator=gen(13), dtype=torch.float64) * 6
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    got = apply_rotary_emb(x, angles.cos(), angles.sin(), interleaved=interleaved, seqlen_offsets=offsets)
    for b in range(2):
        for s in range(3):
            c, sn = angles[offsets[b] + s].cos(), angles[offsets[b] + s].sin()
            a = x[b, s, :, 0:4:2] if interleaved else x[b, s, :, 0:2]
            bb = x[b, s, :, 1:4:2] if interleaved else x[b, s, :, 2:4]
            want_a, want_b = a * c - bb * sn, bb * c + a * sn
            got_a = got[b, s, :, 0:4:2] if interleaved else got[b, s, :, 0:2]
            got_b = got[b, s, :, 1:4:2] if interleaved else got[b, s, :, 2:4]
            torch.testing.assert_close(got_a, want_a, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got_b, want_b, rtol=1e-12, atol=1e-12)
            assert torch.equal(got[b, s, :, 4:], x[b, s, :, 4:])


def test_private_varlen_forward_takes_seqused_k_and_refuses_split_keys(flash_attn):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    lq, lk, used = [2, 3], [9, 6], [5, 6]
    q = randn(5, 2, 16, dtype=torch.float32, device="cpu", generator=gen(14))
    k = randn(15, 2, 16, dtype=torch.float32, device="cpu", generator=gen(15))
    v = randn(15, 2, 16, dtype=torch.float32, device="cpu", generator=gen(16))
    cq, ck = cu(lq, "cpu"), cu(lk, "cpu")
    out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
        q, k, v, cq, ck, 3, 9, 0.0, 0.25, True, seqused_k=torch.tensor(used, dtype=torch.int32))
    rows = torch.cat([torch.arange(0, 5), torch.arange(9, 15)])
    want, want_lse, _ = lanekit.flash_attn_varlen_func(q, k[rows], v[rows], cq, cu(used, "cpu"), 3, 6, 0.0, 0.25,
                                                       True, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(q, k, v, cq, ck, 3, 9, 0.0, 0.25, True, num_splits=2)


@pytest.mark.parametrize("lane", LANES)
def test_private_forward_and_backward_entry_points_give_the_public_functions_gradients(flash_attn, device, lane,
                                                                                       monkeypatch):
    # as ring-attention libraries call them: forward, keep out, lse and rng_state, then backward
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    monkeypatch.setenv("LANEKIT_LANE", lane)
    q = randn(1, 9, 4, 16, dtype=torch.float16, device=device, generator=gen(17))
    k = randn(1, 13, 2, 16, dtype=torch.float16, device=device, generator=gen(18))
    v = randn(1, 13, 2, 16, dtype=torch.float16, device=device, generator=gen(19))
    dout = randn(1, 9, 4, 16, dtype=torch.float16, device=device, generator=gen(20))
    nan = float("nan")   # the caller's buffers poisoned: an element the entry point does not write fails
    with poisoned_outputs():
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.25, 0.3, True, 6, -1, 0.0, None, False)
        dq, dk, dv = torch.full_like(q, nan), torch.full_like(k, nan), torch.full_like(v, nan)
        softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.25, 0.3, True, 6, -1, 0.0, None,
                                         False, rng_state)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse, _ = lanekit.flash_attn_func(*leaves, 0.25, 0.3, True, (6, -1), return_attn_probs=True,
                                                dropout_seed=int(rng_state[0]))
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach())
    for got, expected in zip((dq, dk, dv), torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(got, expected)
    assert softmax_d.shape == (1, 4, 9)
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2))


@pytest.mark.parametrize("lane", LANES)
def test_private_varlen_backward_gives_the_public_functions_gradients(flash_attn, device, lane, monkeypatch):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    monkeypatch.setenv("LANEKIT_LANE", lane)
    lq, lk = [4, 0, 7], [5, 3, 7]
    cq, ck = cu(lq, device), cu(lk, device)
    q = randn(11, 2, 16, dtype=torch.bfloat16, device=device, generator=gen(21))
    k = randn(15, 1, 16, dtype=torch.bfloat16, device=device, generator=gen(22))
    v = randn(15, 1, 16, dtype=torch.bfloat16, device=device, generator=gen(23))
    dout = randn(11, 2, 16, dtype=torch.bfloat16, device=device, generator=gen(24))
    nan = float("nan")   # the caller's buffers poisoned: an element the entry point does not write fails
    with poisoned_outputs():
        out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, cq, ck, 7, 7, 0.0, 0.25, True)
        dq, dk, dv = (torch.full_like(t, nan) for t in (q, k, v))
        _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cq, ck, 7, 7, 0.0, 0.25, True,
                                    rng_state=rng_state)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = lanekit.flash_attn_varlen_func(*leaves, cq, ck, 7, 7, 0.0, 0.25, True)
    assert torch.equal(out, want.detach())
    for got, expected in zip((dq, dk, dv), torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="rng_state: expected"):
        _flash_attn_varlen_backward(dout, q, k, v, out, lse, None, None, None, cq, ck, 7, 7, 0.1, 0.25, True)


# ---- scripts/run_fa_suite.py: the selection and the counts (FlashAttention's suite itself needs a GPU) ----

FAKE_SUITE = '''
import pytest
import torch
from flash_attn import flash_attn_func, flash_attn_varlen_qkvpacked_func
from flash_attn.bert_padding import pad_input, unpad_input


@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("d", [16, 32, 48])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_output(causal, d, dropout_p):
    q = torch.randn(1, 5, 2, d)
    out = flash_attn_func(q, q, q, dropout_p, causal=causal, window_size=torch.tensor([2, 0]))
    assert out.shape == q.shape


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fails_on_two(n):
    assert n != 2


@pytest.mark.parametrize("n", [1, 2])
def test_skips(n):
    pytest.skip("as FlashAttention skips some cases")


def test_flash_attn_generator_arg_must_be_none():
    from flash_attn.flash_attn_interface import flash_attn_gpu  # noqa: F401 (the CUDA extension)
'''


def test_run_fa_suite_deselects_samples_and_counts(tmp_path):
    # 12 cases of test_flash_attn_output (6 with dropout: deselected), 3 of which one fails, 2 that
    # skip, and the CUDA extension's test (deselected)
    suite = tmp_path / "test_flash_attn.py"
    suite.write_text(FAKE_SUITE)
    script = [sys.executable, "scripts/run_fa_suite.py", "--tests", str(suite), "--json", str(tmp_path / "r.json")]
    root = str(Path(__file__).resolve().parents[1])
    full = subprocess.run(script, capture_output=True, text=True, cwd=root)
    assert full.returncode == 1, full.stdout + full.stderr
    assert "fa suite: 8 passed, 1 failed, 2 skipped, 7 deselected (of 18 collected)" in full.stdout, full.stdout
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["failed_ids"] == ["test_flash_attn.py::test_fails_on_two[2]"]
    assert sum(record["deselected"].values()) == 7

    sampled = subprocess.run(script + ["--sample", "2", "--seed", "1"], capture_output=True, text=True, cwd=root)
    counts = json.loads((tmp_path / "r.json").read_text())
    assert counts["passed"] + counts["failed"] + counts["skipped"] == 2 + 2 + 2, sampled.stdout
    assert counts["deselected"]["not sampled (--sample 2)"] == (6 - 2) + (3 - 2)


def _rotated(x, cos, sin, interleaved):
    """x (..., D) rotated by cos, sin (..., rotary_dim / 2), the rest of x unchanged (float64)."""
    r = 2 * cos.shape[-1]
    a, b = (x[..., 0:r:2], x[..., 1:r:2]) if interleaved else (x[..., : r // 2], x[..., r // 2: r])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    rot = torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return torch.cat((rot, x[..., r:]), -1)


@pytest.mark.parametrize("layout", ["qkv", "gqa", "q and kv"])
@pytest.mark.parametrize("xpos", [False, True], ids=["rope", "xpos"])
def test_rotary_embedding_module_rotates_q_and_k_in_place(flash_attn, layout, xpos):
    from flash_attn.layers.rotary import RotaryEmbedding

    B, S, H, D, dim, offset = 2, 5, 2, 8, 6, 3
    module = RotaryEmbedding(dim, base=100.0, interleaved=layout == "gqa", scale_base=16 if xpos else None)
    x = randn(B, S, 3, H, D, dtype=torch.float64, device="cpu", generator=gen(25))
    positions = torch.arange(offset, offset + S, dtype=torch.float64)
    angles = positions[:, None] * 100.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]           # (S, 1, dim / 2)
    scale = torch.ones(1)
    if xpos:
        length = S + offset
        power = (positions - length // 2) / 16
        scale = (((torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)) ** power[:, None])[:, None]
    want_q = _rotated(x[:, :, 0], cos * scale, sin * scale, layout == "gqa")
    want_k = _rotated(x[:, :, 1], cos / scale, sin / scale, layout == "gqa")
    if layout == "qkv":
        got = module(x.clone(), seqlen_offset=offset)
        got_q, got_k, got_v = got.unbind(2)
    elif layout == "gqa":
        got = module(x.clone().flatten(2, 3), seqlen_offset=offset, num_heads_q=H)
        got_q, got_k, got_v = got[:, :, :H], got[:, :, H:2 * H], got[:, :, 2 * H:]
    else:
        got_q, kv = module(x[:, :, 0].clone(), x[:, :, 1:].clone(), seqlen_offset=offset)
        got_k, got_v = kv.unbind(2)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)   # tables in fp32, as FlashAttention's
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_v, x[:, :, 2])
