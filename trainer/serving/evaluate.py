"""dflash-eval: acceptance length measured the way serving measures it, by speculative generation.

On held-out prompts (each record's tokens before its first supervised token) the target generates;
at each step the drafter proposes B-1 tokens from the target's taps of the accepted prefix, the target
verifies [last token, drafts] in one forward, and the matching prefix plus the bonus token are
emitted (trainer/model/modeling_dflash.py `dflash_generate`, the same loop the export ships).

    tau                      mean tokens emitted per verify step (<= B), as in the DFlash paper
    per_position_acceptance  [k-1]: fraction of verify steps whose draft k was accepted (k = 1..B-1)
    block_accuracy           the cheap teacher-forced figure (anchors on held-out text, one block each):
                             the fraction of draft slots equal to the target's argmax; with
                             teacher_forced_block_len (mean accepted prefix + 1). Not tau.

Greedy (temperature 0) by default; temperature > 0 runs standard speculative sampling.
A DFlash2 drafter (its export's DFlash2DraftModel) proposes its candidate selector's path, walked per row in
the batched loop, and is verified against the selector's q at temperature > 0 in the single loop
(trainer/serving/dflash2_eval.py).

    dflash-eval --target-model DIR --checkpoint CKPT_OR_OUTPUT_DIR_OR_EXPORT --data-dir DIR
                [--device cpu|cuda:N] [--max-prompts 16] [--max-new-tokens 128] [--temperature 0]
                [--loop auto|batched|single] [--batch-size 16] [--speed-batch 1,16]
                [--ngram-max 3] [--ngram-min 1] [--ngram-k 0] [--dtype auto|bfloat16|float32] [--profile-phases]

Greedy evals also measure wall-clock speed (trainer/serving/speedup.py, --speed-batch; '' skips it): the
target decoding alone (the captured decoder) against speculative decoding with the drafter and with prompt
lookup (the n-gram baseline), tokens/s of each and the speedup, at each batch size; and the lossless check:
every speculative output must equal the target's greedy output, else exit 1 with one line naming the prompt.

The batched loop (greedy; trainer/serving/captured/eval_decoder.py BatchedSpecDecoder) verifies --batch-size prompts per step,
each row at its own position, with the step captured as CUDA graphs on GPUs; the single loop runs one
prompt at a time. Both give the same accept lengths (tests/serving/test_evaluate.py). On a hybrid target
(Qwen3.5/3.6: Gated DeltaNet layers) both roll the linear layers' states back to the accepted tokens after
each verify step (docs/serving.md, "Hybrid targets"; tests/serving/test_hybrid_generation.py); where the batched
loop cannot, it says so in one line and the single loop runs (`runnable_loop`).

--profile-phases times each phase of the loop's steps (trainer/serving/phases.py: prefill, draft, verify,
rollback on hybrids, accept with its host reads; CUDA events on GPUs, read once at the end): the result gains
"phases" ({phase: ms_total, ms_per_verify_step, calls, share}, per step of the loop that ran: a verify step of
the single loop, a batched step of the batched loop, whose phases on GPUs are one graph "step"),
"phase_steps" and "phase_step_ms" (the wall clock of a step), and stderr one line per phase.

Public entry point for the trainer: `evaluate_checkpoint(checkpoint, target_model, eval_data)`.
"""

from __future__ import annotations

if __name__ == "__main__":   # run as a program (python -m): torchao only when asked for (trainer/optional.py)
    from trainer.optional import defer
    defer()

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config.options import EVAL_MAX_NEW_TOKENS, EVAL_PROMPTS, ConfigError, check_ranges, opt, parse_options
from trainer.model.architectures import resolve
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta
from trainer.model.modeling_dflash import DFlashDraftModel, dflash_generate
from trainer.serving import phases
from trainer.serving.export import ExportError, hf_config_dict, read_checkpoint

log = logging.getLogger("trainer.evaluate")


# ------------------------------------------------------------------------------- loading


