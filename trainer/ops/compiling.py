"""Kernel-level speed options (``--compile``, ``--sdpa-backend``), measured in docs/performance.md.

- Regional compilation: one ``torch.compile``d forward shared by every layer of a stack (identical
  layers reuse the compiled code, so the cost is one layer's compile, not 36). Only the layer's
  ``forward`` is compiled: forward hooks (the target's tap capture) stay eager around it. What it buys
  is fusion of the memory-bound parts between the GEMMs: RMSNorm (six eager passes in fp32 -> one),
  rotary embedding, SiLU x up, residual adds.
- The drafter's LM-head loss uses the same per-chunk function compiled (see loss.lm_head_chunk):
  the ~20 elementwise passes over the fp32 [chunk, vocab] logits become a few fused kernels.
- ``--sdpa-backend`` picks the target's attention kernels. auto (on GPUs) leaves out cuDNN's: its compiled
  plans sit in a per-thread cache keyed on exact shapes with no limit (host memory per shape:
  results/INDEX.md, h200x2-1.7b-shape-cache-probe.json), so host memory grows with every new batch shape;
  flash is as fast on the target (docs/performance.md, "Memory flat"). ``any`` lets PyTorch choose (cuDNN on H100/H200).
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch

log = logging.getLogger("trainer.fast")


def _raise_cache_limits(n: int = 64):
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n if "accumulated" not in name else 4 * n))


def layer_mixer(layer):
    """The token mixer of a decoder layer: a hybrid's (Qwen3.5) `linear_attn` (Gated DeltaNet) or
    `self_attn`, else the layer itself."""
    for name in ("linear_attn", "self_attn"):
        m = getattr(layer, name, None)
        if m is not None:
            return m
    return layer


def layer_kind(layer) -> tuple[type, type]:
    """What a compiled layer forward is shared by: the layer's class and its token mixer's class (a hybrid's
    Qwen3_5DecoderLayer is one class holding either Gated DeltaNet or attention)."""
    return type(layer), type(layer_mixer(layer))


def compile_layers(layers, dynamic: bool | None = None) -> int:
    """Replace each layer's forward with a compiled function shared by all layers of its kind
    (regional compilation; a hybrid stack gets one per mixer class: Gated DeltaNet and attention, so
    neither kind's graph is guarded on the other's and neither recompiles when the stack alternates).
    dynamic=None: compiled for the first shape, then once more with the dims that changed symbolic
    (the warmup runs two shapes so this happens before step 1); True: symbolic from the start.
    Returns how many layers were wrapped.
    Duck shaping is turned off (process-wide): with it, input sizes that are equal when a graph is compiled
    share one symbol and the graph is guarded on their equality. The warmup's synthetic micro-batches
    (512-token sequences) had as many block rows as context rows at --max-anchors 32, so every real
    micro-batch failed that guard and ran eagerly after the warmup (eager FlexAttention: the width-1,024
    OOM in results/log-fp8-parity-wide-failed.txt.gz)."""
    _raise_cache_limits()
    torch.fx.experimental._config.use_duck_shape = False
    fns = {}
    n = 0
    for layer in layers:
        kind = layer_kind(layer)
        if kind not in fns:
            fns[kind] = torch.compile(type(layer).forward, dynamic=dynamic)
        layer.forward = types.MethodType(fns[kind], layer)
        n += 1
    return n


def resolve_compile(opt: str, on_cpu: bool, hybrid: bool = False) -> str:
    """'auto' = everything compiled on GPUs (a dense target and the drafter both gain, see
    docs/performance.md), nothing on the CPU (compile time dominates tiny CPU runs). On a hybrid target
    (linear-attention layers) 'auto' compiles the drafter only: the compiled hybrid target has never
    finished a warmup on a GPU and every hybrid rate measured is for an eager target; until it
    is measured, `--compile all` or `target` asks for it. Say why in the log with `compile_reason`."""
    if opt == "auto":
        return "none" if on_cpu else ("drafter" if hybrid else "all")
    return opt


def compile_reason(opt: str, on_cpu: bool, hybrid: bool = False) -> str:
    """One line for the log: what --compile `opt` resolves to here, and why."""
    got = resolve_compile(opt, on_cpu, hybrid)
    if opt != "auto":
        return f"--compile {opt}"
    why = ("on the CPU, compile time dominates" if on_cpu else
           "the target is a hybrid (linear-attention layers), whose compiled warmup is not measured yet: "
           "the target runs eager (--compile all to compile it)" if hybrid else "on GPUs, everything compiled")
    return f"--compile auto -> {got}: {why}"


def wants(compile_opt: str, part: str) -> bool:
    return compile_opt == "all" or compile_opt == part


def sdpa_context(backend: str, device_type: str = "cuda"):
    """Context that restricts scaled_dot_product_attention to `backend`. 'auto' on CUDA: flash, then the
    memory-efficient and math kernels, never cuDNN (see the module docstring); 'auto' on the CPU and
    'any': no restriction."""
    if backend == "any" or (backend == "auto" and device_type != "cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
             "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
             "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
    return sdpa_kernel(kinds[backend])


def compile_counters() -> dict:
    """Dynamo's running totals (graphs compiled, frames seen): differences show recompiles."""
    try:
        from torch._dynamo.utils import counters
        return {k: int(v) for k, v in counters["stats"].items()}
    except Exception:
        return {}


