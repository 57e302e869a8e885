"""Memorisation probe on the real model (docs/performance.md, "Real model"): 16 real sequences (standard-library
source), the frozen target's taps computed once, the servable DFlash drafter class (modeling_dflash) trained by a
minimal loop with hard CE on block slots 1..B-1, and a slot's accuracy printed as it learns.

    python -m trainer.lab.slot_probe --target-model DIR [--len 64] [--block 2] [--anchors 16] [--steps 150]
        [--taps 15] [--noctx] [--shuffle-ctx] [--tapnorm none|fcstd] [--mask 16] [--lr 3e-3]

A probe, not the trainer: it isolates what the drafter can learn per step from what a step costs (the LM
head's 576 x 49,152 product a label row). tests/chain/test_real_model.py runs `train` and `context_loss` as the
lane's overfit and context checks.
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

from trainer.model.modeling_dflash import DFlashDraftModel


def target_states(model_dir: str, seqs: int = 16, length: int = 256) -> dict:
    """`seqs` real sequences of `length` tokens (standard-library files, 100 tokens in) and the target's hidden
    states over them, computed once and cached beside the model."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    cache = Path(model_dir) / f".slot-probe-states-{seqs}-{length}.pt"
    try:
        return torch.load(cache)
    except (FileNotFoundError, RuntimeError, EOFError):
        pass
    tok = AutoTokenizer.from_pretrained(model_dir)
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    random.Random(0).shuffle(files)
    ids = []
    for f in files:
        t = tok(open(f, encoding="utf-8", errors="replace").read()[:20000])["input_ids"]
        if len(t) >= length + 100:
            ids.append(t[100:100 + length])
        if len(ids) == seqs:
            break
    ids = torch.tensor(ids)
    tgt = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = tgt(input_ids=ids, output_hidden_states=True)
    st = {"ids": ids, "hs": torch.stack(out.hidden_states), "emb": tgt.model.embed_tokens.weight.detach().clone()}
    tmp = cache.with_suffix(".tmp")
    torch.save(st, tmp)
    tmp.replace(cache)
    return st


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int, context: bool = True):
    """The drafter's inputs for `block`-token blocks at `anchors` [N, A] of each row of `ids` [N, S]: the blocks'
    tokens [N, A, B]; their noise ids (the anchor, then MASK); the positions (the context's, then the blocks');
    the attention mask [N, 1, A*B, S + A*B]: each block sees the context strictly before its anchor (nothing
    with context=False) and its own block both ways."""
    N, S = ids.shape
    A, B = anchors.shape[1], block
    at = (anchors[:, :, None] + torch.arange(B)).reshape(N, -1)
    blk = ids.gather(1, at).reshape(N, A, B)
    noise_ids = torch.full_like(blk, mask_id)
    noise_ids[:, :, 0] = blk[:, :, 0]
    pos = torch.cat([torch.arange(S).expand(N, -1), at], 1)
    qa = anchors[:, :, None].expand(-1, -1, B).reshape(N, -1)
    cm = torch.arange(S)[None, None, :] < qa[:, :, None]                  # [N, Tq, S]: the anchor's past
    if not context:
        cm = torch.zeros_like(cm)
    bj = torch.arange(A)[:, None].expand(-1, B).reshape(-1)
    bm = (bj[:, None] == bj[None, :]).expand(N, -1, -1)                   # within a block, both ways
    return blk, noise_ids, pos, torch.cat([cm, bm], -1)[:, None]


