"""Tool calling (OpenAI's `tools` / `tool_choice`, as vLLM serves them).

How a reply becomes tool calls depends on `tool_choice`:
- a named function: the output is constrained to that function's parameters schema (structured outputs), and the
  whole text is its arguments;
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects, one per call, each
  matching one tool;
- "auto": the model decides, in its own format, which a parser (`--tool-call-parser`) reads back out of the text:
  `hermes`, the format of Qwen2.5 / Qwen3, Hermes and many others: `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; `llama3_json`, Llama 3.1-3.3's JSON calls; `mistral`, Mistral's `[TOOL_CALLS]`; `pythonic`, a
  Python list of calls (Llama 3.2, Llama 4).

An extractor turns one choice's text into (content, tool call deltas) as the text arrives, so a stream and a whole
response are made by the same code: fed all the text at once, it gives each call in one delta."""

from __future__ import annotations

import ast
import json
import random
import string
import uuid
from abc import ABC, abstractmethod

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_BLANKS = " \t\r\n"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")  # of a function name, as OpenAI allows


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of tool_choice "required": a non-empty array of calls (one at most unless `parallel`),
    each naming one tool and giving parameters that match its schema. The tools' `$defs` move to the top, where
    their "#/$defs/..." references point (pydantic's and the openai client's schemas use them); ValueError if two
    tools define one name differently."""
    calls, defs = [], {}
    for tool in tools:
        parameters = dict(tool["function"].get("parameters") or _EMPTY_PARAMETERS)
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ValueError(f"tools: the $defs of a tool's parameters must be an object, got {tool_defs!r:.40}")
        for name, schema in tool_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools: two tools define $defs {name!r:.80} differently")
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls},
            **({"$defs": defs} if defs else {})}


def parameters_schema(tools: list[dict], name: str) -> dict:
    """The parameters schema of the tool called `name` (a named tool_choice)."""
    return next(t["function"].get("parameters") or _EMPTY_PARAMETERS for t in tools if t["function"]["name"] == name)


class ToolCallExtractor(ABC):
    """One choice's text in, (new content, new tool call deltas) out. A delta opens a call with its index, id,
    type, name and the arguments known so far; later deltas of the same call carry more arguments."""

    def __init__(self, parallel: bool = True) -> None:
        self.num_calls = 0
        self.parallel = parallel  # False: calls after the first are dropped

    @abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content and call deltas that `text` (the choice's next text; `final`: its last) completes."""

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" when it ended (not cut short) after calling."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _call(self, name: str, arguments: str) -> list[dict]:
        if self.num_calls and not self.parallel:
            return []
        self.num_calls += 1
        return [{"index": self.num_calls - 1, "id": self._new_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}]

    def _new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