from trainer.model.target import load_target  # noqa: E402  (the one loader; target.py imports no trainer loop)
from trainer.ops.plan import anchor_candidates  # noqa: E402


def hf_drafter(cfg: DFlashConfig, state: dict[str, torch.Tensor], device, dtype) -> DFlashDraftModel:
    """The servable drafter class with these weights, loaded strictly (a name mismatch raises). An architecture
    whose entry names a proposer (trainer/model/architectures.py; DFlash2's dflash2_eval.DFlash2Proposer): the
    trainer's class behind it."""
    entry = cfg.architecture
    if entry.proposer:
        model = DFlashDrafter(cfg)
        model.load_state_dict(state, strict=True)
        return resolve(entry.proposer)(model.to(device=device, dtype=dtype).requires_grad_(False))
    from transformers import Qwen3Config
    model = DFlashDraftModel(Qwen3Config(**hf_config_dict(cfg)))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_drafter(checkpoint: str, device, dtype=torch.float32) -> tuple[DFlashDrafter, DFlashConfig]:
    """The trainer's drafter class from a checkpoint, output dir or export; strict."""
    cfg, state, _ = read_checkpoint(checkpoint)
    model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype), cfg


def _as_hf(drafter, cfg: DFlashConfig) -> DFlashDraftModel:
    """The trainer's class as hf_drafter gives it; a servable drafter or proposer as it is."""
    if not isinstance(drafter, DFlashDrafter):
        return drafter
    p = next(drafter.parameters())
    return hf_drafter(cfg, {k: v.detach() for k, v in drafter.state_dict().items()}, p.device, p.dtype)


