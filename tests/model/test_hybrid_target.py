"""The target stage on the seeds' real architecture (issue 39 item 2): a hybrid Gated DeltaNet + gated
attention Qwen3.5 target inside a vision-language checkpoint (dflash-tiny --arch qwen3_5).

- the taps are transformers' own output_hidden_states[l + 1], whichever class holds the decoder;
- the vision tower never reaches the target's device (it is not even loaded);
- a log line names the kernels each layer class runs; on a GPU, a hybrid whose linear-attention layers
  would run transformers' torch fallback is refused in one line naming the package (exit 2) unless the
  user opts in;
- regional compilation gives each mixer class its own compiled forward, and the warmup runs both.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from trainer.distributed.transport import unpack
from trainer.engine.target_stage import TargetStage
from trainer.model.target import (
    decoder,
    describe_kernels,
    layer_kernels,
    load_target,
    missing_fast_kernels,
    vision_params,
)


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_dir):
    return load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)


def _taps(model, ids, tap_ids, gather):
    """forward_pack's taps for `ids`: the stage's hooks, packed into a slot as training packs them."""
    stage = TargetStage(model, torch.device("cpu"), tap_ids, soft_labels=False, rows=len(gather), num_slots=1,
                        dtype=torch.float32, keep_head=True)
    item = SimpleNamespace(input_ids=ids, ctx_gather=gather, final_gather=None, seq_no=0)
    slot = stage.next_slot()
    stage.forward_pack(item, slot)
    taps, _ = unpack(slot.flat, len(gather), 0, len(tap_ids), stage.hidden)
    return taps.clone()


def test_taps_are_transformers_hidden_states_on_the_hybrid_and_the_vl_wrapper(tiny_hybrid_dir, hybrid):
    """Taps l (a Gated DeltaNet layer and a full-attention one) equal output_hidden_states[l + 1], both for
    the text-only class the trainer loads and for the VL wrapper (decoder under model.language_model)."""
    from transformers import Qwen3_5ForConditionalGeneration
    vl = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_hybrid_dir / "target"), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, 500, (2, 37), generator=g)
    gather = torch.randperm(2 * 37, generator=g)[:40]
    tap_ids = [1, 3, 6]                      # linear, full, linear
    kinds = [hybrid.config.layer_types[i] for i in tap_ids]
    assert kinds == ["linear_attention", "full_attention", "linear_attention"]
    for model in (hybrid, vl):
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        want = torch.cat([hs[i + 1].reshape(-1, 64)[gather] for i in tap_ids], dim=1)
        got = _taps(model, ids, tap_ids, gather)
        assert torch.allclose(got, want, atol=1e-5), (type(model).__name__, (got - want).abs().max())
    assert decoder(vl) is vl.model.language_model and decoder(hybrid) is hybrid.model


def test_a_vl_checkpoint_loads_its_language_model_only(tiny_hybrid_dir, hybrid, monkeypatch):
    """load_target builds the text-only class (no vision parameter is ever created or loaded). Where a
    config's causal-LM class is the VL wrapper, the model is loaded on the CPU, the tower dropped before it
    moves, and the language model is the same."""
    assert type(hybrid).__name__ == "Qwen3_5ForCausalLM" and vision_params(hybrid) == []
    from transformers import Qwen3_5ForConditionalGeneration

    import trainer.model.target as target
    monkeypatch.setattr(target, "causal_lm_class", lambda config: Qwen3_5ForConditionalGeneration)
    moved = []
    real_to = torch.nn.Module.to

    def to(self, *a, **k):
        if isinstance(self, Qwen3_5ForConditionalGeneration):
            moved.append(vision_params(self))
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    vl = target.load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)
    assert type(vl).__name__ == "Qwen3_5ForConditionalGeneration"
    assert vision_params(vl) == [] and moved and all(m == [] for m in moved)   # no tower when it moved
    ids = torch.randint(8, 500, (1, 20))
    with torch.no_grad():
        assert torch.allclose(vl(input_ids=ids).logits, hybrid(input_ids=ids).logits, atol=1e-5)


def test_the_kernels_of_each_layer_class_are_logged(tiny_hybrid_dir, tiny_small_dir, caplog):
    """One line names each mixer class and its kernels, as transformers resolved them at import. Here (no
    flash-linear-attention, the CPU) Gated DeltaNet runs the torch fallback; a dense target names sdpa."""
    with caplog.at_level(logging.INFO, logger="trainer.target"):
        m = load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)
    line = [r.getMessage() for r in caplog.records if "target kernels" in r.getMessage()]
    assert len(line) == 1, line
    assert "Qwen3_5GatedDeltaNet: " in line[0] and "chunk_gated_delta_rule=" in line[0]
    assert "Qwen3_5Attention: attention=sdpa" in line[0]
    k = layer_kernels(m, "cpu")
    assert set(k) == {"Qwen3_5GatedDeltaNet", "Qwen3_5Attention"}
    assert all(v.startswith("torch (") for v in k["Qwen3_5GatedDeltaNet"].values())
    assert missing_fast_kernels(layer_kernels(m, "cpu")) in ([], ["flash-linear-attention"])
    dense = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    assert describe_kernels(layer_kernels(dense, "cpu")) == "Qwen3Attention: attention=sdpa"


def test_a_hybrid_without_its_fast_kernels_on_a_gpu_is_refused_unless_asked(tiny_hybrid_dir, tiny_small_dir, hybrid,
                                                                            caplog):
    """On a GPU the torch fallback is ~1.5x slower and runs out of memory keeping every hidden state:
    --check-config / the supervisor refuse it in one line naming flash-linear-attention (ConfigError: exit
    2), the target rank does the same from what transformers really resolved (BadInput: exit 2);
    --allow-slow-linear-attention runs it with a warning. A dense target is never refused."""
    import importlib.util

    import trainer.model.target as target
    from trainer.config.options import ConfigError, parse_args
    from trainer.config.preflight import validate
    from trainer.errors import BadInput
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed here")
    assert missing_fast_kernels(layer_kernels(hybrid, "cuda")) == ["flash-linear-attention"]

    def args(tiny, *extra):
        return parse_args(["--target-model", str(tiny / "target"), "--data-dir", str(tiny / "data"),
                           "--output-dir", "/tmp/unused", "--target-gpus", "0", "--drafter-gpus", "1",
                           "--num-draft-layers", "2", "--block-size", "8", *extra])
    with pytest.raises(ConfigError, match="flash-linear-attention is not installed") as e:
        validate(args(tiny_hybrid_dir), gpu_count=2)
    assert str(e.value).startswith("--target-model: ") and "\n" not in str(e.value)
    validate(args(tiny_hybrid_dir, "--allow-slow-linear-attention"), gpu_count=2)
    validate(args(tiny_small_dir), gpu_count=2)
    validate(args(tiny_hybrid_dir), gpu_count=-1)   # the Ansible controller: the host checks it

    # the rank's own check, on what transformers resolved (the device type is all it needs)
    with pytest.raises(BadInput, match="flash-linear-attention is not installed"):
        target.check_fast_kernels(hybrid, "/m", "cuda", allow=False)
    with caplog.at_level(logging.WARNING, logger="trainer.target"):
        target.check_fast_kernels(hybrid, "/m", "cuda", allow=True)
    assert any("torch fallback" in r.getMessage() for r in caplog.records)
    target.check_fast_kernels(hybrid, "/m", "cpu", allow=False)   # the CPU has no other kernels


def test_compiled_layers_get_one_forward_per_mixer_class_and_the_warmup_runs_both(tiny_hybrid_dir, monkeypatch):
    """fast.compile_layers on a hybrid stack: one compiled forward for the Gated DeltaNet layers, one for the
    attention layers (the decoder layer class is the same); the target warmup calls both. torch.compile is
    replaced by a recorder here (compiling the tiny stack would cost minutes of CPU)."""
    import trainer.ops.compiling as fast
    calls: dict[int, int] = {}
    made = []

    def fake_compile(fn, dynamic=None):
        i = len(made)
        made.append(fn)

        def run(*a, **k):
            calls[i] = calls.get(i, 0) + 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = load_target(str(tiny_hybrid_dir / "target"), torch.device("cpu"), torch.float32)
    stage = TargetStage(model, torch.device("cpu"), [1, 5], soft_labels=False, rows=8, num_slots=1,
                        dtype=torch.float32)
    layers = decoder(stage.model).layers      # hard labels: the layers up to the last tap, both kinds among them
    assert fast.compile_layers(layers) == 6 and len(made) == 2
    stage.warmup([(1, 64), (2, 32)], vocab=512)
    kinds = {fast.layer_kind(layer)[1].__name__ for layer in layers}
    assert kinds == {"Qwen3_5GatedDeltaNet", "Qwen3_5Attention"}
    assert calls == {0: 2 * 5, 1: 2 * 1}       # 5 linear + 1 full layer, two warmup shapes


def test_targets_load_without_hub_kernels(tiny_hybrid_dir, tiny_small_dir, hybrid):
    """transformers >= 5.25 kernelizes every from_pretrained by default when the `kernels` package is installed
    (a dependency of transformers 5.25); on a GPU that fetches layer code from the Hub at load time, and
    offline the load fails ("Kernel repository 'kernels-community/rotary' could not verify publisher trust
    status": all four DFlash2 comparison runs on the H200). Our loader turns it off, dense and hybrid."""
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_small_dir / "target"), local_files_only=True)
    assert plain.use_kernels, "transformers no longer kernelizes by default: this guard may be dropped"
    dense = load_target(str(tiny_small_dir / "target"), torch.device("cpu"), torch.float32)
    assert not dense.use_kernels and not hybrid.use_kernels
