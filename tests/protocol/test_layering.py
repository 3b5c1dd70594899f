"""The layering of appliance/ (docs/ARCHITECTURE.md): no import cycles between its modules, and imports point
one way: cli -> server -> protocol, engine; engine -> native; native/ (the floor: plain arrays and specs in,
arrays out) imports nothing above it; protocol/ (sans-I/O) nothing of the server or the engine but the
sampling parameters it parses into (engine/sampling.py, the generation contract); only the CLI imports the
server application (server/app.py). All read the source's import statements (ast), so a lazy import inside a
function, or one only for type checking, counts as well."""
import ast
import os

import appliance

ROOT = os.path.dirname(appliance.__file__)


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The appliance modules `name` imports (`from .x import y` counts y when y is a module, else x)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def test_the_graph_is_read():
    g = graph()
    assert "appliance.engine.load.hf" in g["appliance.engine.load"] or "appliance.engine.load" in g["appliance.engine.load.hf"]
    assert "appliance.native.kernels" in g["appliance.engine.quant_weights"]


def test_no_import_cycles():
    # a package's __init__ importing its own submodule lazily (load -> load.hf -> load) is the dispatch, not a
    # cycle between concepts: edges from a submodule to its own package are left out
    g = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph().items()}
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_native_imports_nothing_from_engine():
    g = graph()
    bad = {n: sorted(d for d in deps if d.startswith("appliance.engine")) for n, deps in g.items()
           if n.startswith("appliance.native")}
    assert not any(bad.values()), bad


def test_only_the_cli_imports_the_server_application():
    """The API modules (server/openai.py, ollama.py, responses.py) reach the rest of the server through the
    Preparer and generation.run_ticket, never back through server/app.py."""
    g = graph()
    apis = {"appliance.server.openai", "appliance.server.ollama", "appliance.server.responses"}
    assert apis <= g["appliance.server.app"]
    assert sorted(n for n, deps in g.items() if "appliance.server.app" in deps) == ["appliance.cli"]


# Each layer (a package of appliance/, or a top-level module) and the layers it may import.
LAYERS = {
    "server": {"protocol", "engine", "h11_server", "web", "version"},
    "protocol": {"engine.sampling"},  # SamplingParams: what a request's sampling fields parse into
    "engine": {"native"},
    "native": set(),
    "web": {"resources"},
    "h11_server": {"protocol", "native.busy_responder"},  # the socket layer's GIL-free loading answers
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "appliance"


def allowed(src: str, dst: str) -> bool:
    lsrc, ldst = layer_of(src), layer_of(dst)
    if lsrc == ldst or ldst == "appliance" or lsrc not in LAYERS:
        return True
    rest = dst.split(".", 1)[1]
    return any(rest == a or rest.startswith(a + ".") for a in LAYERS[lsrc])


def violations(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{n} -> {d}" for n, deps in g.items() for d in deps if not allowed(n, d))


def test_imports_point_one_way():
    assert violations(graph()) == []


def test_the_order_check_finds_what_breaks_it():
    g = {"appliance.native.kernels": {"appliance.engine.qwen3", "appliance.native.qtypes"},
         "appliance.engine.qwen3": {"appliance.native.ops_numpy"},
         "appliance.protocol.requests": {"appliance.engine.sampling", "appliance.engine.generate"},
         "appliance.engine.generate": {"appliance.server.worker"},
         "appliance.server.app": {"appliance.protocol.sse", "appliance.engine.load", "appliance.cli"}}
    assert violations(g) == ["appliance.engine.generate -> appliance.server.worker",
                             "appliance.native.kernels -> appliance.engine.qwen3",
                             "appliance.protocol.requests -> appliance.engine.generate",
                             "appliance.server.app -> appliance.cli"]
