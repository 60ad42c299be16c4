"""Every piece of code the README, bench/README.md and docs/ name exists, so a rename or a move cannot leave them
behind. The files are parsed with `ast`, never imported. What counts as naming code:

- a dotted name under a project package (`engines.kt.experts.methods.matrix_tokens`, `python -m bench.run`): its
  longest prefix that is a module file or package must exist, and the rest must be defined there, unless the code
  itself spells the whole name as a string it resolves (a rule file's class name in the alias table);
- a repository path (`engines/kt/families/deepseek_mla/runner.py`, `bench/results/<folder>/`, `kt_optimize_rules/DeepSeek-V3.yaml`):
  the file or folder must exist (not a pattern, `isolation-*/` or `{a,b}`, nor a path at a commit, `d1964e9:path`);
- a backticked name beside a Python file (`` `engines/kt/experts/methods.py`, `LLAMAFILE_IN_PLACE` ``, `` `name` in
  `file.py` ``, `` `file.py`'s `name` ``, `` `file.py: name` ``): the file, taken from the repository root or as
  the end of one path in it (`attention/mla.py`), must define or name it (a def, class, assignment, import or
  string constant, for settings keys);
- a backticked `module.Name` whose last part is capitalized, a class or a constant (`placement.operators.MLAAttention`,
  `expert_methods.LLAMAFILE_IN_PLACE`; not `client.models.retrieve`): one project module of that stem must define
  the rest; a snake_case stem that is neither a project module nor an installed package (`expert_cache`) is stale.
Results folders' READMEs are records of their commit and are not read here."""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engines", "bench", "evaluation", "tests")
TOP_DIRS = (*PACKAGES, "scripts", "configs", "kt_optimize_rules", "deploy", "docs")
FILE_SUFFIXES = ("py", "json", "jsonl", "yaml", "yml", "md", "txt", "log", "png", "csv", "gguf", "safetensors", "sh",
                 "patch", "sqlite3", "toml", "cfg", "ini", "so", "cpp", "h")
IDENT = r"[A-Za-z_]\w*"

DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.{IDENT})+)")
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*[\w/])")
PY = r"[\w./-]*\w\.py"
PATH_THEN_NAME = re.compile(rf"`?({PY})`?(?:'s|,|:)\s*`?({IDENT}(?:\.{IDENT})*)`")
NAME_IN_PATH = re.compile(rf"`({IDENT}(?:\.{IDENT})*)` in `({PY})`")
QUALIFIED = re.compile(rf"`({IDENT})\.({IDENT}(?:\.{IDENT})*)`")


