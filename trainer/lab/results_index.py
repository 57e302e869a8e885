"""results/INDEX.md: one line per run in results/, grouped by date and topic, rendered from results/index.json.

results/index.json holds what a file cannot say about itself: its topic, the command that made it, the
commit and date, and the headline figure, for each run (a result file with the logs that belong to it).
What the docs quote changes with the docs, so it is not stored: the renderer finds every mention of a
result file in README.md and docs/*.md (plain names, `{a,b}` lists and `*` patterns) and names the doc
section around it.

    python trainer/lab/results_index.py --write    # render results/INDEX.md
    python trainer/lab/results_index.py --check    # exit 1 when INDEX.md is stale or a file has no line
    python trainer/lab/results_index.py --add FILE [--topic T] [--headline H]   # a new run's line, from its metadata

A result written from now on records its commit (`meta.commit`, `git rev-parse HEAD`); older ones name the
commit that added the file (`git log --diff-filter=A`), the closest record there is.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
INDEX_JSON = RESULTS / "index.json"
INDEX_MD = RESULTS / "INDEX.md"
OWN = {"index.json", "INDEX.md"}          # the index itself, not results
FIELDS = ("date", "topic", "files", "commit", "command", "headline")


def result_files() -> list[str]:
    """Every file in results/ but the index's own two."""
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in OWN)


def load_runs() -> list[dict]:
    return json.loads(INDEX_JSON.read_text())["runs"]


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _expand(pattern: str) -> list[str]:
    """`h200-{a,b}-x.json` -> both names (one level of braces, nested lists expanded left to right)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for alt in m.group(1).split(",") for e in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def quotes(names: list[str]) -> dict[str, list[str]]:
    """For each result file, the doc sections that name it: "docs/x.md: Heading" (the nearest heading
    above the mention, code blocks skipped), in doc order, each once."""
    found: dict[str, list[str]] = {n: [] for n in names}
    mention = re.compile(r"(?:results/)?([\w.*{},-]+\.(?:json|txt|log|gz|md))")
    for doc in docs():
        if not doc.is_file():
            continue
        rel = str(doc.relative_to(REPO))
        heading, fenced = "(top)", False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6} ", line):
                heading = line.lstrip("#").strip()
            for token in mention.findall(line):
                for pat in _expand(token):
                    for name in (fnmatch.filter(names, pat) if "*" in pat else [pat] if pat in found else []):
                        where = f"{rel}: {heading}"
                        if where not in found[name]:
                            found[name].append(where)
    return found


def render(runs: list[dict]) -> str:
    names = [f for r in runs for f in r["files"]]
    quoted = quotes(names)
    out = ["# results/: every run, by date and topic",
           "",
           "Rendered by `python trainer/lab/results_index.py --write` from `results/index.json`; do not edit by hand.",
           "`tests/lab/test_results_index.py` fails when a file in results/ has no line here, or a line names a file",
           "that is gone. Commit: `meta.commit` where the result records it, else the commit that added the",
           "file (results before 2026-12-04 did not record theirs). Date: the run's start (UTC) where recorded,",
           "else the commit's. Quoted in: the doc sections that name the file (found in README.md and docs/*.md",
           "at render time). The current figures and what they mean: `docs/performance.md`.",
           ""]
    for date in sorted({r["date"] for r in runs}):
        out += [f"## {date}", ""]
        day = [r for r in runs if r["date"] == date]
        for topic in sorted({r["topic"] for r in day}):
            out += [f"### {topic}", ""]
            for r in sorted((r for r in day if r["topic"] == topic), key=lambda r: r["files"][0]):
                files = ", ".join(f"`{f}`" for f in r["files"])
                where = sorted({w for f in r["files"] for w in quoted[f]}, key=lambda w: (not w.startswith("docs/performance.md"), w))
                out.append(f"- {files}")
                out.append(f"  - commit {r['commit']}; `{r['command']}`" if r["command"] else f"  - commit {r['commit']}")
                out.append(f"  - {r['headline']}")
                out.append(f"  - quoted in: {'; '.join(where) if where else 'no doc'}")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def problems(runs: list[dict]) -> list[str]:
    """What makes the index untrue: a result file with no line, a line whose file is gone, a file on two
    lines, a line missing a field, a commit that differs from the one the result recorded."""
    out = []
    indexed = [f for r in runs for f in r["files"]]
    have = set(result_files())
    out += [f"not indexed: results/{f}" for f in sorted(have - set(indexed))]
    out += [f"indexed but missing: results/{f}" for f in sorted(set(indexed) - have)]
    out += [f"indexed twice: results/{f}" for f in sorted({f for f in indexed if indexed.count(f) > 1})]
    for r in runs:
        out += [f"{r.get('files')}: no {k}" for k in FIELDS if k not in r]
        for f in r.get("files", []):
            meta = _meta(RESULTS / f)
            if meta.get("commit") and not str(meta["commit"]).startswith(r.get("commit", "-")):
                out.append(f"results/{f}: recorded commit {meta['commit']}, index says {r.get('commit')}")
    return out


def _meta(path: Path) -> dict:
    if path.suffix != ".json" or not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d.get("meta", {}) if isinstance(d, dict) and isinstance(d.get("meta"), dict) else {}


def new_run(path: Path, topic: str, headline: str) -> dict:
    """A line for a new result file from what it records (meta.commit, meta.started, meta.argv)."""
    meta = _meta(path)
    commit = str(meta.get("commit") or "")[:7]
    if not commit:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "-"
    started = meta.get("started")
    date = (datetime.fromtimestamp(started, timezone.utc) if started else datetime.now(timezone.utc)).strftime("%Y-%m-%d")
    argv = meta.get("argv")
    command = " ".join(str(a) for a in argv) if isinstance(argv, list) else ""
    return {"date": date, "topic": topic, "files": [path.name], "commit": commit, "command": command,
            "headline": headline}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="render results/INDEX.md")
    g.add_argument("--check", action="store_true", help="exit 1 when INDEX.md is stale or the index is untrue")
    g.add_argument("--add", metavar="FILE", help="append a line for a new result file to results/index.json")
    ap.add_argument("--topic", default="unsorted")
    ap.add_argument("--headline", default="(headline not written yet)")
    a = ap.parse_args(argv)
    runs = load_runs()
    if a.add:
        runs.append(new_run(RESULTS / Path(a.add).name, a.topic, a.headline))
        INDEX_JSON.write_text(json.dumps({"runs": runs}, indent=1, ensure_ascii=False) + "\n")
        print(f"added results/{Path(a.add).name}; now run --write")
        return 0
    if a.write:
        INDEX_MD.write_text(render(runs))
        print(f"wrote {INDEX_MD.relative_to(REPO)}: {len(runs)} runs")
    bad = problems(runs)
    if a.check and INDEX_MD.read_text() != render(runs):
        bad.append("results/INDEX.md is stale: run python trainer/lab/results_index.py --write")
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
