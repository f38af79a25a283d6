"""The mixture-of-experts kernels and their launchers: routing.py (top-k softmax, grouped top-k),
align.py (moe_align_block_size), transport.py (dispatch and combine), gemm.py (grouped GEMM and
the fused expert MLP). Imported on a lane's first call (see lanekit.runtime.lanes)."""
