"""The drafter rank's stage: its FSDP2 shard of the drafter, the frozen embedding and LM head, one
compute stream, the per-step metric accumulators.

FSDP2 (`fully_shard`) over the drafter ranks' mesh: fp32 sharded parameters are the master weights,
compute runs in bf16 on GPUs (MixedPrecisionPolicy), the optimizer state is sharded like the
parameters. Per optimizer step every drafter rank issues exactly one all-gather and one
reduce-scatter per FSDP unit, whatever number of forward calls its micro-batches need (ranks get
different micro-batches, so their forward counts differ and per-forward collectives would pair up
wrongly): parameters stay unsharded over the step (reshard_after_forward=False, reshard after
backward only at the rank's last backward of the step), gradients accumulate unsharded in fp32 (the
reduce dtype) with gradient sync off, and the last backward of the step reduce-scatters them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from trainer.config.options import ConfigError, parse_kernel_options, split_blocks
from trainer.distributed import oprecord
from trainer.distributed.transport import device_ctx, new_event, new_stream, stream_ctx
from trainer.engine.metrics import StepLayout
from trainer.errors import BadInput, TrainingFailed
from trainer.model.dflash2 import selector_loss
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta, init_drafter_weights
from trainer.ops.compiling import compile_layers, wants
from trainer.ops.loss import dflash_loss

log = logging.getLogger("trainer.drafter")


def load_embed_head(path: str, device: torch.device, dtype: torch.dtype):
    """A drafter rank needs only the target's embedding and LM head: read those two tensors from the
    safetensors files (tied embeddings: the head is the embedding) instead of loading 27B weights."""
    from safetensors import safe_open
    d = Path(path)
    index = d / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    embed = head = None
    for fn in files:
        with safe_open(str(d / fn), framework="pt") as f:
            for k in f.keys():
                if embed is None and k.endswith("embed_tokens.weight") and "mtp" not in k and "visual" not in k:
                    embed = f.get_tensor(k)
                elif head is None and k.endswith("lm_head.weight"):
                    head = f.get_tensor(k)
    if embed is None:
        raise TrainingFailed(f"--target-model: no embed_tokens weight in {d}")
    head = embed if head is None else head
    return embed.to(device, dtype), head.to(device, dtype)


def target_embed_head(model, path: str, device: torch.device, dtype: torch.dtype):
    """The target's embedding and LM head: from the target where this rank holds it, else from its files."""
    if model is None:
        return load_embed_head(path, device, dtype)
    return (model.get_input_embeddings().weight.detach().to(device, dtype),
            model.get_output_embeddings().weight.detach().to(device, dtype))


