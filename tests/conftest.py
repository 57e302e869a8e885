"""Shared pytest fixtures.

Data / dflash-tiny fixtures (owned by the data tests): ``tiny_small_dir`` builds one small
dflash-tiny output per test session (target model + tokenizer, 48 train / 8 held-out sequences).
"""

import pytest


@pytest.fixture(scope="session")
def tiny_small_dir(tmp_path_factory):
    """A small dflash-tiny OUTDIR (target/, data/, heldout/), built once per session."""
    from trainer.tiny import make_tiny

    out = tmp_path_factory.mktemp("dflash-tiny") / "out"
    make_tiny(out, seed=0, num_train=48, num_heldout=8, log=lambda *a, **k: None)
    return out
