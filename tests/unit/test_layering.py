"""The package's import layering: no module imports one of a higher layer, and no import circle; and
the environment is read in one module (envs.py).

Read from the source with `ast`, so function-level imports count as much as top-level ones (an import
inside a function still ties the two modules together). Imports under `if TYPE_CHECKING:` count for circles
(a type-only circle still leaves two modules that cannot be understood or type-checked apart), not for
layers: an annotation may name a higher layer's data without running its code (layers/moe.py's MoEConfig
from models/arch.py, multimodal/media.py's ServerConfig from config.py). docs/architecture.md ("Layers")
describes the order.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "tokenmill"

# lowest first; a module's layer is that of the longest prefix listed
LAYERS = [
    ["envs", "cpu_features", "named_objects"],  # the environment, the CPU, objects named module:Attribute
    ["core", "sampling_params", "request", "outputs", "kv_events_config", "kv_transfer_config", "version",
     "lora.request", "lora.adapter_config", "structured.spec", "structured.json_text",
     "multimodal"],  # plain data, torch-free core, images read and checked (Pillow, no torch)
    ["config", "config_checks", "speculative_json", "cpu_threads"],
    ["kernels", "parallel"],
    ["attention", "layers", "sampling", "structured", "lora"],
    ["models", "multimodal.processing"],  # processing: prompts with images, as the model's image side lays them
    ["worker", "support_table"],  # support_table: README's table, from the checks up to the worker's
    ["spec_decode", "pooling"],
    ["executor"],
    ["engine", "pooling.engine"],
    ["server", "balancer", "bench"],
    ["cli", "__main__", ""],  # "": the package's own __init__
]
RANK = {f"{PACKAGE}.{name}" if name else PACKAGE: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules that `name` imports anywhere in its source; under TYPE_CHECKING only if
    `type_checking`."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def nearest(target: str) -> str:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                submodules = [f"{base}.{alias.name}" for alias in child.names if f"{base}.{alias.name}" in known]
                targets = submodules if len(submodules) == len(child.names) else [base, *submodules]
            for target in targets:
                module = nearest(target)
                if module.startswith(PACKAGE) and module != name:
                    found.add(module)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (see `imported`)."""
    known = modules()
    return {name: imported(name, path, known, type_checking) for name, path in known.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in RANK:
            return RANK[".".join(parts[:end])]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer_and_imports_none_above_it():
    edges = graph()
    upward = sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                    for a, targets in edges.items() for b in targets if layer(b) > layer(a))
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    edges = graph(type_checking=True)
    found = cycles(edges)
    detail = ["  ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in found]
    assert not found, "\n".join(detail)


def test_only_envs_reads_the_environment():
    readers = []
    for name, path in modules().items():
        if name == f"{PACKAGE}.envs":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                    and isinstance(node.value, ast.Name) and node.value.id in ("os", "_os"):
                readers.append(f"{name}:{node.lineno}")
    assert not readers, f"environment variables are read outside envs.py: {readers}"


def test_the_checker_sees_function_level_imports_and_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    source = graph()
    # tokenmill.kernels.build reads tokenmill.envs at the top level: a known edge the walk must find
    assert "tokenmill.envs" in source["tokenmill.kernels.build"]


def test_the_circle_check_counts_type_checking_imports(tmp_path):
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from tokenmill.b import B\n")
    (tmp_path / "b.py").write_text("import tokenmill.a\n")
    known = {f"{PACKAGE}.a": tmp_path / "a.py", f"{PACKAGE}.b": tmp_path / "b.py"}
    for type_checking, expected in ((False, []), (True, [[f"{PACKAGE}.a", f"{PACKAGE}.b"]])):
        edges = {name: imported(name, path, known, type_checking) for name, path in known.items()}
        assert cycles(edges) == expected
