"""The oracles: plain PyTorch definitions of every op, one module per family. No Triton here."""

from lanekit.reference import attention, rnn

__all__ = ["attention", "rnn"]
