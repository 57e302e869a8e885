"""tau during training (--eval-data-dir, --eval-every): the real speculative-generation eval of
trainer/serving/evaluate.py on the current drafter weights, at step boundaries every rank knows from the step
number alone (no message decides them).

Owner: the **eval owner** is the lowest target rank (world size 1: rank 0, which holds both roles). It
alone runs the eval, with the target replica it trains with, and it alone reads the held-out prompts.

At an eval step (every multiple of --eval-every, and the last step of a run that was not stopped), all
ranks, after the step's metrics are drained and before a checkpoint of the same step:
  1. quiesce: this rank's sends of the step complete and its device is synchronised. No receive is
     posted across a step boundary (Feed.post_receives), so nothing of the pipeline is in flight:
     the target's streams and slots are idle while the owner evaluates on the main thread.
  2. drafter ranks: the consolidated drafter on the leader's CPU (checkpoint.consolidated_state, the
     all-gather the checkpoint uses).
  3. leader -> owner, when they differ: a manifest (send_object_list), then each tensor (send), point-to-point
     on `control` (gloo, host memory), in the job's compute dtype (what the eval casts to anyway).
  4. owner: evaluate_state (what dflash-eval runs on a checkpoint) with its target, on the main thread's
     current stream, under no_grad, the target in eval mode with the layers the training forward skips
     put back, the training forward's attention kernels, the global RNG forked. The loop is dflash-eval's
     default (`eval_loop`): the batched loop, all --eval-prompts verified together (16 per step), or the
     single loop with one warning line where the batched loop cannot run this target (runnable_loop);
     both give the same accept lengths. The batched step runs eagerly, not as CUDA graphs (IN_TRAINING_GRAPHS
     says why). The record names the loop ("loop") and its seconds.
  5. owner -> every rank: the result (broadcast_object_list on `control`); the leader records it
     (metrics.jsonl, status.json, W&B/TensorBoard). An eval that raises is reported as {"error": ...}:
     a warning, and training goes on.
Every other rank waits in step 5, in a gloo collective on `control`, whose timeout is
groups.HOST_PHASE_TIMEOUT_S (3 h), not --dist-timeout; no NCCL op is in flight meanwhile. Rank 0 writes
status.json with phase "eval" every 30 s while it waits (status.beating), so the supervisor keeps
petting systemd's watchdog. --eval-prompts and --eval-max-new-tokens bound the eval. The pause is not
counted in tokens/s.
"""

from __future__ import annotations

import logging
import time

import torch

from trainer.distributed.transport import Sender
from trainer.engine.checkpoint import consolidated_state
from trainer.status import beating

log = logging.getLogger("trainer.evaltrain")


# The in-training eval's batched step runs eagerly. CUDA graphs would save seconds, not tens of them: 16 prompts x
# 128 on SmolLM2-135M, alone on an H100, took 3.95 s eager and 1.37 s captured, where the single loop took 45.5 s
# (docs/performance-archive.md, "Real model at scale, round three"). Against that:
# - a capture runs in "global" mode, and this process has another thread at work meanwhile: the prefetch thread
#   (feed.py) pins host memory, and a pinned allocation (cudaHostAlloc) or an event query from any thread during
#   a global capture is an error, so the capture, and the eval, could fail where dflash-eval's never does;
# - a graph's private memory pool is memory beside the training's cached blocks (which the eager eval's tensors
#   reuse). On SmolLM2 the peak was the same (516 MiB over the weights either way); on a card sized for a large
#   target's training it is a risk for seconds.
# dflash-eval, a process of its own with the card to itself, captures (graphs=None).
IN_TRAINING_GRAPHS = False


def eval_loop(dcfg) -> str:
    """The in-training eval's loop: dflash-eval's default ("auto": batched at temperature 0, which the trainer's
    eval is; runnable_loop then falls back to the single loop, with one warning line, on a target the batched
    loop cannot run), or "single" for an architecture without a batched loop."""
    return "auto" if "batched" in dcfg.architecture.eval_loops else "single"


