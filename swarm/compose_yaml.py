"""A compose file as Python data whose scalars keep the text the user wrote, and back to YAML.

Loading with PyYAML's types would change values behind the user's back (it reads `1e3` as a
string where docker's loader reads 1000, and `yes` as true), so every scalar is loaded as a
Scalar: a str holding the user's text, with the YAML tag it resolved to and its quoting, and
dumped back exactly so. Mappings and sequences are plain dicts and lists, so the Compose
steps (compose_resolve.py, compose_swarm.py) edit them as ordinary data. Merge keys (`<<`) are
expanded and aliases written out in full. Compose's own tags `!reset` and `!override` load as
Reset and Override, for extends to apply. Comments are not kept: PyYAML has no place for them.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import ScalarNode

STR = "tag:yaml.org,2002:str"
INT = "tag:yaml.org,2002:int"
NULL = "tag:yaml.org,2002:null"
BOOL = "tag:yaml.org,2002:bool"
_RESOLVER = yaml.resolver.Resolver()


class Scalar(str):
    """The user's text of a scalar; `tag` is what YAML resolves it to, `style` its quoting (None: plain)."""

    tag: str
    style: str | None

    def __new__(cls, text: str, tag: str = STR, style: str | None = None):
        self = super().__new__(cls, text)
        self.tag, self.style = tag, style
        return self

    def with_text(self, text: str) -> "Scalar":
        """The same scalar with other text: a plain one resolves again (`${N:-2}` becomes the number 2)."""
        tag = _RESOLVER.resolve(ScalarNode, text, (True, False)) if self.style is None else self.tag
        return Scalar(text, STR if tag == NULL else tag, self.style)  # "${X:-}" is an empty string, not null

    @property
    def is_null(self) -> bool:
        return self.tag == NULL


class Unresolved(Scalar):
    """A value whose ${...} could not be resolved, kept as written: its problem is said once, where the
    reference is, and the checks that would judge the value are left out (swarm/stack_files.py)."""


class Reset:
    """`!reset`: the key is removed from what it extends, or set to its type's empty value."""


class Override:
    """`!override VALUE`: replaces what it extends instead of merging into it."""

    def __init__(self, value: Any):
        self.value = value


class FlowList(list):
    """A sequence the user wrote in flow style, [a, b]: written back so, so a diff shows only real changes."""


class FlowDict(dict):
    """A mapping the user wrote in flow style, {a: b}."""


def scalar(value: str | int) -> Scalar:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"not a scalar for a compose file: {value!r}")
    return Scalar(str(value), INT) if isinstance(value, int) else Scalar(value, STR, None)


class _Loader(yaml.SafeLoader):
    pass


def _construct_scalar(loader: _Loader, node: ScalarNode) -> Scalar:
    return Scalar(node.value, node.tag, node.style)


for _tag in (STR, INT, NULL, BOOL, "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp",
             "tag:yaml.org,2002:binary"):
    _Loader.add_constructor(_tag, _construct_scalar)
_Loader.add_constructor("!reset", lambda loader, node: Reset())


def _override(loader: _Loader, node):
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(_construct_scalar(loader, node))


_Loader.add_constructor("!override", _override)


def _construct_mapping(loader: _Loader, node):
    loader.flatten_mapping(node)  # `<<` merges, as YAML says: the mapping's own keys win
    out = FlowDict() if node.flow_style else {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        out[str(key)] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:seq", lambda loader, node: (FlowList if node.flow_style else list)(
    loader.construct_object(child, deep=True) for child in node.value))


def load(text: str) -> Any:
    """The document as dicts, lists and Scalars; raises yaml.YAMLError."""
    return unshared(yaml.load(text, Loader=_Loader))  # noqa: S506 (a SafeLoader subclass)


def unshared(value: Any) -> Any:
    """A copy in which no two places hold the same dict or list (an anchor's aliases do), so that
    an edit of one service never reaches another. Scalars never change, so they are kept."""
    if isinstance(value, dict):
        return type(value)((k, unshared(v)) for k, v in value.items())
    if isinstance(value, list):
        return type(value)(unshared(v) for v in value)
    if isinstance(value, Override):
        return Override(unshared(value.value))
    return value


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True  # each service gets its own copy of what an anchor shared


def _represent_scalar(dumper: _Dumper, data: Scalar) -> ScalarNode:
    return ScalarNode(data.tag, str(data), style=data.style)


_Dumper.add_representer(Scalar, _represent_scalar)
_Dumper.add_representer(Unresolved, _represent_scalar)
# The tags as written, for the file as the user wrote it (the diff at preview); what is deployed has none.
_Dumper.add_representer(Reset, lambda dumper, data: ScalarNode("!reset", ""))
_Dumper.add_representer(Override, lambda dumper, data: _retagged(dumper.represent_data(data.value), "!override"))
_Dumper.add_representer(FlowList, lambda dumper, data: dumper.represent_sequence(
    "tag:yaml.org,2002:seq", data, flow_style=True))
_Dumper.add_representer(FlowDict, lambda dumper, data: dumper.represent_mapping(
    "tag:yaml.org,2002:map", data.items(), flow_style=True))


def _retagged(node, tag: str):
    node.tag = tag
    return node


def dump(doc: Any) -> str:
    # A wide line: long commands stay on one line, so a diff shows them whole. Keys keep their order.
    return yaml.dump(doc, Dumper=_Dumper, allow_unicode=True, width=4096, sort_keys=False)


def plain(value: Any) -> Any:
    """The value as PyYAML's safe_load would read it: for checks on numbers and booleans."""
    if isinstance(value, Scalar):
        return yaml.constructor.SafeConstructor().construct_object(ScalarNode(value.tag, str(value)))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, Override):
        return plain(value.value)
    return None if isinstance(value, Reset) else value
