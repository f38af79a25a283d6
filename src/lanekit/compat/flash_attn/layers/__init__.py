"""FlashAttention's ``flash_attn.layers`` (the rotary embedding, :mod:`.rotary`)."""
