"""Hidden states from a target rank to a drafter rank: packed slots, NCCL/gloo point-to-point.

Owners (one each, visible here):
  Slot ring (target rank)      TargetStage owns `num_slots` flat buffers on its device. A slot holds
                               [rows x K*H taps | final_rows x H final hidden] packed back to back,
                               so one send moves a micro-batch.
  Sender (target rank)         its own communication stream. `send` makes that stream wait on the
                               slot's pack event (no host sync), posts the isend there, and keeps the
                               work; the slot is handed out again only after that work completed
                               (the slot ring is the in-flight bound).
  Receiver (drafter rank)      `depth` preallocated flat buffers on the drafter's own device, posted
                               as irecvs ahead of use in the plan's order; the compute stream waits on
                               the receive (work.wait() on NCCL orders streams, it does not block the
                               host); a buffer is re-posted only after the compute that read it was
                               queued, on the compute stream, so the receive is ordered after it.
  Local link (world size 1)    the drafter reads the target's slot in place: nothing is sent.

Both ends know every message's size and peer from the dispatch plan, so no handshake is needed and
operations are posted in the same order on both sides.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from trainer.distributed import oprecord


class HostEvent:
    """Stand-in for torch.cuda.Event on the CPU: host work is complete when recorded."""

    def __init__(self):
        self.t = time.perf_counter()

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, stream=None):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


def new_event(device: torch.device, timing: bool = False):
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing)
    return oprecord.event() or HostEvent()   # recording (oprecord.py): an event that logs its stream


class NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def stream_ctx(stream):
    if isinstance(stream, oprecord.LogicalStream):
        return oprecord.RECORDER.on(stream)
    return torch.cuda.stream(stream) if stream is not None else NullCtx()


def device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else NullCtx()


def new_stream(device: torch.device, name: str | None = None):
    """A CUDA stream on GPUs; None on the CPU, or a named logical stream while recording (oprecord.py),
    named after its owner (the calling class unless `name` is given)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device)
    if oprecord.RECORDER is None:
        return None
    owner = sys._getframe(1).f_locals.get("self")
    return oprecord.stream(name or (type(owner).__name__ if owner is not None else "default"))


def packed_numel(rows: int, final_rows: int, k: int, hidden: int) -> int:
    return rows * k * hidden + final_rows * hidden


def unpack(flat: torch.Tensor, rows: int, final_rows: int, k: int, hidden: int):
    """Views of a packed buffer: taps [rows, K*H], final [final_rows, H] (None when 0)."""
    n = rows * k * hidden
    taps = flat[:n].view(rows, k * hidden)
    final = flat[n:n + final_rows * hidden].view(final_rows, hidden) if final_rows else None
    return taps, final


@dataclass
class Slot:
    """One packed buffer on the target device."""
    index: int
    flat: torch.Tensor
    ready: object = None          # event: packing done (recorded on the target's compute stream)
    work: object = None           # the send that reads it (None: free)
    rows: int = 0
    final_rows: int = 0


class Sender:
    """Target side: posts sends of packed slots to drafter ranks on a communication stream. `link(peer)`
    gives the process group of the pair (groups.Groups.link); None: the default group."""

    def __init__(self, device: torch.device, link=None):
        self.device, self.link = device, link or (lambda peer: None)
        self.stream = new_stream(device)
        self.sent = 0

    def send(self, slot: Slot, dst_rank: int, numel: int, label: str = "") -> None:
        import torch.distributed as dist
        with device_ctx(self.device), stream_ctx(self.stream):
            if self.stream is not None:
                self.stream.wait_event(slot.ready)
            oprecord.label(f"send slot {slot.index} ({label}) to rank {dst_rank}")
            work = dist.isend(slot.flat[:numel], dst_rank, group=self.link(dst_rank))
        slot.work = work
        self.sent += 1

    @staticmethod
    def reclaim(slot: Slot, stream=None) -> None:
        """Before the slot is packed again: order the compute stream after its send (NCCL: a stream
        dependency, no host wait; gloo: the host waits, which is the in-flight bound on the CPU)."""
        if slot.work is not None:
            with stream_ctx(stream):
                slot.work.wait()
            slot.work = None


@dataclass
class Posted:
    seq: int
    buf: int
    work: object
    rows: int
    final_rows: int


class Receiver:
    """Drafter side: `depth` packed buffers on this rank's device, irecvs posted ahead in plan order."""

    def __init__(self, device: torch.device, capacity: int, dtype: torch.dtype, depth: int, k: int, hidden: int,
                 link=None):
        self.device, self.k, self.hidden, self.link = device, k, hidden, link or (lambda peer: None)
        self.bufs = [torch.empty(capacity, device=device, dtype=dtype) for _ in range(depth)]
        self.free = deque(range(depth))
        self.posted: deque[Posted] = deque()
        self.last_posted = -1          # the newest micro-batch posted (they are posted in sequence order)
        self.received = 0

    def can_post(self) -> bool:
        return bool(self.free)

    def post(self, seq: int, src_rank: int, rows: int, final_rows: int, stream=None) -> None:
        import torch.distributed as dist
        b = self.free.popleft()
        numel = packed_numel(rows, final_rows, self.k, self.hidden)
        with device_ctx(self.device), stream_ctx(stream):   # ordered after the last reader of this buffer
            oprecord.label(f"recv mb {seq} into buf {b} from rank {src_rank}")
            work = dist.irecv(self.bufs[b][:numel], src_rank, group=self.link(src_rank))
        self.posted.append(Posted(seq, b, work, rows, final_rows))
        self.last_posted = seq

    def take(self, seq: int, stream=None):
        """The packed tensors of `seq` (the next posted one), with the compute stream ordered after the
        receive. Returns (taps, final, buffer index); give the index back with `release` once the compute
        that reads it has been queued."""
        p = self.posted.popleft()
        if p.seq != seq:
            raise RuntimeError(f"receive order broken: expected micro-batch {seq}, next posted is {p.seq}")
        with stream_ctx(stream):
            p.work.wait()
        buf = self.bufs[p.buf]
        if buf.device != self.device:   # the routing contract: a drafter computes on its own device only
            raise RuntimeError(f"micro-batch {seq} arrived on {buf.device}, this drafter rank is {self.device}")
        self.received += 1
        taps, final = unpack(buf, p.rows, p.final_rows, self.k, self.hidden)
        return taps, final, p.buf

    def release(self, buf: int) -> None:
        self.free.append(buf)
