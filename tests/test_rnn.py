"""RNN cells against torch.nn.LSTMCell, GRUCell and RNNCell themselves, with the same weights.

Every registered sample is also checked on every lane against the float64 oracle by
tests/test_check.py (lanekit.check). Here each cell's output and every gradient (input, state,
weights, biases) is compared with a float64 copy of the PyTorch module under the project's
tolerance rule, with the outputs poisoned (NaN) so that an unwritten element fails.
"""

import copy

import pytest
import torch

from lanekit.reference import rnn as ref
from lanekit.rnn import gru_cell, lstm_cell, rnn_cell
from lanekit.rnn.registry import RNN_BWD, RNN_FWD
from lanekit.testing import assert_close, poisoned_outputs, randn

ON_GPU = torch.cuda.is_available()
IN, H = 13, 27

# name: (module class, lanekit function, extra arguments of both)
CELLS = {
    "lstm": (torch.nn.LSTMCell, lstm_cell, {}),
    "gru": (torch.nn.GRUCell, gru_cell, {}),
    "rnn_tanh": (torch.nn.RNNCell, rnn_cell, {"nonlinearity": "tanh"}),
    "rnn_relu": (torch.nn.RNNCell, rnn_cell, {"nonlinearity": "relu"}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def modules(cell, device, dtype, In=IN, H=H, bias=True, seed=0):
    """The module in ``dtype`` with weights drawn as PyTorch initializes them, and its float64
    copy holding the same (rounded) weights."""
    module_class, _, kw = CELLS[cell]
    module = module_class(In, H, bias=bias, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * H ** -0.5)
    module = module.to(device=device, dtype=dtype)
    return module, copy.deepcopy(module).double()


def inputs(cell, device, dtype, B, In=IN, H=H, seed=1, state=True):
    """input (B, In) and the state (h, or (h, c) for the LSTM) as leaves that require grad; B None
    for an unbatched sample."""
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = randn(*lead, In, dtype=dtype, device=device, generator=g).requires_grad_()
    if not state:
        return x, None
    states = [randn(*lead, H, dtype=dtype, device=device, generator=g).requires_grad_()
              for _ in range(2 if cell == "lstm" else 1)]
    return x, tuple(states) if cell == "lstm" else states[0]


def state_leaves(hx):
    return [] if hx is None else (list(hx) if isinstance(hx, tuple) else [hx])


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def ours(cell, module, x, hx, **kw):
    """The Triton lane on the module's own parameters, with every output it allocates poisoned."""
    fn, extra = CELLS[cell][1], CELLS[cell][2]
    with poisoned_outputs():
        return as_tuple(fn(x, hx, module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh,
                           lane="triton", **extra, **kw))


def grads_of(outputs, leaves, grad_outputs):
    with poisoned_outputs():
        return torch.autograd.grad(outputs, leaves, grad_outputs)


def float64_run(module64, x, hx):
    """The float64 module on float64 copies of x and hx: (outputs, leaves [x, *state])."""
    x64 = x.detach().double().requires_grad_()
    state = [t.detach().double().requires_grad_() for t in state_leaves(hx)]
    hx64 = None if hx is None else (tuple(state) if isinstance(hx, tuple) else state[0])
    return as_tuple(module64(x64, hx64)), [x64, *state]


def check_against_module(cell, module, module64, x, hx, seed=2):
    """Forward and every gradient of the Triton lane against the float64 module."""
    out = ours(cell, module, x, hx)
    expected, leaves64 = float64_run(module64, x, hx)
    for o, e in zip(out, expected):
        assert o.shape == e.shape and o.dtype == x.dtype
        assert_close(o, e, RNN_FWD)
    g = torch.Generator().manual_seed(seed)
    douts = [randn(*o.shape, dtype=o.dtype, device=o.device, generator=g) for o in out]
    params = list(module.parameters())
    got = grads_of(out, [x, *state_leaves(hx), *params], douts)
    want = torch.autograd.grad(expected, [*leaves64, *module64.parameters()], [d.double() for d in douts])
    names = ["input", *[f"hx{i}" for i in range(len(state_leaves(hx)))],
             *[n for n, _ in module.named_parameters()]]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        try:
            assert_close(a, b, RNN_BWD)
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None
    return out, got


CASES = [(cell, dtype, b, bias) for cell in CELLS for dtype in DTYPES for b, bias in ((17, True), (1, False))]


@pytest.mark.parametrize("cell, dtype, B, bias", CASES,
                         ids=[f"{c}-{d}-B{b}{'' if bias else '-nobias'}" for c, d, b, bias in CASES])
def test_forward_and_every_gradient_match_the_module(cell, dtype, B, bias, device):
    module, module64 = modules(cell, device, DTYPES[dtype], bias=bias)
    x, hx = inputs(cell, device, DTYPES[dtype], B)
    check_against_module(cell, module, module64, x, hx)


@pytest.mark.parametrize("cell", list(CELLS))
def test_no_state_is_the_modules_zero_state(cell, device):
    module, module64 = modules(cell, device, torch.bfloat16, In=40, H=70, seed=3)
    x, _ = inputs(cell, device, torch.bfloat16, 17, In=40, H=70, state=False)
    _, grads = check_against_module(cell, module, module64, x, None)
    d_w_hh = grads[2]  # input, weight_ih, weight_hh, ...
    assert d_w_hh.shape == module.weight_hh.shape
    assert torch.equal(d_w_hh, torch.zeros_like(d_w_hh))  # h = 0: zeros, as the module's


@pytest.mark.parametrize("cell", list(CELLS))
def test_unbatched_input_gives_unbatched_outputs(cell, device):
    module, module64 = modules(cell, device, torch.float16, seed=4)
    x, hx = inputs(cell, device, torch.float16, None)
    out, _ = check_against_module(cell, module, module64, x, hx)
    assert all(o.shape == (H,) for o in out)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_relu"])
def test_strided_views_give_the_results_of_contiguous_copies(cell, device):
    _, fn, extra = CELLS[cell]
    G = {"lstm": 4, "gru": 3}.get(cell, 1)
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    x = randn(IN, 17, dtype=dtype, device=device, generator=g).t()                 # transposed
    states = [randn(17, 2 * H, dtype=dtype, device=device, generator=g)[:, 1::2]   # every other column
              for _ in range(2 if cell == "lstm" else 1)]
    w_ih = randn(IN, G * H, dtype=dtype, device=device, generator=g, scale=H ** -0.5).t()
    w_hh = randn(H, G * H, dtype=dtype, device=device, generator=g, scale=H ** -0.5).t()
    b_ih = randn(2 * G * H, dtype=dtype, device=device, generator=g, scale=0.2)[::2]
    b_hh = randn(G * H, 3, dtype=dtype, device=device, generator=g, scale=0.2)[:, 0]
    strided = [x, *states, w_ih, w_hh, b_ih, b_hh]
    assert not any(t.is_contiguous() for t in strided)
    dense = [t.contiguous() for t in strided]

    def run(ts):
        leaves = [t.detach().requires_grad_() for t in ts]
        hx = tuple(leaves[1:3]) if cell == "lstm" else leaves[1]
        k = 3 if cell == "lstm" else 2
        with poisoned_outputs():
            out = as_tuple(fn(leaves[0], hx, *leaves[k:], lane="triton", **extra))
        return out, leaves

    out_s, leaves_s = run(strided)
    out_d, _ = run(dense)
    assert all(torch.equal(a, b) for a, b in zip(out_s, out_d))  # the same tiles, read by strides
    douts = [randn(*o.shape, dtype=dtype, device=device, generator=g) for o in out_s]
    got = grads_of(out_s, leaves_s, douts)
    leaves64 = [t.detach().double().requires_grad_() for t in strided]
    forward = {"lstm": ref.lstm_cell, "gru": ref.gru_cell}.get(cell)
    if forward is None:
        expected = as_tuple(ref.rnn_cell(leaves64[0], leaves64[1], *leaves64[2:], nonlinearity="relu"))
    else:
        expected = as_tuple(forward(*leaves64))
    for o, e in zip(out_s, expected):
        assert_close(o, e, RNN_FWD)
    for a, b in zip(got, torch.autograd.grad(expected, leaves64, [d.double() for d in douts])):
        assert_close(a, b, RNN_BWD)


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_loss_on_h_alone_and_stride_zero_output_gradients(cell, device):
    # (h' * w).sum() leaves c' unused (its gradient is zeros) and h'.sum() hands the backward an
    # expanded, stride-0 gradient
    module, module64 = modules(cell, device, torch.float32, seed=6)
    x, hx = inputs(cell, device, torch.float32, 17)
    params = list(module.parameters())
    leaves = [x, *state_leaves(hx), *params]
    h_next = ours(cell, module, x, hx)[0]
    expected, leaves64 = float64_run(module64, x, hx)
    w = torch.linspace(-1, 1, H, device=device)
    for loss, loss64 in ((h_next.sum(), expected[0].sum()),
                         ((h_next * w).sum(), (expected[0] * w.double()).sum())):
        with poisoned_outputs():
            got = torch.autograd.grad(loss, leaves, retain_graph=True)
        want = torch.autograd.grad(loss64, [*leaves64, *module64.parameters()], retain_graph=True)
        for a, b in zip(got, want):
            assert_close(a, b, RNN_BWD)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_five_steps_unrolled_backpropagate_through_the_state(cell, device):
    module, module64 = modules(cell, device, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    xs = randn(5, 17, IN, dtype=torch.float32, device=device, generator=g).requires_grad_()
    fn, extra = CELLS[cell][1], CELLS[cell][2]
    params = list(module.parameters())

    def unroll(step, xs):
        hx = None
        for t in range(xs.shape[0]):
            hx = step(xs[t], hx)
        return hx[0] if isinstance(hx, tuple) else hx

    with poisoned_outputs():
        h = unroll(lambda x, hx: fn(x, hx, *params, lane="triton", **extra), xs)
        got = torch.autograd.grad(h.square().sum(), [xs, *params])
    xs64 = xs.detach().double().requires_grad_()
    h64 = unroll(module64, xs64)
    want = torch.autograd.grad(h64.square().sum(), [xs64, *module64.parameters()])
    assert_close(h, h64, RNN_FWD)
    for a, b in zip(got, want):
        assert_close(a, b, RNN_BWD)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # sigmoid(-100) = 1 / (1 + inf) = 0
def test_lstm_gate_order_is_i_f_g_o(device):
    # zero weights; biases: input gate shut, forget gate open, output gate open: c' = c, h' = tanh(c)
    w_ih, w_hh = torch.zeros(4 * H, IN, device=device), torch.zeros(4 * H, H, device=device)
    bias = torch.cat([torch.full((H,), v) for v in (-100.0, 100.0, 3.0, 100.0)]).to(device)
    x, (h, c) = inputs("lstm", device, torch.float32, 17)
    with poisoned_outputs():
        h_next, c_next = lstm_cell(x, (h, c), w_ih, w_hh, bias, None, lane="triton")
    assert torch.equal(c_next, c)
    assert_close(h_next, torch.tanh(c.double()), RNN_FWD)


def test_gru_reset_gate_scales_the_hidden_product_after_its_bias(device):
    # PyTorch (and cuDNN): n = tanh(gi_n + r * (W_hn h + b_hn)); the original paper's variant
    # r * (W_hn h) + b_hn differs wherever b_hn is not zero
    module, module64 = modules("gru", device, torch.float32, seed=9)
    with torch.no_grad():
        module.bias_hh[2 * H:] = 1.5
        module64.bias_hh[2 * H:] = 1.5
    x, h = inputs("gru", device, torch.float32, 17)
    out = ours("gru", module, x, h)[0]
    assert_close(out, module64(x.double(), h.double()), RNN_FWD)
    gi = (x @ module.weight_ih.t() + module.bias_ih).double().chunk(3, 1)
    gh_w = (h @ module.weight_hh.t()).double().chunk(3, 1)
    b_r, b_z, b_n = module.bias_hh.double().chunk(3)
    r, z = torch.sigmoid(gi[0] + gh_w[0] + b_r), torch.sigmoid(gi[1] + gh_w[1] + b_z)
    paper = (1 - z) * torch.tanh(gi[2] + r * gh_w[2] + b_n) + z * h.double()
    assert (out.double() - paper).abs().max() > 1e-2


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_batch_zero_gives_empty_outputs_and_zero_weight_gradients(cell, device):
    module, module64 = modules(cell, device, torch.bfloat16, seed=10)
    x, hx = inputs(cell, device, torch.bfloat16, 0)
    out, grads = check_against_module(cell, module, module64, x, hx)
    assert all(o.shape == (0, H) for o in out)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_inference_writes_no_saved_activations(cell, device, monkeypatch):
    from lanekit.rnn import kernels

    # the launcher (eager calls reach it without the custom op: runtime.custom_ops.call)
    name = {"lstm": "lstm_cell_fwd", "gru": "gru_cell_fwd", "rnn_tanh": "rnn_cell_fwd"}[cell]
    original, saved_sizes = getattr(kernels, name), []

    def spy(**kwargs):
        out = original(**kwargs)
        saved_sizes.append(out[-1].numel())
        return out

    monkeypatch.setattr(kernels, name, spy)
    module, _ = modules(cell, device, torch.float16, seed=11)
    x, hx = inputs(cell, device, torch.float16, 17)
    with torch.no_grad():
        inference = ours(cell, module, x, hx)
    training = ours(cell, module, x, hx)
    assert saved_sizes[0] == 0 and saved_sizes[1] > 0
    assert all(torch.equal(a, b) for a, b in zip(inference, training))


def test_float64_runs_on_the_reference_lane_and_matches_the_module(device):
    module, module64 = modules("lstm", device, torch.float64)
    x, hx = inputs("lstm", device, torch.float64, 17)
    with pytest.raises(TypeError, match="float64 runs on the reference lane only"):
        lstm_cell(x, hx, *module.parameters(), lane="triton")
    h_next, c_next = lstm_cell(x, hx, *module.parameters(), lane="reference")
    expected = module64(x, hx)
    assert h_next.dtype == torch.float64
    torch.testing.assert_close(h_next, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_next, expected[1], rtol=1e-12, atol=1e-12)


def test_cpu_tensors_default_to_the_reference_lane(monkeypatch):
    from lanekit.rnn import op

    monkeypatch.delenv("LANEKIT_LANE", raising=False)
    calls, original = [], op.gru_cell_reference
    monkeypatch.setattr(op, "gru_cell_reference", lambda **kw: calls.append(1) or original(**kw))
    module, _ = modules("gru", "cpu", torch.float32)
    x, h = inputs("gru", "cpu", torch.float32, 3)
    out = gru_cell(x, h, *module.parameters())
    assert calls == [1]
    assert_close(out, module.double()(x.double(), h.double()), RNN_FWD)


def _bad_call(case, device):
    """(function, args, kwargs) of a call that is wrong in the way ``case`` names."""
    f32, bf16 = torch.float32, torch.bfloat16
    x = torch.randn(17, IN, device=device, dtype=bf16)
    h, c = (torch.randn(17, H, device=device, dtype=bf16) for _ in range(2))
    w_ih, w_hh = torch.randn(4 * H, IN, device=device, dtype=bf16), torch.randn(4 * H, H, device=device, dtype=bf16)
    b = torch.randn(4 * H, device=device, dtype=bf16)
    lstm = [x, (h, c), w_ih, w_hh, b, b]
    gru = [x, h, w_ih[:3 * H], w_hh[:3 * H], b[:3 * H], b[:3 * H]]
    rnn = [x, h, w_ih[:H], w_hh[:H], b[:H], b[:H]]
    meta = torch.device("meta")

    def replace(args, i, value):
        return args[:i] + [value] + args[i + 1:]

    return {
        "input rank 3": (lstm_cell, replace(lstm, 0, x[None]), {}),
        "input not a tensor": (lstm_cell, replace(lstm, 0, x.tolist()), {}),
        "input int": (gru_cell, replace(gru, 0, x.to(torch.int32)), {}),
        "w_ih In differs": (lstm_cell, replace(lstm, 2, w_ih[:, :12]), {}),
        "w_ih 1-D": (rnn_cell, replace(rnn, 2, w_ih[0]), {}),
        "w_hh 3H rows for LSTM": (lstm_cell, replace(lstm, 3, w_hh[:3 * H]), {}),
        "w_hh dtype": (gru_cell, replace(gru, 3, gru[3].to(f32)), {}),
        "b_ih shape": (lstm_cell, replace(lstm, 4, b[:H]), {}),
        "b_hh device": (rnn_cell, replace(rnn, 5, torch.zeros(H, device=meta, dtype=bf16)), {}),
        "hx[0] batch": (lstm_cell, replace(lstm, 1, (h[:16], c)), {}),
        "hx[1] dtype": (lstm_cell, replace(lstm, 1, (h, c.to(f32))), {}),
        "hx a tensor for LSTM": (lstm_cell, replace(lstm, 1, h), {}),
        "hx triple for LSTM": (lstm_cell, replace(lstm, 1, (h, c, c)), {}),
        "hx 1-D for batched input": (gru_cell, replace(gru, 1, h[0]), {}),
        "hx 2-D for unbatched input": (rnn_cell, replace(replace(rnn, 0, x[0]), 1, h), {}),
        "hx device": (gru_cell, replace(gru, 1, torch.zeros(17, H, device=meta, dtype=bf16)), {}),
        "nonlinearity gelu": (rnn_cell, rnn, {"nonlinearity": "gelu"}),
        "unknown lane": (gru_cell, gru, {"lane": "cuda"}),
    }[case]


BAD_INPUTS = {
    "input rank 3": (ValueError,
                     r"input: expected 2 dimensions \(B, In\), or 1 \(In,\) unbatched, got shape \(1, 17, 13\)"),
    "input not a tensor": (TypeError, "input: expected a torch.Tensor, got list"),
    "input int": (TypeError, "input: expected dtype in .*, got torch.int32"),
    "w_ih In differs": (ValueError, (r"w_ih: expected shape \(108, 13\): \(4\*H, In\) with H=27 from w_hh and "
                                     r"In=13 from input, got \(108, 12\)")),
    "w_ih 1-D": (ValueError, r"w_ih: expected 2 dimensions"),
    "w_hh 3H rows for LSTM": (ValueError, (r"w_hh: expected shape \(4\*H, H\) \(4\*H, ...\), the gates i, f, g, o "
                                           r"stacked along the rows, got \(81, 27\)")),
    "w_hh dtype": (TypeError, r"w_hh: expected the dtype of input \(torch.bfloat16\), got torch.float32"),
    "b_ih shape": (ValueError, r"b_ih: expected shape \(108,\)"),
    "b_hh device": (ValueError, "b_hh: expected the device of input"),
    "hx[0] batch": (ValueError, (r"hx\[0\]: expected shape \(17, 27\): \(B, H\) with B=17 from input and H=27 "
                                 r"from w_hh, got \(16, 27\)")),
    "hx[1] dtype": (TypeError, r"hx\[1\]: expected the dtype of input"),
    "hx a tensor for LSTM": (TypeError, r"hx: expected None or a pair \(h, c\) of tensors, got Tensor"),
    "hx triple for LSTM": (TypeError, r"hx: expected None or a pair \(h, c\) of tensors, got tuple of length 3"),
    "hx 1-D for batched input": (ValueError, r"hx: expected shape \(17, 27\)"),
    "hx 2-D for unbatched input": (ValueError,
                                   r"hx: expected shape \(27,\): \(H,\) with H=27 from w_hh, as input is unbatched"),
    "hx device": (ValueError, "hx: expected the device of input"),
    "nonlinearity gelu": (ValueError, r"nonlinearity: expected one of \('tanh', 'relu'\), got 'gelu'"),
    "unknown lane": (ValueError, "lane: expected one of"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error_and_launches_nothing(case, device, monkeypatch):
    from lanekit.rnn import op

    exc, message = BAD_INPUTS[case]
    fn, args, kwargs = _bad_call(case, device)
    tensors = [t for a in args for t in (a if isinstance(a, tuple) else (a,))
               if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    snapshot = [t.clone() for t in tensors]

    def no_launch(**_):
        raise AssertionError("a lane ran on bad input")

    for name in ("lstm_cell", "gru_cell", "rnn_cell"):
        for lane in ("triton", "reference"):
            monkeypatch.setattr(op, f"{name}_{lane}", no_launch)
    with pytest.raises(exc, match=message):
        fn(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(tensors, snapshot))


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_relu"])
def test_the_custom_ops_pass_torch_library_opcheck(cell, device):
    # fakes, schemas and the autograd registration, on strided inputs
    from lanekit.rnn import op

    G = {"lstm": 4, "gru": 3}.get(cell, 1)
    g = torch.Generator().manual_seed(12)
    x = randn(5, 3, dtype=torch.float16, device=device, generator=g).t().requires_grad_()
    h, c = (randn(3, 6, dtype=torch.float16, device=device, generator=g).requires_grad_() for _ in range(2))
    w_ih = randn(G * 6, 5, dtype=torch.float16, device=device, generator=g).requires_grad_()
    w_hh = randn(G * 6, 6, dtype=torch.float16, device=device, generator=g).requires_grad_()
    b = randn(G * 6, dtype=torch.float16, device=device, generator=g).requires_grad_()
    if cell == "lstm":
        torch.library.opcheck(op._lstm_cell_fwd_op, (x, h, c, w_ih, w_hh, b, None, True))
        saved = op._lstm_cell_fwd_op(x, h, c, w_ih, w_hh, b, None, True)[2].detach()
        torch.library.opcheck(op._lstm_cell_bwd_op, (h.detach(), None, c.detach(), saved, torch.float16))
    elif cell == "gru":
        torch.library.opcheck(op._gru_cell_fwd_op, (x, h, w_ih, w_hh, None, b, True))
        saved = op._gru_cell_fwd_op(x, h, w_ih, w_hh, None, b, True)[1].detach()
        torch.library.opcheck(op._gru_cell_bwd_op, (c.detach().t().contiguous().t(), h.detach(), saved, torch.float16))
    else:
        torch.library.opcheck(op._rnn_cell_fwd_op, (x, None, w_ih, w_hh, b, b, True, True))
        saved = op._rnn_cell_fwd_op(x, None, w_ih, w_hh, b, b, True, True)[1].detach()
        torch.library.opcheck(op._rnn_cell_bwd_op, (h.detach(), saved, True, torch.float16))


@pytest.mark.skipif(not ON_GPU, reason="inductor around the custom ops is what this pins, and it compiles for "
                    "the GPU; on the CPU the custom ops' fakes and autograd are covered by the opcheck test")
def test_works_under_torch_compile_fullgraph(device):
    lstm, _ = modules("lstm", device, torch.bfloat16, In=64, H=96, seed=13)
    gru, _ = modules("gru", device, torch.bfloat16, In=96, H=96, seed=14)
    rnn, _ = modules("rnn_tanh", device, torch.bfloat16, In=96, H=96, seed=15)
    params = [*lstm.parameters(), *gru.parameters(), *rnn.parameters()]
    g = torch.Generator().manual_seed(16)
    xs = randn(3, 33, 64, dtype=torch.bfloat16, device=device, generator=g).requires_grad_()

    def step(xs, *p):
        hx, h2, h3 = None, None, None
        for t in range(xs.shape[0]):
            hx = lstm_cell(xs[t], hx, *p[0:4], lane="triton")
            h2 = gru_cell(hx[0], h2, *p[4:8], lane="triton")
            h3 = rnn_cell(h2, h3, *p[8:12], lane="triton")
        return (h3.float() ** 2).sum() + hx[1].float().sum()

    compiled = torch.compile(step, fullgraph=True)
    with poisoned_outputs():
        got = torch.autograd.grad(compiled(xs, *params), [xs, *params])
    eager = torch.autograd.grad(step(xs, *params), [xs, *params])
    for a, b in zip(got, eager):
        # the kernels' outputs are the same; the bias sums and casts around them are inductor's own
        assert_close(a, b.double(), RNN_BWD)


@pytest.mark.bigmem
@pytest.mark.skipif(not ON_GPU, reason="over 2^31 elements: GPU memory only")
@pytest.mark.parametrize("cell, big", [("lstm", "input"), ("gru", "input"), ("rnn_tanh", "input"),
                                       ("lstm", "weights")])
def test_tensors_over_2_to_the_31_elements(cell, big, device):
    # "input": x is (2^17 + 17, 2^14), 2^31 + 2^18 elements; its last rows are checked.
    # "weights": the LSTM's w_ih is (4 * 1024, 2^19 + 1), 2^31 + 4096 elements; the last hidden
    # units are checked.
    G = {"lstm": 4, "gru": 3}.get(cell, 1)
    In, Hh, B = (2**14, 32, 2**17 + 17) if big == "input" else (2**19 + 1, 1024, 4)
    gen = torch.Generator(device=device).manual_seed(17)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16).requires_grad_()

    x = rnd(B, In)
    states = [rnd(B, Hh) for _ in range(2 if cell == "lstm" else 1)]
    weights = [rnd(G * Hh, In, scale=In ** -0.5), rnd(G * Hh, Hh, scale=Hh ** -0.5),
               rnd(G * Hh, scale=0.1), rnd(G * Hh, scale=0.1)]
    assert (x if big == "input" else weights[0]).numel() > 2**31
    fn, extra = CELLS[cell][1], CELLS[cell][2]
    hx = tuple(states) if cell == "lstm" else states[0]
    with poisoned_outputs():
        out = as_tuple(fn(x, hx, *weights, lane="triton", **extra))
        grads = torch.autograd.grad(out, [x, weights[0]], [torch.ones_like(o) for o in out])

    # The oracle on a slice: the last 40 rows of the batch, or the last 40 hidden units: a unit's
    # outputs and weight gradients need its own 4 rows of the weights, its c, and all of h.
    rows = slice(B - 40, B) if big == "input" else slice(0, B)
    units = torch.arange(Hh - 40 if big == "weights" else 0, Hh, device=device)
    gate_rows = torch.cat([g * Hh + units for g in range(G)])
    sliced_states = [states[0][rows], *[c[rows][:, units] for c in states[1:]]]
    leaves = [x[rows], *sliced_states, *(w[gate_rows] for w in weights)]
    leaves = [t.detach().double().requires_grad_() for t in leaves]
    if cell == "lstm":
        expected = ref.lstm_cell(*leaves)
    elif cell == "gru":
        expected = (ref.gru_cell(*leaves),)
    else:
        expected = (ref.rnn_cell(*leaves, nonlinearity="tanh"),)
    want = torch.autograd.grad(expected, [leaves[0], leaves[len(states) + 1]],
                               [torch.ones_like(e) for e in expected])
    for o, e in zip(out, expected):
        assert_close(o[rows][:, units], e, RNN_FWD)
    if big == "input":
        assert_close(grads[0][rows], want[0], RNN_BWD)
        assert torch.isfinite(grads[1]).all()
    else:
        assert_close(grads[1][gate_rows], want[1], RNN_BWD)
        assert torch.isfinite(grads[0]).all()
