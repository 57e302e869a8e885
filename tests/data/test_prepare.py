"""dflash-prepare: chat template tokenisation, assistant-only loss mask, bad input."""

import json

import numpy as np
import pytest

from trainer.data.dataset import load_dataset
from trainer.data.prepare import Encoder, main

CONVS = [
    [
        {"role": "system", "content": "you are tiny"},
        {"role": "user", "content": "hello there friend"},
        {"role": "assistant", "content": "hi back at you"},
        {"role": "user", "content": "and again"},
        {"role": "assistant", "content": "sure thing, twice"},
    ],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two three"}],
    [{"role": "assistant", "content": "assistant speaks first"}],
]
PC = [("what is up", "the sky is blue"), ("say x", "x")]


@pytest.fixture(scope="module")
def tok(tiny_small_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_small_dir / "target"), local_files_only=True)


def write_jsonl(path, objs, raw_lines=()):
    with open(path, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


def expected_assistant_text(messages):
    return "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def masked_text(tok, ids, mask):
    return tok.decode(ids[mask].tolist())


def test_prepare_masks_assistant_tokens_only(tmp_path, tiny_small_dir, tok, capsys):
    a = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVS], raw_lines=[""])
    b = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PC])
    out = tmp_path / "shards"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--input", str(a),
               "--input", str(b), "--output-dir", str(out), "--shard-size", "2"])
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    ds = load_dataset(out)
    assert len(ds) == len(CONVS) + len(PC) and len(ds.index["shards"]) == 3

    convs = CONVS + [
        [{"role": "user", "content": p}, {"role": "assistant", "content": c}] for p, c in PC
    ]
    for i, msgs in enumerate(convs):
        ids, mask = ds[i]
        # the whole sequence is exactly the chat template rendering, tokenised
        assert tok.decode(ids.tolist()) == tok.apply_chat_template(msgs, tokenize=False)
        # the supervised tokens are exactly the assistant contents plus their end token
        assert masked_text(tok, ids, mask) == expected_assistant_text(msgs)
        # the unsupervised part holds every non-assistant message and no assistant content
        rest = tok.decode(ids[~mask].tolist())
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"] in rest
        # the mask is contiguous per assistant turn
        runs = np.count_nonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])) == 1)
        assert runs == sum(m["role"] == "assistant" for m in msgs)


def test_fallback_when_template_renders_earlier_turns_differently(tok):
    """A Qwen3-like template that decorates only the last assistant turn: the prefix-diff does
    not hold for earlier turns, so their content is located in the full rendering."""
    import copy

    t2 = copy.deepcopy(tok)
    t2.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and loop.last %}{{- '<think></think>' }}{%- endif %}"
        "{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    enc = Encoder(t2)
    msgs = CONVS[0]
    (ids, mask), = enc.encode([enc.render(msgs, raw=False)])
    text = masked_text(t2, ids, mask.astype(bool))
    # last turn by prefix-diff (includes the think block the target would emit), earlier by search
    assert text == "hi back at you<|im_end|><think></think>sure thing, twice<|im_end|>"


def test_truncation_and_skip(tmp_path, tiny_small_dir, capsys):
    long = {"prompt": "a " * 200, "completion": "b c d"}
    ok = {"prompt": "hi", "completion": "there"}
    f = write_jsonl(tmp_path / "in.jsonl", [long, ok])
    out = tmp_path / "o"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--input", str(f),
               "--output-dir", str(out), "--max-seq-len", "64"])
    assert rc == 0
    log = capsys.readouterr().out
    assert "truncated 1" in log and "skipped 1" in log  # truncation cut off all assistant tokens
    ds = load_dataset(out)
    assert len(ds) == 1 and ds.lengths.max() <= 64


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "x"}', "expected a 'messages' list"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ('{"messages": [{"role": "user"}]}', "messages[0] has no 'content'"),
        ('{"prompt": "x", "completion": 5}', "must both be strings"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, tiny_small_dir, capsys, line, why):
    good = json.dumps({"prompt": "a", "completion": "b"})
    f = tmp_path / "in.jsonl"
    f.write_text(good + "\n\n" + line + "\n")
    out = tmp_path / "o"
    rc = main(["--target-model", str(tiny_small_dir / "target"), "--input", str(f),
               "--output-dir", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dflash-prepare: error: {f}:3: ")
    assert why in err[-1]
    assert not out.exists()  # nothing half-written left behind


def test_bad_arguments(tmp_path, tiny_small_dir, capsys):
    target = str(tiny_small_dir / "target")
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "completion": "b"}])
    cases = [
        (["--target-model", str(tmp_path / "nomodel"), "--input", str(f)], "--target-model"),
        (["--target-model", target, "--input", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--target-model", target, "--input", str(f), "--shard-size", "0"], "--shard-size"),
    ]
    for args, what in cases:
        assert main(args + ["--output-dir", str(tmp_path / "o")]) == 2
        assert what in capsys.readouterr().err
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": "a " * 50, "completion": "b"}])
    assert main(["--target-model", target, "--input", str(short), "--max-seq-len", "8",
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert "no sequences with assistant tokens" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert main(["--target-model", target, "--input", str(f), "--output-dir", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["--target-model", target, "--input", str(f), "--output-dir", str(full),
                 "--force"]) == 0
    assert (full / "keep.txt").exists() and len(load_dataset(full)) == 1
