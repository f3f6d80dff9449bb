"""Files written so that a crash at any moment leaves either the old file or the new one, never half."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path, text: str) -> None:
    """Write to a temporary name beside ``path``, fsync, then rename over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
