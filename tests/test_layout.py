"""The package's import graph follows the data flow (docs/layout.md): a package imports only packages of a
lower layer (helpers two stages share sit below both), and no module imports itself back through others. Every
import counts, those inside functions too."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_sao"

# lower layers first; packages in one layer do not import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("platform_layer", "config", "files"),
    ("distributed", "algo", "models", "bus"),  # helpers below the stages
    ("engines",),  # where generation runs: below everything that talks to an engine
    ("rollout", "learner", "weight_sync", "convert"),  # the stages
    ("run",),  # joins the stages on one machine
    ("launch",),  # places them on a cluster
    ("plan",),  # sizes a launch
    ("smoke",),  # entry points: the smoke check, the command line, python -m
    ("cli",),
    ("__main__",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The megatron_sao modules `path` imports (absolute and relative, anywhere in the file): `from pkg import name`
    counts as importing the module pkg.name where there is one, else pkg itself."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "megatron_sao"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == "megatron_sao":
                subs = {f"{target}.{a.name}" for a in node.names} & known
                found |= subs if len(subs) == len(node.names) else {target, *subs}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {m: {t for t in _imports(p, m, known) if t in files and t != m} for m, p in files.items()}


def _stage(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_package_has_a_layer() -> None:
    stages = {_stage(m) for m in _graph()} - {""}
    assert stages <= set(RANK), f"add {sorted(stages - set(RANK))} to LAYERS"


def _against(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if _stage(m) and _stage(t) and _stage(m) != _stage(t) and RANK[_stage(t)] >= RANK[_stage(m)]
    )


def test_imports_flow_down_the_layers() -> None:
    against = _against(_graph())
    assert not against, "imports against the data flow:\n" + "\n".join(against)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """An upward import, absolute or relative, inside a function or not, is read and reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from megatron_sao.rollout import worker\n\ndef f():\n    from ..run import learn\n")
    found = _imports(probe, "megatron_sao.engines.probe", {"megatron_sao.rollout.worker", "megatron_sao.run.learn"})
    assert found == {"megatron_sao.rollout.worker", "megatron_sao.run.learn"}
    assert _against({"megatron_sao.engines.probe": found}) == [
        "megatron_sao.engines.probe -> megatron_sao.rollout.worker",
        "megatron_sao.engines.probe -> megatron_sao.run.learn",
    ]


def test_the_layout_doc_names_every_package_and_command() -> None:
    from megatron_sao.cli import COMMANDS

    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    first, *rest = layout.split("python -m megatron_sao <command>:", 1)[1].split("\n")
    lines = [first, *itertools.takewhile(lambda line: line.startswith(" " * 20), rest)]  # its continuation lines
    listed = {c.strip() for c in " ".join(lines).split(",")}
    assert listed == set(COMMANDS), f"docs/layout.md lists {sorted(listed)}, the CLI has {sorted(COMMANDS)}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(p for p in packages if f"  {p}/ " not in layout)
    assert not missing, f"docs/layout.md does not show {missing}"


def test_the_stages_take_the_layout_instead_of_reading_megatron_globals() -> None:
    """learner/, weight_sync/ and convert/ get ranks, sizes and groups from the DistContext init_distributed
    returned; parallel_state is read in distributed/bootstrap.py (and by the model builders)."""
    readers = sorted(
        str(p.relative_to(PACKAGE.parent))
        for stage in ("learner", "weight_sync", "convert")
        for p in (PACKAGE / stage).rglob("*.py")
        if "parallel_state" in p.read_text()
    )
    assert not readers, f"read megatron's parallel_state; take the DistContext instead: {readers}"


RUN_DIR_NAMES = re.compile(
    r"(\S*/)?(metrics\.jsonl|trajectories\.jsonl|stale\.jsonl|STOP|rollout_metrics_\S*|checkpoints)"
)


def _spelled_names(path: Path) -> list[str]:
    """String constants of a module that name a run-directory file (docstrings left out: they may explain)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.name}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and RUN_DIR_NAMES.fullmatch(node.value)
    ]  # fmt: skip


def test_only_files_names_what_a_run_directory_holds() -> None:
    spelled = [s for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "files"
               for s in _spelled_names(p)]  # fmt: skip
    assert not spelled, f"name these in megatron_sao/files/ and import them: {spelled}"
    launch_to_run = [f"{m} -> {t}" for m, ts in _graph().items() if _stage(m) == "launch" for t in ts
                     if _stage(t) == "run"]  # fmt: skip
    assert not launch_to_run, f"launch/ places jobs and must not import run/: {launch_to_run}"


def test_the_run_directory_check_sees_a_spelled_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Writes metrics.jsonl."""\nPATH = "metrics.jsonl"\nOTHER = f"rollout_metrics_{1}.jsonl"\n')
    assert [s.split(" ", 1)[1] for s in _spelled_names(bad)] == ["'metrics.jsonl'", "'rollout_metrics_'"]


