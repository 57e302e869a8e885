"""Measurement and developer tools: the benchmark, the stream-order replay and checker CLI, dflash-tiny."""
