"""``--model`` as the commands take it: a checkpoint folder, a hub repo id or a ``.gguf`` file, as given; or a GGUF
file of a hub repo, named as llama.cpp's ``-hf`` names it (``--model org/Model-GGUF:Q4_K_M``: the file whose name
holds the tag) or as transformers' ``gguf_file=`` does (``--model org/Model-GGUF --gguf-file model.Q4_K_M.gguf``).
That file alone is fetched (with the other parts of a split GGUF) and the command reads it as a local ``.gguf`` file.
"""
from __future__ import annotations

from pathlib import Path

from vkformers.errors import VkformersError
from vkformers.models.gguf import SPLIT_NAME, gguf_file_of_tag, parse_repo_tag, resolve_gguf_file

MODEL_SPELLINGS = "checkpoint folder, hub repo id, .gguf file, or org/repo:QUANT (a hub repo's GGUF file by its tag)"
GGUF_FILE_HELP = ("a .gguf file of --model's folder or hub repo, fetched alone (transformers' gguf_file=); of a split "
                  "GGUF (NAME-00001-of-0000N.gguf) any part: every part is fetched")


def add_gguf_file_option(parser) -> None:
    parser.add_argument("--gguf-file", default=None, metavar="NAME", help=GGUF_FILE_HELP)


def resolve_model(model, gguf_file: str | None = None, *, option: str = "--model"):
    """The model a command loads: ``model`` as given, or the local path (a str) of the GGUF file that ``org/repo:TAG``
    or ``model`` with ``gguf_file`` names, fetched into the HF cache."""
    if model is None:
        if gguf_file is not None:
            raise VkformersError(f"--gguf-file names a file of {option}'s folder or hub repo: give {option} too")
        return None
    tagged = parse_repo_tag(model)
    if tagged is not None:
        if gguf_file is not None:
            raise VkformersError(f"{option} {model} picks its GGUF file by the tag {tagged[1]!r} and --gguf-file names "
                                 "one too: give one of them")
        repo, tag = tagged
        return str(resolve_gguf_file(repo, gguf_file_of_tag(repo, tag)))
    if gguf_file is None:
        return model
    return str(resolve_gguf_file(model, gguf_file))


def gguf_model_name(model, gguf_file: str | None = None) -> str | None:
    """The name of a GGUF model as given (for the API's model list): ``org/repo:TAG`` as it is, a .gguf file's or
    --gguf-file's stem (a split GGUF's without the part number); None for any other model."""
    if model is not None and parse_repo_tag(model) is not None:
        return str(model)
    name = gguf_file if gguf_file is not None else str(model or "")
    if not name.lower().endswith(".gguf"):
        return None
    found = SPLIT_NAME.fullmatch(Path(name).name)
    return Path(found["prefix"]).name if found else Path(name).stem


__all__ = ["GGUF_FILE_HELP", "MODEL_SPELLINGS", "add_gguf_file_option", "gguf_model_name", "resolve_model"]
