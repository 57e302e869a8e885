"""DFlash2's speculative generation for dflash-eval: the selector's path proposed, verified by the target.

Per verify step, as the reference `dflash` package's loop and SGLang/vLLM run it: the drafter drafts one
block from the target's taps of the accepted prefix (slot 0 the newest token, the rest the mask token);
the candidate selector (dflash2.CandidateSelector.walk) walks its top-K candidates from that token and
proposes the path; the target verifies [token, path] in one forward.

- Greedy: the path's longest prefix equal to the target's argmax is accepted, plus the target's next token.
- Temperature T > 0: position k's draft d was drawn from q_k, the softmax of the selector's scores / T over
  position k's candidates (given the draft before it). Accept it with probability min(1, p_k(d) / q_k(d)),
  p_k the target's softmax(logits / T); at the first rejection draw from max(0, p_k - q_k) renormalised
  (q_k scattered onto the vocabulary at its candidates); with every draft accepted, the bonus token from
  p after the last. The emitted tokens are distributed as the target's sampling (q_k is the distribution
  the draft was actually drawn from, given the prefix the target accepted).

The single loop (dflash2_generate) runs the trainer's packed class (drafter.DFlashDrafter with its DFlash2
config) on the whole accepted context each step (no drafter cache: the context rows are the same taps, so
the drafts are a cached loop's). The batched loop (captured/eval_decoder.BatchedSpecDecoder) runs the same
weights as DFlash2CachedModel: modeling_dflash's layers with their context K/V in the loop's cache, each
sublayer wrapped in its block convolution (one block per row, so the packed layout's conv applies as it is).
tau: tokens emitted per verify step, as modeling_dflash.dflash_generate counts them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.dflash2 import CandidateSelector, GroupedDynamicConv
from trainer.model.drafter import DFlashDrafter, PackedMeta
from trainer.model.modeling_dflash import (
    DFlashDecoderLayer,
    DFlashDraftModel,
    SpecResult,
    _cache_kw,
    crop_cache,
    finish_output,
    records_past,
    target_cache,
    verify_block,
)
from trainer.serving import phases


class DFlash2CachedLayer(DFlashDecoderLayer):
    """modeling_dflash's layer with DFlash2's convolution around each sublayer (drafter.DFlashLayer's forward).
    The block rows of a call are one block per row ([b, B, H]), so the packed convolution runs on them
    flattened, taps never crossing rows."""

    def __init__(self, config, layer_idx: int, kernel_size: int, group_size: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel_size, group_size)

    def forward(self, x, ctx, cos, sin, attention_mask=None, past_key_values=None, position_ids=None):
        b, tq, hs = x.shape
        flat = lambda t: t.reshape(b * tq, hs)   # noqa: E731
        h, out_kernel = self.attention_conv.prepare(flat(self.input_layernorm(x)), tq)
        a = self.self_attn(h.view(b, tq, hs), ctx, cos, sin, attention_mask, past_key_values, position_ids)
        x = x + self.attention_conv.finish(flat(a), out_kernel, tq).view(b, tq, hs)
        h, out_kernel = self.mlp_conv.prepare(flat(self.post_attention_layernorm(x)), tq)
        return x + self.mlp_conv.finish(self.mlp(h), out_kernel, tq).view(b, tq, hs)


class DFlash2CachedModel(DFlashDraftModel):
    """A DFlash2 drafter in modeling_dflash's call convention (its context K/V cached by the caller), with its
    candidate selector: the batched loop's drafter. Same parameter names as the trainer's class."""

    def __init__(self, config, dcfg):
        super().__init__(config)
        self.layers = nn.ModuleList(
            DFlash2CachedLayer(config, i, dcfg.conv_kernel_size, dcfg.conv_group_size)
            for i in range(config.num_hidden_layers))
        self.candidate_selector = CandidateSelector(dcfg.vocab_size, dcfg.hidden_size, dcfg.selector_rank,
                                                    dcfg.selector_top_k)

    @classmethod
    def of(cls, model: DFlashDrafter) -> "DFlash2CachedModel":
        """The same weights (strict) on the same device and dtype as the trainer's `model`."""
        from transformers import Qwen3Config

        from trainer.serving.export import hf_config_dict
        p = next(model.parameters())
        out = cls(Qwen3Config(**hf_config_dict(model.cfg)), model.cfg)
        out.load_state_dict(model.state_dict(), strict=True)
        return out.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def pick(self, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """hidden [R, B-1, H] and logits [R, B-1, V] of the draft positions, first [R] the anchor token ->
        the selector's greedy path [R, B-1]: CandidateSelector.walk's, with the pair scores of every
        (candidate at k-1, candidate at k) computed up front in one product, so the walk itself is a gather and
        an argmax per position (fewer kernels in the captured step; the same scores up to summation order)."""
        sel = self.candidate_selector
        pred, succ = sel.predecessor_codebook, sel.successor_codebook
        unary, cand = torch.topk(logits.float(), sel.top_k, dim=-1)                # [R, L, K]
        first_scores = unary[:, 0] + sel.pair_scores(hidden[:, 0], first, cand[:, 0])
        idx = first_scores.argmax(-1)
        path = [cand[:, 0].gather(1, idx[:, None])[:, 0]]
        if hidden.shape[1] > 1:
            ctx = F.embedding(cand[:, :-1], pred) * sel.hidden_projection(hidden[:, 1:]).to(pred.dtype)[:, :, None]
            pair = torch.matmul(ctx, F.embedding(cand[:, 1:], succ).transpose(-1, -2)).float()   # [R, L-1, K, K]
            k = sel.top_k
            for pos in range(1, hidden.shape[1]):
                row = pair[:, pos - 1].gather(1, idx[:, None, None].expand(-1, 1, k))[:, 0]    # after the pick
                idx = (unary[:, pos] + row).argmax(-1)
                path.append(cand[:, pos].gather(1, idx[:, None])[:, 0])
        return torch.stack(path, 1)


class DFlash2Proposer:
    """A DFlash2 DFlashDrafter as the generation loop uses it (block_size, extract_taps, propose)."""

    def __init__(self, model: DFlashDrafter):
        if not model.cfg.architecture.selector:
            raise ValueError(f"DFlash2Proposer needs a drafter with a candidate selector, got a "
                             f"{model.cfg.architecture.name} drafter")
        self.model = model.eval()
        self.cfg = model.cfg
        self.block_size = model.cfg.block_size
        self.target_layer_ids = list(model.cfg.target_layer_ids)
        self._cached: DFlash2CachedModel | None = None

    def to(self, *args, **kwargs) -> "DFlash2Proposer":
        self.model.to(*args, **kwargs)
        return self

    def parameters(self):
        return self.model.parameters()

    def state_dict(self):
        return self.model.state_dict()

    def cached(self) -> DFlash2CachedModel:
        """These weights as the batched loop's drafter (built once)."""
        if self._cached is None:
            self._cached = DFlash2CachedModel.of(self.model)
        return self._cached

    def extract_taps(self, hidden_states) -> torch.Tensor:
        """HF `output_hidden_states` -> [b, T, K*H] (tap i: the output of target layer i)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def propose(self, target, taps: torch.Tensor, first_token: int, temperature: float = 0.0,
                generator: Optional[torch.Generator] = None):
        """taps [n, K*H] of positions 0..n-1 (the accepted context); the block is anchored at n with
        `first_token` in slot 0 -> (path [B-1], candidates [B-1, K], q [B-1, K] fp32 or None at T = 0)."""
        cfg, bs = self.cfg, self.block_size
        p = next(self.model.parameters())
        dev, n = p.device, taps.shape[0]
        embed = target.get_input_embeddings().weight
        block = torch.full((bs,), cfg.mask_token_id, dtype=torch.long, device=embed.device)
        block[0] = first_token
        slot = torch.arange(bs, device=dev)
        meta = PackedMeta(ctx_seq=torch.zeros(n, dtype=torch.long, device=dev), ctx_pos=torch.arange(n, device=dev),
                          q_seq=torch.zeros(bs, dtype=torch.long, device=dev), q_anchor=torch.full_like(slot, n),
                          q_pos=n + slot, block_size=bs)
        hidden = self.model(taps.to(dev, p.dtype), embed[block].to(dev, p.dtype), meta, backend="sdpa")[1:]
        head = target.get_output_embeddings().weight
        logits = hidden.to(head.dtype) @ head.t()
        anchor = torch.tensor([first_token], device=dev)
        path, cand, q = self.model.candidate_selector.walk(hidden[None], logits[None].to(dev), anchor, temperature,
                                                           generator)
        return path[0], cand[0], (q[0] if q is not None else None)


def verify_candidates(path: torch.Tensor, cand: torch.Tensor, q: Optional[torch.Tensor], target_logits: torch.Tensor,
                      temperature: float, generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """(accepted drafts, next token). path [B-1]; cand [B-1, K]; q [B-1, K] (T > 0); target_logits [B, V],
    row k the target's distribution for the token after block slot k. See the module docstring."""
    n = path.shape[0]
    if temperature <= 0:
        return verify_block(path, None, target_logits, 0.0)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = q.float().to(p.device)
    cand = cand.to(p.device)
    gdev = generator.device if generator is not None else p.device
    for k in range(n):
        d = int(path[k])
        qd = float(q[k][cand[k] == d].sum())
        r = float(torch.rand((), generator=generator, device=gdev))
        if r * qd < float(p[k, d]):
            continue
        resid = p[k].clone().scatter_add_(0, cand[k], -q[k]).clamp_min_(0)
        resid = resid / resid.sum() if float(resid.sum()) > 0 else p[k]
        return k, int(torch.multinomial(resid, 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


@torch.no_grad()
def dflash2_generate(drafter: DFlash2Proposer, target, input_ids: torch.LongTensor, max_new_tokens: int,
                     stop_token_ids: Optional[list[int]] = None, temperature: float = 0.0,
                     generator: Optional[torch.Generator] = None) -> SpecResult:
    """Speculative generation of one prompt [1, P] with a DFlash2 drafter; the loop and its counts are
    modeling_dflash.dflash_generate's, the proposal and its verification the selector's. Inside
    phases.recording its phases are timed as dflash_generate's are (dflash-eval --profile-phases)."""
    timer = phases.active()
    phase = timer.phase
    dev = input_ids.device
    bs = drafter.block_size
    stops = set(stop_token_ids or [])
    n_prompt = input_ids.shape[1]
    cache_t = target_cache(target, bs)
    kw = _cache_kw(target)
    crop = "rollback" if records_past(cache_t) else "crop"   # a dense target's crop only forgets KV positions
    with phase("prefill"):
        out = target(input_ids=input_ids, position_ids=torch.arange(n_prompt, device=dev)[None],
                     use_cache=True, output_hidden_states=True, **{kw: cache_t})
        last = out.logits[0, -1].float()
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator))
        else:
            token = int(last.argmax())
        taps = drafter.extract_taps(out.hidden_states)[0]
        crop_cache(cache_t, n_prompt)
    generated = [token]
    res = SpecResult(output_ids=input_ids, num_prompt_tokens=n_prompt)
    start = n_prompt   # position of `token`, the newest token, not yet seen by the target
    while len(generated) < max_new_tokens and token not in stops:
        with phase("draft"):
            path, cand, q = drafter.propose(target, taps, token, temperature, generator)
        with phase("verify"):
            block = torch.cat([torch.tensor([token], device=dev), path.to(dev)])[None]
            out = target(input_ids=block, position_ids=torch.arange(start, start + bs, device=dev)[None],
                         use_cache=True, output_hidden_states=True, **{kw: cache_t})
        with phase("accept"):
            acc, nxt = verify_candidates(path.to(dev), cand, q, out.logits[0], temperature, generator)
            emitted = path[:acc].tolist() + [nxt]
        res.accept_lengths.append(len(emitted))
        taps = torch.cat([taps, drafter.extract_taps(out.hidden_states)[0, :acc + 1]])
        start += acc + 1
        with phase(crop):
            crop_cache(cache_t, start)
        timer.step()
        for t in emitted:
            generated.append(t)
            if t in stops:
                break
        token = generated[-1]
    return finish_output(res, input_ids, generated, stops, max_new_tokens)
