"""The oracles: plain PyTorch definitions of every op, one module per family. No Triton here."""

from lanekit.reference import attention, layers, rnn

__all__ = ["attention", "layers", "rnn"]
