"""The layer rules of docs/architecture.md, read from the package's import statements (its AST; nothing is
imported): a module imports its own layer or lower ones, and a few edges the layer order alone would allow are
named and refused here too (algo stays pure, models import no engines, config knows no environments, the sandbox
knows nothing of fleetrl, Ray lives in cluster/)."""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fleetrl"

# docs/architecture.md's layer list, bottom up; a folder or top-level module of one entry imports its own entry or
# lower ones ("then" in the doc is one entry per name).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("algo", "sandbox", "batch", "cachedir", "errors", "heartbeat", "netif", "userfile"),
    ("config",),
    ("data",),
    ("models", "engines"),
    ("rewards", "envs"),
    ("workers",),
    ("cluster",),
    ("tracking",),
    ("checkpoint",),
    ("trainer",),
    ("sweep", "report"),
    ("cli",),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
ENTRY_POINTS = ("__init__", "__main__")  # the package's own modules, above every layer


@dataclass(frozen=True)
class Import:
    path: str        # the importing file, relative to fleetrl/ ("config/checks.py")
    target: str      # the imported module ("fleetrl.envs.base", "ray.util")
    line: int
    module_level: bool  # runs when the file is imported (not inside a function)

    @property
    def layer(self) -> str:
        return self.path.split("/")[0].removesuffix(".py")

    @property
    def target_layer(self) -> str | None:
        parts = self.target.split(".")
        return parts[1] if parts[0] == "fleetrl" and len(parts) > 1 else None

    def __str__(self) -> str:
        return f"fleetrl/{self.path}:{self.line} imports {self.target}"


class _Imports(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path, self.depth, self.found = path, 0, []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [Import(self.path, a.name, node.lineno, self.depth == 0) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        assert node.level == 0, f"fleetrl/{self.path}:{node.lineno}: a relative import; the package uses absolute ones"
        # `from fleetrl import heartbeat` imports the module fleetrl.heartbeat.
        targets = [f"fleetrl.{a.name}" for a in node.names] if node.module == "fleetrl" else [node.module]
        self.found += [Import(self.path, t, node.lineno, self.depth == 0) for t in targets]


def imports() -> list[Import]:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        path = file.relative_to(PACKAGE).as_posix()
        visitor = _Imports(path)
        visitor.visit(ast.parse(file.read_text(encoding="utf-8"), filename=str(file)))
        found += visitor.found
    return found


ALL = imports()


def _from(layer: str) -> list[Import]:
    return [i for i in ALL if i.layer == layer]


def test_the_graph_sees_the_edges_it_checks():
    # A parser that found nothing would pass every rule below.
    edges = {(i.path, i.target) for i in ALL}
    assert ("rewards/code.py", "fleetrl.sandbox") in edges and ("cluster/group.py", "fleetrl.heartbeat") in edges
    assert ("envs/check.py", "fleetrl.config.load") in edges


def test_every_folder_and_top_level_module_has_a_layer():
    names = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    unplaced = sorted(names - set(RANK) - set(ENTRY_POINTS))
    assert not unplaced, f"{unplaced}: add each to docs/architecture.md's layer list and to LAYERS here"


def test_no_module_imports_a_higher_layer():
    upward = [f"{i} ({i.layer} is below {i.target_layer})" for i in ALL
              if i.target_layer in RANK and i.layer in RANK and RANK[i.target_layer] > RANK[i.layer]]
    assert not upward, "\n".join(upward)


def test_algo_is_pure_torch():
    bad = [str(i) for i in _from("algo")
           if i.target.split(".")[0] in ("ray", "transformers") or (i.target_layer not in (None, "algo"))]
    assert not bad, "\n".join(bad)


def test_models_import_nothing_of_engines():
    # models/ and engines/ share a layer, but the tie runs one way: a decoder family is defined once in models/
    # (family.py), which the fast engine and the native forward both read (issue 37, "a family is defined once").
    bad = [str(i) for i in _from("models") if i.target_layer == "engines"]
    assert not bad, "\n".join(bad)


def test_config_knows_no_environments_rewards_or_runtime():
    bad = [str(i) for i in _from("config")
           if i.target_layer in ("envs", "rewards", "cluster", "workers", "trainer")]
    assert not bad, "\n".join(bad)


def test_the_sandbox_imports_nothing_of_fleetrl_and_its_bootstrap_only_the_standard_library():
    bad = [str(i) for i in _from("sandbox") if i.target_layer not in (None, "sandbox")]
    # _boot.py runs under `python -I` in the sandboxed process, where fleetrl and site-packages are not importable.
    bad += [str(i) for i in _from("sandbox")
            if i.path == "sandbox/_boot.py" and i.target.split(".")[0] not in sys.stdlib_module_names]
    assert not bad, "\n".join(bad)


def test_only_cluster_imports_ray_at_module_level():
    ray = [i for i in ALL if i.target.split(".")[0] == "ray"]
    assert any(i.layer == "cluster" and i.module_level for i in ray)
    at_import = [str(i) for i in ray if i.module_level and i.layer != "cluster"]
    assert not at_import, "\n".join(at_import)
    # Inside a function, only trainer/run.py (it shuts down a Ray it started itself).
    lazily = [str(i) for i in ray if i.layer != "cluster" and i.path != "trainer/run.py"]
    assert not lazily, "\n".join(lazily)
