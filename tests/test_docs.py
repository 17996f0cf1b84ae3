"""The documentation is tested: README.md and docs/*.md (conventions in docs/testing.md, "The doc tests").

- every ```toml fence parses and passes the launcher's config check at its world size (fence info
  `world_size=N`, default 1; `cuda`: checked as on a machine with a GPU; `parse-only`: keys, types and ranges
  only, for snippets that name your own files);
- every command of a ```bash fence runs and exits 0, unless it is marked `# not run: why` (or its fence is
  ```bash not-run); every command's `--section.key` flags, run or not, exist in the schema, and the scripts and
  modules it names exist;
- every option named in prose (`--section.key`, `section.key`) exists; relative links and their anchors resolve;
- docs/config-reference.md is what `python -m tessera.config --markdown` prints now;
- the README's first commands are the two that work on a fresh clone.
"""

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.config.manager import _leaves
from tessera.preflight import options as preflight_options, validate
from tessera.schema import JobConfig, markdown_reference, parse_args

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE = ROOT / "docs" / "config-reference.md"
OPTIONS = {key for key, _, _ in _leaves(JobConfig())}
PLACEHOLDER = "section.key"  # how docs/configuration.md writes any option
SECTIONS = {key.rsplit(".", i)[0] for key in OPTIONS for i in range(1, key.count(".") + 1)}
FILE_SUFFIXES = (".json", ".jsonl", ".toml", ".py", ".md", ".png", ".bin", ".idx", ".safetensors", ".pickle")
_FENCE = re.compile(r"^```(\S*)(.*)$")
_NOT_RUN = re.compile(r"^not run\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fences(path: Path):
    """(language, info words, body, line number of the opening fence) of every ``` fence."""
    lines, out, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append((m.group(1), m.group(2).split(), "\n".join(lines[i + 1:end]), i + 1))
            i = end
        i += 1
    return out


def _prose(path: Path) -> str:
    """The page without its fences (links and option names in code blocks are not prose)."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment) at the first # outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def _commands(body: str):
    """(command, comment) per shell command: continuation lines joined, comment-only lines skipped."""
    joined, out = "", []
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        command, comment = _split_comment(joined + line)
        joined = ""
        if command:
            out.append((command, comment))
    return out


TOML = [(path, info, body, line) for path in PAGES for lang, info, body, line in _fences(path) if lang == "toml"]
SHELL = [(path, "not-run" in info, command, comment, line) for path in PAGES
         for lang, info, body, line in _fences(path) if lang in ("bash", "sh", "shell")
         for command, comment in _commands(body)]
RUN = sorted({command for _, not_run, command, comment, _ in SHELL if not (not_run or _NOT_RUN.match(comment))})


@pytest.mark.parametrize("path, info, body, line", TOML, ids=[f"{_rel(p)}:{n}" for p, _, _, n in TOML])
def test_toml_snippets_parse_and_pass_the_config_check(path, info, body, line, tmp_path, monkeypatch):
    words = dict(w.partition("=")[::2] for w in info)
    unknown = set(words) - {"world_size", "cuda", "parse-only"}
    assert not unknown, f"{_rel(path)}:{line}: unknown fence words {unknown} (see docs/testing.md)"
    snippet = tmp_path / "snippet.toml"
    snippet.write_text(body)
    monkeypatch.chdir(tmp_path)  # relative dump folders land here, not in the checkout
    if "cuda" in words:  # float8 and MX need a GPU; the check asks the function the validator calls
        monkeypatch.setattr(preflight_options, "has_cuda", lambda: True)
    cfg = parse_args(["--job.config_file", str(snippet)])
    if "parse-only" not in words:
        validate(cfg, int(words.get("world_size") or 1))


def _program(argv: list[str]) -> list[str]:
    """The command without its leading VAR=value assignments."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    return argv


def _flags_and_names(command: str) -> tuple[list[str], list[str]]:
    """(unknown --section.key flags, scripts or modules that do not exist) of one shell command."""
    argv = _program(shlex.split(command))
    flags = [a[2:].partition("=")[0] for a in argv if re.match(r"^--[a-z_]+\.", a)]
    missing = [f"--{f}" for f in flags if f not in OPTIONS | {PLACEHOLDER}]
    if argv and "/" in argv[0] and not argv[0].startswith(".venv/"):
        if not os.access(ROOT / argv[0], os.X_OK):
            missing.append(f"{argv[0]} (not an executable in the checkout)")
    for i, arg in enumerate(argv[:-1]):
        # tessera's modules are looked up whole; others by their package (finding torch's submodules imports torch)
        if arg == "-m" and importlib.util.find_spec(argv[i + 1] if argv[i + 1].startswith("tessera.")
                                                    else argv[i + 1].split(".")[0]) is None:
            missing.append(f"module {argv[i + 1]}")
        if arg.endswith("python") and argv[i + 1].endswith(".py") and not (ROOT / argv[i + 1]).is_file():
            missing.append(argv[i + 1])
    return flags, missing


@pytest.mark.parametrize("path, not_run, command, comment, line", SHELL,
                         ids=[f"{_rel(p)}:{n}:{c[:40]}" for p, _, c, _, n in SHELL])
def test_every_shell_command_names_existing_options_scripts_and_modules(path, not_run, command, comment, line):
    _, missing = _flags_and_names(command)
    assert not missing, f"{_rel(path)}:{line}: `{command}` names {', '.join(missing)}"


@pytest.mark.parametrize("command", RUN, ids=[c[:60] for c in RUN])
def test_the_cheap_shell_commands_run(command):
    argv = _program(shlex.split(command))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if argv[0] in ("python", "python3", ".venv/bin/python"):
        argv[0] = sys.executable
    elif argv[0].endswith(".sh"):  # the launcher sources scripts/env.sh: point it at this interpreter's venv
        if not (Path(sys.prefix) / ".tessera-deps").is_file():
            pytest.skip("not run from a Tessera venv (./run_tests.sh makes one)")
        env["TESSERA_VENV"] = sys.prefix
        argv = ["bash", *argv]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}: {proc.stderr[-2000:]}"