class NamedToolCall(ToolCallExtractor):
    """tool_choice names a function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def finish_reason(self, reason: str | None) -> str | None:
        return reason  # as OpenAI's: a call the client asked for by name ends as "stop"

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if not self.num_calls:
            return "", self._call(self.name, text)
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []


class _CallObjects:
    """Reads call objects (`{"name": ..., <arguments key>: {...}}`) one after another out of a growing text, each
    character once, skipping `separators` between them. `parsed`: where the text after the last call read
    starts; `stuck`: an element was not a call (the caller gives the rest back as content)."""

    def __init__(self, start: int, separators: str, keys: tuple[str, ...]) -> None:
        self.parsed, self.separators, self.keys = start, separators, keys
        self.element: tuple[str | None, _ObjectScanner] | None = None  # (its name if given apart, its JSON) being read
        self.stuck = False

    def read(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """The (name, arguments) of each call that `text` (all of it so far) completes since the last read."""
        calls = []
        while not self.stuck:
            if self.element is None:
                self.element = self._next(text, final)
                if self.element is None:
                    break
            name, scanner = self.element
            end = scanner.end(text)
            if end is None:
                break
            call = self._call_in(name, text[scanner.start:end])
            if call is None:
                self.stuck = True
                break
            calls.append(call)
            self.parsed, self.element = end, None
        return calls

    def _next(self, text: str, final: bool) -> tuple[str | None, _ObjectScanner] | None:
        """The next element after `parsed`: (None, its object's scanner); None while there is none yet (or, having
        set `stuck`, if it is not a call)."""
        start = _skip(text, self.parsed, self.separators)
        return (None, _ObjectScanner(start)) if start < len(text) and text[start] == "{" else None

    def _call_in(self, name: str | None, text: str) -> tuple[str, str] | None:
        """The (name, arguments) of a complete element: a call object, or (name given apart) its arguments' object;
        None if it is not one."""
        if name is None:
            return _call_of(text, self.keys)
        arguments = _parse(text)
        return (name, _json_text(arguments)) if isinstance(arguments, dict) else None


class RequiredToolCalls(ToolCallExtractor):
    """tool_choice "required": the text is a JSON array of {"name", "parameters"}; each call is sent once its
    object is complete. Text the grammar did not get to finish (max_tokens) comes back as content."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""
        self.objects = _CallObjects(0, " \t\r\n[,", ("parameters",))

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.buffer += text
        calls = [delta for call in self.objects.read(self.buffer) for delta in self._call(*call)]
        rest = self.buffer[self.objects.parsed:]
        if not final or not rest.strip(" \t\r\n],"):
            return "", calls
        return (rest.lstrip(" \t\r\n,") if self.num_calls else rest), calls


