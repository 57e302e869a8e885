"""Kernels and numerics shared by training and serving: the block-attention plan (which rows attend to what), the chunked LM-head loss, the compile helpers, the split-KV decode attention."""
