"""This rank's micro-batches: the data and its dispatch plan, the host-side work item of each micro-batch
(collated ids, gather indices, the drafter's chunk metadata as pinned host tensors), the prefetch thread
that builds them in order into a bounded queue, the main thread's lookahead over that queue, and the
posting of receives for the micro-batches this rank drafts.

Threads: the prefetch thread runs make_item() and put()s; everything else here runs on the main thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer.config.options import TrainConfig
from trainer.data.dataset import BatchPlanner, DataError, collate, load_dataset
from trainer.distributed.dispatch import DispatchPlan
from trainer.distributed.topology import Topology
from trainer.engine.metrics import Profiler
from trainer.errors import BadInput, TrainingFailed
from trainer.model.architectures import architecture
from trainer.ops.plan import MicroPlan, plan_micro_batch

log = logging.getLogger("trainer")


@dataclass
class WorkItem:
    seq_no: int
    epoch: int
    batch_index: int
    input_ids: torch.Tensor          # [B, S] int64, pinned when CUDA is used
    ctx_gather: torch.Tensor         # [rows] int64
    final_gather: torch.Tensor | None
    plan: MicroPlan
    data_s: float = 0.0
    lengths: np.ndarray | None = None
    host: dict = field(default_factory=dict)  # chunk metadata as (pinned) host tensors


def to_host_tensors(plan: MicroPlan, pin: bool) -> list[dict]:
    """Each chunk's arrays (plan.CHUNK_ARRAYS) as host tensors, pinned when a GPU will read them."""
    out = []
    for c in plan.chunks:
        d = {k: torch.from_numpy(v) for k, v in c.arrays().items()}
        if pin:
            d = {k: v.pin_memory() for k, v in d.items()}
        out.append(d)
    return out


def make_item(seq_no: int, epoch: int, batch_index: int, batch, plan: MicroPlan, pin: bool,
              data_s: float) -> WorkItem:
    ids = batch.input_ids
    gather = torch.from_numpy(plan.ctx_gather)
    fg = torch.from_numpy(plan.final_gather) if plan.final_gather is not None else None
    if pin:
        ids, gather = ids.pin_memory(), gather.pin_memory()
        fg = fg.pin_memory() if fg is not None else None
    item = WorkItem(seq_no, epoch, batch_index, ids, gather, fg, plan, data_s)
    item.lengths = batch.lengths.numpy()
    item.host["chunks"] = to_host_tensors(plan, pin)
    return item


