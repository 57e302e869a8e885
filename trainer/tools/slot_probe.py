"""Memorisation probe on the real model (docs/performance.md, "Real model"): 16 real sequences (standard-library
source), the frozen target's taps computed once, the servable DFlash drafter class (modeling_dflash) trained by a
minimal loop with hard CE on block slots 1..B-1, and a slot's accuracy printed as it learns.

    python -m trainer.tools.slot_probe --target-model DIR [--len 64] [--block 2] [--anchors 16] [--steps 150]
        [--taps 15] [--noctx] [--shuffle-ctx] [--tapnorm none|fcstd] [--mask 16] [--lr 3e-3]

A probe, not the trainer: it isolates what the drafter can learn per step from what a step costs.
"""
import argparse
import glob
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from trainer.model.modeling_dflash import DFlashDraftModel


def main() -> None:
    p = argparse.ArgumentParser(prog="slot_probe")
    p.add_argument("--target-model", required=True)
    p.add_argument("--taps", default="15"); p.add_argument("--mask", type=int, default=49151)
    p.add_argument("--mask-zero", action="store_true"); p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=150); p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block", type=int, default=8); p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--std", type=float, default=0.02); p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--shuffle-ctx", action="store_true"); p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--len", type=int, default=256); p.add_argument("--tapnorm", default="none")
    p.add_argument("--gamma", type=float, default=4.0); p.add_argument("--noctx", action="store_true"); p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed); random.seed(a.seed)
    torch.set_num_threads(1)
    M = a.target_model
    tok = AutoTokenizer.from_pretrained(M)
    cache = Path(M) / f".slot-probe-states-{a.seqs}-{a.len}.pt"
    try:
        st = torch.load(cache)
    except FileNotFoundError:
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
        rng = random.Random(0); rng.shuffle(files)
        ids = []
        for f in files:
            t = tok(open(f, encoding="utf-8", errors="replace").read()[:20000])["input_ids"]
            if len(t) >= a.len + 100: ids.append(t[100:100 + a.len])
            if len(ids) == a.seqs: break
        ids = torch.tensor(ids)
        tgt = LlamaForCausalLM.from_pretrained(M, dtype=torch.float32).eval()
        with torch.no_grad():
            out = tgt(input_ids=ids, output_hidden_states=True)
        st = {"ids": ids, "hs": torch.stack(out.hidden_states), "emb": tgt.model.embed_tokens.weight.detach().clone(),
              "logits_argmax": out.logits.argmax(-1)}
        torch.save(st, cache)
    ids, hs, E = st["ids"], st["hs"], st["emb"]
    taps = [int(x) for x in a.taps.split(",")]
    ctx = torch.cat([hs[i + 1] for i in taps], -1)       # [N, S, K*H]
    if a.shuffle_ctx:
        ctx = ctx[:, torch.randperm(ctx.shape[1])]
    H = 576
    cfg = Qwen3Config(hidden_size=H, intermediate_size=1536, num_hidden_layers=a.layers, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, initializer_range=a.std)
    cfg.dflash_config = {"target_layer_ids": taps, "block_size": a.block, "mask_token_id": a.mask, "num_target_layers": 30}
    m = DFlashDraftModel(cfg)
    if a.tapnorm == "fcstd":   # data-dependent fc init: each tap channel scaled by 1/its rms over the data
        chan = ctx.reshape(-1, ctx.shape[-1]).pow(2).mean(0).sqrt().clamp_min(1e-3)
        with torch.no_grad():
            m.fc.weight.mul_(1.0 / chan[None, :])
    Emask = E.clone()
    if a.mask_zero: Emask[a.mask] = 0
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    N, S = ids.shape; B = a.block
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / a.gamma) for k in range(1, B)])
    def batch(gen):
        anchors = torch.stack([torch.randperm(S - B - 1, generator=gen)[:a.anchors].sort().values + 1 for _ in range(N)])
        blk = ids.gather(1, (anchors[:, :, None] + torch.arange(B)).reshape(N, -1)).reshape(N, a.anchors, B)
        labels = blk.clone()
        noise_ids = torch.full_like(blk, a.mask); noise_ids[:, :, 0] = blk[:, :, 0]
        noise = Emask[noise_ids].reshape(N, -1, H)
        qpos = (anchors[:, :, None] + torch.arange(B)).reshape(N, -1)
        pos = torch.cat([torch.arange(S).expand(N, -1), qpos], 1)
        qa = anchors[:, :, None].expand(-1, -1, B).reshape(N, -1)
        cm = torch.arange(S)[None, None, :] < qa[:, :, None]                  # [N, Tq, S]
        if a.noctx: cm = torch.zeros_like(cm)
        bj = torch.arange(a.anchors)[:, None].expand(-1, B).reshape(-1)
        bm = (bj[:, None] == bj[None, :]).expand(N, -1, -1)
        mask = torch.cat([cm, bm], -1)[:, None]
        return noise, pos, mask, labels
    gen = torch.Generator().manual_seed(1)
    t0 = time.time(); hist = []
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / a.warmup) if a.warmup else a.lr
        for g in opt.param_groups: g["lr"] = lr
        noise, pos, mask, labels = batch(gen)
        h = m(position_ids=pos, noise_embedding=noise, target_hidden=ctx, attention_mask=mask)
        hs_ = h.reshape(N, a.anchors, B, -1)[:, :, 1:]
        logits = hs_ @ E.t()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, :, 1:].reshape(-1), reduction="none").reshape(N, a.anchors, B - 1)
        loss = (ce * w[1:]).sum() / (w[1:].sum() * N * a.anchors)
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
        if step % 25 == 0 or step == 1:
            acc = (logits.argmax(-1) == labels[:, :, 1:]).float().mean((0, 1))
            print(f"step {step} loss {loss.item():.3f} acc/slot {' '.join(f'{x:.2f}' for x in acc.tolist())} normw {m.norm.weight.mean().item():.2f} {time.time()-t0:.0f}s", flush=True)
            hist.append((step, loss.item(), acc.tolist()))
    print("FINAL", json.dumps({"args": vars(a), "hist": hist[-1]}))


if __name__ == "__main__":
    main()