AFTER_WARMUP_ENV = "DFLASH_AFTER_WARMUP_STANCE"
AFTER_WARMUP_STANCES = ("default", "eager_on_recompile", "fail_on_recompile")
_graphs_after_warmup: list[int] = []   # dynamo's graph count when the warmup ended (process-wide, as dynamo is)
_compile_s: list[float] = []           # dynamo's seconds compiling then, and at each new graph logged since


def compile_seconds() -> float:
    """Seconds this process spent in dynamo's compiles (inductor's included), or 0 where torch does not say."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
        return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
    except Exception:  # noqa: BLE001  (a torch without the metric: the line goes without the time)
        return 0.0


def _set_stance(stance: str) -> None:
    try:
        torch.compiler.set_stance(stance)
    except (AttributeError, RuntimeError) as e:  # torch < 2.6 has no stances
        log.warning("cannot set the compile stance %s (%s)", stance, e)


class RecompileReasons(logging.Handler):
    """Dynamo's own account of each recompile (its `recompiles` log artifact: the function and the guard that
    failed), kept from the warmup's end until `note_new_graphs` logs them with the step."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.pending: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.pending) < 64:   # a run that never calls note_new_graphs keeps a few, not all
            self.pending.append(record.getMessage())

    def take(self) -> list[str]:
        out, self.pending = self.pending, []
        return out


_reasons = RecompileReasons()


def _recompiles_logger() -> logging.Logger:
    from torch._dynamo import guards
    return guards.recompiles_log


def _watch_recompiles() -> None:
    """Dynamo computes a recompile's reasons only while its `recompiles` artifact is on: turn it on (TORCH_LOGS,
    when set, decides instead: torch then ignores set_logs) and collect the messages here, where they are logged
    once, with the step, rather than also on torch's own handler."""
    import os
    try:
        logger = _recompiles_logger()
        if "TORCH_LOGS" not in os.environ:
            torch._logging.set_logs(recompiles=True)
            logger.propagate = False
        if _reasons not in logger.handlers:
            logger.addHandler(_reasons)
    except Exception as e:  # noqa: BLE001  (a torch without the artifact: the count stays, the reasons go)
        log.debug("recompile reasons unavailable: %s", e)


def _unwatch_recompiles() -> None:
    import os
    try:
        logger = _recompiles_logger()
        logger.removeHandler(_reasons)
        if "TORCH_LOGS" not in os.environ and not logger.propagate:
            torch._logging.set_logs()
            logger.propagate = True
    except Exception:  # noqa: BLE001
        pass
    _reasons.take()