# ------------------------------------------------------------------ one layout object, one roles object (issue 50)

RANK_CALLS = ("current_context", "get_rank", "get_world_size")
"""Calls that re-read the layout from globals: outside distributed/ the layout is the DistContext a caller was handed
(or distributed.collectives' named questions: world_position, rank_in, size_of)."""


def _calls(source: str, names: tuple[str, ...]) -> list[int]:
    """Lines of calls to `names` (as `f(...)` or `x.f(...)`); comments and docstrings do not count."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in names:
                found.append(node.lineno)
    return found


def _attribute_reads(source: str, attr: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == attr]


def _outside(package: str) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != package)


def test_ranks_and_sizes_are_passed_not_read_from_globals() -> None:
    """No current_context() and no dist.get_rank() / get_world_size() outside distributed/."""
    found = [
        f"{p.relative_to(PACKAGE.parent)}:{line}"
        for p in _outside("distributed")
        for line in _calls(p.read_text(), RANK_CALLS)
    ]
    assert not found, "take the DistContext (or distributed.collectives) instead of reading ranks: " + ", ".join(found)


def test_one_module_decides_which_jobs_run() -> None:
    """`.value_on_separate_ranks` is read in the config field's own module and config/roles.py only; everything else
    asks cfg.jobs (config.roles.Jobs)."""
    readers = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if _attribute_reads(p.read_text(), "value_on_separate_ranks")
    )
    assert readers == ["megatron_sao/config/learner.py", "megatron_sao/config/roles.py"], (
        f"ask cfg.jobs (config/roles.py) instead of reading learner.value_on_separate_ranks: {readers}"
    )


def test_the_parallel_config_maps_to_megatron_in_one_place() -> None:
    """megatron's size names are spelled only by ParallelConfig.megatron_sizes (config/parallel.py)."""
    spelled = []
    for p in PACKAGE.rglob("*.py"):
        if p.relative_to(PACKAGE).as_posix() == "config/parallel.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            keys = [node.arg] if isinstance(node, ast.keyword) else []
            keys += [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []
            if any(k in ("tensor_model_parallel_size", "pipeline_model_parallel_size") for k in keys):
                spelled.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not spelled, f"use ParallelConfig.megatron_sizes(): {spelled}"


def test_the_planner_and_the_runtime_share_one_layout_record() -> None:
    from megatron_sao.config.parallel import ParallelConfig, ParallelSizes
    from megatron_sao.distributed.bootstrap import DistContext
    from megatron_sao.plan.memory import Layout

    assert issubclass(DistContext, ParallelSizes) and issubclass(Layout, ParallelSizes)
    parallel = ParallelConfig(tensor=2, pipeline=2, expert=2)
    planned = Layout.of(parallel, 8, num_layers=4)
    assert parallel.sizes(8) == ParallelSizes(**{k: getattr(planned, k) for k in ParallelSizes.__dataclass_fields__})
    assert (planned.dp, planned.edp, planned.stage_layers) == (2, 1, (2, 2))


def test_the_layout_checks_see_a_violation() -> None:
    """The checks above read calls and attribute reads, not comments or docstrings."""
    source = (
        '"""current_context() and dist.get_rank() in a docstring."""\n'
        "# dist.get_world_size() in a comment\n"
        "rank = dist.get_rank()\n"
        "ctx = current_context()\n"
        "inner = dist.get_world_size(group)\n"
        "if cfg.learner.value_on_separate_ranks:\n"
        "    pass\n"
    )
    assert _calls(source, RANK_CALLS) == [3, 4, 5]
    assert _attribute_reads(source, "value_on_separate_ranks") == [6]


def test_no_module_shadows_the_standard_library() -> None:
    """A script run from inside the package puts its folder first on sys.path: a module there named like one of the
    standard library's (`platform`, `queue`, ...) would shadow it."""
    import sys

    def name(p: Path) -> str:
        return p.stem if p.suffix == ".py" else p.name if p.is_dir() else ""

    shadowing = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*")
                       if name(p) in sys.stdlib_module_names)  # fmt: skip
    assert not shadowing, f"rename these: {shadowing}"
