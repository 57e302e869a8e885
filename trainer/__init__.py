"""DFlash drafter training pipeline.

One process per GPU (torch.distributed): target ranks run frozen copies of a causal LM and send the
tapped hidden states to drafter ranks (NCCL point-to-point), which train a DFlash block-diffusion
drafter sharded with FSDP2. See README.md and docs/.
"""

__version__ = "0.1.0"

# Importing the package changes no global state. The programs defer optional accelerators (torchao)
# before transformers loads (trainer/optional.py); allow_optional is kept here for the callers that
# ask for one (--fp8).
from trainer.optional import allow as allow_optional  # noqa: E402,F401
