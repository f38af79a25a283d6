"""The argument checks the attention functions share (api.py, api_kvcache.py, api_mla.py, and
lanekit.compat.flash_attn): dtypes, head dims, the scalar options, ALiBi, sinks, fp8/int8 descales,
cumulative sequence lengths, and whether a call may read device values back."""

from __future__ import annotations

import math

import torch

from lanekit.runtime.errors import check_indices_eagerly
from lanekit.runtime.validate import flag, int_pair, is_int, real, tensor


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


_FP32_MAX = 3.4028234663852886e38


def _broadcast_4d(name: str, t: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(f"{name}: expected at most 4 dimensions broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got shape {tuple(t.shape)}")
    try:
        return t.expand(shape) if t.dim() == 4 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).expand(shape)
    except RuntimeError:
        raise ValueError(f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got {tuple(t.shape)}") from None


def _check_heads(q_shape, D: int, Dv: int, Hq: int, Hkv: int, kv_name: str = "k, v") -> None:
    """Head dims within 1..MAX_HEAD_DIM, at least one query head, Hkv dividing Hq (GQA/MQA)."""
    for name, d in (("q/k head dim", D), ("v head dim", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected 1..{MAX_HEAD_DIM}, got {d}")
    if Hq == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q_shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{kv_name}: expected a number of heads that divides Hq={Hq}, got Hkv={Hkv}")


def _options(D: int, Sq: int, Sk: int, dropout_p, softmax_scale, softcap, causal, window_size):
    """Check the scalar options of the attention functions; returns (softmax_scale, left, right)
    with the default scale filled in and the causal mask folded into the window. Ints and bools
    follow runtime.validate's one rule (NumPy's and 0-d tensors count; a bool is not an int)."""
    real("dropout_p", dropout_p, "a float in [0, 1)", lambda p: 0.0 <= p < 1.0)
    softmax_scale = _softmax_scale(D, softmax_scale)
    real("softcap", softcap, "a finite float >= 0", lambda c: c >= 0 and math.isfinite(c))
    causal = flag("causal", causal)
    left, right = int_pair("window_size", window_size, " (left, right)")
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected values >= -1 (-1 is unbounded), got {(left, right)}")
    # A side that reaches past every key is unbounded (FlashAttention also turns window sizes
    # >= Sk into -1); this keeps the kernel's int32 window arithmetic in range.
    if left >= Sk:
        left = -1
    if right >= max(Sq, Sk):
        right = -1
    if causal:
        right = 0
    return softmax_scale, left, right


def _softmax_scale(D: int, softmax_scale) -> float:
    """softmax_scale: a finite real in fp32's range, or None for ``D ** -0.5`` (FlashAttention's and
    FlashMLA's default)."""
    if softmax_scale is None:
        return D ** -0.5
    return real("softmax_scale", softmax_scale, "a finite float (fp32 range) or None",
                lambda s: math.isfinite(s) and abs(s) < _FP32_MAX)


def _alibi(alibi_slopes, B: int, Hq: int, q: torch.Tensor) -> torch.Tensor | None:
    """ALiBi slopes (Hq,) or (B, Hq) fp32 on q's device, checked and expanded to (B, Hq)."""
    if alibi_slopes is None:
        return None
    tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,), ndim=(1, 2), like=q, like_name="q")
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes: expected shape ({Hq},) or ({B}, {Hq}), got {tuple(alibi_slopes.shape)}")
    return alibi_slopes.expand(B, Hq)


def _dropout_seed(dropout_p: float, dropout_seed, dropout_offset) -> int:
    """The Philox seed and offset of the dropout mask as Python ints: checked, the seed drawn from
    PyTorch's CPU generator when None."""
    checked = {}
    for name, val in (("dropout_offset", dropout_offset),) + ((("dropout_seed", dropout_seed),) if dropout_seed is not None else ()):
        if not is_int(val):
            raise TypeError(f"{name}: expected an int in [0, 2**63), got {type(val).__name__}")
        if not 0 <= int(val) < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {int(val)!r}")
        checked[name] = int(val)
    if dropout_p > 0 and dropout_seed is None:
        return int(torch.randint(0, 2**62, (1,), device="cpu").item()), checked["dropout_offset"]
    return checked.get("dropout_seed", 0), checked["dropout_offset"]


_QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _sinks(sinks, Hq: int, q: torch.Tensor) -> torch.Tensor | None:
    """sinks: None, or (Hq,) fp32 (fp64 too for a float64 q) on q's device."""
    if sinks is None:
        return None
    tensor("sinks", sinks, dtypes=(torch.float32,) + ((torch.float64,) if q.dtype == torch.float64 else ()),
           ndim=1, like=q, like_name="q")
    if sinks.shape[0] != Hq:
        raise ValueError(f"sinks: expected shape ({Hq},) (one logit per query head), got {tuple(sinks.shape)}")
    return sinks


def _quant(q: torch.Tensor, B: int, Hkv: int, q_descale, k_descale, v_descale, out_dtype, dropout_p,
           grads: tuple = ()) -> tuple[tuple, torch.dtype | None]:
    """fp8/int8 attention's arguments: for an fp8 or int8 q, the (B, Hkv) fp32 descales (None: 1)
    and out_dtype (bf16, fp16 or fp32; None: bf16), no dropout, and no tensor of ``grads``
    (name, tensor) requiring grad (forward only). For any other q: descales None and out_dtype
    None or q's dtype. Returns ((q_descale, k_descale, v_descale), out_dtype)."""
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if q.dtype not in _QUANT_DTYPES:
        for name, d in descales:
            if d is not None:
                raise ValueError(f"{name}: expected None for {q.dtype} inputs (descales go with fp8 "
                                 f"e4m3/e5m2 or int8 q, k, v), got a tensor")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype: expected None or q's dtype ({q.dtype}) for {q.dtype} inputs, "
                             f"got {out_dtype}")
        return (None, None, None), None
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {[str(d) for d in _OUT_DTYPES]} or None, got {out_dtype!r}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: expected 0.0 with {q.dtype} inputs (fp8/int8 attention is "
                         f"inference only, as FlashAttention-3's), got {dropout_p!r}")
    if torch.is_grad_enabled():
        for name, t in grads:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"{name}: fp8 and int8 attention is forward only (as FlashAttention-3's): "
                                 "expected no tensor requiring grad, got one (use torch.no_grad() or detach)")
    if q.is_cuda and q.dtype != torch.int8 and torch.version.hip is None \
            and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"q: {q.dtype} attention needs an NVIDIA GPU of compute capability 8.9 or later "
                         f"(no fp8 conversions before; int8 runs there), got "
                         f"{torch.cuda.get_device_capability(q.device)}")
    out = []
    for name, d in descales:
        if d is None:
            d = torch.ones((), dtype=torch.float32, device=q.device).expand(B, Hkv)
        else:
            tensor(name, d, dtypes=(torch.float32,), ndim=2, like=q, like_name="q")
            if tuple(d.shape) != (B, Hkv):
                raise ValueError(f"{name}: expected shape ({B}, {Hkv}) (batch, KV heads), got {tuple(d.shape)}")
        out.append(d)
    return tuple(out), out_dtype