def documents() -> list[Path]:
    return [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@functools.cache
def python_files() -> tuple[Path, ...]:
    return tuple(p for package in PACKAGES for p in (REPO / package).rglob("*.py") if ".venv" not in p.parts)


@functools.cache
def names_in(path: Path) -> frozenset[str]:
    """What a file defines or names: defs, classes, assigned names, attributes, imports, arguments, strings."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+", node.value):
            names.update(node.value.split("."))
    return frozenset(names)


def module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines(path: Path, dotted: str) -> bool:
    names = names_in(path)
    return all(part in names for part in dotted.split("."))


def is_file_name(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES


@functools.cache
def dotted_strings() -> frozenset[str]:
    """Dotted names the code resolves itself: string constants such as the alias table's rule-file class names."""
    code = [p for p in python_files() if p.relative_to(REPO).parts[0] != "tests"]
    return frozenset(node.value for p in code for node in ast.walk(ast.parse(p.read_text(), str(p)))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and re.fullmatch(rf"{IDENT}(?:\.{IDENT})+", node.value))


def dotted_problem(name: str) -> str | None:
    if is_file_name(name) or name in dotted_strings():
        return None  # bench.json: a file's name; a name the code resolves (a rule file's class)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        found = module_file(parts[:cut])
        if found:
            rest = ".".join(parts[cut:])
            if not rest or defines(found, rest):
                return None
            return f"{'.'.join(parts[:cut])} defines no {rest}"
    return "no such module"


def path_problem(text: str) -> str | None:
    path = text.rstrip("/.")
    if (REPO / path).exists():
        return None
    return "no such file or folder"


def py_files_for(path: str) -> list[Path]:
    if (REPO / path).is_file():
        return [REPO / path]
    return [p for p in python_files() if p.as_posix().endswith("/" + path.lstrip("./"))]


def symbol_problem(path: str, name: str) -> str | None:
    if is_file_name(name):
        return None  # `a.py`, `b.py`: a list of files
    files = py_files_for(path)
    if not files:
        return f"no file {path}"
    if any(defines(p, name) for p in files):
        return None
    return f"{path} does not define {name}"


@functools.cache
def module_stems() -> dict[str, tuple[Path, ...]]:
    stems: dict[str, list[Path]] = {}
    for p in python_files():
        stems.setdefault(p.parent.name if p.name == "__init__.py" else p.stem, []).append(p)
    return {k: tuple(v) for k, v in stems.items()}


def qualified_problem(stem: str, rest: str) -> str | None:
    if stem in PACKAGES or is_file_name(rest) or not rest.rsplit(".", 1)[-1][0].isupper():
        return None  # DOTTED's; a file (routing.py); an attribute (client.models.retrieve)
    if stem not in module_stems():
        if "_" in stem and importlib.util.find_spec(stem) is None:
            return "no such module"  # a module's name (expert_cache), not an installed package's (kt_kernel)
        return None  # not ours: torch.float32
    files = list(module_stems()[stem])
    head, _, tail = rest.partition(".")
    for p in files:  # `placement.operators.X`: a package's module
        sub = p.parent / head / "__init__.py" if p.name == "__init__.py" else None
        sub_py = p.parent / f"{head}.py" if p.name == "__init__.py" else None
        for s in (sub, sub_py):
            if s is not None and s.is_file() and (not tail or defines(s, tail)):
                return None
    if any(defines(p, rest) for p in files):
        return None
    return f"no module {stem} defines {rest}"


def problems(doc: Path) -> list[str]:
    text = doc.read_text()
    found: list[str] = []

    def note(what: str, problem: str | None) -> None:
        if problem:
            found.append(f"{doc.relative_to(REPO)}: {what}: {problem}")

    for m in DOTTED.finditer(text):
        note(m.group(1), dotted_problem(m.group(1)))
    for m in REPO_PATH.finditer(text):
        pattern = text.startswith(("*", "-*", "{", "<"), m.end())  # isolation-*/
        pinned = re.search(r"\b[0-9a-f]{7,40}:$", text[:m.start()])  # git show d1964e9:bench/results/...
        if not pattern and not pinned:
            note(m.group(1), path_problem(m.group(1)))
    for m in PATH_THEN_NAME.finditer(text):
        note(f"{m.group(1)}: {m.group(2)}", symbol_problem(m.group(1), m.group(2)))
    for m in NAME_IN_PATH.finditer(text):
        note(f"{m.group(1)} in {m.group(2)}", symbol_problem(m.group(2), m.group(1)))
    for m in QUALIFIED.finditer(text):
        note(f"{m.group(1)}.{m.group(2)}", qualified_problem(m.group(1), m.group(2)))
    return found


def test_every_module_file_and_name_the_docs_mention_exists():
    stale = [problem for doc in documents() for problem in problems(doc)]
    assert stale == [], "\n".join(stale)


def test_the_checker_catches_a_stale_name(tmp_path):
    assert dotted_problem("engines.kt.experts.methods.no_such_name")
    assert dotted_problem("engines.kt.expert_cache")
    assert symbol_problem("attention/mla.py", "NoSuchAttention")
    assert symbol_problem("engines/kt/no_such_file.py", "X")
    assert path_problem("engines/kt/no_such_folder/")
    assert qualified_problem("expert_cache", "ConvertedExperts")
    assert qualified_problem("kt_kernel", "KTMoEWrapper") is None
    assert dotted_problem("engines.base.Engine") is None
    assert dotted_problem("bench.json") is None
