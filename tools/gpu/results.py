"""Where the GPU diagnostics leave their results: $OUT, the folder a device call brings back."""

import json
import os


def save_json(name: str, data) -> str:
    """Write `data` as $OUT/name (default folder /tmp/out); returns the path."""
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
