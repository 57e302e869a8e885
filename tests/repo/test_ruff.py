"""ruff is clean over trainer/ and tests/ (issue 55): pyflakes (unused imports and names, undefined names)
and import order, with the rules of pyproject.toml's [tool.ruff]. tests/setup-host.sh installs it."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    assert RUFF.exists(), f"{RUFF} is missing: tests/setup-host.sh installs ruff with the test tools"
    return subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=cwd, capture_output=True, text=True)


def test_ruff_is_clean_over_the_trainer_and_the_tests():
    r = ruff("trainer", "tests")
    assert r.returncode == 0, "ruff check trainer tests (fix the imports with --fix):\n" + (r.stdout + r.stderr)[-6000:]


def test_ruff_runs_our_rules(tmp_path):
    """The config is the repo's: an unused import and imports out of order are findings."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nprint(os.sep)\n")
    r = ruff("--config", str(REPO / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert r.returncode == 1 and "F401" in r.stdout and "I001" in r.stdout, r.stdout + r.stderr