class HermesToolCalls(ToolCallExtractor):
    """tool_choice "auto" with the hermes parser: each `<tool_call>{"name", "arguments"}</tool_call>` is a call; all
    other text is content (held back while it might begin a tag), except blanks between calls. A block whose
    JSON is not a call comes back as content, tags and all. The JSON is read to its closing brace, so a string
    in it may hold "</tool_call>"."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""  # text not yet resolved: outside a block, or inside the current one (after OPEN)
        self.in_block = False
        self.after_block = False  # outside, after a block: a stretch of blanks there is dropped
        self.blanks = ""  # such a stretch so far
        self.json: _ObjectScanner | None = None  # the current block's JSON

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_block:
                start = self.buffer.find(self.OPEN)
                outside, self.buffer = (self.buffer[:start], self.buffer[start + len(self.OPEN):]) if start >= 0 \
                    else release(self.buffer, self.OPEN, final)
                content += self._outside(outside, block_follows=start >= 0)
                if start < 0:
                    return content, calls
                self.in_block, self.json = True, None
                continue
            block = self._read_block(final)
            if block is None:
                return content, calls
            call, used = block
            if call is None:
                content += self._outside(self.OPEN + self.buffer[:used], block_follows=False)
            else:
                calls += self._call(*call)
                self.after_block = True
            self.buffer, self.in_block = self.buffer[used:], False

    def _outside(self, text: str, block_follows: bool) -> str:
        """Content of text outside blocks: after a block, a stretch of only blanks before the next is dropped."""
        if not self.after_block:
            return text
        self.blanks += text
        if self.blanks.strip():
            text, self.blanks, self.after_block = self.blanks, "", False
            return text
        if block_follows:
            self.blanks = ""
        return ""

    def _read_block(self, final: bool) -> tuple[tuple[str, str] | None, int] | None:
        """(the call or None, characters of the buffer the block used), or None until more text decides."""
        if self.json is None:
            start = _skip(self.buffer, 0, _BLANKS)
            if start == len(self.buffer) and not final:
                return None
            if start < len(self.buffer) and self.buffer[start] == "{":
                self.json = _ObjectScanner(start)
        if self.json is not None:
            end = self.json.end(self.buffer)
            if end is not None:
                close = _skip(self.buffer, end, _BLANKS)
                if self.buffer.startswith(self.CLOSE, close) or (final and close == len(self.buffer)):
                    call = _call_of(self.buffer[self.json.start:end], ("arguments",))
                    if call is not None:
                        return call, min(close + len(self.CLOSE), len(self.buffer))
                elif not final and self.CLOSE.startswith(self.buffer[close:]):
                    return None
            elif not final:
                return None
        close = self.buffer.find(self.CLOSE)  # not a call: the block as text, to its closing tag
        if close < 0 and not final:
            return None
        return None, len(self.buffer) if close < 0 else close + len(self.CLOSE)


class Llama3JsonToolCalls(ToolCallExtractor):
    """tool_choice "auto" with the llama3_json parser (Llama 3.1-3.3 with a JSON tool-calling chat template): a reply
    that opens with `<|python_tag|>` or `{` is calls, `{"name": ..., "parameters": {...}}` ("arguments" is read
    too), several separated by ";"; any other reply is content. If no call could be read, the whole reply comes
    back as content; text after the calls that is not one, as content after them."""

    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""
        self.objects: _CallObjects | None = None  # once the reply is known to be calls
        self.is_content = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.is_content:
            return text, []
        self.buffer += text
        if self.objects is None:
            start = _opening(self.buffer, self.TAG)
            head = self.buffer[start:]
            if head.startswith("{"):
                self.objects = _CallObjects(start, _BLANKS + ";", ("parameters", "arguments"))
            elif not final and self.TAG.startswith(head):  # blanks, or what may begin the tag, so far
                return "", []
            else:
                self.is_content = True
                return self.buffer, []
        calls = [delta for call in self.objects.read(self.buffer) for delta in self._call(*call)]
        rest = self.buffer[self.objects.parsed:]
        if not final or not rest.strip(_BLANKS + ";"):
            return "", calls
        return (rest.lstrip(_BLANKS + ";") if self.num_calls else self.buffer), calls


class MistralToolCalls(ToolCallExtractor):
    """tool_choice "auto" with the mistral parser: text before `[TOOL_CALLS]` is content, what follows is calls,
    either a JSON array of {"name", "arguments"} (tokenizers up to v7: Mistral 7B v0.3, Mixtral 8x22B, Nemo) or
    `name[ARGS]{...}` (v11 on), each after its own [TOOL_CALLS]. Text there that is not a call comes back as
    content (all of it, tag included, if no call was read). Call ids are 9 letters and digits: Mistral's chat
    templates refuse the calls they are given back with any other."""

    TAG = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""  # before the first tag: content not yet sent; after it: the text after the tag
        self.objects: _MistralCalls | None = None  # after the first tag

    def _new_id(self) -> str:
        return "".join(random.choices(self._ID_CHARS, k=9))

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.buffer += text
        content = ""
        if self.objects is None:
            start = self.buffer.find(self.TAG)
            if start < 0:
                content, self.buffer = release(self.buffer, self.TAG, final)
                return content, []
            content, self.buffer = self.buffer[:start], self.buffer[start + len(self.TAG):]
            self.objects = _MistralCalls()
        calls = [delta for call in self.objects.read(self.buffer, final) for delta in self._call(*call)]
        rest = self.buffer[self.objects.parsed:]
        if final and (rest.strip(_MistralCalls.BETWEEN + "[") or not self.num_calls):  # no call: all is content
            content += rest.lstrip(_MistralCalls.BETWEEN) if self.num_calls else self.TAG + self.buffer
        return content, calls


class _MistralCalls(_CallObjects):
    """The calls after Mistral's first [TOOL_CALLS]: objects in an array, or `name[ARGS]{...}` after each tag."""

    ARGS = "[ARGS]"
    BETWEEN = " \t\r\n,]"  # between calls (and the array's end); "[" is read apart: it may begin a tag

    def __init__(self) -> None:
        super().__init__(0, self.BETWEEN, ("arguments",))

    def _next(self, text: str, final: bool) -> tuple[str | None, _ObjectScanner] | None:
        tag = MistralToolCalls.TAG
        while True:
            self.parsed = _skip(text, self.parsed, self.BETWEEN)
            rest = text[self.parsed:]
            if not (rest.startswith(tag) or rest.startswith("[") and not tag.startswith(rest)):
                break
            self.parsed += len(tag) if rest.startswith(tag) else 1  # a tag, or the array's start
        if not rest or (not final and tag.startswith(rest)):
            return None
        if rest[0] == "{":
            return None, _ObjectScanner(self.parsed)
        split = rest.find(self.ARGS)
        name = rest[:split] if split >= 0 else release(rest, self.ARGS, final)[0]
        if not all(c in _NAME_CHARS for c in name) or split == 0 or (split < 0 and final):
            self.stuck = True
            return None
        start = _skip(text, self.parsed + split + len(self.ARGS), _BLANKS) if split >= 0 else len(text)
        if start == len(text) or text[start] != "{":
            self.stuck = final or start < len(text)
            return None
        return name, _ObjectScanner(start)


