"""dflash-export: the export is what serving engines and AutoModel(trust_remote_code) load.

A tiny run's checkpoint (random drafter weights, an optimizer state beside them) is exported; the
export must carry a config every loader reads consistently, bf16 weights only, and a modelling file
whose forward equals the trainer's.
"""

import json
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.model.checkpoint_format import CheckpointManager
from trainer.model.drafter import DFlashConfig, DFlashDrafter, PackedMeta, init_drafter_weights
from trainer.serving.export import ExportError, export_drafter
from trainer.serving.export import main as export_main

REFERENCE_SNAPSHOT = Path("/work/.mirror/z-lab+dflash/repo")  # `fetch github:z-lab/dflash`; never committed


def tiny_drafter(target_dir, seed=1, layers=2, block=4, mask_token_id=3):
    from transformers import AutoConfig
    cfg = DFlashConfig.from_target(AutoConfig.from_pretrained(target_dir), num_draft_layers=layers,
                                   block_size=block, mask_token_id=mask_token_id)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.1, seed=seed)
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return cfg, model


def save_run(out, cfg, model, step):
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, len(cfg.target_layer_ids) * cfg.hidden_size),
          torch.zeros(cfg.block_size, cfg.hidden_size),
          PackedMeta(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                     torch.zeros(cfg.block_size, dtype=torch.long), torch.ones(cfg.block_size, dtype=torch.long),
                     torch.arange(1, cfg.block_size + 1), cfg.block_size)).sum().backward()
    opt.step()
    return CheckpointManager(out).save(step, model.state_dict(), cfg.to_dict(),
                                       {"optimizer": opt.state_dict(), "step": step})