class Feed:
    """Owns: the dataset, the batch planner and dispatch plan, the prefetch thread and its queue, the
    lookahead (items the main thread has taken off the queue but not yet used), the shapes seen."""

    def __init__(self, cfg: TrainConfig, topo: Topology, device: torch.device, profiler: Profiler, dataset=None):
        self.cfg, self.topo, self.device, self.profiler = cfg, topo, device, profiler
        self.dataset = dataset               # injected (benchmark, tests) or loaded by load()
        self.planner: BatchPlanner | None = None
        self.dispatch: DispatchPlan | None = None
        self.flex: bool = (cfg.attention == "flex") or (cfg.attention == "auto" and device.type == "cuda")
        self.rows: int = cfg.token_budget + (128 * cfg.max_batch_size if self.flex else 0)   # slot rows
        self.mask_token: int = -1            # set once the target's vocabulary is known (Trainer setup)
        self.batch_shapes: set[tuple[int, int]] = set()
        self.thread: threading.Thread | None = None
        self.q: queue.Queue = queue.Queue(maxsize=8)
        self.lookahead: deque = deque()
        self.fatal: BaseException | None = None
        self.draining = False

    def load(self) -> None:
        cfg = self.cfg
        try:
            self.dataset = self.dataset or load_dataset(cfg.data_dir)
        except DataError as e:
            raise BadInput(f"--data-dir: {e}") from None
        self.planner = BatchPlanner(self.dataset.lengths, cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size,
                                    seed=cfg.seed, drop_long=cfg.drop_long)
        st = self.planner.stats()
        log.info("data: %d sequences, %d tokens; %d batches/epoch; %d truncated, %d dropped (over --max-seq-len %d)",
                 st["num_sequences"], self.dataset.num_tokens, st["num_batches_per_epoch"], st["num_truncated"],
                 st["num_dropped"], cfg.max_seq_len)
        if st["num_batches_per_epoch"] == 0:
            raise TrainingFailed(f"--data-dir: {cfg.data_dir} yields no batches")
        self.dispatch = DispatchPlan(self.planner, self.dataset, cfg, len(self.topo.target_ranks),
                                     len(self.topo.drafter_ranks))

    def position(self, seq: int) -> tuple[int, int]:
        n = self.planner.num_batches
        return seq // n, seq % n

    def plan(self, input_ids, loss_mask, lengths, sample_ids, epoch: int, *, seed: int, max_anchors: int):
        """plan_micro_batch with this run's drafter options: the one place the training batches and the
        warmup's batches take them from, so the warmup compiles for the layouts training will bring."""
        cfg = self.cfg
        return plan_micro_batch(input_ids, loss_mask, lengths, sample_ids, epoch, seed=seed,
                                block_size=cfg.block_size, max_anchors=max_anchors, mask_token_id=self.mask_token,
                                gamma=cfg.gamma, soft_labels=cfg.use_soft_labels, chunk_rows=cfg.drafter_chunk_rows,
                                flex=self.flex, dedup=cfg.loss_dedup, full_blocks=cfg.flex_full_blocks,
                                ctx_group=cfg.flex_ctx_group, loss=cfg.loss, selector=architecture(cfg.arch).selector)

    def make_item(self, seq: int) -> WorkItem:
        cfg = self.cfg
        t0 = time.perf_counter()
        ep, bi = self.position(seq)
        batch = collate(self.dataset, self.planner.batch(ep, bi), cfg.max_seq_len, cfg.pad_multiple)
        plan = self.plan(batch.input_ids.numpy(), batch.loss_mask.numpy(), batch.lengths.numpy(), batch.sample_ids,
                         ep, seed=cfg.seed, max_anchors=cfg.max_anchors)
        self.batch_shapes.add(tuple(batch.input_ids.shape))
        item = make_item(seq, ep, bi, batch, plan, pin=self.device.type == "cuda", data_s=0.0)
        item.data_s = time.perf_counter() - t0
        self.profiler.add("data (collate+plan)", item.data_s)
        return item

    def mine(self, step: int) -> list:
        """This rank's micro-batches of `step`, in sequence order (as target, drafter or both)."""
        topo = self.topo
        ti = topo.target_index if topo.is_target else -1
        di = topo.drafter_index if topo.is_drafter else -1
        return [a for a in self.dispatch.step(step) if a.target == ti or a.drafter == di]

    def start(self, first_step: int, total_steps: int):
        def run():
            try:
                for step in range(first_step, total_steps):
                    for a in self.mine(step):
                        item = self.make_item(a.seq)
                        while not self.draining:
                            try:
                                self.q.put((a, item), timeout=0.5)
                                break
                            except queue.Full:
                                continue
                        if self.draining:
                            return
            except BaseException as e:  # surfaced by the main thread
                self.fatal = e
                log.exception("prefetch failed")
        self.thread = threading.Thread(target=run, name="prefetch", daemon=True)
        self.thread.start()

    def pull(self, block: bool) -> bool:
        try:
            self.lookahead.append(self.q.get(timeout=0.5) if block else self.q.get_nowait())
            return True
        except queue.Empty:
            if self.fatal is not None:
                raise TrainingFailed(f"prefetch thread failed: {self.fatal!r}")
            return False

    def next(self, seq: int):
        while not self.lookahead:
            self.pull(block=True)
        a, item = self.lookahead.popleft()
        if a.seq != seq:
            raise RuntimeError(f"prefetch order broken: expected micro-batch {seq}, got {a.seq}")
        return item

    def post_receives(self, r, stream, step: int) -> None:
        """Post irecvs (Receiver r) for this step's drafter micro-batches, in sequence order, as far as free
        buffers allow, waiting for the prefetch thread where an item is not built yet. So the order of the
        ops this rank issues is a function of the plan alone, never of how far the prefetch thread got: the
        order streamcheck checks is the only one the code can issue. Only this step's: a stop agreed after
        this step must leave no receive posted."""
        di = self.topo.drafter_index
        for a in self.dispatch.step(step):
            if a.drafter != di or a.seq <= r.last_posted:
                continue
            if not r.can_post():
                return
            item = self.peek(a.seq)
            rows = int(item.plan.num_ctx_rows)
            nf = int(item.final_gather.shape[0]) if item.final_gather is not None else 0
            r.post(a.seq, self.topo.target_ranks[a.target], rows, nf, stream)

    def peek(self, seq: int):
        """The work item of `seq` (this rank's), left in the lookahead; waits for the prefetch thread."""
        while True:
            for a, item in self.lookahead:
                if a.seq == seq:
                    return item
            if not self.pull(block=True) and (self.thread is None or not self.thread.is_alive()) and self.q.empty():
                raise TrainingFailed(f"prefetch thread ended before micro-batch {seq}")

    def stop(self):
        """The prefetch thread stops at its next put."""
        self.draining = True

    def close(self):
        self.draining = True
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        if self.thread is not None:
            self.thread.join(timeout=10)