def stop_token_ids(target) -> list[int]:
    ids = []
    for src in (target.config, getattr(target, "generation_config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        ids += [e] if isinstance(e, int) else list(e or [])
    return sorted(set(ids))


def heldout_prompts(dataset, max_prompts: int) -> list[np.ndarray]:
    """Each record's tokens before its first supervised token (records without a prompt are skipped)."""
    prompts = []
    for i in range(len(dataset)):
        ids, mask = dataset[i]
        sup = np.nonzero(mask)[0]
        if len(sup) and sup[0] > 0:
            prompts.append(np.asarray(ids[:sup[0]], dtype=np.int64))
        if len(prompts) >= max_prompts:
            break
    return prompts


# ------------------------------------------------------------------------------- tau by generation


LOOPS = ("auto", "batched", "single")
EVAL_BATCH = 16   # prompts verified together by the batched loop


def resolve_loop(loop: str, temperature: float) -> str:
    """auto: the batched loop for greedy evals, today's one-prompt loop for sampling (ValueError naming the
    flag when the batched loop is asked for a sampled eval)."""
    if loop not in LOOPS:
        raise ValueError(f"--loop: expected one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "auto":
        return "batched" if temperature <= 0 else "single"
    if loop == "batched" and temperature > 0:
        raise ValueError(f"--loop batched: greedy only (--temperature 0), got --temperature {temperature}; "
                         "use --loop single for sampling")
    return loop


def runnable_loop(target, loop: str) -> str:
    """`loop`, or "single" with one warning line where the batched loop cannot run this target (a hybrid
    whose linear-attention layers the captured loops do not know how to roll back: linear_states.hybrid_unsupported)."""
    if loop != "batched":
        return loop
    from trainer.model.target import decoder
    from trainer.serving.captured.linear_states import hybrid_unsupported
    why = hybrid_unsupported(decoder(target), speculative=True)
    if why:
        log.warning("dflash-eval: the batched loop cannot run this target (%s); using the single loop", why)
        return "single"
    return loop


def architecture_of(drafter):
    """The architectures.py entry of a proposer that wraps the trainer's class (its `cfg`); None for the servable
    class (DFlash's AutoModel, whose loops are modeling_dflash's)."""
    cfg = getattr(drafter, "cfg", None)
    return cfg.architecture if isinstance(cfg, DFlashConfig) else None


@torch.no_grad()
def generate_each(target, drafter: DFlashDraftModel, prompts: list, max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
                  temperature: float = 0.0, stop_ids: list[int] | None = None, seed: int = 0, loop: str = "single",
                  batch_size: int = EVAL_BATCH, graphs: bool | None = False) -> list[tuple[list[int], int]]:
    """(tokens emitted per verify step, tokens generated) for each prompt, in order. loop "single": today's
    loop, one prompt at a time (`dflash_generate`); "batched": `batch_size` prompts per step
    (eval_decoder.BatchedSpecDecoder; greedy; `graphs`: CUDA graphs of the step, None = on GPUs).
    A hybrid target on a transformers older than trainer/model/families.py's floor: HybridTransformersTooOld first.
    Inside phases.recording(timer) both loops time their phases to `timer` (trainer/serving/phases.py)."""
    from trainer.model.families import check_hybrid_transformers
    check_hybrid_transformers(target)
    dev = next(target.parameters()).device
    stop_ids = stop_token_ids(target) if stop_ids is None else stop_ids
    loop = runnable_loop(target, resolve_loop(loop, temperature))
    entry = architecture_of(drafter)
    if entry is not None and loop not in entry.eval_loops:
        raise ValueError(f"--loop {loop}: a {entry.name} drafter runs in the {' or '.join(entry.eval_loops)} loop")
    if entry is not None and entry.generate and loop == "single":   # its own loop (DFlash2's: the selector's)
        generate = resolve(entry.generate)
        gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
        return [(r.accept_lengths, r.output_ids.shape[1] - r.num_prompt_tokens)
                for r in (generate(drafter, target, torch.as_tensor(np.asarray(p), dtype=torch.long, device=dev)[None],
                                   max_new_tokens, stop_ids, temperature, gen) for p in prompts)]
    if loop == "batched":   # DFlash's drafter, or DFlash2's with its selector (proposers.DrafterProposer)
        from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
        dec = BatchedSpecDecoder(target, drafter, dev, min(batch_size, len(prompts)), max_new_tokens, stop_ids,
                                 graphs=graphs)
        return [(lengths, len(toks)) for i in range(0, len(prompts), dec.batch)
                for lengths, toks in dec.generate(prompts[i:i + dec.batch])]
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    from trainer.model.target import decoder
    from trainer.serving.captured.linear_states import timed_recurrent_steps
    timer = phases.active()
    each = []
    with timed_recurrent_steps(decoder(target), timer):
        for p in prompts:
            ids = torch.as_tensor(np.asarray(p), dtype=torch.long, device=dev)[None]
            res = dflash_generate(drafter, target, ids, max_new_tokens, stop_ids, temperature, gen,
                                  timer if timer.enabled else None)
            each.append((res.accept_lengths, res.output_ids.shape[1] - res.num_prompt_tokens))
    return each


@torch.no_grad()
def speculative_eval(target, drafter: DFlashDraftModel, prompts: list, max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
                     temperature: float = 0.0, stop_ids: list[int] | None = None, seed: int = 0,
                     loop: str = "single", batch_size: int = EVAL_BATCH, graphs: bool | None = False) -> dict:
    """Run the generation loop on every prompt; tau and per-position acceptance over all verify steps."""
    dev = next(target.parameters()).device
    bs = drafter.block_size
    loop = runnable_loop(target, resolve_loop(loop, temperature))
    t0 = time.perf_counter()
    each = generate_each(target, drafter, prompts, max_new_tokens, temperature, stop_ids, seed, loop, batch_size,
                         graphs)
    lengths = [n for steps, _ in each for n in steps]
    new_tokens = sum(n for _, n in each)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    if not lengths:
        raise ValueError("no verify steps: every prompt stopped at its first token")
    arr = np.asarray(lengths)
    res = {
        "tau": float(arr.mean()),
        "verify_steps": int(len(arr)),
        "prompts": len(prompts),
        "new_tokens": int(new_tokens),
        "per_position_acceptance": [float((arr > k).mean()) for k in range(1, bs)],
        "accept_length_histogram": [int((arr == n).sum()) for n in range(1, bs + 1)],
        "block_size": bs,
        "temperature": float(temperature),
        "max_new_tokens": int(max_new_tokens),
        "loop": loop,
        "seconds": round(secs, 3),
        "verify_steps_per_s": round(len(arr) / secs, 2) if secs > 0 else None,
    }
    timer = phases.active()
    if timer.enabled:   # inside phases.recording: where the loop's steps went (dflash-eval --profile-phases)
        res.update(phases.report(timer, secs))
    return res


# ------------------------------------------------------------------------------- teacher-forced figure


@torch.no_grad()
def block_accuracy(target, drafter: DFlashDrafter, cfg: DFlashConfig, dataset, device: torch.device,
                   anchors_per_seq: int = 8, max_seqs: int = 64, seed: int = 0) -> dict:
    """Cheap and teacher-forced (not tau): anchors sampled on held-out text, one block drafted each from
    the target's taps of the true prefix, compared with the target's argmax on the true text + drafts."""
    bs = cfg.block_size
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    dtype = next(drafter.parameters()).dtype
    rng = np.random.default_rng(seed)
    lens, slots_ok, slots = [], 0, 0
    for i in range(min(len(dataset), max_seqs)):
        ids_np, mask_np = dataset[i]
        n = len(ids_np)
        cand = anchor_candidates(mask_np, min_position=1)   # the training rule (plan.py)
        if len(cand) == 0:
            continue
        anchors = np.sort(rng.choice(cand, size=min(anchors_per_seq, len(cand)), replace=False))
        ids = torch.from_numpy(ids_np.astype(np.int64))[None].to(device)
        out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[t + 1] for t in cfg.target_layer_ids], dim=-1)[0].to(dtype)
        a = torch.from_numpy(anchors).to(device)
        slot = torch.arange(bs, device=device)
        q_anchor = a.repeat_interleave(bs)
        q_pos = (a[:, None] + slot[None]).reshape(-1)
        tokens = torch.full((len(anchors), bs), cfg.mask_token_id, device=device, dtype=torch.long)
        tokens[:, 0] = ids[0, a]
        meta = PackedMeta(ctx_seq=torch.zeros(n, dtype=torch.long, device=device),
                          ctx_pos=torch.arange(n, device=device), q_seq=torch.zeros_like(q_anchor),
                          q_anchor=q_anchor, q_pos=q_pos, block_size=bs)
        hidden = drafter(taps, embed[tokens.reshape(-1)].to(dtype), meta, backend="sdpa")
        drafts = (hidden.to(head.dtype) @ head.t()).argmax(-1).view(len(anchors), bs)[:, 1:]
        width = int(anchors.max()) + bs
        seqs = torch.zeros(len(anchors), width, dtype=torch.long, device=device)
        for j, p in enumerate(anchors):  # right padded; causal, so the padding changes nothing
            seqs[j, :p + 1] = ids[0, :p + 1]
            seqs[j, p + 1:p + bs] = drafts[j]
        logits = target(input_ids=seqs, use_cache=False).logits
        for j, p in enumerate(anchors):
            ok = (logits[j, p:p + bs - 1].argmax(-1) == drafts[j]).long()
            lens.append(int(torch.cumprod(ok, 0).sum()) + 1)
            slots_ok += int(ok.sum())
            slots += bs - 1
    if not lens:
        raise ValueError("no evaluable anchors in the held-out data")
    return {"block_accuracy": slots_ok / slots, "teacher_forced_block_len": float(np.mean(lens)),
            "blocks": len(lens)}


# ------------------------------------------------------------------------------- entry points


def evaluate(target, drafter, dcfg: DFlashConfig, dataset, device: torch.device, max_prompts: int = EVAL_PROMPTS,
             max_new_tokens: int = EVAL_MAX_NEW_TOKENS, temperature: float = 0.0, seed: int = 0,
             with_block_accuracy: bool = False, loop: str = "single", batch_size: int = EVAL_BATCH,
             graphs: bool | None = False) -> dict:
    """tau by speculative generation for a drafter object (trainer's class or the servable one). `loop`,
    `batch_size`, `graphs`: as `generate_each` (the trainer's own eval: trainer/engine/evaltrain.py eval_loop)."""
    hf = _as_hf(drafter, dcfg).to(device)
    prompts = heldout_prompts(dataset, max_prompts)
    if not prompts:
        raise ValueError("no held-out record has a prompt (tokens before its first supervised one)")
    res = speculative_eval(target, hf, prompts, max_new_tokens, temperature, seed=seed, loop=loop,
                           batch_size=batch_size, graphs=graphs)
    if with_block_accuracy:
        packed = drafter if isinstance(drafter, DFlashDrafter) else getattr(hf, "model", None)
        packed = packed if isinstance(packed, DFlashDrafter) else None
        if packed is None:
            packed = DFlashDrafter(dcfg).to(device=device, dtype=next(hf.parameters()).dtype)
            packed.load_state_dict(hf.state_dict(), strict=True)
        # on the same held-out records as tau: its cost is two target forwards a record, which at the default
        # 64 records is most of a CPU eval (and of the trainer's final eval) when --max-prompts is small
        res.update(block_accuracy(target, packed, dcfg, dataset, device, max_seqs=max(max_prompts, 8), seed=seed))
    return res


def evaluate_state(cfg: DFlashConfig, state: dict[str, torch.Tensor], target, dataset, device: torch.device,
                   dtype: torch.dtype, max_prompts: int = EVAL_PROMPTS, max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
                   temperature: float = 0.0, seed: int = 0, with_block_accuracy: bool = True, loop: str = "single",
                   batch_size: int = EVAL_BATCH, graphs: bool | None = False) -> dict:
    """tau for drafter weights `state` (a consolidated state dict, as model.safetensors holds it) against an
    already loaded `target`: what evaluate_checkpoint runs after reading the files, and what the trainer runs
    during training on the current weights (trainer/engine/evaltrain.py), so the two agree by construction."""
    drafter = hf_drafter(cfg, state, device, dtype)
    return evaluate(target, drafter, cfg, dataset, device, max_prompts, max_new_tokens, temperature, seed,
                    with_block_accuracy, loop, batch_size, graphs)


def evaluate_checkpoint(checkpoint: str, target_model: str, eval_data: str, *, device: str | None = None,
                        max_prompts: int = EVAL_PROMPTS, max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
                        temperature: float = 0.0, seed: int = 0, with_block_accuracy: bool = True, target=None,
                        out_dir: str | None = None, loop: str = "auto", batch_size: int = EVAL_BATCH,
                        graphs: bool | None = None) -> dict:
    """Evaluate a drafter given by paths: `checkpoint` is a step-* dir, an output dir (newest step) or a
    dflash-export dir; `target_model` an HF model dir; `eval_data` held-out shards. `target`: an already
    loaded target to reuse (then `target_model` is not read). Returns the dict of `evaluate` plus
    "checkpoint" (the directory read) and "step" (None for an export); with `out_dir`, also writes it to
    `out_dir/eval.json`. `loop` auto: the batched loop for greedy evals (dflash-eval's default too).
    The wall-clock table and lossless check are speed_section's (dflash-eval adds them under "speed")."""
    from trainer.data.dataset import load_dataset
    dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg, state, src = read_checkpoint(checkpoint)
    from trainer.model.identity import check_drafter_on_target
    # TargetMismatch (a ValueError) names what differs; a loaded target is compared by its config
    check_drafter_on_target(src, target_model if target is None else target.config.to_dict())
    if target is None:
        target = load_target(target_model, dev, dtype)
    res = evaluate_state(cfg, state, target, load_dataset(eval_data), dev, dtype, max_prompts, max_new_tokens,
                         temperature, seed, with_block_accuracy, loop, batch_size, graphs)
    from trainer.model.checkpoint_format import STEP_DIR_RE
    m = STEP_DIR_RE.match(src.name)
    res.update(checkpoint=str(src), step=int(m.group(1)) if m else None)
    log.info("eval %s: tau %.3f over %d verify steps (%d prompts, %.1f steps/s); per-position acceptance %s",
             src, res["tau"], res["verify_steps"], res["prompts"], res["verify_steps_per_s"] or 0,
             [round(x, 3) for x in res["per_position_acceptance"]])
    if out_dir is not None:
        (Path(out_dir) / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def parse_speed_batches(text: str) -> list[int]:
    """--speed-batch "1,16" -> [1, 16]; "" or "off" -> [] (no speed section). ValueError naming the flag."""
    if text.strip().lower() in ("", "off", "none"):
        return []
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speed-batch: expected batch sizes like 1,16 (or '' to skip), got {text!r}") from None
    if not batches or min(batches) < 1:
        raise ValueError(f"--speed-batch: every batch size must be >= 1, got {text!r}")
    return list(dict.fromkeys(batches))


def speed_section(target, drafter, cfg: DFlashConfig, dataset, max_prompts: int, max_new_tokens: int,
                  batches: list[int], ngram: tuple[int, int, int] = (3, 1, 0),
                  graphs: bool | None = None) -> dict | None:
    """The wall-clock table and the lossless check (trainer/serving/speedup.py) for this drafter beside the
    n-gram baseline (ngram: max n, min n, k; k 0 = block size - 1), on the eval's held-out prompts, greedy.
    None, with one warning line, on a target the captured loops cannot run (linear_states.hybrid_unsupported)."""
    from trainer.model.target import decoder
    from trainer.serving.captured.linear_states import hybrid_unsupported
    from trainer.serving.captured.proposers import NgramProposer
    from trainer.serving.speedup import speed_table
    why = hybrid_unsupported(decoder(target), speculative=True)
    if why:
        log.warning("dflash-eval: the captured loops cannot run this target (%s); no speed table", why)
        return None
    hf = _as_hf(drafter, cfg)
    max_n, min_n, k = ngram
    proposers = {cfg.architecture.name: hf,
                 "ngram": NgramProposer(cfg.block_size, max_n, min_n, k or None)}
    prompts = heldout_prompts(dataset, max_prompts)
    out = speed_table(target, proposers, prompts, max_new_tokens, stop_token_ids(target), batches, graphs)
    out["ngram"] = {"max_n": max_n, "min_n": min_n, "k": k or cfg.block_size - 1}
    return out


def check_eval_args(max_prompts: int, max_new_tokens: int, temperature: float, loop: str = "auto",
                    batch_size: int = EVAL_BATCH) -> None:
    """The bounds of one eval; ValueError naming the flag (dflash-eval prints it as its one line)."""
    for flag, v in (("--max-prompts", max_prompts), ("--max-new-tokens", max_new_tokens),
                    ("--batch-size", batch_size)):
        if v < 1:
            raise ValueError(f"{flag}: must be >= 1, got {v}")
    if not temperature >= 0:
        raise ValueError(f"--temperature: must be >= 0, got {temperature}")
    resolve_loop(loop, temperature)


def parse_device(text: str) -> torch.device:
    """--device cpu | cuda | cuda:N, checked against this machine (ValueError naming the flag)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: expected cpu or cuda:N, got {text!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {text}: expected cpu or cuda:N")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ValueError(f"--device {text}: CUDA is not available on this machine (use --device cpu)")
    if (dev.index or 0) >= n:
        raise ValueError(f"--device {text}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


IN, EVAL = "what to evaluate", "evaluation"


@dataclass
class EvalConfig:
    """dflash-eval's options (the command line is generated from these fields: trainer/config/options.py)."""
    target_model: str = opt(help="local Hugging Face model directory of the target", group=IN)
    data_dir: str = opt(help="held-out shards", group=IN)
    checkpoint: str = opt("", "a step-* dir, an output dir (newest step) or a dflash-export dir", group=IN,
                         metavar="PATH")
    output_dir: str = opt("", "same as --checkpoint with an output dir", group=IN)
    device: str = opt(help="cpu or cuda:N", group=EVAL, default_factory=_default_device, metavar="DEVICE")
    max_prompts: int = opt(EVAL_PROMPTS, "held-out prompts generated from", group=EVAL, ge=1)
    max_new_tokens: int = opt(EVAL_MAX_NEW_TOKENS, "tokens generated per prompt", group=EVAL, ge=1)
    temperature: float = opt(0.0, "0 = greedy; > 0: speculative sampling", group=EVAL, ge=0)
    seed: int = opt(0, "sampling seed (temperature > 0)", group=EVAL)
    loop: str = opt("auto", "batched: --batch-size prompts verified per step, the step captured as CUDA graphs on "
                            "GPUs (greedy only); single: one prompt at a time (the loop serving exports ship); "
                            "auto: batched for --temperature 0, else single. Both give the same accept lengths",
                    group=EVAL, metavar="|".join(LOOPS))   # checked by resolve_loop, which names the choices
    batch_size: int = opt(EVAL_BATCH, "prompts per step of the batched loop", group=EVAL, ge=1)
    block_accuracy: bool = opt(True, "also the teacher-forced figure (--no-block-accuracy: skip it)", group=EVAL)
    untrained: bool = opt(False, "re-initialise the drafter (baseline)", group=EVAL)
    allow_target_change: bool = opt(False, "evaluate even when the target differs from the one the drafter was "
                                           "trained on (e.g. a fine-tuned revision) where its weights still fit",
                                    group=EVAL)
    speed_batch: str = opt("1,16", "greedy evals: batch sizes at which the target alone, the drafter and the n-gram "
                                   "baseline are timed (tokens/s, speedup) and their outputs checked lossless; '' "
                                   "skips it", group=EVAL, metavar="B,...")
    ngram_max: int = opt(3, "the n-gram baseline's longest suffix matched (vLLM's prompt_lookup_max)", group=EVAL,
                         ge=1)
    ngram_min: int = opt(1, "its shortest (prompt_lookup_min)", group=EVAL, ge=1)
    ngram_k: int = opt(0, "tokens it proposes after a match (0: block size - 1)", group=EVAL, ge=0)
    dtype: str = opt("auto", "the target's and drafter's dtype (auto: bfloat16 on GPUs, float32 on CPUs); float32 "
                             "gives the lossless check a verdict free of bf16 near-ties", group=EVAL,
                     choices=("auto", "bfloat16", "float32"))
    profile_phases: bool = opt(False, "time the loop's phases (prefill, draft, verify, rollback, accept; "
                                      "trainer/serving/phases.py): \"phases\" in the result, one line each on "
                                      "stderr", group=EVAL)
    json: bool = opt(False, "print the result as JSON", group=EVAL)


def main(argv=None) -> int:
    try:
        a = parse_options(EvalConfig, argv, "dflash-eval", __doc__.split("\n")[0])
    except ConfigError as e:
        print(f"dflash-eval: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from trainer.config.preflight import check_model_dir
    from trainer.data.dataset import DataError, load_dataset, read_index
    from trainer.model import identity
    from trainer.model.families import check_hybrid_transformers
    src = a.checkpoint or a.output_dir
    try:
        if not src:
            raise ValueError("--checkpoint: give --checkpoint (or --output-dir)")
        check_ranges(a)
        check_eval_args(a.max_prompts, a.max_new_tokens, a.temperature, a.loop, a.batch_size)
        speed_batches = parse_speed_batches(a.speed_batch) if a.temperature <= 0 else []
        dev = parse_device(a.device)
        # a hybrid target on a transformers older than our cache API: one line, before anything is read
        check_hybrid_transformers(check_model_dir(a.target_model), f"--target-model {a.target_model}")
        ds = load_dataset(a.data_dir)
        cfg, state, ckpt = read_checkpoint(src)
        loops = cfg.architecture.eval_loops
        if a.loop != "auto" and a.loop not in loops:
            raise ValueError(f"--loop {a.loop}: a {cfg.architecture.name} drafter runs in the {' or '.join(loops)} "
                             "loop")
        if speed_batches and "batched" not in loops:
            raise ValueError(f"--speed-batch: a {cfg.architecture.name} drafter has no batched loop to time "
                             "(--speed-batch '')")
        if speed_batches:
            from trainer.serving.captured.proposers import NgramProposer
            try:
                NgramProposer(cfg.block_size, a.ngram_max, a.ngram_min, a.ngram_k or None)
            except ValueError as e:
                raise ValueError(f"--ngram-max/--ngram-min/--ngram-k: {e}") from None
        allowed = identity.check_drafter_on_target(ckpt, a.target_model, allow=a.allow_target_change)
        identity.check_data_tokenizer(read_index(a.data_dir), identity.of_target(a.target_model), "--data-dir",
                                      a.data_dir)
    except (ConfigError, DataError, ExportError, ValueError) as e:   # TargetMismatch is a ValueError
        print(f"dflash-eval: error: {e}", file=sys.stderr)
        return 2
    if allowed:
        log.warning("%s: evaluating %s on a different target: %s", identity.ALLOW_FLAG, ckpt, "; ".join(allowed))
    dtype = ({"bfloat16": torch.bfloat16, "float32": torch.float32}.get(a.dtype)
             or (torch.bfloat16 if dev.type == "cuda" else torch.float32))
    if a.untrained:
        from trainer.model.drafter import init_drafter_weights
        fresh = DFlashDrafter(cfg)
        init_drafter_weights(fresh)
        state = fresh.state_dict()
    drafter = hf_drafter(cfg, state, dev, dtype)
    target = load_target(a.target_model, dev, dtype)
    with phases.recording(phases.PhaseTimer(dev) if a.profile_phases else None):
        res = evaluate(target, drafter, cfg, ds, dev, a.max_prompts, a.max_new_tokens, a.temperature, a.seed,
                       a.block_accuracy, a.loop, a.batch_size, graphs=None)
    if "phases" in res:
        for line in phases.lines(res["phases"], res["phase_step_ms"] or 0.0, res["loop"]):
            log.info("%s", line)
    res["checkpoint"] = str(ckpt)
    speed = speed_section(target, drafter, cfg, ds, a.max_prompts, a.max_new_tokens, speed_batches,
                          (a.ngram_max, a.ngram_min, a.ngram_k), graphs=None) if speed_batches else None
    if speed is not None:
        res["speed"] = speed
    if a.json:
        print(json.dumps(res))
    else:
        print(f"tau {res['tau']:.3f} over {res['verify_steps']} verify steps, {res['prompts']} prompts "
              f"(block size {cfg.block_size}, temperature {a.temperature}; {res['loop']} loop, "
              f"{res['verify_steps_per_s']} steps/s)")
        print("per-position acceptance: " + " ".join(f"{x:.2f}" for x in res["per_position_acceptance"]))
        if "block_accuracy" in res:
            print(f"teacher-forced (not tau): block accuracy {res['block_accuracy']:.3f}, "
                  f"block length {res['teacher_forced_block_len']:.3f} over {res['blocks']} blocks")
        if "speed" in res:
            from trainer.serving.speedup import format_table
            print(f"wall clock, greedy, {res['prompts']} prompts x {a.max_new_tokens} new tokens, {dtype}:")
            print(format_table(res["speed"]))
    if "speed" in res and not res["speed"]["lossless"]["ok"]:
        print(f"dflash-eval: {res['speed']['lossless']['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
