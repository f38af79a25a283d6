"""FlashAttention's ``flash_attn.bert_padding``: between padded (B, S, ...) batches and the packed
(total, ...) layout of the varlen functions, with FlashAttention's names and return values.

Plain PyTorch indexing (differentiable: the gradient of a gather is the scatter back, and of a
scatter the gather); ``unpad_input`` reads the longest length back (one device sync), as
FlashAttention's does.
"""

from __future__ import annotations

import torch

from lanekit.runtime.validate import ArgumentError, argument_errors, int_at_least, tensor


def _index(name: str, indices, like: torch.Tensor) -> None:
    tensor(name, indices, ndim=1, like=like, like_name="the input")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int64 or int32, got {indices.dtype}")


@argument_errors
def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]``: rows (N, ...) of input (R, ...), one row index per output row;
    differentiable in input. Raises for a non-tensor, a 0-d input, or
    indices not a 1-D int tensor on input's device."""
    tensor("input", input, ndim=tuple(range(1, 9)))
    _index("indices", indices, input)
    return input.index_select(0, indices)


@argument_errors
def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A (first_axis_dim, ...) tensor of zeros with row ``indices[i]`` set to ``values[i]``
    (values (N, ...), N distinct indices); differentiable in values."""
    tensor("values", values, ndim=tuple(range(1, 9)))
    _index("indices", indices, values)
    first_axis_dim = int_at_least("first_axis_dim", first_axis_dim)
    if indices.shape[0] != values.shape[0]:
        raise ArgumentError(f"indices: expected one per row of values ({values.shape[0]}), got {indices.shape[0]}")
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor):
    """``(input[indices], input.detach())``, FlashAttention's variant for fused residual paths."""
    return index_first_axis(input, indices), input.detach()


def _lengths(name: str, mask, hidden_states) -> torch.Tensor:
    tensor(name, mask, ndim=2, like=hidden_states, like_name="hidden_states")
    if tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ArgumentError(f"{name}: expected shape {tuple(hidden_states.shape[:2])} (hidden_states' batch and "
                            f"length), got {tuple(mask.shape)}")
    return mask


@argument_errors
def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Pack the tokens a mask keeps, FlashAttention's ``unpad_input``.

    Arguments:
        hidden_states: (B, S, ...), any dtype.
        attention_mask: (B, S), bool or int: 1 keeps the token.
        unused_mask: (B, S) or None: tokens allocated but unused (kept too, not counted in seqused).

    Returns:
        ``(hidden, indices, cu_seqlens, max_seqlen, seqused)``: hidden (total, ...) the kept rows in
        order; indices (total,) int64, their positions in the flattened (B * S) batch; cu_seqlens
        (B + 1,) int32; max_seqlen a Python int; seqused (B,) int32, the tokens attention_mask
        keeps per sequence.

    Raises: a TypeError for a non-tensor, a ValueError for masks not (B, S) on hidden_states' device
    (each a RuntimeError too).

    Source: FlashAttention 2.7's ``flash_attn.bert_padding.unpad_input`` (its 5-tuple).
    """
    tensor("hidden_states", hidden_states, ndim=tuple(range(1, 9)))
    _lengths("attention_mask", attention_mask, hidden_states)
    kept = attention_mask.to(torch.int32)
    if unused_mask is not None:
        _lengths("unused_mask", unused_mask, hidden_states)
        kept = kept + unused_mask.to(torch.int32)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    hidden = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return hidden, indices, cu_seqlens, max_seqlen, attention_mask.sum(dim=-1, dtype=torch.int32)


@argument_errors
def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """FlashAttention's variant for rows that hold several sequences back to back:
    ``attention_mask_in_length`` (B, S) int lists each row's sequence lengths, then zeros
    (``[[2, 3, 0, 0], ...]``: a row holding sequences of 2 and 3 tokens). Returns ``(hidden,
    indices, cu_seqlens, max_seqlen)`` with one cu_seqlens entry per sequence, across rows."""
    tensor("hidden_states", hidden_states, ndim=tuple(range(1, 9)))
    _lengths("attention_mask_in_length", attention_mask_in_length, hidden_states)
    S = attention_mask_in_length.shape[1]
    row_lengths = attention_mask_in_length.sum(dim=-1)
    kept = torch.arange(S, device=row_lengths.device) < row_lengths[:, None]
    flat = attention_mask_in_length.flatten()
    seqlens = flat[flat != 0].to(torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    hidden = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return hidden, indices, cu_seqlens, max_seqlen


@argument_errors
def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: hidden_states (total, ...) back to (batch, seqlen, ...)
    with zeros where no token was kept. Differentiable in hidden_states.

    Source: FlashAttention's ``flash_attn.bert_padding.pad_input``."""
    batch, seqlen = int_at_least("batch", batch), int_at_least("seqlen", seqlen)
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]
