"""Target side and transport: who owns which thread, stream and buffer.

  feeder thread      : data -> WorkItem (collate + plan, pinned host tensors), in order, numbered
  TargetWorker g     : one thread + one CUDA stream + one frozen replica on target device g.
                       Forward with hooks that pack the tapped layers into the SLOT's preallocated
                       buffer on the same stream, then start the copy to the drafter side and record
                       an event. A slot semaphore (per worker) caps copies in flight.
  EventWaiter        : background thread; waits each copy's event, then publishes the item to the
                       Dispatcher. Nothing but the copy touches a slot between acquire and release.
  Dispatcher         : reorders by sequence number; item n goes to drafter replica n % M (bounded queues),
                       so the assignment is the same in async and sync mode.
  Slot release       : the drafter records an event once it no longer needs the slot's memory (after
                       its host->device copy, or after backward when it reads the slot directly); a second
                       EventWaiter releases the slot when that event completes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .fast import sdpa_context
from .plan import MicroPlan

log = logging.getLogger("trainer.pipeline")


class _HostEvent:
    """Stand-in for torch.cuda.Event on the CPU: host work is already complete when recorded."""

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


def new_event(device: torch.device, timing: bool = False):
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing)
    return _HostEvent()


class _NullStream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def stream_ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else _NullStream()


def device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else _NullStream()


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


@dataclass
class Slot:
    """A packed tap buffer on the target device and the destination it is copied to."""
    index: int
    taps: torch.Tensor               # [rows, K*H] on the target device
    final: torch.Tensor | None       # [rows, H] on the target device (soft labels)
    dst_taps: torch.Tensor           # pinned host, peer-device buffer, or `taps` itself (same device)
    dst_final: torch.Tensor | None
    owner: "TargetWorker"
    mode: str                        # "pinned" | "peer" | "same"


@dataclass
class Delivered:
    item: WorkItem
    slot: Slot
    rows: int
    final_rows: int
    timings: dict


class EventWaiter(threading.Thread):
    """Waits for events in order and runs a callback after each; the GPU never waits on this thread."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None

    def put(self, event, callback):
        self.q.put((event, callback))

    def run(self):
        while True:
            job = self.q.get()
            if job is None:
                return
            event, callback = job
            try:
                event.synchronize()
                callback()
            except BaseException as e:  # surfaced by the owner
                self.error = e
                log.exception("%s failed", self.name)

    def close(self):
        self.q.put(None)


class Dispatcher:
    """Reorders delivered items by sequence number; item n goes to replica n % M."""

    def __init__(self, num_replicas: int, depth: int):
        self.queues = [queue.Queue(maxsize=depth) for _ in range(num_replicas)]
        self.pending: dict[int, Delivered] = {}
        self.next_seq = 0
        self.lock = threading.Lock()

    def reset(self, start_seq: int):
        self.next_seq = start_seq

    def publish(self, d: Delivered):
        ready = []
        with self.lock:
            self.pending[d.item.seq_no] = d
            while self.next_seq in self.pending:
                ready.append(self.pending.pop(self.next_seq))
                self.next_seq += 1
        for r in ready:
            self.queues[r.item.seq_no % len(self.queues)].put(r)

    def depths(self) -> list[int]:
        return [q.qsize() for q in self.queues]


