"""The benchmark's targets and data: random-init targets built in memory (no weights on disk) by shape name,
and synthetic datasets with a length mix. Each shape is a config of its model_type, built as its target
family's causal-LM class (trainer/model/families.py): the dense Qwen3 shapes, and the hybrid ones (qwen3.6-27b, tiny-hybrid) as
Qwen3.5's language model, Qwen3_5ForCausalLM (3 Gated DeltaNet : 1 gated attention layers), as the trainer
loads it from the VL checkpoint. trainer/lab/bench/run.py runs them, bench/flops.py counts their work, and the
serving benches (trainer/lab/gpu/regenerate_bench.py, eval_bench.py) build theirs from the same table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer.data.dataset import Dataset

log = logging.getLogger("trainer.bench")


@dataclass(frozen=True)
class Shape:
    """A target's shape: a config of its model_type at these dims (the drafter takes them too)."""
    model_type: str              # the config's (AutoConfig.for_model's key); its family (trainer/model/families.py)
                                 # names the causal-LM class
    hidden: int
    layers: int
    heads: int                   # a hybrid's: its full-attention layers'
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    linear: dict | None = None   # a hybrid's Gated DeltaNet dims and its mRoPE section (every 4th layer is full)
    config: dict = field(default_factory=dict)   # more config keys of the family's (e.g. tied embeddings)

    @property
    def dims(self) -> tuple:
        """(hidden, layers, heads, kv heads, head dim, mlp, vocab)."""
        return self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.mlp, self.vocab

    @property
    def attention_dims(self) -> tuple:
        """dims with the full-attention layers only (a hybrid's every 4th), for the attention checks."""
        return (self.hidden, self.layers // 4 if self.linear else self.layers, *self.dims[2:])


# Qwen3.6-27B's text stack at its real dims (config.json): 16 x (3 Gated DeltaNet + 1 gated full attention),
# full attention 24 x 256 heads over 4 KV heads, partial mRoPE; linear attention 16 QK / 48 V heads of 128, a
# 4-tap conv; an untied 248,320-token head. tiny-hybrid: the same structure at dflash-tiny --arch qwen3_5's size.
QWEN3_6_LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, mrope_section=[11, 11, 10])
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, mrope_section=[2, 1, 1])
SHAPES = {
    "tiny": Shape("qwen3", 64, 8, 4, 2, 16, 128, 512),
    "1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936),
    "8b": Shape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936),
    "27b": Shape("qwen3", 5120, 64, 40, 8, 128, 21504, 151936),
    "tiny-hybrid": Shape("qwen3_5_text", 64, 8, 4, 2, 32, 128, 512, linear=TINY_LINEAR),
    "qwen3.6-27b": Shape("qwen3_5_text", 5120, 64, 24, 4, 256, 17408, 248320, linear=QWEN3_6_LINEAR),
    # SmolLM2-135M-Instruct (dflash-real's model): a Llama with tied embeddings, 49,152 rows, every one a token
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 64, 1536, 49152, config=dict(
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
}
SHAPES["qwen3.5-tiny"] = SHAPES["tiny-hybrid"]   # the serving benches' name for it


def target_config(shape: str):
    """The target's config at `shape`, of its model_type (Qwen3Config; a hybrid's Qwen3_5TextConfig, the
    language model of the VL checkpoint, partial interleaved mRoPE, theta 1e7)."""
    from transformers import AutoConfig
    s = SHAPES[shape]
    common = dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.mlp, vocab_size=s.vocab,
                  max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    common.update(s.config)
    if s.linear:
        lin = dict(s.linear)
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": lin.pop("mrope_section"), "mrope_interleaved": True}
        common.update(rope_parameters=rope, **lin)
    return AutoConfig.for_model(s.model_type, **common)


def make_target_factory(shape: str, dtype, layers: int | None = None):
    """device -> a frozen random-init target of `shape` (its first `layers` layers only, if given): its
    family's causal-LM class (a hybrid shape: Qwen3_5ForCausalLM). Logs the kernels each layer class runs
    there (trainer/model/target.py)."""
    from trainer.model.target import causal_lm_class, describe_kernels, layer_kernels
    cfg = target_config(shape)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    cls = causal_lm_class(cfg)

    def factory(device):
        m = random_target(cls, cfg, dtype, device)
        log.info("bench target %s on %s: kernels %s", shape, device,
                 describe_kernels(layer_kernels(m, torch.device(device).type)))
        return m
    return factory


def random_target(cls, cfg, dtype, device):
    """A frozen `cls(cfg)` with seed-0 random weights, built in `dtype` on `device`, attention on sdpa."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            m = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    cfg._attn_implementation = "sdpa"
    return m.eval().requires_grad_(False)


def synthetic_dataset(n_tokens: int, max_len: int, vocab: int, supervised: float, seed: int = 0,
                      mean_len: int = 2048, min_len: int = 64) -> Dataset:
    """Log-normal lengths (median ~mean_len/1.3) clipped to [min_len, max_len]; the last `supervised`
    share of each sequence is the completion (loss mask)."""
    rng = np.random.default_rng(seed)
    recs, total = [], 0
    while total < n_tokens:
        n = int(np.clip(rng.lognormal(np.log(mean_len / 1.3), 0.8), min_len, max_len))
        ids = rng.integers(0, min(vocab, 150000), n)
        mask = np.zeros(n, np.int8)
        mask[int(n * (1 - supervised)):] = 1
        recs.append((ids, mask))
        total += n
    return Dataset.from_records(recs)