def np_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def build_drafter(dcfg: DFlashConfig, cfg, device: torch.device, dtype: torch.dtype, mesh) -> DFlashDrafter:
    """The drafter, initialised from the seed (identical on every rank), then sharded over `mesh`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    try:   # before any weight is made: a combination refused here is refused on every restart (exit 2)
        split = split_blocks(cfg)   # --flex-kernel-options SPLIT_BLOCKS: its values and the flags it needs
    except ConfigError as e:
        raise BadInput(str(e)) from None
    with torch.device(device):
        model = DFlashDrafter(dcfg, split_fc=cfg.split_fc)
    init_drafter_weights(model, seed=cfg.seed)
    model.train()
    fp8 = getattr(cfg, "fp8", "off")
    if fp8 != "off":
        log.info("--fp8 %s: %d drafter linear layers train in float8 (torchao)", fp8, to_float8(model, fp8))
    kernel_options = parse_kernel_options(getattr(cfg, "flex_kernel_options", ""))
    # SPLIT_BLOCKS=true|1|2 is ours, not FlexAttention's: checked above
    kernel_options.pop("SPLIT_BLOCKS", None)
    for layer in model.layers:
        layer.self_attn.kernel_options = kernel_options or None
        layer.self_attn.split_blocks = "flex" if split else None
        layer.self_attn.split_fused = split == 2   # SPLIT_BLOCKS=2: drafter.BlockMerge (its own backward)
    if wants(cfg.compile, "drafter"):
        compile_layers(model.layers, dynamic=True)  # every micro-batch has its own row counts
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def build_stage(dcfg: DFlashConfig, cfg, device: torch.device, dtype: torch.dtype, group, embed: torch.Tensor,
                head: torch.Tensor, attention: str) -> tuple["DrafterStage", torch.optim.Optimizer]:
    """This drafter rank's stage (its shard of the drafter over the drafter ranks' `group`) and optimizer."""
    from torch.distributed.device_mesh import DeviceMesh

    from trainer.engine.optim import build_optimizer
    module = build_drafter(dcfg, cfg, device, dtype, DeviceMesh.from_group(group, device.type))
    stage = DrafterStage(module, device, embed, head, cfg, dcfg, attention)
    nparams = sum(p.numel() for p in module.parameters())
    log.info("drafter: %.1fM parameters, FSDP2 over %d drafter rank(s); this rank holds its shard on %s",
             nparams / 1e6, group.size(), device)
    return stage, build_optimizer(module, cfg.lr, cfg.weight_decay)


def to_float8(model: DFlashDrafter, recipe: str) -> int:
    """Swap the drafter's nn.Linear layers (fc and every projection of its layers; the LM head is the
    target's, outside this module, and stays bf16) for torchao's Float8Linear with `recipe`'s dynamic
    scaling. Before fully_shard and compile: FSDP2 then shards the same fp32 master weights (the
    state_dict keys do not change, so checkpoints and exports are the same with --fp8 on or off) and the
    casts compile into the layers' graphs. pad_inner_dim: a weight gradient contracts over the rows,
    whose count varies per chunk; FP8 GEMMs need it to be a multiple of 16. Returns the layers swapped.
    DFlash2's own linears stay in the compute dtype: the convolutions' kernel projections (H -> H/4 at
    group 16 and two taps: ~4% of a layer's GEMM FLOPs at width 5120, so FP8 would gain little, and their
    output multiplies every activation of the sublayer) and the candidate selector's rank-256 projection
    (called outside forward, on the loss rows only)."""
    import dataclasses

    from trainer import allow_optional
    allow_optional("torchao")  # asked for (--fp8): the programs defer it (trainer/optional.py)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    names = []

    def eligible(mod: torch.nn.Module, fqn: str) -> bool:
        ok = (isinstance(mod, torch.nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
              and not fqn.endswith("kernel_projection") and not fqn.startswith("candidate_selector"))
        if ok:
            names.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return len(names)


def fsdp_units(model) -> list:
    """The FSDP2 units of the drafter in forward order: the root, then each layer (build_drafter)."""
    return [m for m in model.modules() if hasattr(m, "unshard")]   # FSDPModule (or the op replay's stand-in)


def check_unit_gradients(model) -> None:
    """After the step's syncing backward: every trainable parameter has a gradient. FSDP2 reduce-scatters
    a unit's gradients only when its parameters got some, so a unit that one rank leaves unused (a
    rank-dependent branch) would skip a collective the other ranks issue: a hang on NCCL, found here on
    the rank that skipped, by name, instead."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(f"drafter: no gradient for {len(missing)} parameter(s) after the step's syncing "
                           f"backward ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): their "
                           "FSDP unit skipped its reduce-scatter, which the other drafter ranks issue")


