"""Datasets on disk: the shard format and loader, and dflash-prepare."""
