"""Compose's variable interpolation, done at preview from the values the stack's config supplies.

`docker stack deploy` interpolates too, but on the manager, from the environment of the SSH
session that runs it, and it makes an unset variable empty: `${NGC_API_KEY}` silently became
"". So the program interpolates first, with Compose's own syntax ($VAR, ${VAR}, ${VAR:-x},
${VAR-x}, ${VAR:?msg}, ${VAR?msg}, ${VAR:+x}, ${VAR+x}, defaults that hold variables, and $$
for a literal $), and refuses an unset variable with no default by name. Values come only from
the config, never from the operator's shell, so every machine that runs `pulumi up` deploys
the same bytes. Every $ left in a value is written back as $$, so swarm's loader, which
interpolates again, leaves the text alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class InterpolationError(ValueError):
    """A reference that cannot be resolved: its message names the variable and the fix."""


@dataclass
class Variables:
    """The values a stack's ${...} references read, and which of them were used."""

    plain: Mapping[str, str] = field(default_factory=dict)
    secret: Mapping[str, str] = field(default_factory=dict)
    mask_secrets: bool = False  # True: a secret reads as a placeholder (what preview shows and hashes)
    used: set[str] = field(default_factory=set)
    used_secrets: set[str] = field(default_factory=set)

    def get(self, name: str) -> str | None:
        if name in self.secret:
            self.used_secrets.add(name)
            return mask(name) if self.mask_secrets else str(self.secret[name])
        if name in self.plain:
            self.used.add(name)
            return str(self.plain[name])
        return None


def mask(name: str) -> str:
    return f"[secret {name}]"


def interpolate(text: str, variables: Variables) -> str:
    """The value with every reference resolved and $$ made $; raises InterpolationError."""
    out, _ = _expand(text, 0, variables)
    return out


def _expand(text: str, i: int, variables: Variables) -> tuple[str, int]:
    out = []
    while i < len(text):
        c = text[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            value, i = _braced(text, i + 2, variables)
            out.append(value)
        elif (m := _NAME.match(text, i + 1)):
            out.append(_required(m[0], variables))
            i = m.end()
        else:
            raise InterpolationError(f"{text!r}: a lone `$` at {i}; write `$$` for a literal dollar sign")
    return "".join(out), i


def _braced(text: str, i: int, variables: Variables) -> tuple[str, int]:
    m = _NAME.match(text, i)
    if not m:
        raise InterpolationError(f"{text!r}: `${{` must be followed by a variable name (letters, digits, _)")
    name, i = m[0], m.end()
    if i < len(text) and text[i] == "}":
        return _required(name, variables), i + 1
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if text.startswith(op, i):
            break
    else:
        raise InterpolationError(f"{text!r}: after `${{{name}` expected `}}`, `:-`, `-`, `:?`, `?`, `:+` or `+`")
    end = _closing(text, i + len(op))
    value = variables.get(name)
    empty = value is None or (op.startswith(":") and value == "")
    wanted = empty if op in (":-", "-", ":?", "?") else not empty
    # The default is read only when it is used, as Compose does: ${A:-${B}} needs no B while A is set.
    arg = _expand(text[:end], i + len(op), variables)[0] if wanted else ""
    if op in (":-", "-"):
        return (arg if empty else value), end + 1
    if op in (":+", "+"):
        return arg, end + 1
    if empty:  # :? and ?
        raise InterpolationError(f"${{{name}}} is required: {arg or 'it is not set'}. {_how_to_set(name)}")
    return value, end + 1


def _closing(text: str, i: int) -> int:
    """The index of the `}` that closes the reference whose argument starts at text[i]."""
    depth = 0
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    raise InterpolationError(f"{text!r}: a `${{` has no closing `}}`")


def _required(name: str, variables: Variables) -> str:
    value = variables.get(name)
    if value is None:
        raise InterpolationError(f"${{{name}}} is not set, and the file gives it no default; docker would make it "
                                 f"empty. {_how_to_set(name)}, or write a default: ${{{name}:-value}}")
    return value


def _how_to_set(name: str) -> str:
    # gpu-swarm reads values from the stack's config only, never from the shell a Compose message has in mind.
    return (f"Set it in the stack's config (variables: {{{name}: ...}}), or as a secret "
            f"(pulumi config set --secret --path 'stackSecrets.<stack>.{name}' ...)")