class Probe:
    """The drafter (modeling_dflash's class at the target's width) and its batches over the cached states."""

    def __init__(self, st: dict, taps=(15,), block: int = 2, anchors: int = 16, layers: int = 1, mask: int = 16,
                 std: float = 0.02, gamma: float = 4.0, noctx: bool = False, tapnorm: str = "none",
                 num_target_layers: int = 30):
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
        self.ids, self.E = st["ids"], st["emb"]
        self.ctx = torch.cat([st["hs"][i + 1] for i in taps], -1)       # [N, S, K*H]
        self.block, self.anchors, self.mask, self.noctx = block, anchors, mask, noctx
        H = self.H = self.E.shape[1]
        cfg = Qwen3Config(hidden_size=H, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=self.E.shape[0], rms_norm_eps=1e-5,
                          rope_theta=100000.0, max_position_embeddings=8192, initializer_range=std)
        cfg.dflash_config = {"target_layer_ids": list(taps), "block_size": block, "mask_token_id": mask,
                             "num_target_layers": num_target_layers}
        self.m = DFlashDraftModel(cfg)
        if tapnorm == "fcstd":   # data-dependent fc init: each tap channel scaled by 1/its rms over the data
            chan = self.ctx.reshape(-1, self.ctx.shape[-1]).pow(2).mean(0).sqrt().clamp_min(1e-3)
            with torch.no_grad():
                self.m.fc.weight.mul_(1.0 / chan[None, :])
        self.w = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block)])

    def batch(self, anchors: torch.Tensor, ctx: torch.Tensor):
        N, A, B = self.ids.shape[0], anchors.shape[1], self.block
        blk, noise_ids, pos, mask = block_inputs(self.ids, anchors, B, self.mask, context=not self.noctx)
        h = self.m(position_ids=pos, noise_embedding=self.E[noise_ids].reshape(N, -1, self.H), target_hidden=ctx,
                   attention_mask=mask)
        # one [N*A*(B-1), H] @ [H, V] product: the sliced 4-D view would go to a bmm over a broadcast head,
        # 15x slower on the CPU
        logits = (h.reshape(N, A, B, -1)[:, :, 1:].reshape(-1, self.H) @ self.E.t()).reshape(N, A, B - 1, -1)
        labels = blk[:, :, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        ce = ce.reshape(N, A, B - 1)
        loss = (ce * self.w[1:]).sum() / (self.w[1:].sum() * N * A)
        return loss, (logits.argmax(-1) == labels).float().mean((0, 1))

    def sample_anchors(self, gen: torch.Generator) -> torch.Tensor:
        N, S = self.ids.shape
        return torch.stack([torch.randperm(S - self.block - 1, generator=gen)[:self.anchors].sort().values + 1
                            for _ in range(N)])

    def train(self, steps: int, lr: float, warmup: int = 0, seed: int = 1, every: int = 25, log=None) -> list:
        """AdamW on random anchors each step; returns [(step, loss, accuracy per slot)] every `every` steps."""
        opt = torch.optim.AdamW(self.m.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(seed)
        hist, t0 = [], time.time()
        for step in range(1, steps + 1):
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, step / warmup) if warmup else lr
            loss, acc = self.batch(self.sample_anchors(gen), self.ctx)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.m.parameters(), 1.0)
            opt.step()
            if step % every == 0 or step == 1:
                hist.append((step, loss.item(), acc.tolist()))
                if log:
                    log(f"step {step} loss {loss.item():.3f} acc/slot {' '.join(f'{x:.2f}' for x in acc.tolist())} "
                        f"{time.time() - t0:.0f}s")
        return hist

    @torch.no_grad()
    def context_loss(self, shuffle: bool = False, seed: int = 2) -> tuple[float, list]:
        """Loss and accuracy over every anchor position, with the target's states as they are or shuffled
        over positions and sequences (the same states, each at another token's place)."""
        N, S = self.ids.shape
        ctx = self.ctx
        if shuffle:
            g = torch.Generator().manual_seed(seed)
            flat = ctx.reshape(N * S, -1)
            ctx = flat[torch.randperm(N * S, generator=g)].reshape(ctx.shape)
        anchors = torch.arange(1, S - self.block)[None].expand(N, -1)
        loss, acc = self.batch(anchors, ctx)
        return loss.item(), acc.tolist()


def main() -> None:
    p = argparse.ArgumentParser(prog="slot_probe")
    p.add_argument("--target-model", required=True)
    p.add_argument("--taps", default="15")
    p.add_argument("--mask", type=int, default=49151)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--shuffle-ctx", action="store_true", help="train on shuffled states")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--tapnorm", default="none")
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--noctx", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_num_threads(a.threads)
    st = target_states(a.target_model, a.seqs, a.len)
    taps = [int(x) for x in a.taps.split(",")]
    if a.shuffle_ctx:
        hs = st["hs"]
        st = {**st, "hs": hs[:, :, torch.randperm(hs.shape[2])]}
    pr = Probe(st, taps, a.block, a.anchors, a.layers, a.mask, a.std, a.gamma, a.noctx, a.tapnorm)
    hist = pr.train(a.steps, a.lr, a.warmup, log=lambda s: print(s, flush=True))
    real, shuf = pr.context_loss(), pr.context_loss(shuffle=True)
    print(f"every anchor: loss {real[0]:.3f} (acc {real[1]}) with the states, {shuf[0]:.3f} (acc {shuf[1]}) shuffled")
    print("FINAL", json.dumps({"args": vars(a), "hist": hist[-1], "context_loss": real, "shuffled_loss": shuf}))


if __name__ == "__main__":
    main()
