"""The layout: the host helpers run on a host's bare python3, and the worker package has no import cycle."""

import ast
import sys

from tests.helpers import REPO

# Run before any environment exists (python3 -m train.cluster, python3 -m train.hostenv)
HOST_HELPERS = ("train/cluster/__main__.py", "train/cluster/jobs.py", "train/hostenv.py")
# What the host helpers may import (the packages' own __init__ modules too: importing train.cluster.jobs runs them)
STDLIB_ONLY = ("train/__init__.py", "train/cluster/__init__.py", "train/files/__init__.py", "train/files/rundir.py",
               "train/files/writable.py", "train/cluster/cuda_driver.py", "train/cluster/jobs.py",
               "train/cluster/hostlist.py")


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # `from train import checkpoint` too
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_the_host_helpers_import_only_the_standard_library():
    ours = {path.removesuffix(".py").replace("/", ".") for path in STDLIB_ONLY}
    for helper in (*HOST_HELPERS, *STDLIB_ONLY):
        third_party = {n for n in _imports(REPO / helper) if n.split(".")[0] not in sys.stdlib_module_names
                       and n not in ours and n.rsplit(".", 1)[0] not in ours}  # a name from a stdlib-only module
        assert not third_party, f"{helper} imports {sorted(third_party)}: it must run on the host's bare python3"


def test_the_worker_package_has_no_import_cycle():
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (REPO / "train").rglob("*.py")}
    edges = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in edges[start])

    cycles = sorted(m for m in modules if reaches(m, m))
    assert not cycles, f"modules in an import cycle: {cycles}"


def _named(path) -> set[str]:
    """The modules of the package a module names in a string (for importlib, a fork server's preload, a pickled job):
    a dependency as much as an import."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("train.")}


def _graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of it that it imports, or names for importlib."""
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (REPO / "train").rglob("*.py")}
    return {m: {n for n in _imports(p) | _named(p) if n in modules and n != m} for m, p in modules.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_evaluation_sits_below_the_trainer_and_its_launcher():
    """python -m train.evaluate (and export) import neither the trainer nor its launcher; the trainer imports the
    evaluation, and the command line's workers, the cluster jobs and the run files sit below both."""
    graph = _graph()
    for command in ("train.evaluate", "train.export"):
        assert not {"train.run.trainer", "train.launch", "train.run.plan"} & _reach(graph, command), command
    assert "train.run.validate" in graph["train.run.trainer"]
    assert "train.run.trainer" not in _reach(graph, "train.cluster.spawn") | _reach(graph, "train.cluster.jobs")


def test_no_module_of_the_package_is_long_nor_any_function():
    """One job per module, each read in one sitting: at most 350 lines; a function fits on a screen: at most 60."""
    for path in (REPO / "train").rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 350, path
        long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(text))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
        assert not long, (path, long)


def _takes_the_config(node) -> bool:
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return any(a.arg == "cfg" or (a.annotation is not None and ast.unparse(a.annotation).split(" |")[0].strip("'\"")
                                  .rsplit(".", 1)[-1] == "Config") for a in named)


def test_at_most_25_functions_take_the_whole_config():
    """A component takes the section it reads (or a small object made once); the whole Config goes only to what
    combines it (docs/development.md names them)."""
    takers = [f"{path.relative_to(REPO)}:{node.name}" for path in (REPO / "train").rglob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_the_config(node)]
    assert 20 <= len(takers) <= 25, sorted(takers)  # fewer than 20: the counting missed the entry points


def test_no_line_of_the_makefile_is_long():
    """The shell stays thin and readable: every Makefile line within the code's 120 characters."""
    long = [n for n, line in enumerate((REPO / "Makefile").read_text().splitlines(), 1) if len(line) > 120]
    assert not long, f"Makefile lines over 120 characters: {long}"


def test_the_data_package_holds_one_job_per_module_none_long():
    for path in (REPO / "train" / "data").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 300, path


def test_no_code_outside_the_tests_edits_sys_path():
    """train/ is a package that imports as installed; the host helpers run as python3 -m train.<name> from the
    checkout."""
    for path in [*REPO.glob("train/**/*.py"), *REPO.glob("docker/*.py"), *REPO.glob("slurm/*")]:
        text = path.read_text(errors="replace")
        assert "sys.path.insert" not in text and "sys.path.append" not in text, path


# The packages from the ground up. A module imports modules of its own package and of the packages below it, never
# of one above; the entry points (train/*.py: the commands users run) and make bench's train/bench/ import any.
LAYERS = ("base", "files", "config", "cluster", "loading", "data", "components", "report", "tasks", "run", "pack")


def test_each_package_imports_only_its_own_and_the_packages_below_it():
    def layer(module: str) -> int:
        package = module.split(".")[1] if module.count(".") else ""
        return LAYERS.index(package) if package in LAYERS else len(LAYERS)

    graph = _graph()
    upward = sorted(f"{m} -> {n}" for m, imported in graph.items() for n in imported if layer(n) > layer(m))
    assert not upward, upward
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2 and m.split(".")[1] in LAYERS} == set(LAYERS)


def test_no_module_name_is_another_with_a_suffix():
    """A newcomer finds a file by its name: no checkpoint beside a checkpointer, no worker beside workers."""
    names = sorted({p.stem for p in (REPO / "train").rglob("*.py") if not p.stem.startswith("__")})
    extended = [(a, b) for a in names for b in names if a != b and b.startswith(a)]
    assert not extended, extended


def test_every_path_of_the_package_the_docs_name_exists():
    """README and docs name files by their paths (train/run/trainer.py): each must be there, so a move of a module
    cannot leave a doc pointing nowhere."""
    import re

    named = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        named |= {(doc.name, m) for m in re.findall(r"\btrain/(?:[\w-]+/)*[\w-]+\.(?:py|toml|sh|json|log)\b", text)}
        named |= {(doc.name, m) for m in re.findall(r"\btrain/(?:[\w-]+/)+(?=[\s`)|,.:;])", text)}
    assert len(named) > 40  # the map of docs/development.md alone names more
    missing = sorted(f"{doc}: {path}" for doc, path in named if not (REPO / path).exists())
    assert not missing, missing
