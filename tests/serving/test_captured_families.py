"""The captured loops on every target family (trainer/model/families.py), a sliding-window target among them.

Specification: on each family's tiny target (dflash-tiny --arch ...), greedy, the captured decoder
(captured/regenerate_decoder.GraphDecoder: left-padded batch) and the batched speculative loop
(captured/eval_decoder.BatchedSpecDecoder, with prompt lookup proposing) write exactly the tokens of
transformers' `generate`, well past the window of a target whose layers slide: the tiny Qwen3 with
`use_sliding_window`, a window of 8 and every other layer sliding (no family entry has a sliding target; this is
the Mistral/Gemma-style case). On that target the window must matter: the same loops with the window ignored
write other tokens (what they did before the loops masked it).
"""

import json
import shutil

import numpy as np
import pytest
import torch

from trainer.data.dataset import load_dataset
from trainer.serving.captured.proposers import NgramProposer
from trainer.serving.evaluate import heldout_prompts, load_target

WINDOW = 8
NEW = 20
SLIDING = "qwen3-sliding"


@pytest.fixture(scope="module")
def sliding_dir(tiny_arch_dir, tmp_path_factory):
    """The tiny Qwen3 target with its layers 1, 3, ... sliding over the last WINDOW positions."""
    src = tiny_arch_dir("qwen3")
    out = tmp_path_factory.mktemp("sliding")
    shutil.copytree(src / "target", out / "target")
    shutil.copytree(src / "heldout", out / "heldout")
    cfg_path = out / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    n = cfg["num_hidden_layers"]
    cfg.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
               layer_types=["sliding_attention" if i % 2 else "full_attention" for i in range(n)])
    cfg_path.write_text(json.dumps(cfg))
    return out


def family_case(arch, tiny_arch_dir, sliding_dir):
    d = sliding_dir if arch == SLIDING else tiny_arch_dir(arch)
    torch.set_num_threads(1)
    target = load_target(str(d / "target"), torch.device("cpu"), torch.float32)
    prompts = heldout_prompts(load_dataset(d / "heldout"), 3)
    return target, prompts


def generate(target, prompts, n):
    out = []
    for p in prompts:
        ids = torch.as_tensor(np.asarray(p))[None]
        g = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def captured(target, prompts, n):
    from trainer.serving.captured.eval_decoder import BatchedSpecDecoder
    from trainer.serving.captured.regenerate_decoder import GraphDecoder
    plain = [t.tolist() for t in GraphDecoder(target, "cpu", len(prompts), n, 0.0, [], 0).generate(prompts,
                                                                                                    range(len(prompts)))]
    spec = [t.tolist() for _, t in BatchedSpecDecoder(target, NgramProposer(4), "cpu", len(prompts), n, [],
                                                      graphs=False).generate(prompts)]
    return plain, spec


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama", SLIDING])
def test_captured_decoding_equals_generate_on_each_familys_tiny_target(arch, tiny_arch_dir, sliding_dir):
    target, prompts = family_case(arch, tiny_arch_dir, sliding_dir)
    want = generate(target, prompts, NEW)
    plain, spec = captured(target, prompts, NEW)
    assert plain == want
    assert spec == want
    if arch == SLIDING:
        assert min(len(p) for p in prompts) + NEW > 2 * WINDOW     # well past the window


def test_on_the_sliding_target_the_window_matters(tiny_arch_dir, sliding_dir, monkeypatch):
    from trainer.serving.captured import attention, eval_decoder, regenerate_decoder
    target, prompts = family_case(SLIDING, tiny_arch_dir, sliding_dir)
    want = generate(target, prompts, NEW)
    for mod in (attention, eval_decoder, regenerate_decoder):
        monkeypatch.setattr(mod, "sliding_window", lambda cfg: None)
    plain, spec = captured(target, prompts, NEW)
    assert plain != want and spec != want


def test_the_decoders_switches_are_one_frozen_options_object(tiny_arch_dir, sliding_dir):
    """GraphDecoder's switches are DecoderOptions (named, frozen, checked); a keyword of a field's name replaces
    one; dflash-regenerate hands its workers one named GenerationSettings, which reaches the decoder."""
    import inspect
    from dataclasses import FrozenInstanceError, asdict

    from trainer.serving.captured.regenerate_decoder import DecoderOptions, GraphDecoder
    from trainer.serving.regenerate import GenerationSettings, TargetGenerator
    target, _ = family_case("qwen3", tiny_arch_dir, sliding_dir)
    opts = DecoderOptions(fuse=True, view_step=16)
    with pytest.raises(FrozenInstanceError):
        opts.fuse = False
    dec = GraphDecoder(target, "cpu", 2, 4, 0.0, [], 0, opts, check_every=4)
    assert dec.options == DecoderOptions(fuse=True, view_step=16, check_every=4)
    assert (dec.fuse, dec.view_step, dec.check_every, dec.decode_kernel) == (True, 16, 4, "sdpa")
    assert list(inspect.signature(GraphDecoder).parameters)[7:] == ["options", "switches"]
    with pytest.raises(TypeError, match="fusee"):
        GraphDecoder(target, "cpu", 2, 4, 0.0, [], 0, fusee=True)
    with pytest.raises(ValueError, match="decode_kernel: one of sdpa, matmul, triton, got 'flash'"):
        DecoderOptions(decode_kernel="flash")
    with pytest.raises(ValueError, match="kv_fp8 needs decode_kernel='triton'"):
        DecoderOptions(kv_fp8=True)
    settings = GenerationSettings(8, 0.0, 2, decoder="captured", fuse=True)
    with pytest.raises(FrozenInstanceError):
        settings.fuse = False
    gen = TargetGenerator(target, "cpu", **asdict(settings))
    assert gen._fast_decoder().options == DecoderOptions(fuse=True, decode_kernel="sdpa", state_inplace=True)
