"""dflash-tiny: a loadable tiny Qwen3 target + tokenizer and data the target generated itself."""

import json

import numpy as np
import pytest
import torch

from trainer.data.dataset import check_data_dir, load_dataset
from trainer.tools.tiny import main


@pytest.fixture(scope="module")
def loaded(tiny_small_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_small_dir / "target"
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(target), local_files_only=True, dtype=torch.float32
    )
    model.eval()
    return tok, model


def test_target_loads(tiny_small_dir, loaded):
    tok, model = loaded
    target = tiny_small_dir / "target"
    assert (target / "model.safetensors").is_file()
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["tie_word_embeddings"] is False
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size >= len(tok)
    assert model.config.num_hidden_layers >= 6
    vocab = tok.get_vocab()
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"):
        assert t in vocab and vocab[t] < model.config.vocab_size
    text = tok.apply_chat_template(
        [{"role": "user", "content": "abc"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_data_is_target_generated_and_diverse(tiny_small_dir, loaded):
    tok, model = loaded
    check_data_dir(tiny_small_dir / "heldout")
    ds = load_dataset(tiny_small_dir / "data")
    held = load_dataset(tiny_small_dir / "heldout")
    assert len(ds) == 48 and len(held) == 8
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    comps = []
    for i in range(len(ds)):
        ids, mask = ds[i]
        assert ids[0] == im_start and not mask[0]
        k = int(np.argmax(mask))  # mask = one contiguous completion at the end
        assert mask[k:].all() and not mask[:k].any()
        assert 32 <= len(ids) - k <= 96
        prompt = tok.decode(ids[:k].tolist())
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
        comps.append(tuple(ids[k:].tolist()))
    # diversity: many distinct tokens, no two completions alike, not one token repeated
    all_tokens = np.concatenate([np.array(c) for c in comps])
    assert len(np.unique(all_tokens)) >= 40
    assert len(set(comps)) == len(comps)
    assert np.mean([len(set(c)) for c in comps]) >= 4

    # the completions are the target's own greedy outputs (teacher-forced argmax agrees)
    agree = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is faster on a shared 2-core machine
    try:
        with torch.no_grad():
            for i in range(8):
                ids, mask = ds[i]
                logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1]
                pred = logits.argmax(-1).numpy()
                m = mask[1:]
                agree.append(np.mean(pred[m] == ids[1:][m]))
    finally:
        torch.set_num_threads(threads)
    assert np.mean(agree) >= 0.95


def test_refuses_non_empty_outdir(tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-tiny: error:") and "--force" in err
    assert (tmp_path / "x").read_text() == "keep"


def test_width_options_build_a_wider_target_that_loads(tmp_path):
    """--hidden-size etc. (a wider target for FP8 parity, trainer/lab/gpu/fp8_parity.py); the defaults' shape is
    MODEL_SHAPE itself, so every fixture stays byte-identical."""
    from transformers import AutoModelForCausalLM

    from trainer.tools.tiny import MODEL_SHAPE, model_shape

    assert model_shape() == MODEL_SHAPE
    out = tmp_path / "wide"
    assert main([str(out), "--num-train", "2", "--num-heldout", "0", "--hidden-size", "128",
                 "--intermediate-size", "256", "--num-heads", "8", "--num-kv-heads", "4"]) == 0
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["num_hidden_layers"]) == (128, 256, 8, 4, 16, 8)
    assert json.loads((out / "tiny.json").read_text())["shape"]["hidden_size"] == 128
    model = AutoModelForCausalLM.from_pretrained(str(out / "target"), local_files_only=True, dtype=torch.float32)
    assert model.model.embed_tokens.weight.shape == (512, 128)
    assert len(load_dataset(out / "data")) == 2


@pytest.mark.parametrize("args, option", [
    (["--hidden-size", "0"], "--hidden-size"),
    (["--intermediate-size", "-4"], "--intermediate-size"),
    (["--num-layers", "6"], "--num-layers"),
    (["--num-heads", "3"], "--num-heads"),
    (["--hidden-size", "96", "--num-heads", "4", "--num-kv-heads", "3"], "--num-kv-heads"),
    (["--init-range", "0"], "--init-range"),
    (["--device", "tpu"], "--device"),
])
def test_bad_width_options_exit_2_naming_the_option(tmp_path, capsys, args, option):
    assert main([str(tmp_path / "t"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-tiny: error: {option} ") and err.count("\n") == 1, err
    assert not (tmp_path / "t").exists()


def test_hybrid_target_is_the_real_architecture_at_a_tiny_size(tiny_hybrid_dir):
    """--arch qwen3_5 writes what Qwen3.6-27B's checkpoint is: the VL wrapper with a vision tower,
    3 linear : 1 full attention layers, partial interleaved mRoPE, an untied head; it loads with
    transformers' own class, and the data are its own greedy continuations."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    target = tiny_hybrid_dir / "target"
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    rope = text["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == text["head_dim"] * 0.25 / 2
    assert text["tie_word_embeddings"] is False and cfg["tie_word_embeddings"] is False
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(target), local_files_only=True, dtype=torch.float32)
    assert sum(p.numel() for p in model.model.visual.parameters()) > 0
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    kinds = [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
             for layer in model.model.language_model.layers]
    assert kinds == ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"] + ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"]
    assert AutoConfig.from_pretrained(str(target)).text_config.vocab_size == 512
    tiny = json.loads((tiny_hybrid_dir / "tiny.json").read_text())
    assert tiny["arch"] == "qwen3_5" and tiny["teacher_forced_agreement"] >= 0.9
    ds = load_dataset(tiny_hybrid_dir / "data")
    assert len(ds) == 48
    ids, mask = ds[0]
    with torch.no_grad():   # the completion is the target's own argmax, teacher-forced from position 0
        logits = model(input_ids=torch.as_tensor(np.asarray(ids))[None].long()).logits[0]
    k = int(np.argmax(mask))
    pred = logits[k - 1:-1].argmax(-1).numpy()
    assert (pred == np.asarray(ids)[k:]).mean() >= 0.9


def test_hybrid_width_options_keep_the_hybrid(tmp_path):
    """The shape options apply to --arch qwen3_5 too (query width 2 x hidden), and a head_dim the
    mRoPE sections cannot split exits 2 naming the option."""
    from trainer.tools.tiny import model_shape

    s = model_shape(hidden_size=96, num_heads=4, arch="qwen3_5")
    assert s["head_dim"] == 48 and s["hidden_size"] == 96
    with pytest.raises(ValueError, match="--num-heads"):
        model_shape(hidden_size=64, num_heads=32, arch="qwen3_5")   # head_dim 4: nothing to rotate