class PythonicToolCalls(ToolCallExtractor):
    """tool_choice "auto" with the pythonic parser (Llama 3.2 and Llama 4 with a pythonic tool template, and
    other models trained so): a reply that opens with `[` (or Llama 4's `<|python_start|>[`) is a Python list of
    calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`; any other reply is content. Each call
    is sent as soon as its closing parenthesis arrives. If no call could be read (not calls of literal arguments,
    an empty list, one cut short), the whole reply comes back as content; text from the first element that is not
    a call, or after the list, as content after the calls."""

    TAG, END_TAG = "<|python_start|>", "<|python_end|>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buffer = ""  # text not yet resolved
        self.calls: _PythonCalls | None = None  # once the reply is known to open with a list
        self.after_calls = False  # the list closed after calls: a closing tag may follow, then content
        self.is_content = False  # the rest passes through as content

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.is_content:
            return text, []
        self.buffer += text
        if self.after_calls:
            return self._after_calls(final), []
        if self.calls is None:
            start = _opening(self.buffer, self.TAG)
            head = self.buffer[start:]
            if head.startswith("["):
                self.calls = _PythonCalls(start + 1)
            elif not final and self.TAG.startswith(head):  # blanks, or what may begin the tag, so far
                return "", []
            else:
                return self._content(), []
        deltas = [delta for call in self.calls.read(self.buffer, final) for delta in self._call(*call)]
        if not (self.calls.closed or self.calls.stuck or final):
            return "", deltas
        if not self.num_calls:
            return self._content(), deltas
        self.buffer = self.buffer[self.calls.parsed:]
        if self.calls.closed:
            self.after_calls = True
            return self._after_calls(final), deltas
        self.buffer = self.buffer.lstrip(_PythonCalls.BETWEEN)
        return self._content(), deltas

    def _content(self) -> str:
        text, self.buffer, self.is_content = self.buffer, "", True
        return text

    def _after_calls(self, final: bool) -> str:
        """Content after the calls: Llama 4's closing tag and the blanks around it are dropped."""
        rest = self.buffer.lstrip(_BLANKS)
        tag_then_blanks = rest.startswith(self.END_TAG) and not rest[len(self.END_TAG):].strip(_BLANKS)
        if not final and (self.END_TAG.startswith(rest) or tag_then_blanks):  # the blanks after it may go on
            return ""
        self.buffer = rest[len(self.END_TAG):].lstrip(_BLANKS) if rest.startswith(self.END_TAG) else rest
        return self._content()


