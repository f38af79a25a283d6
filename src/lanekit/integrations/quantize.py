"""``quantize_linears(model, scheme)``: a model's ``nn.Linear`` layers swapped for lanekit's
8-bit linears (``lanekit.gemm``), their weights quantized once, on the host, here.

Schemes (vLLM's):

- ``"fp8"``: e4m3 weights per output channel (scale = amax / 448), activations quantized per
  token on the device (``fp8_linear``);
- ``"fp8_block"``: e4m3 weights per 128 x 128 block, activations per 1 x 128 group
  (DeepSeek-V3's, ``fp8_linear(block_size=[128, 128])``);
- ``"w8a8"``: int8 weights per channel (amax / 127), int8 activations per token (``w8a8_linear``);
- ``"w8a16"``: int8 weights per channel, 16-bit activations (``w8a16_linear``; bf16/fp16 models);
- ``"w4a8"``: int4 weights (``lanekit.quant.quantize_w4a8`` mode 1: symmetric, a per-channel fp32
  scale times per-group e4m3 scales, groups of 128, else 64, else 32 along K), int8 activations
  per token (``w4a8_linear``); every in_features a multiple of 32.
- ``"w4a16"``: group-wise asymmetric int4 weights (group 128 by default) in AWQ's layout, 16-bit
  activations (``w4a16_linear``, :class:`Int4Linear`);
- ``"mxfp4"``: OCP MXFP4 weights (e2m1, an e8m0 scale per 32 of K) in gpt-oss's layout, 16-bit
  activations (``mxfp4_linear``, :class:`Mxfp4Linear`).

``load_quantized_linears(model, state_dict, format)`` loads checkpoints already quantized: AutoAWQ's
and GPTQ's (v1 and v2) int4 state dicts.

Layers whose qualified name contains one of ``skip`` (by default the LM head, which serving
stacks keep in 16 bits) are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lanekit.reference.numerics import QUANT_MAX, pack_int4, quantize_groups, to_codes, unpack_int4
from lanekit.runtime.lanes import select_lane
from lanekit.runtime.validate import is_int

SCHEMES_8BIT = ("fp8", "fp8_block", "w8a8", "w8a16", "w4a8")   # QuantizedLinear's: 8-bit activations or weights
SCHEMES_4BIT = ("w4a16", "mxfp4")                              # Int4Linear's, Mxfp4Linear's: 16-bit activations
SCHEMES = SCHEMES_8BIT + SCHEMES_4BIT
BLOCK = 128


def _int8_channels(w: torch.Tensor):
    amax = w.abs().amax(1)
    s = torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax))
    return to_codes(w / s[:, None], torch.int8), s


def _fp8_blocks(w: torch.Tensor):
    N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    padded = torch.nn.functional.pad(w, (0, kb * BLOCK - K, 0, nb * BLOCK - N))
    amax = padded.reshape(nb, BLOCK, kb, BLOCK).abs().amax((1, 3))
    qmax = QUANT_MAX[torch.float8_e4m3fn]
    s = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
    full = s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return to_codes(w / full, torch.float8_e4m3fn), s


class _QuantizedBuffers(nn.Module):
    """A layer whose quantized buffers (codes and scales: every buffer but ``bias``) keep their
    dtype when the model is cast: ``model.half()`` or ``model.to(torch.bfloat16)`` moves them to
    the new device only, as it does integer buffers (it turned fp8 codes into fp16 values and
    rounded fp32 scales to 16 bits, which the linears then refused at the first forward, or took
    rounded). The bias follows the model's dtype."""

    def _apply(self, fn, recurse=True):
        kept = {n: b for n, b in self._buffers.items() if b is not None and n != "bias"}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self


