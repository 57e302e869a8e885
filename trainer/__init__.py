"""DFlash drafter training pipeline.

Target GPUs run frozen replicas of a causal LM and capture tapped hidden states; drafter GPUs
train a DFlash block-diffusion drafter on them. See README.md and docs/.
"""

__version__ = "0.1.0"
