"""Chat tasks built from standard-library source: the conversations the house target learns to answer.

From one source file (parsed with `ast`) this module builds conversations in the OpenAI `messages` schema, one
kind per cohort of the held-out workloads:

- ``docstring-to-code``: "write a function with this signature and docstring" -> the real implementation;
- ``code-completion``: a raw code prefix (no chat) -> its real continuation;
- ``prose``: "explain what X does" -> its docstring as prose (and language-reference topics);
- ``json-tool-call``: a system prompt declaring tools + a request -> one JSON tool call;
- ``copy-heavy``: a code context + "quote / edit the definition of X" -> text copied from the context (the RAG case);
- ``short-output``: a one-line factual question about the code -> a short answer.

Everything is deterministic for a given source text and seed. This module does not tokenize or train.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from dataclasses import dataclass, field

from speculators.house.corpus import SourceFile

COHORTS: tuple[str, ...] = (
    "code-completion", "docstring-to-code", "prose", "json-tool-call", "copy-heavy", "short-output",
)

SYSTEM_CODER = "You are a helpful Python assistant. Answer with code when code is asked for."
SYSTEM_TOOLS_HEAD = (
    "You can call tools. To call a tool, answer with one JSON object "
    '{"name": <tool name>, "arguments": {<argument>: <value>}} and nothing else.\nTools:\n'
)


@dataclass
class Task:
    """One conversation (or raw prompt) with the answer the stdlib itself gives."""

    cohort: str
    module: str
    messages: list[dict[str, str]] = field(default_factory=list)  # chat cohorts: full conversation incl. answer
    prompt: str | None = None  # code-completion: raw text prefix
    completion: str | None = None  # code-completion: the true continuation

    def to_row(self, row_id: str, max_new_tokens: int, with_answer: bool) -> dict:
        """A workload / dataset row (`{"id", "cohort", "messages" | "prompt", "max_new_tokens"}`)."""
        row: dict = {"id": row_id, "cohort": self.cohort}
        if self.prompt is not None:
            row["prompt"] = self.prompt
            if with_answer:
                row["completion"] = self.completion
        else:
            row["messages"] = self.messages if with_answer else self.messages[:-1]
        row["max_new_tokens"] = max_new_tokens
        return row


@dataclass
class _Function:
    qualname: str
    name: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    source: str  # dedented source of the whole def
    doc: str | None


def _functions(src: SourceFile) -> list[_Function]:
    try:
        tree = ast.parse(src.text)
    except SyntaxError:
        return []
    lines = src.text.splitlines(keepends=True)
    out: list[_Function] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                end = node.end_lineno or node.lineno
                code = textwrap.dedent("".join(lines[start:end]))
                if 3 <= code.count("\n") <= 60:
                    out.append(_Function(prefix + node.name, node.name, node, code, ast.get_docstring(node)))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(tree.body, "")
    return out


def _signature(fn: _Function) -> str:
    args = fn.node.args
    return f"{fn.name}({ast.unparse(args)})"


def _strip_docstring(fn: _Function) -> str:
    """The function's source with its docstring removed (used when the docstring is given in the prompt)."""
    body = fn.node.body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return fn.source
    first_line = fn.node.lineno
    deco_start = min([fn.node.lineno] + [d.lineno for d in fn.node.decorator_list])
    doc_start, doc_end = body[0].lineno - deco_start, (body[0].end_lineno or body[0].lineno) - deco_start
    del first_line
    lines = fn.source.splitlines(keepends=True)
    kept = lines[:doc_start] + lines[doc_end + 1:]
    return "".join(kept) if len(kept) > doc_start else fn.source


def _first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def _fence(code: str) -> str:
    return "```python\n" + code.rstrip("\n") + "\n```"


def docstring_to_code(src: SourceFile, rng: random.Random) -> list[Task]:
    tasks = []
    for fn in _functions(src):
        if not fn.doc or len(fn.doc) < 20:
            continue
        ask = rng.choice([
            "Write a Python function `{sig}` that does the following:\n\n{doc}",
            "Implement `{sig}`.\n\nDocstring:\n{doc}",
            "In the `{mod}` module, `{qual}` is documented as:\n\n{doc}\n\nWrite its implementation.",
        ]).format(sig=_signature(fn), doc=fn.doc.strip(), mod=src.module, qual=fn.qualname)
        answer = _fence(_strip_docstring(fn))
        tasks.append(Task("docstring-to-code", src.module, [
            {"role": "system", "content": SYSTEM_CODER}, {"role": "user", "content": ask},
            {"role": "assistant", "content": answer}]))
    return tasks


