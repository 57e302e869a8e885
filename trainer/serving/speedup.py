"""dflash-eval's wall-clock section: the target decoding alone against speculative decoding, on the same
prompts, greedy, and the lossless check between them.

- The target alone: the captured decoder dflash-regenerate runs (captured/regenerate_decoder.GraphDecoder):
  a preallocated KV cache, the decode step one CUDA graph per KV view on GPUs, the query heads folded per KV
  head; greedy, the EOS ids stopping a row. It has what the speculative loop has (static cache, captured
  step), so the ratio measures speculation, not a better decoder.
- Speculative: the batched loop (captured/eval_decoder.BatchedSpecDecoder) with each proposer: the drafter
  being evaluated (DFlash, or DFlash2's selector path) and prompt lookup (captured/proposers.NgramProposer,
  the n-gram baseline a vLLM or SGLang user would otherwise switch on).
- Each runs at every batch size asked for (the prompts in that many per call); tokens/s = tokens generated /
  seconds over all prompts (prefill included); speedup = a speculative row's tokens/s over the target's at
  the same batch size. On GPUs each decoder first runs one prompt of every prompt width untimed, so that the
  timed pass replays graphs (its captures are the first run's).
- Lossless: at temperature 0 every speculative output must equal the target's own greedy output token for
  token (the target-alone run at the first batch size is the reference). The first prompt that differs is
  named (LosslessMismatch); in bf16 a near-tie of two logits can part them where fp32 would not
  (dflash-eval --dtype float32 decides).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trainer.serving.captured.kv_cache import PAD_TO

TARGET = "target"   # the target-alone row's name


@dataclass
class Run:
    """One decoder over every prompt at one batch size."""
    name: str
    batch: int
    outputs: list[np.ndarray]
    seconds: float
    accept_lengths: list[list[int]] | None = None   # speculative rows: tokens emitted per verify step

    @property
    def tokens(self) -> int:
        return int(sum(len(o) for o in self.outputs))

    def row(self) -> dict:
        out = {"drafter": self.name, "batch": self.batch, "tokens": self.tokens, "seconds": round(self.seconds, 4),
               "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None}
        if self.accept_lengths is not None:
            steps = [n for lengths in self.accept_lengths for n in lengths]
            out.update(tau=round(float(np.mean(steps)), 4) if steps else None, verify_steps=len(steps))
        return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _warm_prompts(prompts: list) -> list:
    """One prompt of each padded width (the captured loops' graphs are per KV view, which follows the width),
    the longest first: a loop reallocates its caches (and drops its graphs) when a longer prompt comes."""
    seen = {}
    for p in prompts:
        seen.setdefault(-(-len(p) // PAD_TO), p)
    return [seen[w] for w in sorted(seen, reverse=True)]


def _timed(dec_generate, prompts: list, batch: int, dev: torch.device, warm: bool):
    if warm:
        for p in _warm_prompts(prompts):
            dec_generate([p], 0)
    _sync(dev)
    t0 = time.perf_counter()
    results = []
    for i in range(0, len(prompts), batch):
        results += dec_generate(prompts[i:i + batch], i)
    _sync(dev)
    return results, time.perf_counter() - t0


def target_alone(target, prompts: list, max_new_tokens: int, stop_ids: list[int], batch: int,
                 graphs: bool | None = None) -> Run:
    """The target's own greedy decoding of every prompt, `batch` at a time (GraphDecoder)."""
    from trainer.serving.captured.regenerate_decoder import DecoderOptions, GraphDecoder
    dev = next(target.parameters()).device
    pad = stop_ids[0] if stop_ids else 0
    dec = GraphDecoder(target, dev, min(batch, len(prompts)), max_new_tokens, 0.0, stop_ids, pad,
                       DecoderOptions(graphs=graphs))
    outs, secs = _timed(lambda ps, i: dec.generate(ps, range(i, i + len(ps))), prompts, dec.batch, dev,
                        dec.graphs)
    return Run(TARGET, batch, [np.asarray(o, dtype=np.int64) for o in outs], secs)


def speculative(target, name: str, proposer, prompts: list, max_new_tokens: int, stop_ids: list[int], batch: int,
                graphs: bool | None = None) -> Run:
    """Speculative decoding of every prompt with `proposer` (a drafter or a proposers.py proposer), `batch`
    at a time (BatchedSpecDecoder)."""
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    dev = next(target.parameters()).device
    dec = BatchedSpecDecoder(target, proposer, dev, min(batch, len(prompts)), max_new_tokens, stop_ids,
                             graphs=graphs)
    res, secs = _timed(lambda ps, i: dec.generate(ps), prompts, dec.batch, dev, dec.graphs)
    return Run(name, batch, [toks for _, toks in res], secs, [lengths for lengths, _ in res])


class LosslessMismatch(ValueError):
    """A speculative output that is not the target's greedy output (the message names where)."""


def first_difference(reference: list[np.ndarray], got: list[np.ndarray]) -> tuple[int, int] | None:
    """(prompt index, first differing generated position) of the first prompt whose tokens differ, or None."""
    for i, (a, b) in enumerate(zip(reference, got)):
        a, b = np.asarray(a), np.asarray(b)
        n = min(len(a), len(b))
        diff = np.nonzero(a[:n] != b[:n])[0]
        if len(diff) or len(a) != len(b):
            return i, int(diff[0]) if len(diff) else n
    return None


def check_lossless(reference: Run, run: Run) -> None:
    """LosslessMismatch naming the first prompt where `run` differs from the target's greedy `reference`."""
    where = first_difference(reference.outputs, run.outputs)
    if where is None:
        return
    i, pos = where
    ref, got = reference.outputs[i], run.outputs[i]
    said = lambda toks: int(toks[pos]) if pos < len(toks) else "end"   # noqa: E731
    raise LosslessMismatch(
        f"not lossless: {run.name} at batch {run.batch} differs from the target's greedy output on prompt {i} "
        f"at generated token {pos} (target {said(ref)}, speculative {said(got)})")


def speed_table(target, proposers: dict, prompts: list, max_new_tokens: int, stop_ids: list[int],
                batches: list[int], graphs: bool | None = None) -> dict:
    """Every proposer (name -> drafter or proposer) and the target alone at every batch size: rows as
    Run.row gives them plus `speedup` (speculative tokens/s over the target's at that batch size), and
    `lossless`: {"ok": bool, "prompts": n, "error": the first mismatch's message or None}."""
    rows, reference, error = [], None, None
    for b in batches:
        alone = target_alone(target, prompts, max_new_tokens, stop_ids, b, graphs)
        reference = reference or alone
        base = alone.row()
        rows.append(base)
        for name, proposer in proposers.items():
            run = speculative(target, name, proposer, prompts, max_new_tokens, stop_ids, b, graphs)
            row = run.row()
            row["speedup"] = (round(row["tokens_per_s"] / base["tokens_per_s"], 3)
                              if row["tokens_per_s"] and base["tokens_per_s"] else None)
            rows.append(row)
            if error is None:
                try:
                    check_lossless(reference, run)
                except LosslessMismatch as e:
                    error = str(e)
    return {"batches": list(batches), "rows": rows,
            "lossless": {"ok": error is None, "prompts": len(prompts), "error": error}}


def format_table(speed: dict) -> str:
    """The rows as a text table (one line per decoder and batch size)."""
    lines = [f"{'drafter':<10} {'batch':>5} {'tau':>6} {'tokens/s':>10} {'speedup':>8}"]
    for r in speed["rows"]:
        tau = f"{r['tau']:.3f}" if r.get("tau") is not None else "-"
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        tps = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] is not None else "-"
        lines.append(f"{r['drafter']:<10} {r['batch']:>5} {tau:>6} {tps:>10} {sp:>8}")
    return "\n".join(lines)
