"""The package's import graph: folders by floor, each importing only from the floors
below it (or its own), and no module importing itself back through others. Read from
the source with `ast`, lazy imports inside functions included."""

import ast
import os

import pytest
import support

PACKAGE = os.path.join(support.ROOT, "gpt_oss_train")

# Lowest first. A unit is a top-level module or a folder of gpt_oss_train.
FLOORS = (
    ("errors", "logs", "hardware"),
    ("sharding", "runtime"),
    ("architecture", "arrays", "hosts"),
    ("kernels",),
    ("config",),
    ("model",),
    ("io",),
    ("checkpoints",),
    ("inference",),
    ("training",),
    ("post_training",),
    ("aot",),
    ("train", "decode", "serve", "tools"),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _modules():
    """{dotted module name: path} of every module in the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), support.ROOT)[:-3]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                out[name] = os.path.join(folder, f)
    return out


def _imports(path: str, modules) -> set[str]:
    """The package modules a file imports (`from a import b` counts a.b if it is one)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("gpt_oss_train."):
                found.add(name)
    return found


def _unit(module: str) -> str:
    return module.split(".")[1]


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items() if m != "gpt_oss_train"}


def test_every_unit_has_a_floor(graph):
    assert {_unit(m) for m in graph} <= set(FLOOR), {_unit(m) for m in graph} - set(FLOOR)


def test_no_import_from_a_lower_floor_to_a_higher_one(graph):
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if d != "gpt_oss_train" and FLOOR[_unit(d)] > FLOOR[_unit(m)]
    )
    assert not upward, "\n".join(upward)


def test_inference_imports_neither_training_nor_decode(graph):
    """Inference (the engine, loading, scoring, adapters, the server) is usable without the
    training code or the decode command's front-ends above it."""
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _unit(m) == "inference"
        for d in deps
        if d != "gpt_oss_train" and _unit(d) in ("training", "decode")
    )
    assert not upward, "\n".join(upward)


def test_only_tools_import_aot(graph):
    """The ahead-of-time compile (aot/) is the library of tools/' commands alone: train,
    decode and serve (on the floor above it) never load it, nor does anything below."""
    importers = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _unit(m) not in ("aot", "tools")
        for d in deps
        if d != "gpt_oss_train" and _unit(d) == "aot"
    )
    assert not importers, "\n".join(importers)
    tools = {d for m, deps in graph.items() if _unit(m) == "tools" for d in deps}
    assert "gpt_oss_train.aot.check" in tools, sorted(tools)  # the edge is seen at all


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components over the module graph: none larger than 1."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_graph_is_read_at_all(graph):
    """The checks above would pass on an empty graph: it has the edges we know of."""
    assert "gpt_oss_train.kernels" in graph["gpt_oss_train.model.moe"]
    assert "gpt_oss_train.config" in graph["gpt_oss_train.model.lora"]
    assert FLOOR["config"] < FLOOR["model"] < FLOOR["io"]