@pytest.fixture(scope="module")
def run(tiny_small_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export-run") / "out"
    cfg, model = tiny_drafter(tiny_small_dir / "target")
    save_run(out, cfg, model, 7)
    return out, cfg, model


@pytest.fixture(scope="module")
def exported(run, tiny_small_dir, tmp_path_factory):
    out, cfg, model = run
    dst = tmp_path_factory.mktemp("export") / "drafter"
    export_drafter(out / "step-00000007", dst, target_model=str(tiny_small_dir / "target"))
    return dst


def test_config_is_consistent_and_has_every_loaders_keys(exported, run, tiny_small_dir):
    _, cfg, _ = run
    c = json.loads((exported / "config.json").read_text())
    target = json.loads((tiny_small_dir / "target" / "config.json").read_text())
    d = c["dflash_config"]
    assert c["architectures"] == ["DFlashDraftModel"]
    assert c["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert c["num_target_layers"] == d["num_target_layers"] == target["num_hidden_layers"] == 8
    assert "target_num_hidden_layers" not in c
    assert d["target_layer_ids"] == cfg.target_layer_ids and all(0 <= t < c["num_target_layers"]
                                                                 for t in d["target_layer_ids"])
    assert c["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in d["target_layer_ids"]]
    assert 0 <= d["mask_token_id"] < c["vocab_size"] == target["vocab_size"]
    assert d["mask_token"] == "<|mask|>"  # the tiny tokenizer's token at that id (SGLang compares them)
    assert c["block_size"] == d["block_size"] == 4
    assert c["num_hidden_layers"] == 2 and c["layer_types"] == ["full_attention"] * 2
    assert c["dtype"] == c["torch_dtype"] == "bfloat16"
    assert c["rope_theta"] == c["rope_parameters"]["rope_theta"] == target["rope_parameters"]["rope_theta"]
    assert c["rope_parameters"]["rope_type"] == "default" and c["rope_scaling"] is None
    assert c["hidden_size"] == target["hidden_size"] and c["head_dim"] == target["head_dim"]


def test_weights_are_bf16_and_nothing_but_the_model_is_exported(exported, run):
    _, cfg, model = run
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "export.json", "model.safetensors",
                                                         "modeling_dflash.py"]
    assert json.loads((exported / "export.json").read_text())["step"] == 7
    state = safetensors.torch.load_file(str(exported / "model.safetensors"))
    ref = model.state_dict()
    assert set(state) == set(ref)
    for n, t in state.items():
        assert t.dtype == torch.bfloat16, n
        assert torch.equal(t, ref[n].to(torch.bfloat16)), n


def test_automodel_builds_the_drafter_and_its_forward_equals_the_trainers(exported):
    from transformers import AutoModel
    hf, info = AutoModel.from_pretrained(exported, trust_remote_code=True, dtype="auto", output_loading_info=True)
    assert type(hf).__name__ == "DFlashDraftModel" and hf.dtype == torch.bfloat16
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf = hf.float()
    cfg_dict = json.loads((exported / "config.json").read_text())
    from trainer.serving.export import drafter_config_from_json
    cfg = drafter_config_from_json(cfg_dict)
    ours = DFlashDrafter(cfg)
    ours.load_state_dict(safetensors.torch.load_file(str(exported / "model.safetensors")), strict=True)
    ours.float().eval()
    g = torch.Generator().manual_seed(0)
    n, bs, k = 23, cfg.block_size, len(cfg.target_layer_ids)
    taps = torch.randn(n, k * cfg.hidden_size, generator=g)
    anchors = torch.tensor([3, 11, 19])
    emb = torch.randn(len(anchors) * bs, cfg.hidden_size, generator=g)
    q_anchor = anchors.repeat_interleave(bs)
    meta = PackedMeta(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros_like(q_anchor), q_anchor,
                      (anchors[:, None] + torch.arange(bs)).reshape(-1), bs)
    with torch.no_grad():
        packed = ours(taps, emb, meta, backend="sdpa").view(len(anchors), bs, -1)
        for j, a in enumerate(anchors.tolist()):
            # one block: context rows 0..a-1, block rows at positions a..a+B-1
            out = hf(position_ids=torch.arange(a + bs)[None], noise_embedding=emb[j * bs:(j + 1) * bs][None],
                     target_hidden=taps[:a][None])
            assert torch.allclose(out[0], packed[j], atol=1e-5), (a, (out[0] - packed[j]).abs().max())


def test_incremental_context_cache_equals_full_recompute(exported):
    """The generation loop feeds only new context rows and keeps the rest in a cache."""
    from transformers import AutoModel, DynamicCache

    from trainer.model.modeling_dflash import crop_cache
    hf = AutoModel.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    bs, width = hf.block_size, len(hf.target_layer_ids) * hf.config.hidden_size
    taps = torch.randn(1, 30, width, generator=g)
    noise = torch.randn(1, bs, hf.config.hidden_size, generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        for prev, start in ((0, 12), (12, 13), (13, 17), (17, 30)):
            inc = hf(position_ids=torch.arange(prev, start + bs)[None], noise_embedding=noise,
                     target_hidden=taps[:, prev:start], past_key_values=cache)
            crop_cache(cache, start)
            full = hf(position_ids=torch.arange(start + bs)[None], noise_embedding=noise, target_hidden=taps[:, :start])
            assert cache.get_seq_length() == start
            assert torch.allclose(inc, full, atol=1e-5)


def test_export_from_an_output_dir_takes_the_newest_step(tiny_small_dir, tmp_path):
    out = tmp_path / "out"
    for step, seed in ((5, 1), (9, 2)):
        cfg, model = tiny_drafter(tiny_small_dir / "target", seed=seed)
        save_run(out, cfg, model, step)
    assert export_main([str(out), str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "export.json").read_text())["step"] == 9
    state = safetensors.torch.load_file(str(tmp_path / "e" / "model.safetensors"))
    assert torch.equal(state["fc.weight"], model.state_dict()["fc.weight"].to(torch.bfloat16))
    # a second export into the same, now non-empty, OUT needs --force
    assert export_main([str(out), str(tmp_path / "e")]) == 2
    assert export_main([str(out), str(tmp_path / "e"), "--force"]) == 0


def test_export_refuses_what_cannot_serve(tiny_small_dir, tmp_path, capsys):
    cfg, model = tiny_drafter(tiny_small_dir / "target")
    # a weight the drafter does not have: strict, never skipped
    state = dict(model.state_dict(), **{"layers.0.self_attn.extra.weight": torch.zeros(2)})
    CheckpointManager(tmp_path / "a").save(1, state, cfg.to_dict(), {})
    with pytest.raises(ExportError, match="unexpected .*extra"):
        export_drafter(tmp_path / "a", tmp_path / "ea")
    # a tap outside the target
    bad = DFlashConfig.from_dict(dict(cfg.to_dict(), target_layer_ids=[1, 8]))
    CheckpointManager(tmp_path / "b").save(1, model.state_dict(), bad.to_dict(), {})
    assert export_main([str(tmp_path / "b"), str(tmp_path / "eb")]) == 2
    assert "taps [8] are outside the target's 8 layers" in capsys.readouterr().err
    # a target of another depth
    cfg12 = DFlashConfig.from_dict(dict(cfg.to_dict(), target_num_hidden_layers=12))
    CheckpointManager(tmp_path / "c").save(1, model.state_dict(), cfg12.to_dict(), {})
    with pytest.raises(ExportError, match="target has 8 layers, the drafter was trained on 12"):
        export_drafter(tmp_path / "c", tmp_path / "ec", target_model=str(tiny_small_dir / "target"))
    assert not (tmp_path / "ea").exists() and not (tmp_path / "ec").exists()
    with pytest.raises(ExportError, match="neither a checkpoint"):
        export_drafter(tmp_path, tmp_path / "ed")


def _reference_module(tmp_path):
    if not (REFERENCE_SNAPSHOT / "HEAD").exists() and not (REFERENCE_SNAPSHOT / ".git").exists():
        pytest.skip("no snapshot of z-lab/dflash (fetch github:z-lab/dflash)")
    src = subprocess.run(["git", "--git-dir", str(REFERENCE_SNAPSHOT), "show", "HEAD:dflash/model.py"],
                         capture_output=True, text=True)
    if src.returncode != 0:
        pytest.skip(f"cannot read dflash/model.py from the snapshot: {src.stderr.strip()}")
    import importlib.util
    path = tmp_path / "zlab_dflash_model.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:
        pytest.skip(f"the reference does not import with this transformers: {e}")
    return mod


def test_reference_model_class_loads_the_export_and_agrees(exported, tmp_path):
    """The DFlash authors' class (z-lab/dflash dflash/model.py) reads num_target_layers, block_size,
    dflash_config and layer_types from our config.json, loads every weight, and computes our forward."""
    ref_mod = _reference_module(tmp_path)
    from transformers import AutoModel
    ref, info = ref_mod.DFlashDraftModel.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = AutoModel.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32)
    assert ref.target_layer_ids == ours.target_layer_ids and ref.block_size == ours.block_size
    assert ref.mask_token_id == ours.mask_token_id
    g = torch.Generator().manual_seed(2)
    bs, width = ours.block_size, len(ours.target_layer_ids) * ours.config.hidden_size
    taps = torch.randn(1, 9, width, generator=g)
    noise = torch.randn(1, bs, ours.config.hidden_size, generator=g)
    pos = torch.arange(9 + bs)[None]
    with torch.no_grad():
        a = ref(position_ids=pos, noise_embedding=noise, target_hidden=taps, is_causal=False)
        b = ours(position_ids=pos, noise_embedding=noise, target_hidden=taps)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_readme_route_spec_generate_on_the_export_equals_greedy(exported, tiny_small_dir):
    """AutoModel(trust_remote_code) -> draft.spec_generate(target=..., ...), as the reference README does."""
    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_small_dir / "target", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 60, 61, 62, 63, 2, 64]])
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=12, stop_token_ids=[], temperature=0.0)
    ref = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)


def test_export_is_readable_by_a_serving_user(exported):
    """Issue 30: safetensors writes 0600; a serving engine running as another user must read the export."""
    import stat
    assert stat.S_IMODE(exported.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in exported.iterdir()}
    assert modes and all(m == 0o644 for m in modes.values()), modes