class _PythonCalls(_CallObjects):
    """The elements of a Python list of calls, from just after its "[": `name(keyword=literal, ...)`, separated
    by commas; `closed` once the list's "]" is read (`parsed` is then just past it)."""

    BETWEEN = _BLANKS + ","

    def __init__(self, start: int) -> None:
        super().__init__(start, self.BETWEEN, ())
        self.closed = False

    def _next(self, text: str, final: bool) -> tuple[str | None, _ObjectScanner] | None:
        start = _skip(text, self.parsed, self.separators)
        if start < len(text) and text[start] == "]":
            self.closed, self.parsed = True, start + 1
            return None
        paren = start
        while paren < len(text) and (text[paren].isalnum() or text[paren] == "_"):
            paren += 1
        if paren == len(text):  # the name goes on, or nothing came yet
            self.stuck = final
            return None
        if paren == start or text[paren] != "(":
            self.stuck = True
            return None
        return text[start:paren], _ObjectScanner(paren, quotes="\"'", opening="[({", closing="])}")

    def _call_in(self, name: str | None, text: str) -> tuple[str, str] | None:
        """`name` and the arguments of `name` + `text` (its parenthesised keyword arguments) as JSON, or None if
        that is not a call with literal keyword arguments."""
        try:
            call = ast.parse(name + text, mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                    and all(k.arg is not None for k in call.keywords)):
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            return call.func.id, _json_text(arguments)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # not literals, or too deep
            return None


class _ObjectScanner:
    """Finds where the JSON object (or, with Python's quotes and brackets, the Python list) starting at `start`
    ends, reading each character once however the text arrives (re-parsing the whole object at every chunk was
    quadratic in its length)."""

    def __init__(self, start: int, quotes: str = '"', opening: str = "{[", closing: str = "}]") -> None:
        self.start, self.pos, self.depth, self.escaped = start, start, 0, False
        self.quotes, self.opening, self.closing = quotes, opening, closing
        self.in_string: str | None = None  # the quote that opened the string we are in
        self.found: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the object's closing brace, or None if `text` does not reach it yet."""
        if self.found is not None:
            return self.found
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.in_string:
                    self.in_string = None
            elif ch in self.quotes:
                self.in_string = ch
            elif ch in self.opening:
                self.depth += 1
            elif ch in self.closing:
                self.depth -= 1
                if self.depth == 0:
                    self.found = i + 1
                    return self.found
        self.pos = len(text)
        return None


def _opening(text: str, tag: str) -> int:
    """Where a reply's first call starts: after leading blanks and an optional `tag` (and blanks after it)."""
    start = _skip(text, 0, _BLANKS)
    return _skip(text, start + len(tag), _BLANKS) if text.startswith(tag, start) else start


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _call_of(text: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object's JSON text, or None if it is not one; the arguments are
    under the first of `keys` it has (none: no arguments)."""
    call = _parse(text)
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and _encodable(call["name"])):
        return None
    return call["name"], _json_text(next((call[key] for key in keys if key in call), {}))


def _encodable(text: str) -> bool:
    """Whether UTF-8 can carry `text`: a JSON or Python escape of half a surrogate pair ("\\ud83d") decodes to a
    string it cannot, which would fail the response mid-stream."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _json_text(value: object) -> str:
    """`value` as JSON text: non-ASCII characters as they are, unless a string holds a lone surrogate (see
    `_encodable`): then all escaped, which JSON can carry (a Python literal's escaped emoji is two of them)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _encodable(text) else json.dumps(value)


def _parse(text: str) -> object:
    """The JSON value of `text`, or None if it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for the json module
        return None


def release(text: str, tag: str, final: bool) -> tuple[str, str]:
    """(what of `text` is known not to begin `tag`, what is held back until the next text decides): the longest
    end of `text` that is a start of `tag`, unless the text is `final`."""
    keep = 0 if final else next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
    return text[:len(text) - keep], text[len(text) - keep:]


# --tool-call-parser NAME
TOOL_CALL_PARSERS: dict[str, type[ToolCallExtractor]] = {"hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls,
                                                      "mistral": MistralToolCalls, "pythonic": PythonicToolCalls}
