"""The target rank's stage: a frozen replica of the target on one GPU, its compute stream, its slots.

Forward hooks on the tapped layers (and on the final norm, for soft labels) pack exactly the rows
the drafter needs into a slot, on the forward's own stream, so packing is ordered after the
producer without a sync; `forward_pack` then records the slot's ready event for the sender.
Its twin on the drafter ranks is trainer/engine/drafter_stage.py; loading the target is
trainer/model/target.py.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from trainer.distributed import oprecord
from trainer.distributed.transport import (
    Sender,
    Slot,
    device_ctx,
    new_event,
    new_stream,
    packed_numel,
    stream_ctx,
    unpack,
)
from trainer.errors import BadInput, TrainingFailed
from trainer.model.target import decoder, load_target
from trainer.ops.compiling import compile_layers, sdpa_context, wants

log = logging.getLogger("trainer.target")


class TargetStage:
    """Owns: the model replica, one compute stream, `num_slots` packed slot buffers, the capture hooks."""

    def __init__(self, model, device: torch.device, tap_ids: list[int], soft_labels: bool, rows: int,
                 num_slots: int, dtype: torch.dtype, sdpa_backend: str = "auto", keep_head: bool = False):
        self.model, self.device, self.sdpa_backend = model, device, sdpa_backend
        self.stream = new_stream(device)
        self.tap_ids, self.soft_labels = list(tap_ids), soft_labels
        self.k = len(tap_ids)
        dec = decoder(model)
        self.hidden = dec.config.hidden_size if hasattr(dec, "config") else model.config.hidden_size
        self.capacity = packed_numel(rows, rows if soft_labels else 0, self.k, self.hidden)
        self.slots = [Slot(i, torch.empty(self.capacity, device=device, dtype=dtype)) for i in range(num_slots)]
        self._next = 0
        self._cur: dict | None = None
        layers = dec.layers
        self.all_layers = layers   # the whole stack (full_model); training may run only a prefix of it
        self._hooks = [layers[lid].register_forward_hook(self._tap_hook(col)) for col, lid in enumerate(self.tap_ids)]
        if soft_labels:
            self._hooks.append(dec.norm.register_forward_hook(self._final_hook))
        elif max(self.tap_ids) + 1 < len(layers) and not keep_head:
            # hard labels need nothing after the last tap: run only the layers we read
            dec.layers = layers[: max(self.tap_ids) + 1]

    @contextmanager
    def full_model(self):
        """The whole target for generation (trainer/engine/evaltrain.py): every layer, the final norm and the LM
        head, in eval mode. The layers hard-label training skips are put back for the duration. Call
        it only on the main thread while no forward of this stage is queued (an eval step's boundary);
        the tap hooks stay registered but copy nothing outside forward_pack."""
        dec, model = decoder(self.model), self.model
        trained, was_training = dec.layers, model.training
        dec.layers = self.all_layers
        model.eval()
        try:
            yield model
        finally:
            dec.layers = trained
            model.train(was_training)

    # hooks run on the forward's (this stage's) stream
    def _tap_hook(self, col):
        def hook(module, args, output):
            cur = self._cur
            if cur is None:
                return
            out = output[0] if isinstance(output, tuple) else output
            h = self.hidden
            cur["taps"][:, col * h:(col + 1) * h].copy_(out.reshape(-1, h).index_select(0, cur["gather"]))
        return hook

    def _final_hook(self, module, args, output):
        cur = self._cur
        if cur is None or cur["final"] is None:
            return
        cur["final"].copy_(output.reshape(-1, self.hidden).index_select(0, cur["final_gather"]))

    def next_slot(self) -> Slot:
        """The next slot of the ring, with this stage's stream ordered after its previous send."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        Sender.reclaim(slot, self.stream)
        return slot

    @torch.inference_mode()
    def forward_pack(self, item, slot: Slot) -> dict:
        """Forward + pack into `slot`, on this stage's stream. Returns timing events (start, done)."""
        dev = self.device
        ev = {"start": new_event(dev, True), "done": new_event(dev, True)}
        with device_ctx(dev), stream_ctx(self.stream):
            ev["start"].record()
            ids = item.input_ids.to(dev, non_blocking=True)
            gather = item.ctx_gather.to(dev, non_blocking=True)
            fg = item.final_gather.to(dev, non_blocking=True) if item.final_gather is not None else None
            rows, nf = gather.shape[0], (fg.shape[0] if fg is not None else 0)
            taps, final = unpack(slot.flat, rows, nf, self.k, self.hidden)
            self._cur = {"taps": taps, "gather": gather, "final": final, "final_gather": fg}
            try:
                with sdpa_context(self.sdpa_backend, dev.type):
                    decoder(self.model)(input_ids=ids, use_cache=False)
            finally:
                self._cur = None
            oprecord.compute(self.stream, f"target fwd+pack mb {item.seq_no}")   # no-op unless recording
            ev["done"].record()
            slot.ready = new_event(dev)
            slot.ready.record()
        slot.rows, slot.final_rows = rows, nf
        return ev

    def numel(self, slot: Slot) -> int:
        return packed_numel(slot.rows, slot.final_rows, self.k, self.hidden)

    def warmup(self, shapes: list[tuple[int, int]], vocab: int):
        """Run representative [B, S] shapes so allocation/autotune surprises happen before step 1."""
        for bsz, seqlen in shapes:
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (bsz, seqlen))
            with torch.inference_mode(), device_ctx(self.device), stream_ctx(self.stream), \
                    sdpa_context(self.sdpa_backend, self.device.type):
                decoder(self.model)(input_ids=ids.to(self.device), use_cache=False)
            if self.stream is not None:
                self.stream.synchronize()
            log.info("warmup: target %s shape %dx%d in %.2fs", self.device, bsz, seqlen, time.perf_counter() - t0)


def load_for_run(cfg, device: torch.device, dtype: torch.dtype):
    """The target of --target-model on this rank's device (model.target.load_target). BadInput (exit 2) for
    what a restart will not fix: a hybrid without its fast kernels on a GPU, or a truncated or corrupt shard
    (named); TrainingFailed for any other failure to load."""
    t0 = time.perf_counter()
    try:
        model = load_target(cfg.target_model, device, dtype, cfg.allow_slow_linear_attention)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001  a truncated or corrupt shard: name it, exit 2
        from trainer.config.options import ConfigError
        from trainer.config.preflight import check_target_shards
        try:
            check_target_shards(cfg.target_model)
        except ConfigError as bad:
            raise BadInput(str(bad)) from None
        raise TrainingFailed(f"--target-model: {cfg.target_model} failed to load: {e}") from e
    log.info("loaded the target on %s in %.1fs", device, time.perf_counter() - t0)
    return model


def build_target_stage(cfg, model, device: torch.device, dtype: torch.dtype, tap_ids: list[int], rows: int,
                       link) -> tuple[TargetStage, Sender]:
    """This target rank's stage around `model` (its slots sized for `rows` packed rows) and the sender of its
    slots on `link`; with --compile target or all, the target's layers compiled (regional; the compile
    happens during warmup)."""
    stage = TargetStage(model, device, tap_ids, cfg.use_soft_labels, rows, cfg.slots_per_worker, dtype,
                        sdpa_backend=cfg.sdpa_backend)
    if wants(cfg.compile, "target"):
        n = compile_layers(decoder(model).layers)
        log.info("--compile %s: %d target layers compiled (regional; compiles during warmup)", cfg.compile, n)
    return stage, Sender(device, link)
