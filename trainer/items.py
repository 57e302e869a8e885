"""Host side of a micro-batch: the work item every rank builds for itself from the batch plan
(collated token ids, the gather indices of the rows the drafter needs, the drafter's chunk metadata),
as (pinned) host tensors ready for non-blocking copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .plan import MicroPlan


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
    """Chunk metadata as host tensors (pinned when a GPU will read them)."""
    out = []
    for c in plan.chunks:
        d = {
            "ctx_seq": torch.from_numpy(c.ctx_seq), "ctx_pos": torch.from_numpy(c.ctx_pos),
            "q_seq": torch.from_numpy(c.q_seq), "q_anchor": torch.from_numpy(c.q_anchor),
            "q_pos": torch.from_numpy(c.q_pos), "block_tokens": torch.from_numpy(c.block_tokens),
            "labels": torch.from_numpy(c.labels), "row_weight": torch.from_numpy(c.row_weight),
        }
        if c.loss_rows is not None:
            d["loss_rows"] = torch.from_numpy(c.loss_rows)
        if c.soft_unique is not None:
            d["soft_unique"] = torch.from_numpy(c.soft_unique)
            d["soft_local"] = torch.from_numpy(c.soft_local)
        if c.kv_num_blocks is not None:
            d["kv_num_blocks"] = torch.from_numpy(c.kv_num_blocks)
            d["kv_indices"] = torch.from_numpy(c.kv_indices)
        if c.full_kv_num_blocks is not None:
            d["full_kv_num_blocks"] = torch.from_numpy(c.full_kv_num_blocks)
            d["full_kv_indices"] = torch.from_numpy(c.full_kv_indices)
        if c.kv_ctx is not None:
            d["kv_ctx"] = torch.from_numpy(c.kv_ctx)
            d["kv_ctx_seq"] = torch.from_numpy(c.kv_ctx_seq)
            d["q_copy_seq"] = torch.from_numpy(c.q_copy_seq)
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
