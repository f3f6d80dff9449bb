"""What a tokenizer folder's JSON files say, read as transformers reads them: tokenizer_config.json completed from
special_tokens_map.json and the chat template files, and the special tokens it names. Shared by the fast
tokenizer (models/tokenizer.py) and the rebuilt slow ones (models/slow_tokenizers.py)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json(file: Path, error: type[Exception]):
    """``file``'s JSON; ``error`` (the caller's VkformersError) names the file when it is not JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{file}: not valid JSON ({exc})") from None


def token_text(value) -> str | None:
    """A special token as the files spell it (a string, a serialised AddedToken dict or a tokenizers.AddedToken),
    as its text."""
    if isinstance(value, dict):
        return value.get("content")
    if value is None:
        return None
    return getattr(value, "content", None) or str(value)


def extra_special_tokens(config: dict) -> list:
    """The special tokens beyond the named ones (bos_token, ...): ``extra_special_tokens`` (transformers 5's
    spelling), else ``additional_special_tokens``; a dict of model-specific tokens counts by its values."""
    extra = config.get("extra_special_tokens")
    if not (isinstance(extra, list) and extra):
        extra = config.get("additional_special_tokens") or extra or []
    return list(extra.values()) if isinstance(extra, dict) else list(extra)


def merge_special_tokens_map(config: dict, special_map: dict) -> dict:
    """special_tokens_map.json over tokenizer_config.json, as transformers 5 merges them: only for a config without
    ``added_tokens_decoder`` (saved before it existed; a newer config holds every special token itself), where the
    map's tokens win, its extra special tokens are appended to the config's, and its additional_special_tokens
    count only when the config has no extra special tokens of its own."""
    config = dict(config)
    if "added_tokens_decoder" in config:
        return config
    if config.get("additional_special_tokens") and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    for name, value in special_map.items():
        if name == "extra_special_tokens" and isinstance(value, list):
            kept = list(config.get("extra_special_tokens") or [])
            seen = {token_text(token) for token in kept}
            value = kept + [token for token in value if token_text(token) not in seen]
        elif name == "additional_special_tokens" and config.get("extra_special_tokens"):
            continue
        config[name] = value
    return config


def tokenizer_config(folder: Path, error: type[Exception]) -> dict:
    """tokenizer_config.json, completed from special_tokens_map.json and chat_template.jinja (or a processor's
    chat_template.json) when present."""
    folder = Path(folder)
    file = folder / "tokenizer_config.json"
    config = read_json(file, error) if file.is_file() else {}
    if (folder / "special_tokens_map.json").is_file():
        config = merge_special_tokens_map(config, read_json(folder / "special_tokens_map.json", error))
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        config.setdefault("chat_template", read_json(folder / "chat_template.json", error).get("chat_template"))
    return config
