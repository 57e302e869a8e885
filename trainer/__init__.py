"""DFlash drafter training pipeline.

One process per GPU (torch.distributed): target ranks run frozen copies of a causal LM and send the
tapped hidden states to drafter ranks (NCCL point-to-point), which train a DFlash block-diffusion
drafter sharded with FSDP2. See README.md and docs/.
"""

import sys as _sys

__version__ = "0.1.0"

# Optional accelerators load only when asked for (--fp8). transformers imports torchao at import
# time whenever it is installed (its quantizer registry, transformers/quantizers/quantizer_torchao.py),
# and torchao's import loads its compiled kernels (on a CPU torch: two "Failed to load ... .so" lines)
# and registers pytree constants (two deprecation warnings): on every CLI call, --help included, and
# in the unit's journal. A None in sys.modules makes the package look absent to importlib (find_spec
# returns None, import raises ModuleNotFoundError) until allow_optional() lifts it.
DEFERRED = ("torchao",)
for _name in DEFERRED:
    _sys.modules.setdefault(_name, None)


def allow_optional(name: str) -> None:
    """Let the deferred package NAME be found and imported from now on (the caller asked for it)."""
    if name in _sys.modules and _sys.modules[name] is None:
        del _sys.modules[name]
