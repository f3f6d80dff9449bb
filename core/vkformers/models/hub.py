"""A local folder, or a Hugging Face hub repo id fetched into the HF cache: where checkpoints and adapters come from,
and where ``push_to_hub`` sends them.

Only the files a loader reads are fetched (``allow_patterns``); PyTorch's pickled weights only where a repo has no
safetensors (a second download). ``revision``, ``token`` (else HF_TOKEN or the saved login), ``cache_dir`` and
``local_files_only`` are huggingface_hub's; HF_HUB_OFFLINE serves the cache alone. A push uploads a folder as one
commit (``HfApi.upload_folder``), the repo created first where it is missing, as transformers' push_to_hub does.
"""
from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable

from vkformers.errors import VkformersError
from vkformers.models.module import CheckpointError
from vkformers.models.slow_tokenizers import SLOW_TOKENIZER_FILES

HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                # a slow tokenizer's files, read where a repo has no tokenizer.json (models/slow_tokenizers.py)
                *SLOW_TOKENIZER_FILES,
                # sentence-transformers' layout (vkformers.SentenceTransformer)
                "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "*/config.json"]
# fetched only where a repo has no safetensors weights (read by models/torch_pickle.py); */ for a sentence-transformers
# Dense module's folder
HUB_PICKLE_PATTERNS = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json",
                       "*/pytorch_model.bin"]


class HubError(VkformersError, OSError):
    """A repo id that could not be fetched (offline without a cached copy, unknown repo, network down)."""


def local_path(name_or_path) -> Path:
    return Path(os.path.expanduser(str(name_or_path)))


def is_path_name(name_or_path) -> bool:
    """Written as a path, never a repo id ("org/name" or "name"): starts with . / ~ or has more than one /."""
    return str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1


def fetch_repo(repo_id: str, allow_patterns: list[str], *, fallback_patterns: list[str] | None = None,
               needs_fallback: Callable[[Path], bool] | None = None, what: str = "model",
               revision: str | None = None, cache_dir=None, token=None, local_files_only: bool = False) -> Path:
    """The snapshot folder of ``repo_id`` holding the files of ``allow_patterns``; ``fallback_patterns`` fetched too
    where ``needs_fallback(folder)`` says the first files lack what is read (an older repo's pickled weights)."""
    from huggingface_hub import constants, snapshot_download  # slow to import: only for a hub name
    offline = constants.HF_HUB_OFFLINE
    fetch = partial(snapshot_download, repo_id, revision=revision, cache_dir=cache_dir, token=token,
                    local_files_only=bool(offline or local_files_only))
    try:
        folder = Path(fetch(allow_patterns=allow_patterns))
        if fallback_patterns and needs_fallback is not None and needs_fallback(folder):
            folder = Path(fetch(allow_patterns=fallback_patterns))
        return folder
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not get it"
        where = cache_dir or constants.HF_HUB_CACHE
        mode = ("offline (HF_HUB_OFFLINE is set) and it is not in" if offline else
                "not in" if local_files_only else "could not be fetched into")
        raise HubError(f"{what} {repo_id!r} {mode} the cache {where}: {type(exc).__name__}: {exc}") from None


def _push_failed(repo_id: str, exc: Exception) -> HubError:
    return HubError(f"could not push to the hub repo {repo_id!r}: {type(exc).__name__}: {exc} (a token with write "
                    "access: HF_TOKEN, `hf auth login` or token=)")


def create_hub_repo(repo_id: str, *, private: bool | None = None, token=None) -> None:
    """The hub model repo ``repo_id`` made where it is missing (``private`` or not): before a long run that pushes
    at its end, so that a wrong name or token stops it first."""
    from huggingface_hub import HfApi  # slow to import: only for a push
    try:
        HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not push"
        raise _push_failed(repo_id, exc) from None


def upload_to_hub(folder, repo_id: str, *, commit_message: str, private: bool | None = None, token=None,
                  create_pr: bool = False, revision: str | None = None, commit_description: str | None = None):
    """``folder``'s files uploaded to the hub model repo ``repo_id`` in one commit (the repo created, ``private``
    or not, where it is missing); huggingface_hub's CommitInfo (``.commit_url``, ``.pr_url``)."""
    from huggingface_hub import HfApi  # slow to import: only for a push
    create_hub_repo(repo_id, private=private, token=token)
    try:
        return HfApi(token=token).upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                                commit_message=commit_message, commit_description=commit_description,
                                                create_pr=create_pr, revision=revision)
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not push"
        raise _push_failed(repo_id, exc) from None


def push_saved(save: Callable[[Path], None], repo_id: str, **options):
    """What ``save(folder)`` writes (a save_pretrained), staged in a temporary folder and uploaded as one commit
    (:func:`upload_to_hub`'s options)."""
    with tempfile.TemporaryDirectory(prefix="vkformers-push-") as staged:
        save(Path(staged))
        return upload_to_hub(staged, repo_id, **options)


def _lacks_safetensors(folder: Path) -> bool:
    return not any(folder.glob("*.safetensors"))


def resolve_checkpoint(name_or_path, *, revision: str | None = None, cache_dir=None, token=None,
                       local_files_only: bool = False) -> Path:
    """A local folder as is; otherwise a hub repo id fetched (only the files we use) into the HF cache (``token``:
    a Hugging Face access token for gated or private repos, else HF_TOKEN or the saved login)."""
    path = local_path(name_or_path)
    if path.exists():
        return path
    if is_path_name(name_or_path):
        raise CheckpointError(f"{name_or_path}: no such file or folder")
    return fetch_repo(str(name_or_path), HUB_PATTERNS, fallback_patterns=HUB_PICKLE_PATTERNS,
                      needs_fallback=_lacks_safetensors, revision=revision, cache_dir=cache_dir, token=token,
                      local_files_only=local_files_only)


__all__ = ["HUB_PATTERNS", "HUB_PICKLE_PATTERNS", "HubError", "fetch_repo", "is_path_name", "local_path",
           "create_hub_repo", "push_saved", "resolve_checkpoint", "upload_to_hub"]