def eval_owner(topo) -> int:
    """The rank that runs the eval: the lowest rank holding a target replica."""
    return topo.target_ranks[0]


def eval_due(step: int, every: int, last: bool) -> bool:
    """Whether the eval runs after optimizer step `step` (1-based): a function of the step, so every
    rank, and a resumed run, agree."""
    return last or (every > 0 and step % every == 0)


def send_state(state: dict[str, torch.Tensor], dst: int, group, dtype: torch.dtype) -> None:
    import torch.distributed as dist
    manifest = [(name, tuple(t.shape)) for name, t in state.items()]
    dist.send_object_list([manifest, str(dtype)], dst=dst, group=group)
    for _, t in state.items():
        dist.send(t.detach().to("cpu", dtype).contiguous(), dst=dst, group=group)


def recv_state(src: int, group) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    box = [None, None]
    dist.recv_object_list(box, src=src, group=group)
    manifest, dtype = box[0], getattr(torch, box[1].replace("torch.", ""))
    state = {}
    for name, shape in manifest:
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src=src, group=group)
        state[name] = t
    return state


class InTrainingEval:
    """The eval's owner, its prompts and the message flow of one eval (module docstring)."""

    def __init__(self, cfg, topo, groups, device: torch.device, dtype: torch.dtype):
        self.cfg, self.topo, self.groups = cfg, topo, groups
        self.device, self.dtype = device, dtype
        self.owner = eval_owner(topo)
        self.dataset = None
        if topo.rank == self.owner:
            from trainer.data.dataset import load_dataset
            from trainer.serving.evaluate import heldout_prompts
            self.dataset = load_dataset(cfg.eval_data_dir)
            check_eval_data(cfg.eval_data_dir, cfg.target_model)
            if not heldout_prompts(self.dataset, 1):
                raise ValueError(f"{cfg.eval_data_dir}: no record has a prompt (tokens before its first "
                                 "supervised one) to generate from")

    def due(self, step: int, last: bool) -> bool:
        return eval_due(step, self.cfg.eval_every, last)

    def at_boundary(self, step: int, final: bool, report, last_ckpt: str | None, drafter, target, receiver,
                    dcfg) -> float:
        """Every rank, at an eval step's boundary (the module docstring's steps 1-5): tau of the current
        weights, measured by the owner, recorded by the leader in `report`. `drafter`, `target` and `receiver`
        are this rank's stages and receive buffers (None where it has none). Returns the seconds it took."""
        t0 = time.perf_counter()
        if self.topo.is_drafter:
            report.drain(last_ckpt, block=True)   # step records first: W&B drops a step below the last logged
        # status.json says eval and keeps moving (systemd's watchdog is petted while rank 0 waits)
        with beating(report.status, phase="eval", step=step):
            quiesce(step, target, receiver, self.device)
            state = consolidated_state(drafter.model, self.device, self.topo.leader) if self.topo.is_drafter \
                else None
            res = self.run(step, state, target, dcfg, final)
            del state
        secs = time.perf_counter() - t0
        if self.topo.leader:
            if "error" in res:
                log.warning("eval at step %d failed on rank %d: %s (training goes on)", step, self.owner, res["error"])
            else:
                report.record_eval(eval_record(step, res, final), secs)
        return secs

    def run(self, step: int, state: dict | None, target_stage, dcfg, final: bool) -> dict:
        """Steps 3-5 on every rank; `state` is the consolidated drafter on the leader (None elsewhere),
        `target_stage` the owner's TargetStage. Returns the result on every rank."""
        import torch.distributed as dist
        topo, control = self.topo, self.groups.control
        if topo.leader and self.owner != topo.rank:
            send_state(state, self.owner, control, self.dtype)
            state = None
        elif topo.rank == self.owner and not topo.leader:
            state = recv_state(0, control)
        box = [None]
        if topo.rank == self.owner:
            box[0] = self._evaluate(step, state, target_stage, dcfg, final)
        dist.broadcast_object_list(box, src=self.owner, group=control)
        return box[0]

    def _evaluate(self, step: int, state: dict, target_stage, dcfg, final: bool) -> dict:
        from trainer.ops.compiling import no_new_graphs, sdpa_context
        from trainer.serving.evaluate import evaluate_state
        cfg, dev = self.cfg, self.device
        log.info("eval at step %d on rank %d: speculative generation on up to %d held-out prompt(s), "
                 "%d new tokens each%s", step, self.topo.rank, cfg.eval_prompts, cfg.eval_max_new_tokens,
                 " (final, with the teacher-forced block accuracy)" if final else "")
        try:
            # the training forward's kernel choice too: on GPUs never cuDNN, whose plan cache would grow
            # with every KV length the generation loop sees (compiling.py)
            with target_stage.full_model() as target, sdpa_context(cfg.sdpa_backend, dev.type), no_new_graphs(), \
                    torch.random.fork_rng(devices=[dev.index] if dev.type == "cuda" else [], device_type=dev.type):
                check_drafter_fits(dcfg, target.config.to_dict())   # TargetMismatch -> {"error": ...}
                res = evaluate_state(dcfg, state, target, self.dataset, dev, self.dtype, cfg.eval_prompts,
                                     cfg.eval_max_new_tokens, with_block_accuracy=final, loop=eval_loop(dcfg),
                                     graphs=IN_TRAINING_GRAPHS)
                log.info("eval at step %d: the %s loop, %.1fs of generation", step, res["loop"], res["seconds"])
                return res
        except Exception as e:  # noqa: BLE001  an eval must not end the run; the leader warns
            log.exception("eval at step %d failed", step)
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()   # the drafter copy and KV caches: give the memory back to training


