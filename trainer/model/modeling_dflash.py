"""DFlash drafter as a Hugging Face model, plus the speculative generation loop that serving runs.

This file is self-contained (torch + transformers only): `dflash-export` copies it next to the
weights, and config.json's `auto_map` points at it, so that

    AutoModel.from_pretrained(export_dir, trust_remote_code=True)

builds this drafter (not a plain decoder). The trainer's own model (trainer/model/drafter.py, packed layout)
and this one hold the same parameters under the same names; a test checks that their forwards agree.

Call convention (the DFlash authors' reference class uses the same one, so either loop drives either
model): `forward(position_ids, noise_embedding, target_hidden, past_key_values=None)`
  target_hidden    [b, Tc, K*H]  tapped target hidden states of the context tokens not yet in the cache
  noise_embedding  [b, Tq, H]    target embeddings of the block: real token at slot 0, MASK after it
  position_ids     [b, Tc + Tq]  positions of those context rows, then of the block rows
Every block row attends to every cached and new context row and to every block row (not causal), except
in a sliding layer (config.layer_types[i] == "sliding_attention"), which is causal over the last
config.sliding_window positions, as SGLang and vLLM run it (a row at position p sees keys k <= p, p - k < W).
Returns the final-normed hidden states of the block rows [b, Tq, H]; feed them to the target's LM head.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions. Negative crop() means "remove that many" in transformers 4.x
    and 5.x alike (5.x rejects the positive, absolute form the 4.x reference loop uses). A cache that
    records the past (a hybrid target's linear-attention layers, `target_cache`) is cropped even by 0:
    that is what frees the states it recorded for the rollback."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0 or records_past(cache):
        cache.crop(-max(extra, 0))


def records_past(cache) -> bool:
    """Whether `cache` records the past (a hybrid's linear-attention layers: `target_cache`), so that its crop
    rolls states back rather than only forgetting KV positions."""
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ()))


def target_cache(target, block_size: int):
    """The target's cache for speculative generation: transformers' DynamicCache(config=...), so that a hybrid
    target's linear-attention layers (Qwen3.5's Gated DeltaNet) get their conv and recurrent states. On a
    hybrid, past recording keeps the recurrent states of a forward's last `block_size` positions and the conv
    inputs, so that crop() rolls them back to the accepted length, as the DFlash reference loop does (its
    activate_past_recording() without a count fails in the layer on transformers 5.x: the count is needed)."""
    cache = DynamicCache(config=target.config)
    if any(getattr(cache, "is_linear", ()) or ()):
        cache.activate_past_recording(recurrent_states_to_keep=block_size)
    return cache


def _dflash_field(config, key: str, default=None):
    """dflash_config[key], else the top-level attribute (both layouts exist in published configs)."""
    sub = getattr(config, "dflash_config", None) or {}
    if key in sub:
        return sub[key]
    return getattr(config, key, default)


class DFlashAttention(nn.Module):
    """Qwen3 attention; keys and values are cat(proj(context), proj(block)) ("KV injection")."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        types = getattr(config, "layer_types", None) or ()
        sliding = layer_idx < len(types) and types[layer_idx] == "sliding_attention"
        self.sliding_window = int(config.sliding_window) if sliding else None

    def window_mask(self, key_pos: torch.LongTensor, query_pos: torch.LongTensor) -> torch.Tensor:
        """[b, 1, Tq, K] bool for a sliding layer: key position <= query position, within the window."""
        d = query_pos[:, :, None] - key_pos[:, None, :]
        return ((d >= 0) & (d < self.sliding_window))[:, None]

    def forward(self, x, ctx, cos, sin, attention_mask=None, past_key_values=None, position_ids=None):
        b, tq, _ = x.shape
        tc = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, tq, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, tc + tq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, tc + tq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # cos/sin cover the new context rows then the block rows; queries are the last tq of them
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -tq:], sin[:, -tq:])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.sliding_window is not None:
            if position_ids is None:
                raise ValueError("a sliding draft layer needs position_ids")
            # without a cache the keys are the rows given; with one, a key's index is its position (a
            # DynamicCache of positions 0.., or a preallocated buffer written at each position) except the
            # block rows, always the last tq keys (a buffer may append them after its view)
            kpos = position_ids if past_key_values is None else torch.cat(
                [torch.arange(k.shape[2] - tq, device=k.device).expand(b, -1), position_ids[:, -tq:]], dim=1)
            win = self.window_mask(kpos, position_ids[:, -tq:])
            attention_mask = win if attention_mask is None else attention_mask & win
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, tq, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, ctx, cos, sin, attention_mask=None, past_key_values=None, position_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask, past_key_values, position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter: fc + hidden_norm fuse the K taps; Qwen3-style layers with KV injection; final norm.
    No embedding and no LM head: both are the target's."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = list(_dflash_field(config, "target_layer_ids"))
        self.block_size = int(_dflash_field(config, "block_size"))
        self.mask_token_id = int(_dflash_field(config, "mask_token_id"))
        self.num_target_layers = int(_dflash_field(config, "num_target_layers"))
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, noise_embedding: torch.Tensor,
                target_hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """attention_mask (optional): bool [b, 1, Tq, cached + Tc + Tq], True where a block row may attend."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        x = noise_embedding.to(ctx.dtype)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask, past_key_values, position_ids)
        return self.norm(x)

    # ---------------------------------------------------------------- one proposal, as serving does it

    def extract_taps(self, hidden_states) -> torch.Tensor:
        """HF `output_hidden_states` tuple -> [b, T, K*H]; tap i is the output of target layer i."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def draft_logits(self, target, new_taps: torch.Tensor, first_token: int, start: int, cache) -> torch.Tensor:
        """Logits [B-1, V] for positions start+1 .. start+B-1 of one sequence.

        new_taps [1, n, K*H]: taps of positions start-n .. start-1 (the rows `cache` lacks); the token at
        `start` is known (slot 0) and is not yet in the context. The cache keeps the context rows only."""
        dev = self.fc.weight.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = first_token
        noise = target.get_input_embeddings()(block.to(target.get_input_embeddings().weight.device))
        cached = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(cached, start + self.block_size, device=dev)[None]
        hidden = self(position_ids=pos, noise_embedding=noise.to(dev), target_hidden=new_taps.to(dev),
                      past_key_values=cache)
        if cache is not None:
            crop_cache(cache, start)
        head = target.get_output_embeddings()
        return head(hidden[0, 1:].to(head.weight.device, head.weight.dtype)).float()

    @torch.no_grad()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: Optional[list[int]] = None, temperature: float = 0.0,
                      generator: Optional[torch.Generator] = None) -> torch.LongTensor:
        """The reference README's entry point: prompt [1, P] -> prompt + generated tokens [1, P + n]."""
        return dflash_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature,
                               generator).output_ids


