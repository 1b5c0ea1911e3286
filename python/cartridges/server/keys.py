"""API keys: random, shown once, stored only as SHA-256 hashes (docs/api.md §0)."""

from __future__ import annotations

import hashlib
import secrets
import sys
from typing import Any, TextIO

from cartridges.store import core

KEY_PREFIX = "sk-cart-"
DEFAULT_USER = "default"
ADMIN_USER = "admin"  # owns what the admin key creates; reserved for `keys create`


def generate_key() -> str:
    """A fresh key: the prefix and 192 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_hint(key: str) -> str:
    """What `keys list` shows: enough to recognise a key, not enough to use it."""
    return key[: len(KEY_PREFIX) + 4] + "..."


def create_key(store: Any, user_name: str, key: str | None = None) -> str:
    """Adds a key for user_name (creating the user if needed) and returns it."""
    user = find_or_create_user(store, user_name)
    key = key or generate_key()
    store.add_key(user.id, hash_key(key), key_hint(key))
    return key


def find_or_create_user(store: Any, name: str) -> Any:
    """The user `name`, created if missing (by this server or, at the same moment, another)."""
    found = store.find_user(name)
    if found is not None:
        return found
    try:
        return store.create_user(name)
    except core().ConflictError:
        return store.find_user(name)


def bootstrap(store: Any, api_key: str | None, out: TextIO = sys.stdout) -> None:
    """On a store with no users: user `default` with api_key, or a fresh key printed once."""
    if store.list_users():
        return
    try:
        key = create_key(store, DEFAULT_USER, api_key)
    except core().ConflictError:
        return  # another server sharing the database bootstrapped it at the same moment
    if api_key is None:
        print(f"Created user '{DEFAULT_USER}' with API key (shown once): {key}", file=out, flush=True)
    else:
        print(f"Created user '{DEFAULT_USER}' with the key from CARTRIDGES_API_KEY", file=out, flush=True)
