"""A stand-in for the hub in tests (no network): ``huggingface_hub.snapshot_download`` over local repo folders."""
from __future__ import annotations

import shutil
from fnmatch import fnmatch
from pathlib import Path


class FakeHub:
    """huggingface_hub.snapshot_download over local repo folders: each call recorded, the selected files copied into
    the snapshot folder of (repo, revision), which later calls add to as the real cache does."""

    def __init__(self, tmp_path: Path, repos: dict[str, Path]):
        self.repos, self.cache, self.calls = repos, tmp_path / "cache", []

    def __call__(self, repo_id, *, allow_patterns, revision=None, cache_dir=None, token=None,
                 local_files_only=False):
        self.calls.append(dict(repo_id=repo_id, allow_patterns=allow_patterns, revision=revision,
                               cache_dir=cache_dir, token=token, local_files_only=local_files_only))
        if repo_id not in self.repos:
            raise FileNotFoundError(f"404: no repo {repo_id}")
        snapshot = self.cache / repo_id.replace("/", "--") / (revision or "main")
        for file in self.repos[repo_id].rglob("*"):
            name = file.relative_to(self.repos[repo_id]).as_posix()
            if file.is_file() and any(fnmatch(name, pattern) for pattern in allow_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, snapshot / name)
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(snapshot)

    def fetched(self, repo_id: str, revision: str = "main") -> list[str]:
        snapshot = self.cache / repo_id.replace("/", "--") / revision
        return sorted(f.relative_to(snapshot).as_posix() for f in snapshot.rglob("*") if f.is_file())