@dataclass
class SpecResult:
    output_ids: torch.LongTensor            # [1, P + n]: prompt then generated tokens
    num_prompt_tokens: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step (<= B)


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])


def verify_block(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                 temperature: float, generator=None) -> tuple[int, int]:
    """(accepted drafts, next token). draft_tokens [B-1]; draft_logits [B-1, V]; target_logits [B, V],
    row k = the target's distribution for the token after block slot k.

    Greedy: accept while the draft equals the target's argmax; the next token is the target's argmax
    after the last accepted slot. Temperature > 0: standard speculative sampling (accept draft d with
    probability min(1, p(d)/q(d)); on rejection sample from max(0, p - q) renormalised); if every draft
    is accepted, the bonus token is sampled from p after the last slot."""
    n = draft_tokens.shape[0]
    if temperature <= 0:
        choice = target_logits.argmax(-1)
        ok = (draft_tokens == choice[:n]).int()
        acc = int(torch.cumprod(ok, 0).sum())
        return acc, int(choice[acc])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    dev = p.device
    for k in range(n):
        d = int(draft_tokens[k])
        r = torch.rand((), generator=generator, device=generator.device if generator is not None else dev)
        if float(r) < min(1.0, float(p[k, d] / q[k, d].clamp_min(1e-30))):
            continue
        resid = (p[k] - q[k]).clamp_min(0)
        resid = resid / resid.sum() if float(resid.sum()) > 0 else p[k]
        return k, int(torch.multinomial(resid, 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def _cache_kw(target) -> str:
    """transformers 5.x renames forward's past_key_values to cache; use whichever the target takes."""
    import inspect
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


@torch.no_grad()
def dflash_generate(drafter, target, input_ids: torch.LongTensor, max_new_tokens: int,
                    stop_token_ids: Optional[list[int]] = None, temperature: float = 0.0,
                    generator: Optional[torch.Generator] = None, phases=None) -> SpecResult:
    """Speculative generation for one prompt [1, P], the loop serving engines run:
    prefill -> first token; then repeat: the drafter proposes B-1 tokens from the target's taps of the
    accepted prefix, the target verifies the block [last token, drafts] in one forward, the matching
    prefix plus one target token (the bonus) are emitted. `accept_lengths` holds the tokens emitted per
    verify step; their mean is tau. `drafter` needs block_size, extract_taps and draft_logits. `phases`: a
    timer whose phase(name) is a context manager around each phase of the step (dflash-eval --profile-phases:
    trainer/serving/phases.py); None: none."""
    dev = input_ids.device
    bs = drafter.block_size
    stops = set(stop_token_ids or [])
    n_prompt = input_ids.shape[1]
    cache_t = target_cache(target, bs)
    cache_d = DynamicCache()
    kw = _cache_kw(target)
    phase = phases.phase if phases is not None else _no_phase
    crop = "rollback" if records_past(cache_t) else "crop"   # a dense target's crop only forgets KV positions
    with phase("prefill"):
        out = target(input_ids=input_ids, position_ids=torch.arange(n_prompt, device=dev)[None],
                     use_cache=True, output_hidden_states=True, **{kw: cache_t})
        token = int(_pick(out.logits[0, -1], temperature, generator))
        new_taps = drafter.extract_taps(out.hidden_states)
        crop_cache(cache_t, n_prompt)   # a hybrid's recorded prefill states are not needed: free them
    generated = [token]
    res = SpecResult(output_ids=input_ids, num_prompt_tokens=n_prompt)
    start = n_prompt  # position of `token`, the newest token, not yet seen by the target
    while len(generated) < max_new_tokens and token not in stops:
        with phase("draft"):
            q_logits = drafter.draft_logits(target, new_taps, token, start, cache_d)
            drafts = _pick(q_logits, temperature, generator).to(dev)
        with phase("verify"):
            block = torch.cat([torch.tensor([token], device=dev), drafts])[None]
            out = target(input_ids=block, position_ids=torch.arange(start, start + bs, device=dev)[None],
                         use_cache=True, output_hidden_states=True, **{kw: cache_t})
        with phase("accept"):
            acc, nxt = verify_block(drafts, q_logits, out.logits[0], temperature, generator)
            emitted = drafts[:acc].tolist() + [nxt]
        res.accept_lengths.append(len(emitted))
        new_taps = drafter.extract_taps(out.hidden_states)[:, :acc + 1]
        start += acc + 1
        with phase(crop):
            crop_cache(cache_t, start)
        if phases is not None:
            phases.step()
        for t in emitted:
            generated.append(t)
            if t in stops:
                break
        token = generated[-1]
    return finish_output(res, input_ids, generated, stops, max_new_tokens)


_NULL = nullcontext()


def _no_phase(name: str):
    return _NULL


def finish_output(res, input_ids, generated: list, stops, max_new_tokens: int):
    """The generation loops' last step: `generated` cut at max_new_tokens and after the first stop token,
    appended to the prompt as res.output_ids."""
    generated = generated[:max_new_tokens]
    for i, t in enumerate(generated):
        if t in stops:
            generated = generated[:i + 1]
            break
    res.output_ids = torch.cat([input_ids, torch.tensor([generated], device=input_ids.device,
                                                        dtype=input_ids.dtype)], dim=1)
    return res
