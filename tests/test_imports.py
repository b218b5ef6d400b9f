"""Imports point one way: kernels/ <- concept files <- model.py <- train.py <- experiments/, bench.py.

The graph is read from the source (every `import`, also the ones inside functions), not by importing,
so a lazy import that closes a circle counts as much as one at the top of a file.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONCEPTS = {"muonclip", "kda", "attnres", "vision", "swarm"}
TOP = {"train", "runs", "sample", "bench"}   # nothing below these imports them


def local_modules() -> dict:
    """module name -> path, for the top-level files, kernels/ and experiments/."""
    mods = {p.stem: p for p in ROOT.glob("*.py")}
    mods.update({f"kernels.{p.stem}": p for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__"})
    mods.update({f"experiments.{p.stem}": p for p in (ROOT / "experiments").glob("*.py")})
    return mods


def imports_of(name: str, path: pathlib.Path, mods: dict) -> set:
    """The local modules `name` imports. An experiment's bare `import x` finds experiments/x.py first
    (the script's folder leads sys.path), then the top level."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            candidates = ([f"experiments.{t}"] if name.startswith("experiments.") else []) + [t]
            hit = next((c for c in candidates if c in mods and c != name), None)
            if hit:
                found.add(hit)
    return found


def import_graph() -> dict:
    mods = local_modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycle(graph: dict) -> list | None:
    """One import circle as [a, b, ..., a], or None."""
    state = {}                                    # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_point_one_way():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("kernels."):
            assert not deps - {d for d in deps if d.startswith("kernels.")}, f"{name} imports {deps}"
        if not name.startswith("experiments.") and name not in TOP:
            bad = {d for d in deps if d in TOP or d.startswith("experiments.")}
            assert not bad, f"{name} imports {sorted(bad)}: only experiments and the scripts on top may"
        if name in CONCEPTS - {"swarm"}:          # swarm.py may borrow model.GPT as its orchestrator
            assert "model" not in deps, f"{name} imports model.py"


def test_the_cycle_finder_finds_one():
    # the check above can fail: a made-up circle is found, with its path
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "kernels.kda" in graph["kda"] and "kda" in graph["model"] and "model" in graph["train"]