def _capturing() -> bool:
    """Inside a CUDA graph capture, where reading a device value back would break the capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _read_indices(lane: str) -> bool:
    """Whether this call reads its device-resident index values back to check them on the host
    (a device sync): in the debug mode ``LANEKIT_CHECK_INDICES=1``, and always on the reference
    lane (the float64 oracle, off the hot path, which would index out of range); never inside a
    CUDA graph capture. Otherwise the kernels mask what is out of range and record it for
    :func:`lanekit.check_errors` (DESIGN.md's hot path)."""
    return (lane == "reference" or check_indices_eagerly()) and not _capturing()


def _cu_seqlens(name: str, cu, B: int | None, q: torch.Tensor) -> int:
    """Check cumulative sequence lengths' type, shape and device: (B + 1,) int32 on q's. Returns B."""
    tensor(name, cu, dtypes=(torch.int32,), ndim=1, like=q, like_name="q")
    if cu.shape[0] < 1 or (B is not None and cu.shape[0] != B + 1):
        raise ValueError(f"{name}: expected shape ({'B + 1' if B is None else B + 1},) (B + 1 cumulative "
                         f"lengths), got {tuple(cu.shape)}")
    return cu.shape[0] - 1


def _cu_seqlens_values(name: str, vals: list[int], total: int, max_seqlen: int) -> None:
    """Check cumulative sequence lengths read back: from 0 up to ``total`` (-1: any), non-decreasing,
    no sequence longer than ``max_seqlen``."""
    lengths = [b - a for a, b in zip(vals, vals[1:])]
    if vals[0] != 0 or any(n < 0 for n in lengths) or (total >= 0 and vals[-1] != total):
        raise ValueError(f"{name}: expected non-decreasing values from 0 to {total if total >= 0 else 'the cache size'}, "
                         f"got {vals if len(vals) <= 16 else vals[:8] + ['...'] + vals[-4:]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name}: expected no sequence longer than its max_seqlen ({max_seqlen}), "
                         f"got one of {max(lengths)}")
