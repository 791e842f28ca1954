"""Tenants: the clients a server knows, what each may use, and the salted hashes their keys are known by.

`--tenants-file` names a JSON or YAML file:

    {"tenants": [{"name": "team-a", "key_hash": "sha256$...$...", "requests_per_minute": 60,
                  "tokens_per_minute": 20000, "max_concurrent": 8, "priority": 0, "weight": 1.0,
                  "models": ["SmolLM2-135M-Instruct"], "admin": false}]}

Every field but `name` and `key_hash` is optional (no limit, priority 0, weight 1, every model, not admin).
`key_hash` is what `tokenmill hash-key` prints for a key read from stdin: a random salt and the SHA-256 of salt and
key, never the key. An API key is a long random secret (`tokenmill hash-key --new` makes one), so one salted hash
is enough; a password would need a slow one. `--api-key` is one admin tenant named "default" with no limits.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tokenmill.request import TenantShare

_SCHEME = "sha256"
_SALT_BYTES = 16
MIN_KEY_CHARS = 20  # shorter keys are refused by `hash-key`: the hash must not be worth a brute-force search
DEFAULT_TENANT = "default"  # the one tenant of --api-key
# a tenant's name is a metrics label and the name of its folder of files
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")

# the tenant a request is handled for (set by server/tenant_gate.py; inherited by the in-process work it starts)
current_tenant: contextvars.ContextVar[Optional["Tenant"]] = contextvars.ContextVar("current_tenant", default=None)


def hash_key(key: str, salt: Optional[bytes] = None) -> str:
    """`sha256$<salt hex>$<digest hex>` of `key` with a new random salt (or `salt`)."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    return f"{_SCHEME}${salt.hex()}${_digest(salt, key.encode('utf-8', 'surrogatepass'))}"


def _digest(salt: bytes, key: bytes) -> str:
    return hashlib.sha256(salt + key).hexdigest()


def _parse_hash(text: str, where: str) -> tuple[bytes, str]:
    parts = text.split("$")
    if len(parts) != 3 or parts[0] != _SCHEME:
        raise ValueError(f"{where}: key_hash must be what `tokenmill hash-key` prints (sha256$<salt>$<digest>)")
    try:
        salt = bytes.fromhex(parts[1])
        int(parts[2], 16)
    except ValueError:
        raise ValueError(f"{where}: key_hash is not hexadecimal where `tokenmill hash-key` writes hex") from None
    if len(salt) < 8 or len(parts[2]) != 64:
        raise ValueError(f"{where}: key_hash has a salt shorter than 8 bytes or a digest that is not SHA-256's")
    return salt, parts[2]


@dataclass(frozen=True)
class Tenant:
    """One client of the server and its limits (None: unlimited)."""

    name: str
    key_hash: str
    requests_per_minute: Optional[int] = None
    tokens_per_minute: Optional[int] = None
    max_concurrent: Optional[int] = None
    priority: int = 0  # vLLM's convention: lower runs first; a request's own priority is never better than this
    weight: float = 1.0  # its share of the engine against other tenants of the same priority
    models: Optional[tuple[str, ...]] = None  # the served model names and adapters it may use (None: all)
    admin: bool = False  # may call the operational routes (weights, sleep, pause, adapters)
    # its requests' prefix-cache blocks are reachable from its own requests only (each request's cache_salt is
    # combined with the tenant's name): no other tenant can time a prefix hit on what it sent
    isolate_cache: bool = False

    @property
    def share(self) -> TenantShare:
        """What the scheduler knows of the tenant."""
        return TenantShare(self.name, self.weight)

    def may_use(self, model: str) -> bool:
        """Whether the tenant may send requests to `model`."""
        return self.models is None or model in self.models


