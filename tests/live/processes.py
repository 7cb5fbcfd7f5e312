"""Which processes a test left behind: each test's children carry a tag of its own in their environment, so
tests running side by side (pytest -n) never count each other's servers."""

from __future__ import annotations

import os
import uuid

import psutil

TAG = "ENGINE_TEST_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str) -> dict[str, str]:
    """This process's environment with the tag: for a subprocess whose children are to be found later."""
    return {**os.environ, TAG: tag}


def leftovers(tag: str) -> list[str]:
    """The command lines of live processes (zombies aside) started with `tag` in their environment."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(TAG) == tag:
                found.append(" ".join(p.info["cmdline"] or []))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found
