"""The docs state the present: no development diary in the project, README's test command is the
one CI runs, and every relative link in README.md and docs/ resolves (file and heading)."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()

# Words that date a text to who did what when; history belongs in git log.
DIARY = re.compile(
    r"\bstops? \d+\b(?!\s*(?:s|ms|min|seconds?|minutes?)\b)"
    r"|\bthis (?:stop|session)\b"
    r"|\b(?:earlier|later|previous|next|last) (?:stop|session)\b"
    r"|\bthe stop before\b"
    r"|\bissues? #?\d+"
    r"|\bthe issue(?:'s)?\b|\(issue\b"
    r"|\ba helper\b|\breviewers?\b|\ba review\b"
    r"|\bat this point\b"
    r"|\btoday(?:'s)?\b",
    re.IGNORECASE)
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".example", ""}
SCANNED = ["README.md", "pyproject.toml", "constraints.txt", ".ci", "conf", "deploy", "docs",
           "fedact_app", "scripts", "tests"]


def project_text_files():
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in candidates:
            if file.resolve() == THIS or "__pycache__" in file.parts or file.suffix not in TEXT_SUFFIXES:
                continue
            yield file


def diary_lines(text):
    """(line number, line) of every line that speaks of the project's history."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if DIARY.search(line)]


@pytest.mark.parametrize("text, hits", [
    ("figures of stop 25", 1), ("Stops 24 and 25 below", 1), ("measured this session", 1),
    ("at the stop before", 1), ("issue 20's run", 1), ("see issue #3", 1), ("the issue's forgeries", 1),
    ("found by a reviewer", 1), ("a helper read it", 1), ("at this point we", 1),
    ("with today's launcher", 1),
    ("the run stops at the dataset", 0), ("the session's engine (pytest)", 0),
    ("to issue a new certificate", 0), ("stop_tree kills it", 0), ("a SuperNode stops 3 s", 0),
])
def test_the_diary_pattern_tells_history_from_present_tense(text, hits):
    assert len(diary_lines(text)) == hits


def test_no_file_of_the_project_speaks_of_its_history():
    found = []
    for file in project_text_files():
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{file.relative_to(ROOT)}:{n}: {line}" for n, line in diary_lines(text)]
    assert not found, "history belongs in git log, not in the project:\n" + "\n".join(found)


def readme_command(marker):
    """The one line of README.md's ```bash blocks that contains ``marker``."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if marker in line]
    assert len(lines) == 1, f"README.md should show one command with {marker!r}, found {lines}"
    return lines[0].strip()


def test_readme_test_command_is_the_one_ci_runs():
    command = readme_command("pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run does not run README.md's test command:\n{command}"
    assert "pip install" in command and "HF_HUB_OFFLINE=1" in command and "HF_DATASETS_OFFLINE=1" in command
    assert "FLWR_TELEMETRY_ENABLED=0" in command and "FLWR_DISABLE_UPDATE_CHECK=1" in command


def test_readme_main_job_installs_and_runs_the_launcher():
    command = readme_command("&& python3 -m fedact_app.cli.launch")
    assert command.startswith("python3 -m pip install") and "-c constraints.txt" in command


def github_anchor(heading):
    """The #fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    text = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def anchors(markdown):
    """Every heading's anchor, numbered as GitHub numbers repeats (-1, -2, ...); code fences skipped."""
    seen, result = {}, set()
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def test_github_anchor_follows_githubs_rule():
    assert github_anchor("Checkpoints and resume") == "checkpoints-and-resume"
    assert github_anchor("Measured on an NVIDIA H100 80GB HBM3") == "measured-on-an-nvidia-h100-80gb-hbm3"
    assert github_anchor("`bench_run.py`: a whole run") == "bench_runpy-a-whole-run"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def relative_links(markdown):
    """Link targets of ``[text](target)`` that are not URLs, outside code fences and code spans."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t.split()[0] for t in re.findall(r"\]\(([^)\s][^)]*)\)", text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def markdown_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page.read_text()):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{fragment} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