def quiesce(step: int, target, receiver, device: torch.device) -> None:
    """Step 1: nothing of this rank's pipeline in flight: the step's sends complete, the device idle. (No
    receive is posted across a step boundary: Feed.post_receives.)"""
    if target is not None:
        for slot in target.slots:
            Sender.reclaim(slot)
    if receiver is not None and receiver.posted:
        raise RuntimeError(f"eval at step {step}: receives still posted across the step boundary")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_eval_data(eval_data_dir: str, target_model: str) -> None:
    """The held-out shards were tokenized with the target's tokenizer (index.json's record, where
    dflash-prepare wrote one). ValueError without a flag name: the trainer adds --eval-data-dir."""
    from trainer.model.identity import TargetMismatch, check_data_dir_tokenizer
    if not target_model:
        return
    try:
        check_data_dir_tokenizer(eval_data_dir, target_model, "")
    except TargetMismatch as e:
        raise ValueError(str(e).removeprefix(": ")) from None


def check_drafter_fits(dcfg, target_config: dict) -> None:
    """The drafter being evaluated belongs to the target replica it is evaluated with (the same identity
    check as dflash-eval's, on the shapes: a loaded model has no files to fingerprint)."""
    from trainer.model import identity
    trained = identity.from_drafter_config(dcfg.to_dict())
    identity.check(trained, identity.of_config(target_config), flag="eval", what="the drafter",
                   compare_drafter=False)


def eval_record(step: int, res: dict, final: bool) -> dict:
    """metrics.jsonl's eval record (docs/contracts.md): kind "eval", the step whose weights were evaluated."""
    return {"kind": "eval", "step": step, "final": final, **res}


def eval_status(rec: dict) -> dict:
    """status.json's `eval`: the last eval, short."""
    keys = ("step", "tau", "per_position_acceptance", "block_accuracy", "prompts", "verify_steps", "seconds")
    return {k: rec[k] for k in keys if k in rec}


def eval_scalars(rec: dict) -> dict:
    """What W&B and TensorBoard plot: eval/tau, eval/acceptance/pos_NN (per draft position), ..."""
    out = {"tau": rec["tau"], "acceptance": rec["per_position_acceptance"],
           "verify_steps_per_s": rec.get("verify_steps_per_s")}
    for k in ("block_accuracy", "teacher_forced_block_len"):
        if k in rec:
            out[k] = rec[k]
    return {"eval": out}
