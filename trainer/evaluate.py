"""Acceptance-length evaluation: from real contexts, the drafter proposes a block, the target verifies it.

For an anchor p of a held-out sequence: the target has seen tokens[:p] (their hidden states are the
context) and token p is known (slot 0). The drafter proposes d_1..d_{B-1} for positions p+1..p+B-1 in
one forward. The target then runs on tokens[:p+1] + drafts and its greedy choices t_k verify them:
accepted = the longest prefix with d_k == t_k; tau = accepted + 1 (the bonus token), at most B.

`dflash-eval --target-model DIR --checkpoint DIR --data-dir DIR [--device cpu|cuda:N]`
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from .model import DFlashConfig, DFlashDrafter, PackedMeta

log = logging.getLogger("trainer.evaluate")


def _taps(target, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def evaluate(target, drafter: DFlashDrafter, dcfg: DFlashConfig, dataset, device: torch.device,
             anchors_per_seq: int = 8, max_seqs: int = 64, seed: int = 0) -> dict:
    drafter.eval()
    bs = dcfg.block_size
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    dtype = next(drafter.parameters()).dtype
    rng = np.random.default_rng(seed)
    taus, accepted_hist = [], np.zeros(bs, np.int64)
    for i in range(min(len(dataset), max_seqs)):
        ids_np, mask_np = dataset[i]
        n = len(ids_np)
        m = mask_np.astype(bool)
        cand = np.nonzero(m[:-1] & m[1:])[0]
        cand = cand[cand >= 1]
        if len(cand) == 0:
            continue
        anchors = np.sort(rng.choice(cand, size=min(anchors_per_seq, len(cand)), replace=False))
        ids = torch.from_numpy(ids_np.astype(np.int64))[None].to(device)
        taps = _taps(target, ids, dcfg.target_layer_ids)[0].to(dtype)
        a = torch.from_numpy(anchors).to(device)
        slot = torch.arange(bs, device=device)
        q_anchor = a.repeat_interleave(bs)
        q_pos = (a[:, None] + slot[None]).reshape(-1)
        tokens = torch.full((len(anchors), bs), dcfg.mask_token_id, device=device, dtype=torch.long)
        tokens[:, 0] = ids[0, a]
        meta = PackedMeta(ctx_seq=torch.zeros(n, dtype=torch.long, device=device),
                          ctx_pos=torch.arange(n, device=device), q_seq=torch.zeros_like(q_anchor),
                          q_anchor=q_anchor, q_pos=q_pos, block_size=bs)
        hidden = drafter(taps, embed[tokens.reshape(-1)].to(dtype), meta, backend="sdpa")
        drafts = (hidden.to(head.dtype) @ head.t()).argmax(-1).view(len(anchors), bs)[:, 1:]
        # verify: target on tokens[:p+1] + drafts, right padded (causal: padding changes nothing)
        lens = anchors + bs
        seqs = torch.zeros(len(anchors), int(lens.max()), dtype=torch.long, device=device)
        for j, p in enumerate(anchors):
            seqs[j, :p + 1] = ids[0, :p + 1]
            seqs[j, p + 1:p + bs] = drafts[j]
        logits = target(input_ids=seqs, use_cache=False).logits
        for j, p in enumerate(anchors):
            t = logits[j, p:p + bs - 1].argmax(-1)
            ok = (t == drafts[j]).long()
            acc = int(torch.cumprod(ok, 0).sum())
            taus.append(acc + 1)
            accepted_hist[acc] += 1
    if not taus:
        raise ValueError("no evaluable anchors in the held-out data")
    total = len(taus)
    # fraction of blocks whose draft position k was accepted (k = 1..B-1)
    at_least = [float(accepted_hist[k:].sum() / total) for k in range(1, bs)]
    drafter.train()
    return {"tau": float(np.mean(taus)), "blocks": total, "per_position_acceptance": at_least}


def evaluate_trainer(trainer, data_dir: str) -> dict:
    """End-of-training evaluation with the trained master weights (a fresh, un-truncated target)."""
    from .data import load_dataset
    from .train import load_target
    dev = trainer.master_dev
    target = load_target(trainer.cfg.target_model, dev, trainer.dtype)
    model = DFlashDrafter(trainer.dcfg, split_fc=trainer.cfg.split_fc).to(dev)
    with torch.no_grad():
        for p, mp in zip(model.parameters(), trainer.master_params):
            p.copy_(mp)
    model.to(trainer.dtype)
    res = evaluate(target, model, trainer.dcfg, load_dataset(data_dir), dev)
    log.info("evaluation on %s: tau %.3f over %d blocks; per-position acceptance %s", data_dir, res["tau"],
             res["blocks"], [round(x, 3) for x in res["per_position_acceptance"]])
    (Path(trainer.cfg.output_dir) / "eval.json").write_text(json.dumps(res, indent=2))
    return res


def load_drafter(checkpoint: str, device, dtype=torch.float32) -> tuple[DFlashDrafter, DFlashConfig]:
    from .checkpoint import load
    state, mcfg, _, _ = load(checkpoint)
    dcfg = DFlashConfig.from_dict(mcfg)
    model = DFlashDrafter(dcfg)
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype), dcfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dflash-eval", description=__doc__.split("\n")[0])
    p.add_argument("--target-model", required=True)
    p.add_argument("--checkpoint", help="a step-* directory; default: the newest in --output-dir")
    p.add_argument("--output-dir")
    p.add_argument("--data-dir", required=True, help="held-out shards")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--anchors-per-seq", type=int, default=8)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--untrained", action="store_true", help="evaluate a freshly initialised drafter (baseline)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .checkpoint import CheckpointManager
    from .config import ConfigError, check_model_dir
    from .data import DataError, load_dataset
    from .train import load_target
    try:
        check_model_dir(a.target_model)
        ds = load_dataset(a.data_dir)
    except (ConfigError, DataError) as e:
        print(f"dflash-eval: error: {e}", file=sys.stderr)
        return 2
    ckpt = a.checkpoint
    if ckpt is None and a.output_dir:
        latest = CheckpointManager(a.output_dir).latest()
        ckpt = str(latest) if latest else None
    if ckpt is None:
        print("dflash-eval: error: --checkpoint: none given and none found in --output-dir", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, dcfg = load_drafter(ckpt, dev, dtype)
    if a.untrained:
        from .model import init_drafter_weights
        init_drafter_weights(model)
    target = load_target(a.target_model, dev, dtype)
    res = evaluate(target, model, dcfg, ds, dev, a.anchors_per_seq, a.max_seqs)
    res["checkpoint"] = ckpt
    if a.json:
        print(json.dumps(res))
    else:
        print(f"tau {res['tau']:.3f} over {res['blocks']} blocks (block size {dcfg.block_size})")
        print("per-position acceptance: " + " ".join(f"{x:.2f}" for x in res["per_position_acceptance"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
