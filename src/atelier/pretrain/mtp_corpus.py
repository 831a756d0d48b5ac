"""A self-distillation corpus for MTP heads: the model's own replies to prompts like the ones it serves.

Heads learn to predict the model, so the text they train on is best the text they will draft:
the model's replies to chat requests and to the harness's prompt, not library code. `prompts`
builds both kinds from the public functions of this interpreter's standard library (each one's
name, signature and the first line of its docstring), so a corpus needs no download and no two
prompts are alike; one top-level module in ten is held out (`in_split`), for measuring the heads
on prompts they never saw:

- chat: a user asks for a function, an explanation, a test or a usage of one function;
- agent: the harness's system prompt and tools (`atelier.harness.prompt.build_messages`) and a
  task about that function in a repository.

`generate` has the built-in engine reply to each, at the temperatures asked for in turn (greedy
replies for greedy serving, sampled ones for RL's rollouts), and writes one chat per line,
`{"messages": [...], "kind", "temperature"}`: the `chat` files of an `sft` phase, whose loss
mask keeps the heads' distillation on the replies (`recipes/mtp-attach-smollm2.toml`).
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from atelier.errors import AtelierError
from atelier.fsio import atomic_write
from atelier.harness.prompt import build_messages
from atelier.harness.tools import default_tools
from atelier.inference.types import SamplingParams

KINDS = ("chat", "agent")
SPLITS = ("train", "heldout")
HELDOUT_MODULES = 10   # one module in this many (by a hash of its name) is held out

CHAT_TEMPLATES = (
    "Write a Python function `{name}({args})` that {doc}.",
    "Explain what `{module}.{name}` does in Python's standard library, with a short example.",
    "Write pytest unit tests for `{module}.{name}`, which {doc}.",
    "How do I use `{module}.{name}({args})`? The docs say it {doc}.",
    "Review this signature and suggest improvements: `def {name}({args})` - it {doc}.",
)
AGENT_TEMPLATES = (
    "`{name}` in {path} should {doc}, but its test fails. Find the bug and fix it.",
    "Add a unit test for `{name}` in {path} and make sure the test suite passes.",
    "Add type hints to `{name}` in {path} without changing its behaviour.",
    "`{name}` in {path} is slow on large inputs; make it faster and keep the tests green.",
)


class CorpusError(AtelierError):
    """A self-distillation corpus that cannot be built as asked."""


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    args: str
    doc: str        # the docstring's first line, lower-cased first letter, no final period

    @property
    def path(self) -> str:
        return "src/" + self.module.replace(".", "/") + ".py"


def stdlib_functions(root: Path | None = None) -> list[Function]:
    """Every public, documented top-level function of the standard library's pure-Python modules."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith("_") or p in ("test", "tests", "idlelib", "site-packages") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = _first_line(ast.get_docstring(node))
                if doc:
                    found.append(Function(module, node.name, ", ".join(a.arg for a in node.args.args), doc))
    return found


def in_split(function: Function, split: str) -> bool:
    """Whether `function` belongs to `split`: whole modules are held out, so a held-out prompt never
    names a function, or a neighbour of one, that the heads trained on."""
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}", hint=f"use one of {', '.join(SPLITS)}")
    held = zlib.crc32(function.module.split(".")[0].encode()) % HELDOUT_MODULES == 0
    return held == (split == "heldout")


def _first_line(doc: str | None) -> str:
    line = (doc or "").strip().split("\n", 1)[0].strip().rstrip(".")
    if not 12 <= len(line) <= 160 or not line[0].isalpha():
        return ""
    return line[0].lower() + line[1:]


def prompts(kind: str, count: int, seed: int = 0, functions: Sequence[Function] | None = None
            ) -> list[list[dict[str, str]]]:
    """`count` conversations of `kind` (chat or agent) to reply to, each a list of messages."""
    if kind not in KINDS:
        raise CorpusError(f"unknown prompt kind {kind!r}", hint=f"use one of {', '.join(KINDS)}")
    pool = list(functions if functions is not None else stdlib_functions())
    if not pool:
        raise CorpusError("no documented standard-library functions to build prompts from",
                          hint="run with a Python whose standard library has its .py sources")
    random.Random(f"{seed}:{kind}").shuffle(pool)
    templates = CHAT_TEMPLATES if kind == "chat" else AGENT_TEMPLATES
    tools = default_tools() if kind == "agent" else None
    out = []
    for i in range(count):
        fn = pool[i % len(pool)]
        text = templates[i % len(templates)].format(module=fn.module, name=fn.name, args=fn.args, doc=fn.doc,
                                                    path=fn.path)
        out.append(build_messages(tools, text) if tools else [{"role": "user", "content": text}])
    return out


@dataclass(frozen=True)
class CorpusSpec:
    """What `generate` asks the model for."""

    chat: int = 700
    agent: int = 20
    max_tokens: int = 160
    temperatures: tuple[float, ...] = (0.0, 0.7)
    seed: int = 0
    split: str = "train"

    def __post_init__(self) -> None:
        if self.chat < 0 or self.agent < 0 or self.chat + self.agent == 0:
            raise CorpusError(f"nothing to generate: {self.chat} chat and {self.agent} agent prompts",
                              hint="ask for some: --chat N, --agent N")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise CorpusError(f"temperatures {self.temperatures} must be one or more numbers >= 0",
                              hint="e.g. --temperature 0 --temperature 0.7")
        if self.split not in SPLITS:
            raise CorpusError(f"unknown split {self.split!r}", hint=f"use one of {', '.join(SPLITS)}")


def conversations(spec: CorpusSpec) -> Iterator[tuple[str, float, list[dict[str, str]]]]:
    """(kind, temperature, messages) of every reply the corpus asks for; temperatures in turn."""
    functions = [f for f in stdlib_functions() if in_split(f, spec.split)]
    for kind in KINDS:
        for i, messages in enumerate(prompts(kind, getattr(spec, kind), spec.seed, functions)):
            yield kind, spec.temperatures[i % len(spec.temperatures)], messages


def generate(engine, spec: CorpusSpec, out: Path, on_reply: Callable[[int, int], None] = lambda done, total: None
             ) -> dict:
    """The engine's reply to every conversation of `spec`, written to `out` (JSONL, atomically);
    returns counts. All requests are submitted at once, so the engine batches them."""
    tokenizer = engine.tokenizer
    stops = tuple(t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
                  if isinstance(t, int) and t >= 0)
    asked = list(conversations(spec))
    handles = []
    for i, (_, temperature, messages) in enumerate(asked):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=temperature, seed=spec.seed * 1_000_003 + i,
                                stop_token_ids=stops)
        handles.append(engine.submit([int(t) for t in ids], params))
    lines, reply_tokens = [], 0
    for done, ((kind, temperature, messages), handle) in enumerate(zip(asked, handles), 1):
        token_ids = [t for t in handle.result().token_ids if t not in stops]
        reply_tokens += len(token_ids)
        reply = tokenizer.decode(token_ids, skip_special_tokens=False)
        lines.append(json.dumps({"messages": [*messages, {"role": "assistant", "content": reply}],
                                 "kind": kind, "temperature": temperature}))
        on_reply(done, len(asked))
    atomic_write(Path(out), "\n".join(lines) + "\n")
    return {"out": str(out), "replies": len(lines), "reply_tokens": reply_tokens, "split": spec.split,
            "chat": spec.chat, "agent": spec.agent, "temperatures": list(spec.temperatures)}