class TargetWorker:
    """A frozen replica of the target on one device, its stream, its slots and its capture hooks."""

    def __init__(self, index: int, model, device: torch.device, tap_ids: list[int], soft_labels: bool,
                 rows: int, drafter_devices: list[torch.device], num_slots: int, dtype: torch.dtype,
                 transport: str = "auto", sdpa_backend: str = "auto"):
        self.index, self.model, self.device = index, model, device
        self.sdpa_backend = sdpa_backend
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.tap_ids, self.soft_labels = list(tap_ids), soft_labels
        self.k = len(tap_ids)
        decoder = _decoder(model)
        self.hidden = decoder.config.hidden_size if hasattr(decoder, "config") else model.config.hidden_size
        self.sem = threading.Semaphore(num_slots)
        self.free: queue.Queue = queue.Queue()
        self._cur: dict | None = None
        self.in_flight = 0
        self._lock = threading.Lock()
        dst_dev = drafter_devices[0]
        mode = "same" if dst_dev == device else ("peer" if _peer_ok(device, dst_dev) else "pinned")
        if transport == "pinned" and mode == "peer":
            mode = "pinned"
        elif transport == "peer" and mode == "pinned":
            raise RuntimeError(f"--transport peer: {device} cannot access {dst_dev} directly "
                               "(no peer-to-peer path); use --transport auto or pinned")
        self.mode = mode
        self.slots = []
        for i in range(num_slots):
            taps = torch.empty(rows, self.k * self.hidden, device=device, dtype=dtype)
            final = torch.empty(rows, self.hidden, device=device, dtype=dtype) if soft_labels else None
            if mode == "same":
                dt, df = taps, final
            elif mode == "peer":
                dt = torch.empty_like(taps, device=dst_dev)
                df = torch.empty_like(final, device=dst_dev) if final is not None else None
            else:
                dt = torch.empty(taps.shape, dtype=dtype, pin_memory=True)
                df = torch.empty(final.shape, dtype=dtype, pin_memory=True) if final is not None else None
            s = Slot(i, taps, final, dt, df, self, mode)
            self.slots.append(s)
            self.free.put(s)
        self._hooks = []
        layers = decoder.layers
        for col, lid in enumerate(self.tap_ids):
            self._hooks.append(layers[lid].register_forward_hook(self._tap_hook(col)))
        if soft_labels:
            self._hooks.append(decoder.norm.register_forward_hook(self._final_hook))
        elif max(self.tap_ids) + 1 < len(layers):
            # hard labels need nothing after the last tap: run only the layers we read
            decoder.layers = layers[: max(self.tap_ids) + 1]

    def pinned_bytes(self) -> int:
        if self.mode != "pinned":
            return 0
        return sum(s.dst_taps.numel() * s.dst_taps.element_size()
                   + (s.dst_final.numel() * s.dst_final.element_size() if s.dst_final is not None else 0)
                   for s in self.slots)

    # hooks run on the forward's (this worker's) stream: packing is ordered after the producer
    def _tap_hook(self, col):
        def hook(module, args, output):
            cur = self._cur
            if cur is None:
                return
            out = output[0] if isinstance(output, tuple) else output
            rows = cur["gather"].shape[0]
            h = self.hidden
            cur["slot"].taps[:rows, col * h:(col + 1) * h].copy_(out.reshape(-1, h).index_select(0, cur["gather"]))
        return hook

    def _final_hook(self, module, args, output):
        cur = self._cur
        if cur is None or cur["final_gather"] is None:
            return
        n = cur["final_gather"].shape[0]
        cur["slot"].final[:n].copy_(output.reshape(-1, self.hidden).index_select(0, cur["final_gather"]))

    def acquire(self, cancelled=lambda: False) -> Slot | None:
        """Block until a slot is free (the bound on copies in flight); None when cancelled meanwhile."""
        while not self.sem.acquire(timeout=0.5):
            if cancelled():
                return None
        with self._lock:
            self.in_flight += 1
        return self.free.get()

    def release(self, slot: Slot):
        self.free.put(slot)
        with self._lock:
            self.in_flight -= 1
        self.sem.release()

    @torch.inference_mode()
    def forward_pack(self, item: WorkItem, slot: Slot) -> tuple[object, dict]:
        """Forward + pack + start copy, all on this worker's stream. Returns (copy-done event, timings)."""
        dev = self.device
        ev = {k: new_event(dev, timing=True) for k in ("start", "fwd", "copy")}
        with device_ctx(dev), stream_ctx(self.stream):
            ev["start"].record()
            ids = item.input_ids.to(dev, non_blocking=True)
            gather = item.ctx_gather.to(dev, non_blocking=True)
            fg = item.final_gather.to(dev, non_blocking=True) if item.final_gather is not None else None
            self._cur = {"slot": slot, "gather": gather, "final_gather": fg}
            try:
                with sdpa_context(self.sdpa_backend, self.device.type):
                    _decoder(self.model)(input_ids=ids, use_cache=False)
            finally:
                self._cur = None
            ev["fwd"].record()
            rows = gather.shape[0]
            nf = fg.shape[0] if fg is not None else 0
            if slot.mode != "same":
                slot.dst_taps[:rows].copy_(slot.taps[:rows], non_blocking=True)
                if nf:
                    slot.dst_final[:nf].copy_(slot.final[:nf], non_blocking=True)
            ev["copy"].record()
        return ev, {"rows": rows, "final_rows": nf}

    def warmup(self, shapes: list[tuple[int, int]], vocab: int):
        """Run representative [B, S] shapes so allocation/autotune surprises happen before step 1."""
        for bsz, seqlen in shapes:
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (bsz, seqlen))
            with torch.inference_mode(), device_ctx(self.device), stream_ctx(self.stream), \
                    sdpa_context(self.sdpa_backend, self.device.type):
                _decoder(self.model)(input_ids=ids.to(self.device), use_cache=False)
            if self.stream is not None:
                self.stream.synchronize()
            log.info("warmup: target worker %d (%s) shape %dx%d in %.2fs", self.index, self.device, bsz, seqlen,
                     time.perf_counter() - t0)


def _decoder(model):
    """The decoder stack (embeddings, layers, final norm) without the LM head."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def _peer_ok(a: torch.device, b: torch.device) -> bool:
    if a.type != "cuda" or b.type != "cuda":
        return False
    try:
        return bool(torch.cuda.can_device_access_peer(a, b))
    except Exception:
        return False


def to_host_tensors(plan: MicroPlan, pin: bool) -> list[dict]:
    """Chunk metadata as host tensors (pinned when a GPU will read them)."""
    out = []
    for c in plan.chunks:
        d = {
            "ctx_seq": torch.from_numpy(c.ctx_seq), "ctx_pos": torch.from_numpy(c.ctx_pos),
            "q_seq": torch.from_numpy(c.q_seq), "q_anchor": torch.from_numpy(c.q_anchor),
            "q_pos": torch.from_numpy(c.q_pos), "block_tokens": torch.from_numpy(c.block_tokens),
            "labels": torch.from_numpy(c.labels), "row_weight": torch.from_numpy(c.row_weight),
        }
        if c.soft_index is not None:
            d["soft_index"] = torch.from_numpy(c.soft_index)
        if c.kv_num_blocks is not None:
            d["kv_num_blocks"] = torch.from_numpy(c.kv_num_blocks)
            d["kv_indices"] = torch.from_numpy(c.kv_indices)
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


def np_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
