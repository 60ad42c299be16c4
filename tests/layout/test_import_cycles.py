"""No module of server/, engines/ or evaluation/ imports itself through others: the layers are a graph without
cycles, so every module can be read (and imported) after the ones it uses. The graph is grimp's, the one
import-linter checks the contracts on (.importlinter), with function-local imports in it; imports under
`if TYPE_CHECKING:` are left out, since they never run (annotations only)."""
from __future__ import annotations

import configparser
import pkgutil
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engines", "evaluation")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    cycles = _cycles(graph)
    described = ["; ".join(f"{m} -> {', '.join(sorted(graph.find_modules_directly_imported_by(m) & set(c)))}"
                           for m in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_the_kt_core_contract_names_every_core_module():
    """The contract that keeps the ktransformers core from importing a family lists the core's modules one by
    one (import-linter has no 'all but'); a module added to engines/kt/ must join that list."""
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    listed = set(config["importlinter:contract:kt-core-knows-no-family"]["source_modules"].split())
    core = {f"engines.kt.{m.name}" for m in pkgutil.iter_modules([str(REPO / "engines" / "kt")])} - {"engines.kt.families"}
    assert listed == core
