"""The benchmark's targets and data: random-init Qwen3-shaped targets built in memory (no weights on disk) by
shape name, and synthetic datasets with a length mix. The hybrid shapes (qwen3.6-27b, tiny-hybrid) are
Qwen3.5's language model, Qwen3_5ForCausalLM (3 Gated DeltaNet : 1 gated attention layers), as the trainer
loads it from the VL checkpoint. trainer/tools/bench.py runs them; bench_flops.py counts their work. The
serving benches' hybrid targets (HYBRID_SHAPES, make_hybrid_target) are here too.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from trainer.data.dataset import Dataset

log = logging.getLogger("trainer.bench")

SHAPES = {
    # name: (hidden, layers, heads, kv heads, head dim, mlp, vocab)
    "tiny": (64, 8, 4, 2, 16, 128, 512),
    "1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
    "8b": (4096, 36, 32, 8, 128, 12288, 151936),
    "27b": (5120, 64, 40, 8, 128, 21504, 151936),
    # hybrids (HYBRID below): the full-attention layers' dims here; the drafter takes these too
    "tiny-hybrid": (64, 8, 4, 2, 32, 128, 512),
    "qwen3.6-27b": (5120, 64, 24, 4, 256, 17408, 248320),
}
# the hybrid shapes' Gated DeltaNet layers (every 4th layer is full attention) and rope (Qwen3.6-27B's
# config.json; tiny-hybrid is dflash-tiny --arch qwen3_5's)
HYBRID = {
    "tiny-hybrid": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, mrope_section=[2, 1, 1]),
    "qwen3.6-27b": dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, mrope_section=[11, 11, 10]),
}


def qwen3_config(shape: str):
    """The target's config: Qwen3Config, or for a hybrid shape Qwen3_5TextConfig (the language model of
    the VL checkpoint, partial interleaved mRoPE, theta 1e7)."""
    from transformers import Qwen3Config
    h, n, nh, nkv, hd, mlp, vocab = SHAPES[shape]
    if shape in HYBRID:
        from transformers import Qwen3_5TextConfig
        lin = dict(HYBRID[shape])
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": lin.pop("mrope_section"), "mrope_interleaved": True}
        return Qwen3_5TextConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=nh,
                                 num_key_value_heads=nkv, head_dim=hd, intermediate_size=mlp, vocab_size=vocab,
                                 max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6,
                                 rope_parameters=rope, **lin)
    return Qwen3Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=nh, num_key_value_heads=nkv,
                       head_dim=hd, intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=32768,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)


def make_target_factory(shape: str, dtype, layers: int | None = None):
    """device -> a frozen random-init Qwen3 of `shape` (its first `layers` layers only, if given); a hybrid
    shape gives Qwen3_5ForCausalLM. Logs the kernels each layer class runs there (trainer/model/target.py)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    from trainer.model.target import describe_kernels, layer_kernels
    cfg = qwen3_config(shape)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    cls = Qwen3_5ForCausalLM if shape in HYBRID else Qwen3ForCausalLM

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


# The serving benches' hybrid targets (trainer/tools/gpu/regenerate_bench.py and eval_bench.py; issue 39):
# Qwen3.6-27B's text stack at its real dims (Qwen3_5ForCausalLM, random weights): 16 x (3 Gated DeltaNet + 1
# gated full attention), full attention 24 x 256 heads over 4 KV heads, partial mRoPE; linear attention 16 QK / 48 V heads of 128, a 4-tap conv; untied 248,320-token head.
# "qwen3.5-tiny": the same structure at the CPU smoke size. (Attention dims in SHAPES' order for the
# attention check: hidden, full-attention layers, heads, KV heads, head dim, mlp, vocab.)
HYBRID_SHAPES = {
    "qwen3.6-27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, vocab_size=248320,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, mrope_section=[11, 11, 10]),
    "qwen3.5-tiny": dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128, vocab_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4, mrope_section=[2, 1, 1]),
}


def hybrid_dims(name: str) -> tuple:
    d = HYBRID_SHAPES[name]
    return (d["hidden_size"], d["num_hidden_layers"] // 4, d["num_attention_heads"], d["num_key_value_heads"],
            d["head_dim"], d["intermediate_size"], d["vocab_size"])


def make_hybrid_target(name: str, dtype, device):
    """A frozen random-init Qwen3_5ForCausalLM of HYBRID_SHAPES[name] on `device`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    d = dict(HYBRID_SHAPES[name])
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": d.pop("mrope_section"), "mrope_interleaved": True}
    cfg = Qwen3_5TextConfig(**d, rope_parameters=rope, max_position_embeddings=32768,
                            layer_types=["linear_attention", "linear_attention", "linear_attention",
                                         "full_attention"] * (d["num_hidden_layers"] // 4))
    return random_target(Qwen3_5ForCausalLM, cfg, dtype, device)
