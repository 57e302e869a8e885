"""Where a speculative loop's step goes: the phases of dflash-eval's loops timed (`dflash-eval --profile-phases`).

A loop asks `active()` for the timer and wraps each phase of its step in `with timer.phase(name):`
(PHASES says what each name covers). Nothing records unless a caller made a PhaseTimer the active one
(`recording`); the loops then hold NO_PHASES, whose phase() hands back one shared null context: no clock,
no event, no allocation.

On a GPU a phase is a pair of CUDA events recorded on the current stream around it, read once at the end
(`summary` synchronises once): no sync is added inside the loop, so the phases measure the GPU's timeline
as the loop runs it. A phase whose host work outruns the GPU (a loop bound by launches) shows its host
time; a host read (.tolist(), int()) shows as the wait for the GPU plus the round trip. On the CPU a phase
is time.perf_counter around it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch

PHASES = {
    "prefill": "the target's forward over the prompt (the first token and taps)",
    "draft": "the drafter's forward and its pick of the drafts (the first block's too)",
    "verify": "the target's forward over [last token, drafts] (a hybrid's single loop: its recording of a "
              "state per position too), the head and argmax",
    "record": "within verify and prefill, a hybrid's single loop: transformers' one-token recurrent kernel "
              "calls that record a state per position (linear_states.timed_recurrent_steps)",
    "rollback": "a hybrid's linear-attention states set to those after the accepted tokens (single loop: "
                "transformers' crop of the recorded states; batched: LinearStates.commit re-running the "
                "accepted prefix)",
    "crop": "a dense target's KV cache cropped to the accepted tokens (single loop)",
    "accept": "acceptance: the comparison with the target's tokens and the host reads (.tolist(), int())",
    "step": "one batched step replayed as a CUDA graph (verify, rollback, accept and draft inside it)",
    "capture": "the batched step captured as a CUDA graph (its eager warm-up step included)",
}


WITHIN = {"record"}   # phases timed inside others: their time is already in the enclosing phase's


class NoPhases:
    """What a loop holds when nothing records: phase() is one shared null context."""

    enabled = False
    _null = nullcontext()

    def phase(self, name: str):
        return self._null

    def step(self) -> None:
        pass


NO_PHASES = NoPhases()


class PhaseTimer:
    """Milliseconds per named phase over one run of a loop, and the run's loop steps (`step()`: one per verify
    step of the single loop, one per batched step of the batched loop)."""

    enabled = True

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.ms: dict[str, float] = {}           # CPU: milliseconds so far, per phase
        self.events: dict[str, list] = {}        # CUDA: (start, end) event pairs, per phase
        self.calls: dict[str, int] = {}
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise KeyError(f"unknown phase {name!r} (trainer/serving/phases.py PHASES)")
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.setdefault(name, []).append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def step(self) -> None:
        self.steps += 1

    def summary(self, step_ms: float | None = None) -> dict[str, dict]:
        """{phase: {"ms_total", "ms_per_verify_step", "calls"[, "share"]}} in PHASES order; `step_ms`: the wall
        time of one loop step, of which "share" is each phase's part."""
        if self.cuda and self.events:
            torch.cuda.synchronize()
            for name, pairs in self.events.items():
                self.ms[name] = sum(s.elapsed_time(e) for s, e in pairs)
            self.events.clear()
        out = {}
        for name in PHASES:
            if name not in self.calls:
                continue
            total = self.ms.get(name, 0.0)
            per = total / self.steps if self.steps else 0.0
            out[name] = {"ms_total": round(total, 3), "ms_per_verify_step": round(per, 3), "calls": self.calls[name]}
            if step_ms:
                out[name]["share"] = round(per / step_ms, 4)
        return out


def report(timer: PhaseTimer, seconds: float) -> dict:
    """What a result gains from a run of `seconds` wall clock: "phase_steps", "phase_step_ms" (the wall clock of a
    loop step) and "phases" (`PhaseTimer.summary`, each with its share of that step)."""
    step_ms = round(seconds * 1e3 / timer.steps, 3) if timer.steps else None
    return {"phase_steps": timer.steps, "phase_step_ms": step_ms, "phases": timer.summary(step_ms)}


def lines(phases: dict[str, dict], step_ms: float, loop: str) -> list[str]:
    """One human line per phase (ms per step, share of the step), then the part no phase covers."""
    out = [f"phases of the {loop} loop, {step_ms:.2f} ms a step (wall clock):"]
    for name, p in phases.items():
        out.append(f"  {name:<9} {p['ms_per_verify_step']:9.2f} ms a step  {100 * p.get('share', 0):5.1f}%  "
                   f"({p['calls']} calls{', within the phases above' if name in WITHIN else ''})")
    rest = step_ms - sum(p["ms_per_verify_step"] for name, p in phases.items() if name not in WITHIN)
    out.append(f"  {'untimed':<9} {rest:9.2f} ms a step  {100 * rest / step_ms if step_ms else 0:5.1f}%  "
               "(host work between the phases)")
    return out


_ACTIVE: ContextVar = ContextVar("dflash_eval_phases", default=NO_PHASES)


def active():
    """The timer the loops record to: a PhaseTimer inside `recording`, else NO_PHASES."""
    return _ACTIVE.get()


@contextmanager
def recording(timer: PhaseTimer | None):
    """The loops run inside record to `timer` (None: to nothing, as outside)."""
    token = _ACTIVE.set(timer if timer is not None else NO_PHASES)
    try:
        yield timer
    finally:
        _ACTIVE.reset(token)