def code_completion(src: SourceFile, rng: random.Random, prefix_lines: tuple[int, int] = (6, 30)) -> list[Task]:
    """Raw-text prompts: the file's text up to a point inside a function, with the true continuation."""
    tasks = []
    lines = src.text.splitlines(keepends=True)
    for fn in _functions(src):
        start = fn.node.lineno - 1
        end = fn.node.end_lineno or fn.node.lineno
        if end - start < 6:
            continue
        cut = start + rng.randint(2, max(2, min(end - start - 2, 12)))
        ctx_start = max(0, cut - rng.randint(*prefix_lines))
        # The prompt stops before its last newline: byte-level BPE merges a newline with the next line's
        # indentation, so a prompt ending in a bare "\n" is a token boundary the model never saw in training.
        text = "".join(lines[ctx_start:cut])
        prompt = text.removesuffix("\n")
        completion = text[len(prompt):] + "".join(lines[cut:min(end, cut + 12)])
        if prompt.strip() and completion.strip():
            tasks.append(Task("code-completion", src.module, prompt=prompt, completion=completion))
    return tasks


def prose(src: SourceFile, rng: random.Random) -> list[Task]:
    tasks = []
    for fn in _functions(src):
        if not fn.doc or len(fn.doc) < 60:
            continue
        ask = rng.choice([
            "Explain what `{mod}.{qual}` does.",
            "What is `{qual}` in the `{mod}` module for?",
            "Describe the behaviour of `{qual}` from `{mod}`.",
        ]).format(mod=src.module, qual=fn.qualname)
        answer = f"`{fn.qualname}` in `{src.module}`: " + textwrap.dedent(fn.doc).strip()
        tasks.append(Task("prose", src.module, [{"role": "user", "content": ask},
                                                 {"role": "assistant", "content": answer}]))
    try:
        mod_doc = ast.get_docstring(ast.parse(src.text))
    except SyntaxError:
        mod_doc = None
    if mod_doc and len(mod_doc) > 80:
        tasks.append(Task("prose", src.module, [
            {"role": "user", "content": f"What does the `{src.module}` module provide?"},
            {"role": "assistant", "content": textwrap.dedent(mod_doc).strip()}]))
    return tasks


def topic_prose(name: str, text: str) -> Task:
    body = text.strip()
    if len(body) > 2400:
        body = body[:2400].rsplit("\n", 1)[0]
    return Task("prose", f"topic:{name}", [
        {"role": "user", "content": f"Explain the Python language reference topic `{name}`."},
        {"role": "assistant", "content": body}])


_SAMPLE_VALUES: dict[str, list] = {
    "path": ["/tmp/data.txt", "setup.cfg", "notes/readme.md"], "filename": ["report.csv", "a.json", "log.txt"],
    "name": ["alpha", "config", "user_id"], "n": [3, 10, 64], "size": [16, 1024, 4096], "count": [2, 5, 7],
    "text": ["hello world", "a, b, c", "first line\nsecond line"], "s": ["abc", "The quick brown fox", "x=1"],
    "width": [40, 72, 80], "key": ["id", "name", "version"], "value": [42, "on", 3.5],
    "data": ["b'\\x00\\x01'", "raw bytes", "[1, 2, 3]"], "sep": [",", ";", "\t"], "mode": ["r", "rb", "w"],
    "timeout": [1.0, 5, 30], "encoding": ["utf-8", "latin-1", "ascii"], "x": [0, 1.5, -2], "a": [1, 4, 9],
    "b": [2, 8, 16], "start": [0, 5, 10], "stop": [10, 20, 100], "level": [0, 1, 2], "flags": [0, 2, 8],
}


def _sample_arg(param: str, default: ast.expr | None, rng: random.Random):
    if param in _SAMPLE_VALUES:
        return rng.choice(_SAMPLE_VALUES[param])
    if default is not None:
        try:
            value = ast.literal_eval(default)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            value = None
        if isinstance(value, bool):
            return not value if rng.random() < 0.5 else value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value + rng.choice([1, 2, 10])
        if isinstance(value, str) and value:
            return value
    return rng.choice(["example", 1, 2, "data", True, 0.5, "output.txt", 12])


