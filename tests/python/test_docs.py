"""The repository as a reader meets it: the README is short and its links and the docs' stay
inside the repository, docs/ stays small, and measurements are named by date and commit, never by
the period of work that made them."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def test_every_link_resolves_inside_the_repository():
    bad, count = [], 0
    for f in markdown_files():
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)  # code blocks hold no links
        for lineno, line in enumerate(text.split("\n"), 1):
            if line.startswith("    "):
                continue
            for m in LINK.finditer(line):
                count += 1
                target = m.group(1).split("#")[0]
                where = f"{f.relative_to(ROOT)}:{lineno}: {m.group(1)}"
                if re.match(r"^[a-z]+:", m.group(1)) or target.startswith("/"):
                    bad.append(f"{where} leaves the repository")
                elif target:
                    p = (f.parent / target).resolve()
                    if ROOT not in p.parents and p != ROOT:
                        bad.append(f"{where} leaves the repository")
                    elif not p.exists():
                        bad.append(f"{where} names no file")
    assert count > 0, "no links found: the pattern is wrong"
    assert not bad, "\n".join(bad)


def test_the_readme_is_one_short_page():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    long = [f"line {i}: {len(l)} characters" for i, l in enumerate(lines, 1) if len(l) > 200]
    assert not long, "\n".join(long)


def tracked_files():
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist)
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def test_docs_stay_small():
    size = sum(p.stat().st_size for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert size < 2 * 1024 * 1024, f"docs/ holds {size / 2**20:.2f} MiB (under 2 MiB)"


def test_measurements_are_named_by_date_and_commit():
    # The word for a period of work, spelled so this file does not contain it; Python's
    # subprocess argument start_new_session is its one legitimate use.
    word = re.compile("ses" + "sion", re.I)
    found = []
    for p in tracked_files():
        if not p.is_file() or p.suffix in (".png", ".gz", ".tgz"):
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for lineno, line in enumerate(text.split("\n"), 1):
            if word.search(line.replace("start_new_session", "")):
                found.append(f"{p.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:20])
