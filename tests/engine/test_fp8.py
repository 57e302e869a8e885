"""--fp8 (issue 15) on the CPU: torchao's float8 training of the drafter's linear layers.

torchao's Float8Linear runs here through the CPU's scaled-mm kernel, so the same code path as on a GPU
(dynamic scaling, the e4m3/e5m2 casts, padded weight-gradient GEMMs) trains a tiny drafter. What the
GPU adds, speed and parity at real width, is measured in docs/performance.md.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import learning_run_args
from tests.engine.test_trainer import losses, tiny_args, train_here
from trainer import allow_optional
from trainer.__main__ import main as train_main
from trainer.config.options import ConfigError, parse_args, parse_kernel_options, validate_flags
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta, init_drafter_weights

allow_optional("torchao")  # the programs defer torchao until --fp8 asks for it (trainer/optional.py)
torchao = pytest.importorskip("torchao", reason="--fp8 needs torchao (pip install 'dflash-trainer[fp8]')")
PATHS = ["--target-model", "/m", "--data-dir", "/d", "--output-dir", "/o"]


def _drafter(layers=2):
    dcfg = DFlashConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=512, num_hidden_layers=layers, target_layer_ids=[1, 2, 3],
                        block_size=8, mask_token_id=5, target_num_hidden_layers=8)
    m = DFlashDrafter(dcfg)
    init_drafter_weights(m, seed=0)
    return dcfg, m


def _inputs(dcfg, n_ctx=37, blocks=3):
    """One sequence: 37 context rows (not a multiple of 16: the weight gradients need the padding) and
    three blocks anchored inside it."""
    g = torch.Generator().manual_seed(1)
    bs = dcfg.block_size
    taps = torch.randn(n_ctx, 3 * dcfg.hidden_size, generator=g)
    emb = torch.randn(blocks * bs, dcfg.hidden_size, generator=g)
    anchors = torch.tensor([5, 17, 30]).repeat_interleave(bs)
    q_pos = anchors + torch.arange(bs).repeat(blocks)
    meta = PackedMeta(torch.zeros(n_ctx, dtype=torch.long), torch.arange(n_ctx),
                      torch.zeros(blocks * bs, dtype=torch.long), anchors, q_pos, bs)
    return taps, emb, meta


def test_fp8_swaps_every_drafter_linear_and_keeps_the_state_dict():
    """fc and the 7 projections of each layer become Float8Linear; the parameters keep their names,
    shapes and values (checkpoints and exports do not change), and the forward and the gradients stay
    close to the full-precision ones (measured here: outputs 0.1%, gradients 8-12%, relative)."""
    from torchao.float8.float8_linear import Float8Linear

    from trainer.engine.drafter_stage import to_float8
    dcfg, ref = _drafter()
    _, m = _drafter()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert to_float8(m, "tensorwise") == 1 + 7 * 2
    assert sum(isinstance(x, Float8Linear) for x in m.modules()) == 15
    after = m.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    taps, emb, meta = _inputs(dcfg)
    probe = torch.randn(emb.shape, generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (ref, m):
        t = taps.clone().requires_grad_(True)
        h = model(t, emb, meta)
        (h * probe).sum().backward()
        outs.append((h.detach(), t.grad, model.fc.weight.grad, model.layers[1].mlp.down_proj.weight.grad))
    for a, b in zip(*outs):
        rel = ((a - b).norm() / a.norm()).item()
        assert 0 < rel < 0.25, rel   # > 0: the FP8 path ran; e5m2 gradients keep 2 mantissa bits


def test_fp8_leaves_dflash2s_own_linears_in_the_compute_dtype():
    """DFlash2 (issue 43): the same 15 layers as DFlash swap; the convolutions' kernel projections and the
    selector's projection stay nn.Linear (drafter.to_float8 says why), and the selector's loss still
    reaches every parameter through the FP8 layers."""
    from torchao.float8.float8_linear import Float8Linear

    from trainer.engine.drafter_stage import to_float8
    from trainer.model.dflash2 import as_dflash2, selector_loss
    dcfg, _ = _drafter()
    m = DFlashDrafter(as_dflash2(dcfg))
    init_drafter_weights(m, seed=0)
    assert to_float8(m, "tensorwise") == 1 + 7 * 2
    kept = [n for n, x in m.named_modules() if type(x) is torch.nn.Linear]
    assert sorted(kept) == ["candidate_selector.hidden_projection", "layers.0.attention_conv.kernel_projection",
                            "layers.0.mlp_conv.kernel_projection", "layers.1.attention_conv.kernel_projection",
                            "layers.1.mlp_conv.kernel_projection"]
    assert sum(isinstance(x, Float8Linear) for x in m.modules()) == 15
    taps, emb, meta = _inputs(dcfg)
    h = m(taps, emb, meta)
    g = torch.Generator().manual_seed(3)
    head = torch.randn(dcfg.vocab_size, dcfg.hidden_size, generator=g)
    rows = torch.arange(1, h.shape[0])
    tokens = torch.randint(0, dcfg.vocab_size, (h.shape[0],), generator=g)
    cand = torch.topk(h.detach() @ head.t(), 16, dim=-1).indices
    loss, _ = selector_loss(m.candidate_selector, h, head, cand, tokens, tokens.roll(1), torch.ones(h.shape[0]),
                            1.0, rows)
    (loss + h.square().mean()).backward()
    assert [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


def test_fp8_run_trains_like_bf16_and_its_checkpoint_resumes_without_it(tiny_learning_run, tiny_small_dir, tmp_path):
    """The real trainer with --fp8 tensorwise: losses within a few percent of the same run without it (the
    session's learning run, tests/conftest.py, whose end-of-run eval this one leaves out), step by step, and it
    learns. Its checkpoint resumes in a run without --fp8 (same keys). Both runs train their one rank in this
    process (train_here: what they compute is the point, not their processes)."""
    out = tmp_path / "fp8"
    assert train_here(learning_run_args(tiny_small_dir, out, "--fp8", "tensorwise", evaluate=False)) == 0
    a, b = losses(tiny_learning_run), losses(out)
    assert a.keys() == b.keys() == set(range(1, 7))
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=0.05), (s, a[s], b[s])
    assert b[6] < b[1]
    assert b != a  # the FP8 path ran
    assert train_here(tiny_args(tiny_small_dir, out, "--max-steps", "7", "--lr", "5e-3", "--grad-accum", "1")) == 0
    assert max(losses(out)) == 7


def test_kernel_options_parse_and_bad_ones_name_the_flag():
    assert parse_kernel_options("") == {}
    assert parse_kernel_options("BLOCK_M=64, bwd_num_warps=4,PRESCALE_QK=true") == {
        "BLOCK_M": 64, "bwd_num_warps": 4, "PRESCALE_QK": True}
    for bad in ("BLOCK_M", "BLOCK_M=big", "=4", "9X=1"):
        with pytest.raises(ConfigError, match="^--flex-kernel-options: "):
            validate_flags(parse_args(PATHS + ["--flex-kernel-options", bad]), gpu_count=-1)


def test_fp8_without_torchao_is_refused_with_one_line(monkeypatch, capsys):
    """A trainer host without torchao: exit 2, one line naming --fp8, before anything loads. The Ansible
    controller's flag check (gpu_count=-1) leaves it to the trainer's host."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    argv = PATHS + ["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--fp8", "rowwise"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-train: error: --fp8 rowwise: needs the torchao package") and err.count("\n") == 1
    validate_flags(parse_args(argv), gpu_count=-1)