def json_tool_call(src: SourceFile, rng: random.Random) -> list[Task]:
    fns = [f for f in _functions(src) if f.doc and not f.name.startswith("_") and "." not in f.qualname]
    tasks = []
    for i, fn in enumerate(fns):
        args = fn.node.args
        params = [a.arg for a in args.posonlyargs + args.args if a.arg not in ("self", "cls")]
        if not params:
            continue
        defaults = [None] * (len(args.posonlyargs + args.args) - len(args.defaults)) + list(args.defaults)
        by_name = {a.arg: d for a, d in zip(args.posonlyargs + args.args, defaults, strict=False)}
        chosen = [p for p in params if by_name.get(p) is None] or params[:1]
        extra = [p for p in params if p not in chosen]
        if extra and rng.random() < 0.5:
            chosen.append(rng.choice(extra))
        values = {p: _sample_arg(p, by_name.get(p), rng) for p in chosen}
        others = [f for f in fns if f is not fn and f.doc]
        tools = [fn] + rng.sample(others, min(len(others), rng.randint(1, 3)))
        rng.shuffle(tools)
        spec = "\n".join(json.dumps({"name": f"{src.module}.{t.name}", "description": _first_sentence(t.doc or "")[:160],
                                     "parameters": [a.arg for a in t.node.args.args if a.arg not in ("self", "cls")]})
                         for t in tools)
        described = ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
        ask = rng.choice([
            "Call {fn} with {args}.", "Use the tool {fn} on {args}.", "Please run {fn} ({args}).",
        ]).format(fn=f"`{src.module}.{fn.name}`", args=described)
        answer = json.dumps({"name": f"{src.module}.{fn.name}", "arguments": values})
        tasks.append(Task("json-tool-call", src.module, [
            {"role": "system", "content": SYSTEM_TOOLS_HEAD + spec}, {"role": "user", "content": ask},
            {"role": "assistant", "content": answer}]))
        del i
    return tasks


def copy_heavy(src: SourceFile, rng: random.Random) -> list[Task]:
    """Quote or lightly edit a definition that is given in the context (retrieval-augmented answering)."""
    fns = [f for f in _functions(src) if f.source.count("\n") <= 30]
    tasks = []
    for fn in fns:
        neighbours = rng.sample([f for f in fns if f is not fn], min(len(fns) - 1, rng.randint(1, 2)))
        context_parts = [fn.source] + [f.source for f in neighbours]
        rng.shuffle(context_parts)
        context = "\n".join(context_parts)
        kind = rng.random()
        if kind < 0.5:
            ask = f"Context:\n{_fence(context)}\n\nQuote the definition of `{fn.name}` from the context exactly."
            answer = _fence(fn.source)
        else:
            params = [a.arg for a in fn.node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1]
            if not params:
                continue
            old = rng.choice(params)
            new = old + rng.choice(["_value", "_arg", "2", "_in"])
            ask = (f"Context:\n{_fence(context)}\n\nRewrite `{fn.name}` from the context with the parameter "
                   f"`{old}` renamed to `{new}`. Change nothing else.")
            answer = _fence(re.sub(rf"\b{re.escape(old)}\b", new, fn.source))
        tasks.append(Task("copy-heavy", src.module, [{"role": "user", "content": ask},
                                                      {"role": "assistant", "content": answer}]))
    return tasks


def short_output(src: SourceFile, rng: random.Random) -> list[Task]:
    tasks = []
    for fn in _functions(src):
        params = [a.arg for a in fn.node.args.args if a.arg not in ("self", "cls")]
        kind = rng.randrange(3)
        if kind == 0:
            ask = f"How many parameters does `{src.module}.{fn.qualname}` take (not counting self)? Answer briefly."
            answer = f"{len(params)}" + (f": {', '.join(params)}." if params else ".")
        elif kind == 1 and fn.doc:
            ask = f"In one line, what does `{src.module}.{fn.qualname}` do?"
            answer = _first_sentence(fn.doc)[:200]
        else:
            ask = f"Which module defines `{fn.qualname}`? Answer with the module name only."
            answer = f"`{src.module}`"
        tasks.append(Task("short-output", src.module, [{"role": "user", "content": ask},
                                                        {"role": "assistant", "content": answer}]))
    return tasks


BUILDERS = {
    "code-completion": code_completion,
    "docstring-to-code": docstring_to_code,
    "prose": prose,
    "json-tool-call": json_tool_call,
    "copy-heavy": copy_heavy,
    "short-output": short_output,
}


def tasks_for(src: SourceFile, seed: int) -> dict[str, list[Task]]:
    """Every cohort's tasks for one source file, deterministic in (module, seed)."""
    out = {}
    for cohort, build in BUILDERS.items():
        rng = random.Random(f"{seed}:{cohort}:{src.module}")
        out[cohort] = build(src, rng)
    return out
