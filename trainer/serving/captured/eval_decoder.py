"""The evaluation loop (BatchedSpecDecoder, dflash-eval --loop batched): greedy speculative decoding of
several prompts at once, each row with its own position, accept length and stop, the verify step captured
as CUDA graphs on GPUs. Its caches are kv_cache.RowKV; a hybrid target's states roll back to each row's
accepted prefix after a verify step (linear_states.rollback_kernels). What drafts is a proposer
(proposers.py): DFlash's or DFlash2's drafter, or prompt lookup (n-gram).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import numpy as np
import torch

from trainer.model.families import check_hybrid_transformers
from trainer.model.target import decoder
from trainer.serving import phases
from trainer.serving.captured.attention import layer_masks, register_attention, sliding_window, verify_attention
from trainer.serving.captured.kv_cache import PAD_TO, RowKV
from trainer.serving.captured.linear_states import (
    LinearStates,
    hybrid_unsupported,
    linear_layer_ids,
    rollback_kernels,
)
from trainer.serving.captured.proposers import proposer_for


class BatchedSpecDecoder:
    """Greedy speculative generation (dflash-eval's loop, trainer/model/modeling_dflash.py `dflash_generate`) of up
    to `batch_size` prompts at once, each row with its own position, accept length and stop.

    A step verifies every row's block [last token, B-1 drafts] in one target forward (each row's keys written
    at its own positions of a preallocated cache, a row attending its positions up to the query's), accepts
    each row's matching prefix plus the bonus token, then drafts every row's next block in one drafter forward
    (the B new context rows of the verified block are all written; those past a row's accepted prefix sit at
    positions the mask hides and the next step overwrites). Rows that finished stay in the batch, frozen.
    The target's attention folds the query heads of one KV head into rows of one attention
    (attention.py's verify attention): the KV cache is read once per step, not once per query head.
    On a GPU the step is one CUDA graph per KV view length (`graphs`), captured once and replayed; the host
    reads each row's position and stop flag once per step. The prefill runs eagerly: the target over the
    right-padded rows (causal, so the padding changes nothing before each row's end), then the drafter's
    first block row by row. Same accept lengths as `dflash_generate` (tests/serving/test_evaluate.py compares
    them on the CPU). `drafter`: a DFlash drafter, a DFlash2 one (dflash2_eval.DFlash2Proposer) or a proposer
    (proposers.py, e.g. NgramProposer); `hist` [R, capacity + 1] holds each row's tokens by position."""

    def __init__(self, target, drafter, device, batch_size: int, max_new_tokens: int, stop_ids,
                 graphs: bool | None = None, view_step: int = 128, prefill_tokens: int = 16384):
        self.target, self.device = target, torch.device(device)
        self.proposer = proposer_for(drafter)
        self.base = decoder(target)
        self.head = target.get_output_embeddings()
        self.embed = target.get_input_embeddings()
        self.cfg = self.base.config
        self.batch, self.max_new = batch_size, max_new_tokens
        self.block = self.proposer.block_size
        self.taps = list(self.proposer.taps)   # HF hidden_states index of each tap the proposer reads
        self.stop_ids = list(stop_ids)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs and self.device.type == "cuda")
        self.view_step, self.prefill_tokens = view_step, prefill_tokens
        params = inspect.signature(self.base.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.dtype = next(target.parameters()).dtype
        # a hybrid target: its linear-attention states are rolled back to each row's accepted length (on
        # transformers >= trainer/model/families.py's floor, else one line, here)
        check_hybrid_transformers(self.cfg)
        why = hybrid_unsupported(self.base, speculative=True)
        if why:
            raise ValueError(f"the batched loop cannot run this target: {why}")
        self.linear_ids = linear_layer_ids(self.cfg)
        self.window = sliding_window(self.cfg)   # sliding layers: attention.layer_masks
        self.capacity = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        self.steps = 0            # batched steps run (each verifies every unfinished row once)
        self.timer = phases.NO_PHASES    # the phases' timer of the batch running (phases.active(), set by generate)
        register_attention()

    # ---------------------------------------------------------------- state
    def _alloc(self, capacity: int) -> None:
        if self.capacity >= capacity:
            return
        capacity = -(-capacity // self.view_step) * self.view_step
        self._graphs.clear()
        self._pool = None
        self.tcache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        c, dev, r, bs = self.cfg, self.device, self.batch, self.block
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.tcache = RowKV(c.num_hidden_layers, r, kv_heads, capacity, head_dim, self.dtype, dev, 0,
                            LinearStates(self.base, r, self.dtype, dev) if self.linear_ids else None)
        self.proposer.alloc(self, capacity)
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=dev)
        self.start, self.ngen, self.step = z(r), z(r), z(1)
        self.done = z(r, dt=torch.bool)
        self.tokens = z(r, bs)                          # [last token, drafts] per row: the block to verify
        self.out = z(r, self.max_new + bs + 1)          # generated tokens; the last column takes discards
        self.accepted = z(r, max(1, self.max_new))      # tokens emitted per step (0: no step for that row)
        self.hist = z(r, capacity + 1)                  # each row's tokens by position; the last column: discards
        self.kv_pos = torch.arange(capacity, device=dev)
        self.slot = torch.arange(bs, device=dev)
        self.stop = torch.tensor(self.stop_ids or [-1], dtype=torch.long, device=dev)
        self.capacity = capacity

    def _target_attn(self):
        return verify_attention(self.cfg)

    def _rollback(self):
        """A hybrid's chunked kernel reporting to the cache (rollback_kernels), for the forwards inside."""
        return rollback_kernels(self.base, self.tcache.linear) if self.tcache.linear is not None else nullcontext()

    def _step(self, view: int) -> None:
        with self._rollback():
            self._step_inner(view)

    def _step_inner(self, view: int) -> None:
        """One verify step of every row, then the next drafts: all on the device, no host reads."""
        tc = self.tcache
        pos = self.start[:, None] + self.slot[None]                       # [R, B] the block's positions
        tc.rows, tc.view, tc.wpos = None, view, pos
        keys, queries = self.kv_pos[None, None, None, :view], pos[:, None, :, None]
        keep = keys > queries - self.window if self.window is not None else None
        mask = layer_masks(self.cfg, keys <= queries, keep, self.linear_ids)
        if tc.linear is not None:   # a hybrid: record the block, commit each row's accepted prefix below
            tc.linear.defer = True
        timer = self.timer
        with timer.phase("verify"):   # a missing draft (-1) runs as token 0 and is rejected by the comparison below
            out = self.base(input_ids=self.tokens.clamp_min(0), position_ids=pos, attention_mask=mask, use_cache=True,
                            output_hidden_states=bool(self.taps), **{self.cache_kw: tc})
            choice = self.head(out.last_hidden_state).float().argmax(-1)      # [R, B] the target's tokens
            taps = torch.cat([out.hidden_states[i] for i in self.taps], dim=-1) if self.taps else None
        with timer.phase("accept"):
            nxt, acc = self._accept(choice, pos)
        if tc.linear is not None:   # linear-attention states after [last token, accepted drafts]
            with timer.phase("rollback"):
                tc.linear.defer = False
                tc.linear.commit(acc + 1)
        with timer.phase("draft"):
            drafts = self.proposer.step(self, nxt, taps, pos, view)   # the next drafts, from the new start
        self.tokens[:, 0] = nxt
        self.tokens[:, 1:] = drafts
        self.step.add_(1)

    def _accept(self, choice: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's matching prefix plus the bonus token emitted, its position and stop advanced, on the
        device; (the bonus token [R], drafts accepted [R])."""
        ok = (self.tokens[:, 1:] == choice[:, :-1]).long().cumprod(-1)
        acc = ok.sum(-1)                                                  # drafts accepted per row
        nxt = choice.gather(1, acc[:, None])[:, 0]                        # the bonus token
        live = ~self.done
        emitted = self.slot[None] <= acc[:, None]                         # [R, B]: choice[:, :acc+1] is emitted
        self.accepted.index_copy_(1, self.step, torch.where(live, acc + 1, 0)[:, None])
        col = torch.where(emitted & live[:, None], self.ngen[:, None] + self.slot[None], self.out.shape[1] - 1)
        self.out.scatter_(1, col, choice)
        # choice[:, k] is the token at position pos[:, k] + 1
        self.hist.scatter_(1, torch.where(emitted & live[:, None], pos + 1, self.hist.shape[1] - 1), choice)
        hit = ((choice[..., None] == self.stop).any(-1) & emitted).any(-1)
        ngen = self.ngen + acc + 1
        start = self.start + acc + 1
        self.done |= live & (hit | (ngen >= self.max_new))
        self.ngen.copy_(torch.where(live, ngen, self.ngen))
        self.start.copy_(torch.where(live, start, self.start))
        return nxt, acc

    def _capture(self, view: int) -> torch.cuda.CUDAGraph:
        """This step, run eagerly (the warm-up outside the capture), then the graph of the next ones captured
        (capturing runs nothing): the warm-up is kept, as GraphDecoder._capture says why."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(view)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(view)
        self.captures += 1
        return g

    def _replay_or_capture(self, view: int) -> None:
        """One step on a GPU as its graph; the first at this view captures it, timed as one "capture" (no event
        is recorded inside a capture: the step's own phases are off while it runs)."""
        g = self._graphs.get(view)
        if g is not None:
            with self.timer.phase("step"):
                g.replay()
            return
        timer, self.timer = self.timer, phases.NO_PHASES
        try:
            with timer.phase("capture"):   # the capture runs this step eagerly
                self._graphs[view] = self._capture(view)
        finally:
            self.timer = timer

    def _prefill(self, ids: torch.Tensor, last: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over the right-padded prompts `ids` [R, width] (causal, so the padding changes nothing before
        each row's end `last`), in row chunks: (each row's first token [R], the proposer's taps or None)."""
        r, dev, tc = self.batch, self.device, self.tcache
        chunk = max(1, self.prefill_tokens // width)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()[None, None]
        ar = torch.arange(width, device=dev)
        keep = (ar[None, :] > ar[:, None] - self.window) if self.window is not None else None
        pos = torch.arange(width, device=dev)[None]
        first = torch.empty(r, dtype=torch.long, device=dev)
        taps = []
        for r0 in range(0, r, chunk):
            r1 = min(r, r0 + chunk)
            tc.rows = slice(r0, r1)
            mask = layer_masks(self.cfg, causal.expand(r1 - r0, -1, -1, -1), keep, self.linear_ids)
            if tc.linear is not None:   # a hybrid: each row's states after its own prompt, not the padding
                tc.linear.rows, tc.linear.fresh, tc.linear.keep = slice(r0, r1), True, last[r0:r1] + 1
            o = self.base(input_ids=ids[r0:r1], position_ids=pos.expand(r1 - r0, -1),
                          attention_mask=mask, use_cache=True,
                          output_hidden_states=bool(self.taps), **{self.cache_kw: tc})
            h_last = o.last_hidden_state[torch.arange(r1 - r0, device=dev), last[r0:r1]]
            first[r0:r1] = self.head(h_last).float().argmax(-1)
            if self.taps:
                taps.append(torch.cat([o.hidden_states[i] for i in self.taps], dim=-1))
        if tc.linear is not None:
            tc.linear.rows, tc.linear.fresh, tc.linear.keep = slice(None), False, None
        taps = torch.cat(taps) if taps else None
        return first, taps

    # ---------------------------------------------------------------- one batch
    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
        """For each prompt: (tokens emitted per verify step, generated tokens), as dflash_generate gives them."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._generate(prompts)
        return self._generate(prompts)

    def _generate(self, prompts: list[np.ndarray]) -> list[tuple[list[int], np.ndarray]]:
        n, r, bs, dev = len(prompts), self.batch, self.block, self.device
        assert 1 <= n <= r, (n, r)
        rows = list(prompts) + [prompts[-1]] * (r - n)       # a short batch: repeated rows, finished at once
        lens = [len(p) for p in rows]
        width = -(-max(lens) // PAD_TO) * PAD_TO
        self._alloc(max(lens) + self.max_new + 2 * bs)
        ids = torch.zeros((r, width), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, :len(p)] = torch.as_tensor(np.asarray(p), dtype=torch.long)
        ids = ids.to(dev)
        last = torch.as_tensor(lens, device=dev) - 1
        timer = self.timer = phases.active()
        self.out.zero_()
        self.hist.zero_()
        self.accepted.zero_()
        self.step.zero_()
        with self._target_attn(), self._rollback():
            with timer.phase("prefill"):
                first, taps = self._prefill(ids, last, width)
            self.hist[:, :width] = ids
            self.hist.scatter_(1, (last + 1)[:, None], first[:, None])
            self.out[:, 0] = first
            self.ngen.fill_(1)
            self.start.copy_(last + 1)
            # the first drafts (a drafter: row by row, its context the whole prompt)
            self.tokens[:, 0] = first
            with timer.phase("draft"):
                self.tokens[:, 1:] = self.proposer.first(self, first, taps, lens)
            del taps
            stopped = (first[:, None] == self.stop).any(-1) if self.stop_ids else torch.zeros_like(self.done)
            self.done.copy_(stopped | (self.max_new <= 1))
            self.done[n:] = True
            steps = 0
            while True:
                with timer.phase("accept"):   # the host's one read a step
                    top, finished = torch.stack([self.start.max(), self.done.all().long()]).tolist()
                if finished:
                    break
                view = -(-(top + bs) // self.view_step) * self.view_step
                if self.graphs:
                    self._replay_or_capture(view)
                else:
                    self._step(view)
                timer.step()
                steps += 1
        self.steps += steps
        acc = self.accepted[:n, :steps].cpu().numpy()
        out = self.out[:n].cpu().numpy()
        ngen = self.ngen[:n].cpu().numpy()
        result = []
        for i in range(n):
            lengths = [int(x) for x in acc[i] if x > 0]
            toks = out[i, :min(int(ngen[i]), self.max_new)]
            hit = np.nonzero(np.isin(toks, self.stop_ids))[0] if self.stop_ids else []
            if len(hit):
                toks = toks[:int(hit[0]) + 1]
            result.append((lengths, toks.astype(np.int64)))
        return result

