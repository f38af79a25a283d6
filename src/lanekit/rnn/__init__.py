"""RNN cells: one step of torch.nn.LSTMCell, GRUCell and RNNCell, forward and backward."""

from lanekit.rnn.api import gru_cell, lstm_cell, rnn_cell

__all__ = ["gru_cell", "lstm_cell", "rnn_cell"]
