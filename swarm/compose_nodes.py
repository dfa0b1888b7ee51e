"""Edits a compose file as a YAML node graph, so that every value the user wrote reaches swarm as written.

Loading the file into Python and dumping it again would change values behind the user's
back: PyYAML reads `1e3` as a string where docker's loader reads 1000, and `yes` as true.
A node graph keeps each scalar's text, tag and quoting, so only the keys edited here change.
Comments and anchor names are not kept (PyYAML has no place for comments; anchors come back
as &id001); the YAML merge key `<<` is expanded where an edit passes through it, which
keeps its meaning. The output is deterministic: same input, same bytes.
"""
from __future__ import annotations

from typing import Iterable

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAP_TAG = "tag:yaml.org,2002:map"
SEQ_TAG = "tag:yaml.org,2002:seq"
STR_TAG = "tag:yaml.org,2002:str"
INT_TAG = "tag:yaml.org,2002:int"
MERGE_TAG = "tag:yaml.org,2002:merge"


def parse(text: str) -> Node | None:
    return yaml.compose(text, Loader=yaml.SafeLoader)


def dump(node: Node) -> str:
    # A wide line: long commands stay on one line, so a diff shows them whole.
    return yaml.serialize(node, Dumper=yaml.SafeDumper, allow_unicode=True, width=4096)


def scalar(value: str | int) -> ScalarNode:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"not a scalar for a compose file: {value!r}")
    return ScalarNode(INT_TAG, str(value)) if isinstance(value, int) else ScalarNode(STR_TAG, value)


def mapping(pairs: Iterable[tuple[str, Node]]) -> MappingNode:
    return MappingNode(MAP_TAG, [(scalar(k), v) for k, v in pairs], flow_style=False)


def _key(node: Node) -> object:
    return node.value if isinstance(node, ScalarNode) else id(node)


def _copy_key(node: Node) -> Node:
    # A key node shared with the merged mapping would come out as an anchor and an alias *as a key*.
    return ScalarNode(node.tag, node.value, style=node.style) if isinstance(node, ScalarNode) else node


def flattened(node: MappingNode) -> MappingNode:
    """A new mapping with the `<<` merges expanded in place: the mapping's own keys win, and of
    several merged mappings the earlier one wins, as YAML's merge key says."""
    own = {_key(k) for k, _ in node.value if k.tag != MERGE_TAG}
    pairs, seen = [], set()
    for k, v in node.value:
        if k.tag != MERGE_TAG:
            pairs.append((_copy_key(k), v))
            continue
        sources = v.value if isinstance(v, SequenceNode) else [v]
        for source in sources:
            if not isinstance(source, MappingNode):
                continue  # PyYAML refuses such a file when it loads it
            for mk, mv in flattened(source).value:
                if _key(mk) not in own and _key(mk) not in seen:
                    pairs.append((_copy_key(mk), mv))
                    seen.add(_key(mk))
    return MappingNode(node.tag, pairs, flow_style=node.flow_style)


def _index(node: MappingNode, key: str) -> int | None:
    found = None
    for i, (k, _) in enumerate(node.value):
        if _key(k) == key:
            found = i  # the last one wins, as when PyYAML loads it
    return found


def get(node: MappingNode, key: str) -> Node | None:
    i = _index(node, key)
    return None if i is None else node.value[i][1]


def put(node: MappingNode, key: str, value: Node) -> Node:
    i = _index(node, key)
    if i is None:
        node.value.append((scalar(key), value))
    else:
        node.value[i] = (node.value[i][0], value)
    return value


def delete(node: MappingNode, key: str) -> None:
    node.value[:] = [(k, v) for k, v in node.value if _key(k) != key]


def own_mapping(parent: MappingNode, key: str, *, create: bool = False) -> MappingNode | None:
    """The mapping at parent[key] as a fresh copy that belongs to parent alone (so an edit never
    reaches another service through an alias or a merge), or None when there is none to edit."""
    child = get(parent, key)
    if child is None or (isinstance(child, ScalarNode) and child.tag == "tag:yaml.org,2002:null"):
        if not create:
            return None
        return put(parent, key, MappingNode(MAP_TAG, [], flow_style=False))
    if not isinstance(child, MappingNode):
        return None
    return put(parent, key, flattened(child))


def own_sequence(parent: MappingNode, key: str, *, create: bool = False) -> SequenceNode | None:
    child = get(parent, key)
    if child is None and create:
        return put(parent, key, SequenceNode(SEQ_TAG, [], flow_style=False))
    if not isinstance(child, SequenceNode):
        return None
    return put(parent, key, SequenceNode(child.tag, list(child.value), flow_style=child.flow_style))


def own_path(root: MappingNode, keys: Iterable[str], *, create: bool = False) -> MappingNode | None:
    node = root
    for key in keys:
        node = own_mapping(node, key, create=create)
        if node is None:
            return None
    return node
