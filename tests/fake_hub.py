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


class FakeHubApi:
    """huggingface_hub.HfApi's create_repo and upload_folder over a FakeHub's repo folders (``HfApi(token=...)``
    returns it): an upload copies the folder's files into the repo, one commit each, which the FakeHub then serves.
    A token of "read-only" is refused as the hub refuses a token without write access."""

    def __init__(self, hub: FakeHub, root: Path):
        self.hub, self.root, self.calls = hub, root, []

    def __call__(self, token=None, **unused) -> "FakeHubApi":
        self.token = token
        return self

    def create_repo(self, repo_id, *, private=None, exist_ok=False, repo_type=None, **unused):
        self.calls.append(("create_repo", repo_id, dict(private=private, exist_ok=exist_ok, token=self.token)))
        if self.token == "read-only":
            raise PermissionError("403 Forbidden: the token cannot write")
        if repo_id not in self.hub.repos:
            self.hub.repos[repo_id] = self.root / repo_id.replace("/", "--")
            self.hub.repos[repo_id].mkdir(parents=True)

    def upload_folder(self, *, repo_id, folder_path, commit_message, repo_type=None, commit_description=None,
                      create_pr=False, revision=None, **unused):
        files = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        self.calls.append(("upload_folder", repo_id, dict(files=files, commit_message=commit_message,
                                                          create_pr=create_pr, revision=revision)))
        shutil.copytree(folder_path, self.hub.repos[repo_id], dirs_exist_ok=True)
        commits = sum(1 for call in self.calls if call[0] == "upload_folder")
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/{commits}"})()
