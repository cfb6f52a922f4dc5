"""``midflight model tiny DIR``: a small Llama model made here, reproducible byte for byte.

The model is a decoder-only Llama (two layers, hidden size 64) with weights drawn from a seeded
generator, and a tokenizer built with ``tokenizers`` whose vocabulary is the reference
deployment's: token id *b* is the Latin-1 byte *b* (:func:`protocols.encode`), so the ids the
policy server sends are the ids the model reads, and no merge can make the two disagree (D307).
Nothing is downloaded. Both are written with ``save_pretrained``, the layout Hugging Face
``transformers`` and vLLM load, beside :data:`ENGINE_FILE`, which names the tokens the model may
output (the reference output alphabet and its stop token).

Needs the ``engine`` extra (``pip install -e '.[engine]'``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from participants import fsync_directory, make_directory_durable

from .generation import OUTPUT_ALPHABET

ENGINE_FILE: Final = "midflight.json"
"""Beside the model: ``{"output_token_ids": [...], "stop_token_ids": [...]}``."""
STOP_TOKEN: Final = ord("\n")
"""The tiny model's end-of-sequence token: a newline ends a completion (and is part of it)."""
VOCAB_SIZE: Final = 256
INIT_RANGE: Final = 0.3
"""Standard deviation of the seeded weights: wide enough that greedy decoding varies."""
STOP_ROW_SCALE: Final = 0.6
"""The stop token's output row is scaled by this, so some completions stop early and the rest
run to ``max_tokens`` (with the unscaled row, most stopped within a few tokens)."""


@dataclass(frozen=True)
class TinyModel:
    """What :func:`build_tiny_model` wrote.

    Attributes:
        directory: The model directory.
        digest: sha256 over every file's name and bytes, in name order: equal for equal seeds.
        parameters: The model's parameter count.
    """

    directory: Path
    digest: str
    parameters: int


def tiny_config(seed: int = 0) -> dict[str, Any]:
    """The tiny model's Llama configuration (what ``config.json`` holds, less the library's own
    fields)."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": INIT_RANGE,
        "bos_token_id": 2,  # the reference framing's message start (0x02)
        "eos_token_id": STOP_TOKEN,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def directory_digest(directory: Path) -> str:
    """sha256 over every regular file's name and bytes under ``directory``, in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def refuse_to_replace(directory: Path) -> None:
    """Refuse a ``directory`` that the build would replace and that is not a tiny model.

    Raises:
        ValueError: ``directory`` is a file, or a non-empty directory without ``midflight.json``.
    """
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"{directory} is not a directory: name a new one")
    ours = (directory / ENGINE_FILE).is_file()
    if directory.is_dir() and not ours and any(directory.iterdir()):
        raise ValueError(
            f"{directory} holds files and no {ENGINE_FILE}, so it is no tiny model: the "
            "build replaces its directory whole; name a new or empty one"
        )


def build_tiny_model(directory: Path, *, seed: int = 0) -> TinyModel:
    """Write the tiny model and its tokenizer to ``directory`` (replacing what is there).

    The files are written into a temporary sibling, fsynced, and renamed into place, so a crash
    leaves the old directory or the whole new one, never half a model.

    Only a tiny model is replaced (a directory holding ``midflight.json``): any other directory
    that holds files, or a file, is refused before anything is written (D368).

    Raises:
        ImportError: The ``engine`` extra is not installed.
        ValueError: ``directory`` is a file, or a directory holding something else.
    """
    refuse_to_replace(directory)
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the command prints its own one line

    directory = directory.resolve()
    make_directory_durable(directory.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server run as another user
    try:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = LlamaForCausalLM(LlamaConfig(**tiny_config(seed)))
        finally:
            torch.random.set_rng_state(generator_state)  # the caller's generator is left as it was
        with torch.no_grad():
            model.lm_head.weight[STOP_TOKEN] *= STOP_ROW_SCALE
        model.save_pretrained(staging)
        vocabulary = {bytes([b]).decode("latin-1"): b for b in range(VOCAB_SIZE)}
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.BPE(vocab=vocabulary, merges=[])),
            # Tokenizer special tokens, not secrets.
            eos_token="\n",  # noqa: S106
            pad_token="\x00",  # noqa: S106
            bos_token="\x02",  # noqa: S106
        )
        tokenizer.save_pretrained(staging)
        engine = {
            "output_token_ids": sorted({*OUTPUT_ALPHABET, STOP_TOKEN}),
            "stop_token_ids": [STOP_TOKEN],
            "seed": seed,
        }
        (staging / ENGINE_FILE).write_text(json.dumps(engine, indent=2) + "\n")
        _fsync_files(staging)
        parameters = sum(p.numel() for p in model.parameters())
        if directory.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            os.replace(directory, retired / directory.name)
            os.replace(staging, directory)
            shutil.rmtree(retired)
        else:
            os.replace(staging, directory)
        fsync_directory(directory.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return TinyModel(directory=directory, digest=directory_digest(directory), parameters=parameters)


def _fsync_files(directory: Path) -> None:
    """Flush every file written under ``directory``, then the directory itself."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_directory(directory)


def read_engine_file(model: Path) -> dict[str, list[int]]:
    """The output and stop tokens :data:`ENGINE_FILE` names, or ``{}`` for a model without it."""
    path = model / ENGINE_FILE
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {
        key: [int(t) for t in raw[key]]
        for key in ("output_token_ids", "stop_token_ids")
        if key in raw
    }