_INT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def tenant_from_dict(entry: Any, index: int) -> Tenant:
    """A tenant from one entry of the file's list; ValueError naming the entry and field that are wrong."""
    where = f"tenants[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with name and key_hash")
    unknown = set(entry) - {f for f in Tenant.__dataclass_fields__}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    for field in ("name", "key_hash"):
        if not isinstance(entry.get(field), str) or not entry[field]:
            raise ValueError(f"{where}.{field} is required (a non-empty string)")
    if not _NAME.fullmatch(entry["name"]):
        raise ValueError(f"{where}.name must be 1-64 letters, digits, '.', '_' or '-' (not starting with '.'), "
                         f"got {entry['name']!r}")
    where = f"tenants[{index}] ({entry['name']})"
    _parse_hash(entry["key_hash"], where)
    for field in _INT_FIELDS:
        value = entry.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{where}.{field} must be an integer >= 1, got {value!r}")
    if type(entry.get("priority", 0)) is not int:
        raise ValueError(f"{where}.priority must be an integer, got {entry['priority']!r}")
    weight = entry.get("weight", 1.0)
    if type(weight) not in (int, float) or not 0 < weight <= 1e6:
        raise ValueError(f"{where}.weight must be a number in (0, 1e6], got {weight!r}")
    for flag in ("admin", "isolate_cache"):
        if type(entry.get(flag, False)) is not bool:
            raise ValueError(f"{where}.{flag} must be true or false, got {entry[flag]!r}")
    models = entry.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise ValueError(f"{where}.models must be a list of model names")
    return Tenant(**{**entry, "weight": float(weight), "models": None if models is None else tuple(models)})


class Tenants:
    """The tenants a server knows, found by key. Every lookup hashes the key with every tenant's salt and compares
    each digest in constant time, whatever matched before: the time taken says nothing of which tenant, if any,
    a key belongs to."""

    def __init__(self, tenants: list[Tenant], source: Optional[str] = None) -> None:
        names = [t.name for t in tenants]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"tenant names must be unique: {', '.join(duplicated)} appear more than once")
        if not tenants:
            raise ValueError("a tenants file names at least one tenant")
        self.tenants = tuple(tenants)
        self.source = source
        self._salted = [(_parse_hash(t.key_hash, t.name), t) for t in tenants]

    @classmethod
    def from_file(cls, path: str) -> "Tenants":
        """The tenants of a JSON or YAML file (by its suffix; JSON otherwise); ValueError saying what is wrong."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"tenants_file {path!r} cannot be read: {exc.strerror}") from None
        try:
            if Path(path).suffix in (".yaml", ".yml"):
                import yaml

                document = yaml.safe_load(text)
            else:
                document = json.loads(text)
        except Exception as exc:  # the parser's own message says where
            raise ValueError(f"tenants_file {path!r} does not parse: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("tenants"), list):
            raise ValueError(f"tenants_file {path!r} must hold {{\"tenants\": [...]}}")
        return cls([tenant_from_dict(entry, i) for i, entry in enumerate(document["tenants"])], path)

    @classmethod
    def single_key(cls, key: str) -> "Tenants":
        """`--api-key`: one admin tenant, without limits."""
        return cls([Tenant(DEFAULT_TENANT, hash_key(key), admin=True)])

    @property
    def names(self) -> tuple[str, ...]:
        """The tenants' names, in the file's order."""
        return tuple(t.name for t in self.tenants)

    def identify(self, key: bytes) -> Optional[Tenant]:
        """The tenant whose key is `key`, or None."""
        found = None
        for (salt, digest), tenant in self._salted:
            if hmac.compare_digest(_digest(salt, key), digest):
                found = tenant
        return found


def require_admin(action: str) -> None:
    """Raise a 403 APIError unless the request is an admin tenant's (`action`: what it would do)."""
    from tokenmill.server.serving_common import APIError

    tenant = current_tenant.get()
    if tenant is None:
        raise APIError(403, f"{action}: it needs the key of an admin tenant (start the server with --api-key, or "
                            "--tenants-file with an admin tenant)", "permission_error")
    if not tenant.admin:
        raise APIError(403, f"{action}: tenant '{tenant.name}' is not an admin tenant", "permission_error")
