"""Grammars in Lark's notation, which vLLM also takes: rewritten in the EBNF that xgrammar reads.

A grammar with no `::=` is read as Lark (vLLM's test). Its rules (`name: ...`, `?name` and `!name` alike, a
`.priority` ignored) become `name ::= ...`, lines that start with `|` continue the rule above, an alternative's
`-> alias` (a parse-tree name) is dropped, `'text'` becomes `"text"`, `[item]` (Lark's optional) becomes `(item)?`,
and a `/regex/` terminal becomes rules of its own (xgrammar turns the regex into a grammar). The grammar's root is its
`start` rule, else its first. `//` and `#` start comments. Directives (`%import`, `%ignore`, `%declare`) are
refused: they name other grammars or change how text is split into terminals, which EBNF has no counterpart for.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"[?!]*([A-Za-z_]\w*)(?:\.-?\d+)?\s*:(?!:)(.*)", re.S)
_ALIAS = re.compile(r"->\s*[A-Za-z_]\w*")
_NAME = re.compile(r"[A-Za-z_]\w*")


def is_lark(grammar: str) -> bool:
    """vLLM's test: no line (outside comments) defines a rule with `::=`."""
    return not any("::=" in _strip_comment(line) for line in grammar.splitlines())


def lark_to_ebnf(grammar: str, regex_to_ebnf) -> tuple[str, str]:
    """The EBNF of a Lark grammar and the name of its root rule; `regex_to_ebnf(pattern)` gives a regex's EBNF
    rules, rooted at `root`. ValueError naming the line for what cannot be rewritten."""
    rules: list[list] = []  # [name, body, line number]
    for number, line in enumerate(grammar.splitlines(), 1):
        text = _strip_comment(line).strip()
        if not text:
            continue
        if text.startswith("%"):
            raise ValueError(f"Lark grammar line {number}: directives ({text.split()[0]}) are not supported")
        if text.startswith("|"):
            if not rules:
                raise ValueError(f"Lark grammar line {number}: '|' continues no rule")
            rules[-1][1] += " " + text
            continue
        match = _RULE.fullmatch(text)
        if match is None:
            raise ValueError(f"Lark grammar line {number}: expected 'name: ...', got {text!r:.80}")
        rules.append([match.group(1), match.group(2).strip(), number])
    if not rules:
        raise ValueError("the Lark grammar defines no rule")
    defined = frozenset(name for name, _, _ in rules)
    names = set(defined)  # the rules' and, as they are made, the regex terminals' rule names
    lines = []
    for name, body, number in rules:
        extra: list[str] = []
        ebnf, used = _body(body, name, names, extra, regex_to_ebnf, number)
        undefined = sorted(used - defined)
        if undefined:
            raise ValueError(f"Lark grammar line {number}: rule {name} uses undefined {', '.join(undefined)}")
        lines.append(f"{name} ::= {ebnf}")
        lines.extend(extra)
    return "\n".join(lines), "start" if "start" in defined else rules[0][0]


def _strip_comment(line: str) -> str:
    """The line up to a `//` or `#` that is not inside a string or a regex."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "/" and line.startswith("//", i):
            return line[:i]
        elif c == "/":
            quote = "/"
        elif c == "#":
            return line[:i]
        i += 1
    return line


def _body(body: str, rule: str, names: set[str], extra: list[str], regex_to_ebnf, number: int
          ) -> tuple[str, set[str]]:
    """A rule's right-hand side in EBNF, and the rule names it uses; its regex terminals' rules go to `extra`, under
    names not yet in `names` (which they join)."""
    out, used, depth = [], set(), 0  # depth: '[' left open
    i = 0
    while i < len(body):
        c = body[i]
        if (alias := _ALIAS.match(body, i)) is not None:  # a parse-tree name: nothing to match
            i = alias.end()
            continue
        if c in "\"'/":
            end = _closing(body, i, number)
            if end + 1 < len(body) and body[end + 1].isalpha():
                raise ValueError(f"Lark grammar line {number}: flags after a string or regex "
                                 f"({body[i:end + 2]!r:.40}) are not supported")
            literal = body[i + 1:end]
            if c == "/":
                name = next(n for k in range(len(names) + 1) if (n := f"{rule}__re{k}") not in names)
                names.add(name)  # (with the helper rules xgrammar derives from it, name_1, ...)
                extra.extend(_renamed(regex_to_ebnf(literal.replace("\\/", "/")), name))
                out.append(name)
            elif c == "'":
                out.append('"' + literal.replace("\\'", "'").replace('\\"', '"').replace('"', '\\"') + '"')
            else:
                out.append(f'"{literal}"')
            i = end + 1
        elif c in "[]":
            depth += 1 if c == "[" else -1
            if depth < 0:
                raise ValueError(f"Lark grammar line {number}: ']' closes no '['")
            out.append("(" if c == "[" else ")?")
            i += 1
        elif body.startswith("..", i) or c == "~":
            what = 'ranges ("a".."z")' if c == "." else "repetition with '~'"
            raise ValueError(f"Lark grammar line {number}: {what} is not supported: use a regex (/[a-z]/) or {{m,n}}")
        elif (match := _NAME.match(body, i)) is not None:
            used.add(match.group())
            out.append(match.group())
            i = match.end()
        else:
            out.append(c)
            i += 1
    if depth:
        raise ValueError(f"Lark grammar line {number}: '[' is never closed")
    return "".join(out), used


def _closing(body: str, start: int, number: int) -> int:
    """The index of the quote (or '/') that closes the string (or regex) opened at `start`."""
    i = start + 1
    while i < len(body):
        if body[i] == "\\":
            i += 2
            continue
        if body[i] == body[start]:
            return i
        i += 1
    raise ValueError(f"Lark grammar line {number}: {body[start]} is never closed")


def _renamed(ebnf: str, name: str) -> list[str]:
    """A regex's EBNF rules with `root` (and its `root_1`, ... helpers) renamed to `name` (`name_1`, ...), outside
    its strings."""
    pieces = re.split(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])', ebnf)  # strings and character classes
    renamed = "".join(p if p[:1] in ('"', "[") else re.sub(r"\broot(?=\b|_)", name, p) for p in pieces)
    return [line for line in renamed.splitlines() if line.strip()]
