"""The Examples blocks of the public docstrings run on the CPU and print what they claim; README and docs/ read as
a product: design notes linked and closed by what was dropped, no process history or machine paths, every
environment variable documented."""

from __future__ import annotations

import doctest
import pathlib
import re
import subprocess

import pytest

import flashinfer_triton as fi


@pytest.mark.parametrize(
    "module", [fi.decode, fi.prefill, fi.cascade, fi.page, fi.quantization], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


# ----------------------------------------------------------------------------- README and docs/ as a product

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN_NOTES = ["decode", "prefill", "cascade", "vllm", "host-path", "ops"]  # each ends with what was tried and dropped


def _tracked(*parts):
    # safe.directory: a copy owned by another user (a CI or GPU machine's checkout) is still read through git, so
    # files the test run itself writes into the tree are never taken for the product's
    out = subprocess.run(
        ["git", "-c", "safe.directory=*", "ls-files", *parts], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:  # not a git checkout (an sdist): walk the folders instead
        return [p.relative_to(ROOT).as_posix() for d in parts for p in (ROOT / d).rglob("*") if p.is_file()]
    return out.stdout.split()


def test_readme_links_to_docs_resolve_and_cover_the_design_notes():
    text = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", text))
    assert links, "README links no design note"
    for link in links:
        assert (ROOT / link).is_file(), link
    for name in [*DESIGN_NOTES, "semantics", "page", "benchmarking"]:
        assert f"docs/{name}.md" in links, f"README does not link docs/{name}.md"


@pytest.mark.parametrize("name", DESIGN_NOTES)
def test_design_notes_end_with_what_was_dropped(name):
    text = (ROOT / "docs" / f"{name}.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings and headings[-1] == "Tried and dropped", headings


def test_no_process_history_or_machine_paths_in_the_product():
    """No session names, run timestamps, issue numbers or machine paths in what ships (source, tests, docs,
    results)."""
    session = re.compile(r"\bsessions?[ -]?\d+", re.I)
    # a run's time of day (results carry the date only) and a tracker's issue numbers
    timestamp = re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}|\b\d{2}:\d{2}(?::\d{2})? ?UTC\b")
    issue = re.compile(r"\bissues? #?\d+\b", re.I)
    machine = re.compile(r"(?<![\w.])/(?:work|root|home|mnt|Users)/")
    tmp = re.compile(r"(?<![\w.])/tmp/")
    # what ships names no working session ("another session's tests") and no file of the ignored scratch folder
    session_word = re.compile(r"\bsession(?:s|'s)?\b", re.I)
    scratch = re.compile(r"(?<![\w./$-])out/[\w.-]+/")
    bad = []
    for rel in _tracked("README.md", "docs", "src", "tests", "benchmarks", "examples", "scripts", "Makefile"):
        if not rel.endswith((".py", ".md", ".json", ".sh", ".txt", ".toml", "Makefile")):
            continue
        if re.search(r"session_?\d", rel, re.I):
            bad.append(f"{rel}: named after a session")
        text = (ROOT / rel).read_text(errors="replace")
        checks = [session, machine, timestamp, issue] + (
            [tmp, session_word, scratch] if rel.startswith(("README", "docs/", "src/", "benchmarks/results/")) else []
        )
        for pattern in checks:
            m = pattern.search(text)
            if m and rel != "tests/test_docs.py":
                bad.append(f"{rel}: {m.group(0)!r}")
    assert not bad, bad


def test_every_environment_variable_read_by_the_library_is_documented():
    names = set()
    for path in (ROOT / "src").rglob("*.py"):
        names |= set(re.findall(r"[\"'](FLASHINFER_TRITON_[A-Z0-9_]+|TRITON_[A-Z0-9_]+)[\"']", path.read_text()))
    assert "FLASHINFER_TRITON_GLUON" in names  # the scan itself works
    readme = (ROOT / "README.md").read_text()
    config = readme[readme.index("## Configuration") :]
    config = config[: config.index("\n## ", 1)]
    missing = sorted(n for n in names if f"`{n}`" not in config)
    assert not missing, f"README's Configuration table lacks {missing}"


def test_results_files_named_in_the_docs_exist():
    """Every ``results/<gpu>/<file>.json`` the README and docs/ name is in the repository (a reference renamed or
    dropped leaves no dangling name behind)."""
    named = set()
    for rel in _tracked("README.md", "docs"):
        if rel.endswith(".md"):
            named |= set(re.findall(r"results/[\w-]+/[\w.-]+\.json", (ROOT / rel).read_text()))
    assert named
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / n).is_file())
    assert not missing, missing


def test_prefill_custom_mask_figure_is_the_results_table_s():
    """docs/prefill.md quotes the block-diagonal custom-mask row's TFLOP/s from the README table: the figure is the
    prefill results file's, rounded as the table rounds it."""
    import json

    text = (ROOT / "docs" / "prefill.md").read_text()
    got = re.search(r"\(32/8, D128\): (\d+) TFLOP/s in the README table", text)
    assert got, "docs/prefill.md no longer quotes the custom-mask row"
    (row,) = [
        r
        for r in json.loads((ROOT / "benchmarks/results/H100-80GB-HBM3/prefill.json").read_text())["rows"]
        if "blockdiag" in r["case"]
    ]
    assert int(got.group(1)) == round(row["ours_tflops"]), (got.group(1), row["ours_tflops"])
