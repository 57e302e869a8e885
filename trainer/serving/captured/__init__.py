"""The captured decoders: serving's own generation loops around the target's own modules (transformers'
decoder layers, rotary embedding, norms, LM head), each with preallocated caches and its step captured as
CUDA graphs on GPUs. Two loops, and the rooms they share:

  regenerate_decoder.py  GraphDecoder: dflash-regenerate's batched greedy (or sampled) decoding of the
                         target alone (`--decoder captured`)
  eval_decoder.py        BatchedSpecDecoder: dflash-eval's batched speculative loop (`--loop batched`):
                         the drafter drafts, the target verifies every row's block in one forward
  proposers.py           what drafts in that loop: DFlash's or DFlash2's drafter, or prompt lookup (n-gram)
  attention.py           the attention functions the target runs inside them (a decode step's query heads
                         folded per KV head; the verify step's; the split-KV kernel's switch) and the masks
                         by layer type (a sliding layer's window)
  fused_ops.py           the decode step's small ops compiled (norms, rotary, SiLU-gated MLP) with `fuse`
  kv_cache.py            the preallocated KV caches (one per loop) that answer transformers' cache API
  linear_states.py       a hybrid target's linear-attention layers (Qwen3.5/3.6 Gated DeltaNet): their conv
                         and recurrent states in buffers allocated once, the verify step's rollback, the
                         in-place recurrent step, and what these loops can hold (`hybrid_unsupported`)

Same tokens as transformers' `generate` (greedy) and the same accept lengths as `dflash_generate`;
tests/serving/test_regenerate.py and tests/serving/test_evaluate.py compare them on the CPU, where the same loops run
without graphs. Nothing is imported here: import the room you need.
"""