def _spans(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(path))


@pytest.mark.parametrize("path", [p for p in PAGES if p != REFERENCE], ids=_rel)
def test_options_named_in_prose_exist(path):
    """`--section.key ...`, `section.key`, `section.key = value`: a renamed option shows up here."""
    bad = []
    for span in _spans(path):
        for m in re.finditer(r"(?:^|\s)--([a-z_]+(?:\.[a-z0-9_]+)+)", span):
            if m.group(1) not in OPTIONS | {PLACEHOLDER}:
                bad.append(span)
        section = re.match(r"^\[([a-z_.]+)\]$", span)  # `[checkpoint]`: a TOML section
        if section and section.group(1) not in SECTIONS | OPTIONS:  # (a table-valued option is a TOML table too)
            bad.append(span)
        m = re.match(r"^([a-z_]+(?:\.[a-z0-9_]+)+)(?:$|\s|=)", span)
        if m and m.group(1).split(".")[0] in SECTIONS and not m.group(1).endswith(FILE_SUFFIXES):
            if m.group(1) not in OPTIONS | SECTIONS:
                bad.append(span)
    assert not bad, f"{_rel(path)} names options the schema does not have: {bad}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(path), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        seen[slug if not seen[slug] else f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("path", PAGES, ids=_rel)
def test_relative_links_and_anchors_resolve(path):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", _prose(path))):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading with that anchor in {dest.name})")
    assert not bad, f"{_rel(path)}: {bad}"


def test_every_guide_is_listed_in_the_docs_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


def test_the_config_reference_is_up_to_date():
    assert REFERENCE.read_text(encoding="utf-8") == markdown_reference() + "\n", (
        "docs/config-reference.md is stale: run `python -m tessera.config --markdown > docs/config-reference.md`")


def test_the_reference_lists_every_option_once():
    text = REFERENCE.read_text(encoding="utf-8")
    for section in (f.name for f in dataclasses.fields(JobConfig)):
        assert re.search(rf"^## \[{section}(\.[a-z.]+)?\]$", text, flags=re.M), section
    assert len(re.findall(r"^\| `[a-z0-9_]+` \|", text, flags=re.M)) == len(OPTIONS)


@pytest.mark.ranks
def test_the_readme_starts_with_the_two_commands_that_work_on_a_fresh_clone(tmp_path):
    lang, _, body, _ = _fences(ROOT / "README.md")[0]
    assert lang == "bash" and [c for c, _ in _commands(body)] == ["./run_train.sh", "./run_tests.sh"]
    for script in ("run_train.sh", "run_tests.sh", "scripts/env.sh", "configs/llama3_debug.toml"):
        assert (ROOT / script).is_file(), script
        if (ROOT / ".git").exists():  # committed, not just present here
            subprocess.run(["git", "ls-files", "--error-unmatch", script], cwd=ROOT, check=True, capture_output=True)
    assert os.access(ROOT / "run_train.sh", os.X_OK) and os.access(ROOT / "run_tests.sh", os.X_OK)
    # what ./run_train.sh checks before it starts its 2 CPU processes
    validate(parse_args(["--job.config_file", str(ROOT / "configs/llama3_debug.toml"),
                         "--job.dump_folder", str(tmp_path)]), 2)