class QuantizedLinear(_QuantizedBuffers):
    """An ``nn.Linear``'s forward on lanekit's 8-bit linear of ``scheme``: weight codes (N, K) and
    fp32 scales as buffers, the bias kept in the layer's dtype."""

    def __init__(self, linear: nn.Linear, scheme: str, lane: str | None = None):
        super().__init__()
        if scheme not in SCHEMES_8BIT:
            raise ValueError(f"scheme: expected one of {SCHEMES_8BIT}, got {scheme!r}")
        self.scheme, self.lane = scheme, lane
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        bias = linear.bias.detach() if linear.bias is not None else None
        if scheme == "w4a8":
            self._init_w4a8(w, bias)
            return
        if scheme == "fp8":
            codes, s = quantize_groups(w, w.shape[1], torch.float8_e4m3fn)
            s = s.reshape(-1)
        elif scheme == "fp8_block":
            codes, s = _fp8_blocks(w)
        else:
            codes, s = _int8_channels(w)
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", s.to(torch.float32).contiguous())
        self.register_buffer("bias", bias)

    def _init_w4a8(self, w: torch.Tensor, bias: torch.Tensor | None):
        from lanekit.quant import quantize_w4a8

        self.group_size = w4a8_group_size(w.shape[1])
        qweight, scales, channel, _ = quantize_w4a8(w, W4A8_MODE, self.group_size, torch.float8_e4m3fn)
        self.register_buffer("weight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("channel_scale", channel)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lanekit import gemm

        bias = self.bias
        if bias is not None and bias.dtype not in (x.dtype, torch.float32):
            bias = bias.to(x.dtype)
        if self.scheme == "fp8":
            return gemm.fp8_linear(x, self.weight, self.weight_scale, bias, lane=self.lane)
        if self.scheme == "fp8_block":
            return gemm.fp8_linear(x, self.weight, self.weight_scale, bias, block_size=[BLOCK, BLOCK],
                                   lane=self.lane)
        if self.scheme == "w8a8":
            return gemm.w8a8_linear(x, self.weight, self.weight_scale, bias, lane=self.lane)
        if self.scheme == "w4a8":
            return gemm.w4a8_linear(x, self.weight, self.scales, self.channel_scale, None, self.group_size, bias,
                                    lane=self.lane)
        return gemm.w8a16_linear(x, self.weight, self.weight_scale, bias, lane=self.lane)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def _model_and_lane(model, lane):
    """model an nn.Module (a TypeError), lane one that its layers can run on (a ValueError now,
    not at the first forward)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    select_lane(param.device if param is not None else torch.device("cpu"), lane)


def _group_size_arg(group_size):
    """group_size as an int >= 1 or -1 (one group of K): a TypeError for a float or bool, a
    ValueError for 0 or another negative, before any layer is read."""
    if not is_int(group_size):
        raise TypeError(f"group_size: expected an int >= 1, or -1 (one group of all K), got "
                        f"{type(group_size).__name__} {group_size!r}")
    if int(group_size) < 1 and int(group_size) != -1:
        raise ValueError(f"group_size: expected an int >= 1, or -1 (one group of all K), got {group_size!r}")
    return int(group_size)


def _finite(w: torch.Tensor):
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("weight: expected finite values, got a NaN or inf (4-bit codes cannot hold it; "
                         "MXFP4 would drop it silently)")


def quantize_linears(model: nn.Module, scheme: str, *, skip: tuple[str, ...] = ("lm_head",),
                     lane: str | None = None, group_size: int = 128) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name contains none of
    ``skip`` by a :class:`QuantizedLinear` of ``scheme`` ("fp8", "fp8_block", "w8a8", "w8a16",
    "w4a8"), an :class:`Int4Linear` ("w4a16": int4 per ``group_size`` rows of K, AWQ's layout) or
    an :class:`Mxfp4Linear` ("mxfp4"); returns the model. Raises ValueError for an unknown scheme,
    and for "w4a8" / "w4a16" / "mxfp4" a layer whose shape the format cannot hold ("w4a8": K not a
    multiple of 32; "w4a16": K not a multiple of group_size or N of 8; "mxfp4": K not a multiple
    of 32) or a NaN or inf in a weight ("w4a8", "w4a16", "mxfp4"), naming the layer; nothing is
    replaced then. Also, before any layer is read: TypeError for a model that is not an
    nn.Module, a skip that is not a tuple or list of str (a plain "lm_head" would match its
    letters), a group_size that is not an int; ValueError for an unknown lane or a group_size
    below 1 other than -1 (one group of all K).

    Casting the model afterwards (``model.half()``, ``model.to(torch.bfloat16)``) casts the
    layers' biases and moves their codes and scales without changing their dtype."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    _model_and_lane(model, lane)
    if not isinstance(skip, (tuple, list)) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"skip: expected a tuple or list of str (fragments of qualified names), got {skip!r}"
                        + (f"; write ({skip!r},)" if isinstance(skip, str) else ""))
    if scheme == "w4a16":
        group_size = _group_size_arg(group_size)
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in name for s in skip)]
    if scheme == "w4a8":
        for name, linear in targets:
            w4a8_group_size(linear.in_features, name)
    built = []
    for name, linear in targets:
        try:
            if scheme == "w4a16":
                built.append((name, Int4Linear.from_linear(linear, group_size, lane)))
            elif scheme == "mxfp4":
                built.append((name, Mxfp4Linear(linear, lane)))
            else:
                built.append((name, QuantizedLinear(linear, scheme, lane)))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    for name, layer in built:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer)
    return model


# ---- 4-bit weights (issue 33): "w4a16" (AWQ's layout) and "mxfp4" (gpt-oss's), and loading AWQ
# and GPTQ checkpoints. The layouts and the dequantization are lanekit.gemm's w4a16_linear and
# mxfp4_linear (docs/semantics.md, "4-bit weights"); their oracles lanekit.reference.gemm's
# w4_weight and mxfp4_weight.

FORMATS = ("awq", "gptq", "gptq_v2")
MX_GROUP = 32


def quantize_int4_awq(w: torch.Tensor, group_size: int = 128):
    """Group-wise asymmetric int4 of a linear's weight w (N, K), as an AWQ checkpoint stores it:
    ``(qweight (K, N/8) int32, qzeros (K/G, N/8) int32, scales (K/G, N) fp16)``, both packed along
    N in AWQ's nibble order. Per group of G rows of K and output channel n: lo = min(w, 0),
    hi = max(w, 0) (zero always representable), scale = (hi - lo) / 15 rounded to fp16 (the stored
    scale; the codes are chosen from it), z = clamp(round(-lo / scale), 0, 15), q = clamp(round(w /
    scale) + z, 0, 15) (round half to even). A group whose fp16 scale is 0 (all zero, or below
    fp16's range) gets q = z = 0: its weights dequantize to 0, never NaN. group_size -1: one group
    of K. A NaN or inf in w is refused (ValueError). Source: AutoAWQ's ``pseudo_quantize_tensor``
    (zero point from the minimum), with the range widened to hold 0."""
    N, K = w.shape
    group_size = K if group_size == -1 else group_size
    if K % group_size:
        raise ValueError(f"group_size: expected a divisor of K = {K} (the layer's in_features), got {group_size}")
    _finite(w)
    if N % 8:
        raise ValueError(f"weight: expected out_features a multiple of 8 (AWQ packs eight columns of N to "
                         f"an int32), got {N}")
    g = w.detach().to(torch.float64).t().reshape(K // group_size, group_size, N)   # (K/G, G, N)
    lo = g.amin(1).clamp(max=0.0)
    hi = g.amax(1).clamp(min=0.0)
    scales = ((hi - lo) / 15).to(torch.float16)
    s = scales.to(torch.float64)
    live = s > 0
    safe = torch.where(live, s, torch.ones_like(s))
    z = torch.where(live, torch.round(-lo / safe).clamp(0, 15), torch.zeros_like(s))
    q = torch.where(live[:, None], torch.round(g / safe[:, None]) + z[:, None], torch.zeros_like(g))
    q = q.clamp(0, 15).reshape(K, N).to(torch.int64)
    qweight = pack_int4(q, dim=1, order="awq")
    qzeros = pack_int4(z.to(torch.int64), dim=1, order="awq")
    return qweight.contiguous(), qzeros.contiguous(), scales.contiguous()


_E2M1_MAG = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def quantize_mxfp4(w: torch.Tensor):
    """OCP MXFP4 of a linear's weight w (N, K), K a multiple of 32, in gpt-oss's layout:
    ``(w_fp4 (N, K/2) uint8, element 2i in the low nibble; w_scale (N, K/32) uint8 e8m0)``. Per 32
    of K: the shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), clamped to e8m0's
    [-127, 127] (an all-zero block: 2^0); each value divided by it and rounded to the nearest e2m1
    value, ties to the even mantissa, saturating at +-6; a NaN or inf in w is refused (ValueError:
    the codes have no NaN, and a saturated inf would vanish). Source: OCP Microscaling Formats (MX)
    v1.0, section 6.3 (the conversion from a float vector)."""
    N, K = w.shape
    if K % MX_GROUP:
        raise ValueError(f"weight: expected in_features a multiple of {MX_GROUP} (one e8m0 scale per 32 "
                         f"along K), got {K}")
    _finite(w)
    b = w.detach().to(torch.float64).reshape(N, K // MX_GROUP, MX_GROUP)
    amax = b.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0))) - 2,
                      torch.zeros_like(amax)).clamp(-127, 127)
    v = b / torch.exp2(exp)[..., None]
    mag = _E2M1_MAG.to(w.device)
    dist = (v.abs().clamp(max=6.0)[..., None] - mag).abs()                    # (..., 8)
    best = dist == dist.amin(-1, keepdim=True)
    even = (torch.arange(8, device=w.device) % 2 == 0)
    idx = (best * (1 + even)).argmax(-1)                                      # a tie: the even mantissa
    codes = (idx + 8 * (v < 0)).reshape(N, K)
    w_fp4 = pack_int4(codes, dim=1, dtype=torch.uint8)
    return w_fp4.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _bias_for(bias, x):
    if bias is not None and bias.dtype not in (x.dtype, torch.float32):
        bias = bias.to(x.dtype)
    return bias


class Int4Linear(_QuantizedBuffers):
    """An ``nn.Linear``'s forward on ``lanekit.gemm.w4a16_linear``: an AWQ or GPTQ int4 weight
    (buffers ``qweight``, ``qzeros``, ``scales``, ``g_idx``, named as the checkpoints name them,
    so ``state_dict()`` of an AWQ layer is an AutoAWQ state dict), the bias in the layer's dtype.
    ``layout`` "awq" or "gptq" (lanekit.gemm's: GPTQ's zeros hold z - 1)."""

    def __init__(self, in_features: int, out_features: int, qweight, qzeros, scales, bias=None,
                 group_size: int = 128, layout: str = "awq", g_idx=None, lane: str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.layout, self.lane = group_size, layout, lane
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, lane: str | None = None):
        qweight, qzeros, scales = quantize_int4_awq(linear.weight, group_size)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, qweight, qzeros, scales, bias,
                   linear.in_features if group_size == -1 else group_size, "awq", None, lane)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lanekit import gemm

        return gemm.w4a16_linear(x, self.qweight, self.scales, self.qzeros, self.group_size, self.layout,
                                 _bias_for(self.bias, x), self.g_idx, lane=self.lane)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}, "
                f"group_size={self.group_size}, act_order={self.g_idx is not None}")


class Mxfp4Linear(_QuantizedBuffers):
    """An ``nn.Linear``'s forward on ``lanekit.gemm.mxfp4_linear``: buffers ``weight`` (N, K/2)
    uint8 e2m1 codes and ``weight_scale`` (N, K/32) uint8 e8m0, gpt-oss's layout."""

    def __init__(self, linear: nn.Linear, lane: str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.lane = linear.in_features, linear.out_features, lane
        w_fp4, w_scale = quantize_mxfp4(linear.weight)
        self.register_buffer("weight", w_fp4)
        self.register_buffer("weight_scale", w_scale)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lanekit import gemm

        return gemm.mxfp4_linear(x, self.weight, self.weight_scale, _bias_for(self.bias, x), lane=self.lane)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme=mxfp4"


def _key(state_dict, name: str, dtypes, shape, what: str):
    if name not in state_dict:
        raise ValueError(f"state_dict: expected the key {name!r} ({what}), got no such key")
    t = state_dict[name]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")
    return t


def _gptq_v2_zeros(qzeros, qweight, g_idx, name):
    """GPTQ v2 zeros (z itself) as lanekit's "gptq" layout (z - 1), or, where some z is 0 and so
    has no z - 1 nibble, the whole layer in AWQ's layout (no act-order only)."""
    z = unpack_int4(qzeros, dim=1).to(torch.int64)
    if bool((z >= 1).all()):
        return "gptq", qweight, pack_int4(z - 1, dim=1), g_idx
    if g_idx is not None:
        raise ValueError(f"{name}.qzeros: expected zero points >= 1 for a gptq_v2 layer with act-order "
                         f"(lanekit's GPTQ layout stores z - 1), got a zero point 0")
    q = unpack_int4(qweight, dim=0).to(torch.int64)                             # (K, N)
    return "awq", pack_int4(q, dim=1, order="awq"), pack_int4(z, dim=1, order="awq"), None


def load_quantized_linears(model: nn.Module, state_dict, format: str = "awq", *,
                           group_size: int | None = None, lane: str | None = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose ``<name>.qweight`` is in
    ``state_dict`` by an :class:`Int4Linear` on that checkpoint's int4 weight; returns the model.
    Linears without a ``qweight`` (the LM head of most checkpoints) are left as they are.

    Keys per layer (K = in_features, N = out_features, G = group_size), as the checkpoints store
    them:

    - ``format="awq"`` (AutoAWQ's ``WQLinear_GEMM``, version "gemm"): ``qweight`` int32 (K, N/8)
      and ``qzeros`` int32 (K/G, N/8), packed along N in AWQ's nibble order (column 8e + j in
      nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]), ``qzeros`` holding the zero points z; ``scales`` (K/G, N).
    - ``format="gptq"`` (AutoGPTQ's and GPTQModel's ``checkpoint_format`` "gptq", "v1": every
      AutoGPTQ release, GPTQModel's default on save, transformers' default): ``qweight`` int32
      (K/8, N), row 8e + j of K in nibble j; ``qzeros`` int32 (K/G, N/8), column 8e + j in nibble
      j, storing **z - 1** (AutoGPTQ's ``pack`` subtracts 1 before packing and its kernels add it
      back, so a symmetric checkpoint stores 7 for zero 8); ``scales`` (K/G, N); ``g_idx`` (K,)
      int32, the group of each row of K (act-order when it is not k // G; absent: k // G).
    - ``format="gptq_v2"`` (``checkpoint_format`` "gptq_v2": AutoGPTQ's late releases, whose
      ``CHECKPOINT_FORMAT`` has GPTQ_V2 (the first such version not pinned down here), and GPTQModel,
      which converts v1 to v2 in memory by adding 1 to every qzeros nibble): as "gptq" but ``qzeros``
      storing z itself; converted here to v1 (z - 1), or to AWQ's layout for a layer with a zero
      point 0 (which v1 cannot hold) and no act-order.
    - ``bias`` (N,), optional; else the layer's own bias is kept.

    group_size: None reads it from the shapes (K / scales' rows); an int is checked against them.

    Raises (before any layer is replaced): ValueError for an unknown format or lane, a missing key
    (named), a wrong shape (the key, the expected and the got), a group size that does not divide
    K (or below 1, other than -1), a g_idx value outside [0, K/G) (read here, at load), a
    ``<name>.qweight`` key of no nn.Linear of the model (it would be left unloaded), or no
    quantized layer at all; TypeError for a wrong dtype, a state_dict that is not a mapping, a
    model that is not an nn.Module, a group_size that is not an int. Other values (codes, zeros,
    scales) are not range-checked.

    Sources: AutoAWQ's ``WQLinear_GEMM.from_linear``; AutoGPTQ's ``QuantLinear.pack`` and
    ``CHECKPOINT_FORMAT``; GPTQModel's ``convert_gptq_v1_to_v2_format``; docs/semantics.md."""
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    _model_and_lane(model, lane)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    if group_size is not None:
        group_size = _group_size_arg(group_size)
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and f"{name}.qweight" in state_dict]
    linears = {f"{name}.qweight" for name, _ in targets}
    stray = [key for key in state_dict if isinstance(key, str) and key.endswith(".qweight") and key not in linears]
    if targets and stray:
        raise ValueError(f"state_dict: expected each '<name>.qweight' to name an nn.Linear of the model, got "
                         f"{stray[:4]}{' ...' if len(stray) > 4 else ''} matching none (those layers would stay "
                         f"unloaded; drop the keys to load the rest)")
    if not targets:
        raise ValueError(f"state_dict: expected '<linear>.qweight' keys for some nn.Linear of the model "
                         f"(e.g. {next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), '?')!r}), "
                         f"got none")
    built = []
    for name, linear in targets:
        K, N = linear.in_features, linear.out_features
        awq = format == "awq"
        qweight = _key(state_dict, f"{name}.qweight", (torch.int32,), (K, N // 8) if awq else (K // 8, N),
                       "AWQ's (K, N / 8)" if awq else "GPTQ's (K / 8, N)")
        if (N if awq else K) % 8:
            raise ValueError(f"{name}.qweight: expected {'N' if awq else 'K'} a multiple of 8, got "
                             f"in_features {K}, out_features {N}")
        given = _key(state_dict, f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32), None,
                     "(K / group_size, N)")
        rows = given.shape[0] if given.dim() == 2 else 0
        G = group_size if group_size is not None else (K // rows if rows and K % rows == 0 else 0)
        if G == -1:
            G = K
        if not G or K % G:
            raise ValueError(f"{name}.scales: expected (K / group_size, N) with group_size dividing K = {K}, "
                             f"got shape {tuple(given.shape)}"
                             + (f" and group_size {group_size}" if group_size is not None else ""))
        scales = _key(state_dict, f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32),
                      (K // G, N), f"(K / group_size, N) with group_size {G}")
        qzeros = _key(state_dict, f"{name}.qzeros", (torch.int32,), (K // G, N // 8), "(K / group_size, N / 8)")
        g_idx = None
        if not awq and f"{name}.g_idx" in state_dict:
            g_idx = _key(state_dict, f"{name}.g_idx", (torch.int32, torch.int64), (K,), "(K,), the group of each row")
            groups = g_idx.cpu().to(torch.int64)                 # read once, at load
            if K and (int(groups.min()) < 0 or int(groups.max()) >= K // G):
                bad = groups[(groups < 0) | (groups >= K // G)][0]
                raise ValueError(f"{name}.g_idx: expected groups in [0, {K // G}) (K / group_size), got {int(bad)}")
            if torch.equal(groups, torch.arange(K) // G):
                g_idx = None                                     # no act-order: the group-run kernel
        bias = state_dict.get(f"{name}.bias", linear.bias)
        if bias is not None:
            bias = _key({f"{name}.bias": bias}, f"{name}.bias", (torch.float16, torch.bfloat16, torch.float32),
                        (N,), "(N,)").detach()
        layout = "awq" if awq else "gptq"
        if format == "gptq_v2":
            layout, qweight, qzeros, g_idx = _gptq_v2_zeros(qzeros, qweight, g_idx, name)
        if layout == "gptq" and G % 8:
            raise ValueError(f"{name}.scales: expected group_size a multiple of 8 for GPTQ's layout, got {G}")
        device = linear.weight.device
        built.append((name, Int4Linear(K, N, qweight.to(device), qzeros.to(device), scales.to(device),
                                       None if bias is None else bias.to(device), G, layout,
                                       None if g_idx is None else g_idx.to(device), lane)))
    for name, layer in built:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer)
    return model


# ---- w4a8 ----

W4A8_MODE = 1                   # symmetric, e4m3 group scales relative to a per-channel fp32 scale
W4A8_GROUPS = (128, 64, 32)     # the widest that divides in_features


def w4a8_group_size(K: int, name: str = "") -> int:
    """The group size "w4a8" quantizes a layer of in_features K with: the widest of 128, 64, 32
    dividing K; ValueError when none does (w4a8_linear's groups are whole int8 MMA steps)."""
    for group in W4A8_GROUPS:
        if K % group == 0 and K:
            return group
    raise ValueError(f"scheme: 'w4a8' expects every quantized layer's in_features a multiple of 32, got "
                     f"{K} for {name or 'a layer'!r} (add it to skip to keep it in 16 bits)")
