"""API keys as tenants: who is calling, and which cache scope their requests live in.

`--api-key` may be given several times, each `KEY` or `NAME=KEY`; `--api-key-file` holds one
`NAME: KEY` per line (`#` comments, blank lines). A value whose text after its first `=` is
empty or only `=` is a key (base64's padding), not a name and an empty key. Each key is a
tenant: its name is what prefixes.yaml's `tenants:` lists (an unnamed key's is `key-` and 8
hex digits of a digest of the key: the same whatever other keys are given or in what order,
so what a tenant owns, such as stored responses, never passes to another when a key is
revoked or the list reordered), and a digest of the key salts its requests' automatic
prefix cache, so one tenant's prompts can never be detected through another's
`cached_tokens` or latency. A request's own `cache_salt` narrows its scope further, within
its tenant's. With no keys configured there is one shared scope.

Keys are looked up by their SHA-256 digest: the comparison never touches the key itself, so
its time says nothing about how much of a guess was right.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from engine import EngineConfig

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    scope: str  # hex digest of the key: the tenant's cache scope

    def cache_salt(self, request_salt: str | None) -> str:
        """The engine's cache scope for a request of this tenant."""
        return f"{self.scope}/{request_salt or ''}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The configured API keys and their tenants."""

    def __init__(self, keys: tuple[str, ...] = (), key_file: str | None = None) -> None:
        named = [_parse_key(value) for value in keys]
        if key_file is not None:
            named += _read_key_file(Path(key_file))
        self._tenants: dict[bytes, Tenant] = {}
        names: set[str] = set()
        for name, key in named:
            if not key:
                raise ValueError("an API key is empty")
            if name in names:
                raise ValueError(f"API key name {name!r} is given twice")
            digest = _digest(key)
            if digest in self._tenants:
                raise ValueError(f"API keys {self._tenants[digest].name!r} and {name!r} are equal")
            names.add(name)
            self._tenants[digest] = Tenant(name, hashlib.sha256(b"scope:" + digest).hexdigest())

    @property
    def is_empty(self) -> bool:
        return not self._tenants

    @property
    def names(self) -> list[str]:
        return sorted(tenant.name for tenant in self._tenants.values())

    def serving(self, engine: EngineConfig) -> EngineConfig:
        """`engine` told these keys' names: its prefix file's `tenants:` may list no other."""
        return dataclasses.replace(engine, tenant_names=tuple(self.names))

    def tenant_of(self, token: str | None) -> Tenant | None:
        """The tenant whose key `token` is, if any."""
        if not token:  # an empty header is no key, whatever keys are configured
            return None
        return self._tenants.get(_digest(token))


def _parse_key(value: str) -> tuple[str, str]:
    """`KEY` or `NAME=KEY` -> (name, key). A key with `=` in it reads as NAME=KEY when the
    text before the first `=` could be a name; what follows must then be more than padding
    (`dG9rZW4=` is a key, not the tenant dG9rZW4 with an empty key, which any empty header
    would then have matched)."""
    name, separator, key = value.partition("=")
    if separator and _NAME.match(name) and key.strip("="):
        return name, key
    # named by its digest, not its position: see the module's docstring
    return f"key-{hashlib.sha256(b'name:' + _digest(value)).hexdigest()[:8]}", value


def _read_key_file(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc}") from exc
    named = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        name, separator, key = text.partition(":")
        name, key = name.strip(), key.strip()
        if not separator or not _NAME.match(name) or not key:
            raise ValueError(
                f"{path}:{number}: expected 'NAME: KEY' (a name of letters, digits, '.', '_' "
                "or '-', then the key)"
            )
        named.append((name, key))
    return named


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is from: a tenant (one of the API keys), the admin (the admin key, or
    anyone on a server without keys), or anyone (inference on a server with only an admin
    key)."""

    tenant: Tenant | None = None
    is_admin: bool = False

    @property
    def tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    def cache_salt(self, request_salt: str | None) -> str | None:
        """The engine's cache scope: the tenant's, narrowed by the request's own salt."""
        return self.tenant.cache_salt(request_salt) if self.tenant is not None else request_salt

    def sees(self, tenants: tuple[str, ...] | None) -> bool:
        """May this caller see a registry entry limited to `tenants` (None: everyone)?"""
        return self.is_admin or tenants is None or self.tenant_name in tenants