def recompile_reason(message: str) -> str:
    """One line from dynamo's recompile message: the function, where it is, and each failed guard without the
    source line dynamo appends (`forward (a file:line): 0/0: tensor 'x' size mismatch at index 0 ...`)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    head = lines[0].removeprefix("Recompiling function ") if lines else "?"
    name, _, where = head.partition(" in ")
    guards = [ln.removeprefix("- ").split("  # ", 1)[0] for ln in lines[1:] if ln.startswith("- ")]
    return f"{name} ({where.rsplit('/', 1)[-1]}): {'; '.join(guards) or 'guard not named'}"


def begin_warmup() -> None:
    """Before the warmup: compiling allowed (a second warmup in the same process compiles again)."""
    _set_stance("default")
    _graphs_after_warmup.clear()
    _unwatch_recompiles()


def end_warmup() -> str:
    """After the warmup. By default a micro-batch shape the warmup's graphs do not cover compiles a new graph
    (once per shape regime; `note_new_graphs` logs it with its guard and counts it, and the count reaches
    status.json through the stop vote): running it eagerly instead would materialize
    FlexAttention's whole score matrix (the width-1,024 OOMs). Inductor itself splits the shapes into regimes
    the warmup cannot know in advance: its fusion and kernel choices add size guards (on the H200, a chunk of
    5,120 block rows or more at width 1,024, and block plus context rows of 10,240 or more:
    results/log-warmup-recompiles-5.txt.gz).
    A compile in the middle of a run is safe because a rank runs every module forward on its main thread
    (tests/ops/test_compiling.py checks it): compiling traces with FX, which patches nn.Module.__call__ process-wide,
    and that broke forwards running in other threads in the old thread-per-replica engine
    (results/h200x2-1.7b-memory-fx-race.json), which is why the graphs used to be frozen after the warmup.
    DFLASH_AFTER_WARMUP_STANCE=eager_on_recompile restores that freeze (nothing compiles, so nothing is counted);
    fail_on_recompile (trainer/lab/gpu/warmup_recompiles.sh; the unit's dflash_service_environment can set it) refuses
    a recompile: an uncovered shape ends the run with an error that names the guard it failed.
    Returns the stance set."""
    import os
    stance = os.environ.get(AFTER_WARMUP_ENV, "default")
    if stance not in AFTER_WARMUP_STANCES:
        raise ValueError(f"{AFTER_WARMUP_ENV}={stance}: one of {', '.join(AFTER_WARMUP_STANCES)}")
    _set_stance(stance)
    _graphs_after_warmup[:] = [compile_counters().get("unique_graphs", 0)]
    _compile_s[:] = [compile_seconds()]
    if stance == "default":
        _watch_recompiles()
    return stance


def note_new_graphs(step: int) -> int:
    """Graphs compiled since the warmup ended (0 before it ends). Each new one is logged once, as a warning with
    the step, the seconds the compile took (the peers' receives wait that long, against their NCCL timeout) and
    dynamo's reason (the function and the guard it failed)."""
    if not _graphs_after_warmup:
        return 0
    now = compile_counters().get("unique_graphs", 0)
    if now > _graphs_after_warmup[-1]:
        reasons = [recompile_reason(m) for m in _reasons.take()]
        secs = compile_seconds()
        took = secs - _compile_s[-1] if _compile_s else 0.0
        log.warning("step %d: %d graph(s) compiled after the warmup in %.1fs, %d in all (a micro-batch shape its "
                    "graphs did not cover): %s", step, now - _graphs_after_warmup[-1], took,
                    now - _graphs_after_warmup[0],
                    " | ".join(reasons) or "reason not recorded (TORCH_LOGS=recompiles names the guard)")
        _graphs_after_warmup.append(now)
        _compile_s.append(secs)
    return now - _graphs_after_warmup[0]


def no_new_graphs():
    """Context: existing graphs run where their guards hold, anything else eagerly, nothing compiles (the
    tau eval's generation loop, whose KV lengths change at every token)."""
    try:
        return torch.compiler.set_stance("eager_on_recompile")
    except (AttributeError, RuntimeError):
        return contextlib.nullcontext()
