"""The drafter model (DFlash, DFlash2), the exported modelling file, the checkpoint format on disk, and what we know about targets (loading, kernels, identity, hybrid layers)."""
