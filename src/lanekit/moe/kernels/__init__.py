"""The mixture-of-experts kernels and their launchers: routing.py (top-k softmax, grouped top-k),
align.py (moe_align_block_size), transport.py (dispatch and combine), gemm.py (the grouped GEMM, its weights' gradient and
the fused expert MLP's backward), fused.py (the fused expert MLP's forward). Imported on a lane's first call (see lanekit.runtime.lanes)."""
