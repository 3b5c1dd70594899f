"""Walking a JSON schema as a schema: its sub-schemas with their request paths and nesting levels, its limits,
and the parts whose first grammar steps must run before the request is admitted.

Policies:
- Levels count nested schemas, not JSON containers: a property's schema, an array's `items`, an `anyOf`
  alternative is one level below the schema holding it; the keyword containers (`properties`, the `anyOf`
  list, `$defs`) add nothing, so 32 levels are 32 nested objects. A value that is data (`enum`, `const`,
  `default`, `examples`, unknown keywords) is held to as many levels of its own; both keep the raw nesting
  llguidance's JSON reader sees (at most 128) inside what it takes.
- First steps (probe points): what llguidance refuses only once it runs (its Earley rows past
  max_items_in_row, a regex whose lexer runs out of fuel, a `$ref` loop that allows no value) shows where a
  part starts, so each risky part is compiled on its own and stepped into before admission, deepest first,
  so the error names the smallest part: a wide object or `anyOf` (>= WIDE properties / alternatives that can
  start at one point), a string `pattern`, `patternProperties` / `propertyNames` (key regexes), a `$defs`
  entry on a `$ref` cycle, then the whole schema. A part that refers to anything but the root's `$defs` /
  `definitions` (or declares `$id` / `$anchor`) cannot be compiled alone and is left to the whole schema's
  probe. At most MAX_PROBES parts (the whole schema always).
"""
from __future__ import annotations

from typing import Any, Iterator

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else", "contentSchema")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
DEF_MAPS = ("$defs", "definitions")
WIDE = 64
MAX_PROBES = 48


def holds_schemas(key: str, value: Any) -> bool:
    """Whether a schema's `key: value` holds schemas (else it is data: enum, const, default, ...)."""
    return ((key in SCHEMA_MAPS and isinstance(value, dict)) or (key in SCHEMA_LISTS and isinstance(value, list))
            or (key in SCHEMA_ONE and isinstance(value, (dict, bool))))


def sub_schemas(node: dict) -> Iterator[tuple[str, Any]]:
    """(path suffix, sub-schema) of each schema directly inside `node` (a schema object)."""
    for key, value in node.items():
        if not holds_schemas(key, value):
            continue
        if key in SCHEMA_MAPS:
            for name, sub in value.items():
                yield f".{key}.{name}", sub
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                yield f".{key}[{i}]", sub
        else:
            yield f".{key}", value


def walk(schema: Any, path: str) -> Iterator[tuple[Any, str, int]]:
    """(schema, path, level) of the schema and every schema nested in it (root: level 0), depth first."""
    stack = [(schema, path, 0)]
    while stack:
        node, p, level = stack.pop()
        yield node, p, level
        if isinstance(node, dict):
            subs = [(sub, p + suffix, level + 1) for suffix, sub in sub_schemas(node) if isinstance(sub, dict)]
            stack.extend(reversed(subs))


def data_depth(value: Any) -> int:
    """How many JSON containers deep a data value is (a scalar: 0, [1]: 1, [[1]]: 2)."""
    depth, frontier = 0, [value] if isinstance(value, (dict, list)) else []
    while frontier:
        depth += 1
        frontier = [v for c in frontier for v in (c.values() if isinstance(c, dict) else c)
                    if isinstance(v, (dict, list))]
    return depth


def local_refs(node: Any) -> Iterator[str]:
    """Every `$ref` string anywhere inside node (schemas and data alike: a conservative view)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def _def_target(ref: str) -> tuple[str, str] | None:
    """("$defs" | "definitions", name) for a ref to a root definition, else None."""
    for kind in DEF_MAPS:
        prefix = f"#/{kind}/"
        if ref.startswith(prefix) and "/" not in ref[len(prefix):]:
            return kind, ref[len(prefix):].replace("~1", "/").replace("~0", "~")
    return None


def _standalone(node: dict, root: dict) -> dict | None:
    """node as a schema of its own (the root's definitions attached), or None when it refers elsewhere."""
    refs = set(local_refs(node))
    if any(_def_target(r) is None for r in refs) or _declares_ids(node):
        return None
    if not refs:
        return node
    out = dict(node)
    for kind in DEF_MAPS:
        if isinstance(root.get(kind), dict):
            out[kind] = root[kind]
    return out


def _declares_ids(node: Any) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if any(k in n for k in ("$id", "$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "id")
                   if isinstance(n.get(k), str)):
                return True
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return False


def _resolve(node: Any, root: dict) -> Any:
    target = _def_target(node["$ref"]) if isinstance(node, dict) and isinstance(node.get("$ref"), str) else None
    if target is not None and isinstance(root.get(target[0]), dict):
        return root[target[0]].get(target[1], node)
    return node


def width(node: dict, root: dict) -> int:
    """How many properties / alternatives can start at one point of `node` (one level of root $refs followed)."""
    def props(n: Any) -> int:
        n = _resolve(n, root)
        return len(n["properties"]) if isinstance(n, dict) and isinstance(n.get("properties"), dict) else 0

    w = props(node)
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            w += sum(1 + props(alt) for alt in node[key])
    if isinstance(node.get("allOf"), list):
        w += sum(props(part) for part in node["allOf"])
    return w


def cyclic_defs(root: dict) -> set[tuple[str, str]]:
    """The root definitions that reach themselves through `$ref`s."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for kind in DEF_MAPS:
        if isinstance(root.get(kind), dict):
            for name, sub in root[kind].items():
                edges[(kind, name)] = {t for r in local_refs(sub) if (t := _def_target(r)) is not None}
    on_cycle = set()
    for start in edges:
        seen, frontier = set(), set(edges[start])
        while frontier and start not in seen:
            seen |= frontier
            frontier = {t for f in frontier for t in edges.get(f, ()) if t not in seen}
        if start in seen:
            on_cycle.add(start)
    return on_cycle


def probe_points(schema: Any, path: str) -> tuple[tuple[str, Any], ...]:
    """((path, schema to compile alone), ...): the parts of `schema` whose first grammar steps run before
    admission, deepest first, the whole schema last (the same object, so it can reuse the request's grammar)."""
    if not isinstance(schema, dict):
        return ((path, schema),)
    cyclic = cyclic_defs(schema)
    found = []
    for node, p, level in walk(schema, path):
        if level == 0 or not isinstance(node, dict):
            continue
        risky = ("pattern" in node or "patternProperties" in node or "propertyNames" in node
                 or width(node, schema) >= WIDE)
        kind, _, name = p[len(path) + 1:].partition(".")
        if not risky and not (level == 1 and kind in DEF_MAPS and (kind, name) in cyclic):
            continue
        alone = _standalone(node, schema)
        if alone is not None:
            found.append((level, p, alone))
    found.sort(key=lambda t: -t[0])
    return tuple((p, s) for _, p, s in found[:MAX_PROBES - 1]) + ((path, schema),)
