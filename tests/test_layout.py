"""The package's layout holds: no import cycle in eaglepipe/, every script one call of eaglepipe.jobs, every rule's
script named by a function of that module, and the workflow independent of the developer tools in eaglepipe/tools/."""

import ast
import re
from pathlib import Path

from eaglepipe import jobs

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "eaglepipe"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """eaglepipe modules that `path` imports anywhere in it (function-level imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports(p, modules) for p in paths}
    # A parent package is imported before its modules: an edge from a module to its own package is no cycle.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert graph["eaglepipe.preflight"] >= {"eaglepipe.estimate"}  # the walk sees relative imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_every_script_is_one_call_of_its_job():
    """Each rule's script is one call, jobs.<script name>(snakemake); rules may share a script (train and
    train_variant run one job)."""
    rules = {}
    for smk in (REPO / "rules").glob("*.smk"):
        for rule, script in re.findall(r"^\s*rule (\w+):.*?script:\s*\"\.\./scripts/(\w+\.py)\"", smk.read_text(),
                                       re.S | re.M):
            rules.setdefault(script, set()).add(rule)
    scripts = sorted((REPO / "scripts").glob("*.py"))
    assert {s.name for s in scripts} == set(rules), "a script no rule runs, or a rule whose script is missing"
    for script in scripts:
        tree = ast.parse(script.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert len(calls) == 1, f"{script.name}: {len(calls)} calls, expected one (put the work in eaglepipe.jobs)"
        call = ast.unparse(calls[0])
        assert call == f"jobs.{script.stem}(snakemake)", f"{script.name} (rules {sorted(rules[script.name])}): {call}"
        assert callable(getattr(jobs, script.stem))


def workflow_modules(modules: set[str]) -> set[str]:
    """eaglepipe modules the workflow reaches: those rules/*.smk import, the jobs, and everything they import."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = {"eaglepipe.jobs"}
    for smk in (REPO / "rules").glob("*.smk"):
        found |= {m for m in re.findall(r"^import (eaglepipe[\w.]*)", smk.read_text(), re.M) if m in modules}
    todo = list(found)
    while todo:
        for dep in imports(paths[todo.pop()], modules) - found:
            found.add(dep)
            todo.append(dep)
    return found


def test_the_workflow_imports_nothing_from_the_developer_tools():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    reached = workflow_modules(modules)
    assert {"eaglepipe.jobs", "eaglepipe.preflight", "eaglepipe.estimate", "eaglepipe.train"} <= reached
    tools = sorted(m for m in reached if m.startswith("eaglepipe.tools"))
    assert not tools, f"the workflow imports developer tools {tools}: move what it needs into the core package"


def test_config_docs_are_generated_from_the_schema(tmp_path):
    """config/README.md's key tables are the schema's descriptions and defaults; an edit of the schema alone makes
    them stale, and the check says so."""
    import shutil

    from eaglepipe.tools import config_docs

    text = config_docs.README.read_text()
    assert config_docs.render(text) == text, "config/README.md is stale: run python -m eaglepipe.tools.config_docs"
    schema = tmp_path / "schema.yaml"
    shutil.copy(config_docs.SCHEMA, schema)
    schema.write_text(schema.read_text().replace("Short name used in reports.", "A new description.", 1))
    stale = config_docs.render(text, schema_path=schema)
    assert stale != text and "| `target.name` | `smollm2-135m` | A new description" in stale
    documented = set(re.findall(r"^\| `([\w.]+)` \|", text, re.M))
    assert {"engine.threads", "train.checkpoint_every", "prompts.synthesize.seed", "preflight.enabled"} <= documented
