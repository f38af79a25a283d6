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

Layers whose qualified name contains one of ``skip`` (by default the LM head, which serving
stacks keep in 16 bits) are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from lanekit.reference.numerics import QUANT_MAX, quantize_groups, to_codes

SCHEMES = ("fp8", "fp8_block", "w8a8", "w8a16", "w4a8")
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


class QuantizedLinear(nn.Module):
    """An ``nn.Linear``'s forward on lanekit's 8-bit linear of ``scheme``: weight codes (N, K) and
    fp32 scales as buffers, the bias kept in the layer's dtype."""

    def __init__(self, linear: nn.Linear, scheme: str, lane: str | None = None):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
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


def quantize_linears(model: nn.Module, scheme: str, *, skip: tuple[str, ...] = ("lm_head",),
                     lane: str | None = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name contains none of
    ``skip`` by a :class:`QuantizedLinear` of ``scheme`` ("fp8", "fp8_block", "w8a8", "w8a16",
    "w4a8"); returns the model. Raises ValueError for an unknown scheme, or for "w4a8" a layer
    whose in_features is not a multiple of 32 (nothing replaced)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in name for s in skip)]
    if scheme == "w4a8":
        for name, linear in targets:
            w4a8_group_size(linear.in_features, name)
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantizedLinear(linear, scheme, lane))
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