class DrafterStage:
    """Owns: the FSDP2 module, one compute stream, the metric vector, the step's host counters."""

    def __init__(self, model: DFlashDrafter, device: torch.device, embed: torch.Tensor, lm_head: torch.Tensor,
                 cfg, dcfg: DFlashConfig, attention: str):
        self.model, self.device, self.embed, self.lm_head = model, device, embed, lm_head
        self.cfg, self.dcfg, self.attention = cfg, dcfg, attention
        self.stream = new_stream(device)
        self.fused_loss = wants(cfg.compile, "drafter")
        self.fp32_logits = getattr(cfg, "fp32_logits", True)
        self.gen = torch.Generator(device=device)
        bs = dcfg.block_size
        self.layout = StepLayout(bs)
        self.metric = torch.zeros(self.layout.acc_size, device=device, dtype=torch.float32)  # loss, correct per slot
        self.poison = False
        self.tokens = 0
        self.weight = 0.0          # the step's sum of loss weights (the logged loss is per unit of weight)
        self.pos_counts = np.zeros(bs, np.int64)

    def begin_step(self):
        """Before the step's first receive: no gradient sync, parameters kept unsharded between calls, and
        every FSDP unit's all-gather issued now, on this stage's stream (the forward waits for it).
        Issued by FSDP at the first forward instead, the all-gather would wait for that forward's receive
        (FSDP's all-gather streams wait on the current stream), while another drafter's receive can sit
        behind this drafter's next one on a target's communicator: a wait cycle on the GPUs that gloo never
        shows (docs/distributed.md; tests/distributed/test_streamcheck.py finds it in the order FSDP issues).
        --fsdp-prefetch forward restores FSDP's order, for the checker's tests and measurements."""
        self.model.set_requires_gradient_sync(False)
        self.model.set_reshard_after_backward(False)
        if getattr(self.cfg, "fsdp_prefetch", "step") == "step":
            # on this stage's stream: after the previous optimizer step wrote the shards it copies in
            with device_ctx(self.device), stream_ctx(self.stream):
                for unit in fsdp_units(self.model):
                    unit.unshard(async_op=True)

    def _final_backward(self, last: bool):
        if last:   # this backward reduce-scatters the step's gradients and reshards the parameters
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)

    def micro_step(self, item, taps: torch.Tensor, final: torch.Tensor | None, noise_amp: float,
                   loss_scale: float, last: bool, ready=None) -> tuple:
        """Forward + backward of one micro-batch on this stage's stream (after `ready`, if given).
        loss_scale multiplies each micro-batch's normalised loss (D / micro-batches per step, so that
        FSDP's average over the D ranks gives the mean over the step's micro-batches). `last`: the
        rank's last micro-batch of the step (its last backward syncs the gradients).
        Returns (start, done) events; `done` marks the end of every read of taps/final."""
        cfg, bs = self.cfg, self.dcfg.block_size
        plan = item.plan
        self.tokens += plan.num_tokens
        self.weight += float(plan.weight_total)
        self.pos_counts += plan.pos_counts
        with device_ctx(self.device), stream_ctx(self.stream):
            e0, e1 = new_event(self.device, True), new_event(self.device, True)
            if ready is not None and self.stream is not None:
                self.stream.wait_event(ready)
            e0.record()
            chunks = list(zip(plan.chunks, item.host["chunks"])) if plan.weight_total > 0 else []
            norm = plan.weight_total / loss_scale
            if chunks:
                self.gen.manual_seed(np_seed(cfg.seed, item.seq_no + 1))
            for i, (c, h) in enumerate(chunks):
                dev = {k: v.to(self.device, non_blocking=True) for k, v in h.items()}
                meta = PackedMeta.from_chunk(dev, bs)
                x = taps[c.c0:c.c1]
                if noise_amp > 0 and cfg.noise_type != "none":
                    if cfg.noise_type == "uniform":
                        noise = torch.rand(x.shape, generator=self.gen, device=self.device, dtype=torch.float32)
                        noise = (noise * 2 - 1) * noise_amp
                    else:
                        noise = torch.randn(x.shape, generator=self.gen, device=self.device,
                                            dtype=torch.float32) * noise_amp
                    x = x + noise.to(x.dtype)
                emb = self.embed[dev["block_tokens"]]
                hidden = self.model(x, emb, meta, backend=self.attention)
                # soft labels: the final-hidden rows of each loss chunk's unique positions (plan.loss_layout)
                soft = final[dev["soft_unique"]] if final is not None and "soft_unique" in dev else None
                layout = (dev["loss_rows"], c.loss_bounds, dev.get("soft_local"))
                dpace = cfg.dpace_alpha if cfg.loss == "ce+dpace" else None
                top_k = self.dcfg.selector_top_k if self.dcfg.architecture.selector else 0
                out = dflash_loss(hidden, self.lm_head, dev["labels"], dev["row_weight"], norm, soft_rows=soft,
                                  fused=self.fused_loss, layout=layout, fp32_logits=self.fp32_logits, block_size=bs,
                                  dpace_alpha=dpace, top_k=top_k)
                loss, correct = out[:2]
                if top_k:   # the candidate selector's K-way loss (DFlash2's) on the same rows, same weights
                    sel, _ = selector_loss(self.model.candidate_selector, hidden, self.lm_head, out[2], out[3],
                                           dev["prev_tokens"], dev["row_weight"], norm, dev["loss_rows"], bs, dpace)
                    loss = loss + sel
                if self.poison:  # fault injection (DFLASH_FAULT_NAN_FROM_STEP)
                    loss = loss * float("nan")
                if i == len(chunks) - 1:   # (no-op unless recording) the work, then the last backward's collectives
                    oprecord.compute(self.stream, f"drafter fwd+bwd mb {item.seq_no}")
                self._final_backward(last and i == len(chunks) - 1)
                loss.backward()
                if last and i == len(chunks) - 1:
                    check_unit_gradients(self.model)
                valid = (dev["row_weight"] > 0).float()
                self.metric[self.layout.loss] += loss.detach() * norm      # this chunk's sum of w * CE
                self.metric[self.layout.correct] += (correct * valid).view(-1, bs).sum(0)
            if not chunks:
                oprecord.compute(self.stream, f"drafter fwd+bwd mb {item.seq_no}")
                if last:
                    self._empty_backward()
            e1.record()
        return e0, e1

    def _empty_backward(self):
        """A micro-batch with nothing to train on that ends this rank's step: one block of zero-weight
        rows through the drafter, so this rank still joins the step's all-gather and reduce-scatter."""
        bs, dev = self.dcfg.block_size, self.device
        k = len(self.dcfg.target_layer_ids)
        zeros = lambda n: torch.zeros(n, dtype=torch.long, device=dev)  # noqa: E731
        meta = PackedMeta(zeros(1), zeros(1), zeros(bs), zeros(bs) + 1, torch.arange(1, bs + 1, device=dev), bs)
        x = torch.zeros(1, k * self.dcfg.hidden_size, device=dev, dtype=self.embed.dtype)
        hidden = self.model(x, self.embed[zeros(bs)], meta, backend="sdpa")
        self._final_backward(True)
        nothing = hidden.float().sum() * 0.0
        if self.dcfg.architecture.selector:   # used outside forward: its parameters need their zeros too
            nothing = nothing + sum(p.float().sum() for p in self.model.candidate_selector.parameters()) * 0.0
        nothing.backward()
        check_unit_gradients(self.model)

    def step_vector(self) -> torch.Tensor:
        """This rank's numbers of the step as the drafter ranks sum them (StepLayout.summed); on this
        stage's stream."""
        counts = torch.tensor([float(self.tokens), self.weight, *self.pos_counts.tolist()], dtype=torch.float32,
                              pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        return self.layout.summed(self.metric, counts)

    def reset_counters(self):
        """After the step's numbers were queued for the host (step_vector, on this stage's stream). The
        zeroing goes on the same stream: issued on another (the caller's current one), it could run before
        step_vector's read of the same vector and the step's record would show loss 0.0 (seen on the H200,
        docs/performance.md, "FP8 parity")."""
        with device_ctx(self.device), stream_ctx(self.stream):
            self.metric.zero_()
        self.tokens = 0
        self.weight = 0.0
        self.pos_counts = np.zeros_like(self.pos_counts)
