"""The prefixes file on disk: read it whole (parse, validate, render, compile each entry's
response_format) and poll it for changes.

A writer that is not atomic (an editor saving in place, `cat > file`) leaves a half-written
file for a moment, often one that is still valid YAML with fewer entries; acting on it would
drop prefixes until the next poll. So a change is reported only when two polls in a row read
identical bytes (README: write atomically anyway).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import GrammarSpec
from engine.registry.file import parse_prefix_bytes, read_prefix_file
from engine.registry.spec import PrefixSpec, RegistryFileError

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer


class PrefixFileWatcher:
    """Engine-thread only. `path` None: no file is configured (a read says so)."""

    def __init__(
        self,
        path: Path | None,
        tokenizer: Tokenizer,
        max_model_len: int,
        check_grammar: Callable[[GrammarSpec], None],
        tenant_names: tuple[str, ...] | None = None,
    ) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # a function, not the compiler: the compiler's view of the tokenizer (0.3-1 s and up
        # to ~135 MB) is built by the first constrained request, not by a file's contracts
        # (`RequestChecker.check`)
        self.check_grammar = check_grammar
        # the API keys' names (EngineConfig.tenant_names); None: `tenants:` is not checked
        self.tenant_names = tenant_names
        # sha-256 of the file as last read, and as read by the last poll
        self._read_digest: bytes | None = None
        self._settling_digest: bytes | None = None

    def read(self) -> list[PrefixSpec]:
        """Every entry of the file, or one RegistryFileError listing all that is wrong. The
        digest of the bytes read (valid or not, None when unreadable) is remembered, so a
        poll reports a change only when the file changes again."""
        if self.path is None:
            raise RegistryFileError(Path("<none>"), ["no prefix file is configured"])
        try:
            content = read_prefix_file(self.path)
        except RegistryFileError:
            self._read_digest = self._settling_digest = None
            raise
        self._read_digest = self._settling_digest = _digest(content)
        specs = parse_prefix_bytes(content, self.path, self.tokenizer, self.max_model_len)
        self._check_contracts(specs, self.path)
        self._check_tenants(specs, self.path)
        return specs

    def poll(self) -> bool:
        """True when the file changed since the last read and the last two polls read the
        same bytes: time to reload."""
        if self.path is None:
            return False
        try:
            digest = _digest(self.path.read_bytes())
        except OSError:
            digest = None
        if digest == self._read_digest or digest != self._settling_digest:
            self._settling_digest = digest
            return False
        return True

    def _check_contracts(self, specs: list[PrefixSpec], path: Path) -> None:
        """Each entry's response_format is checked now: a bad schema fails the file (old
        registry kept), not the first request that hits the entry."""
        problems = []
        for spec in specs:
            if spec.contract.grammar is None:
                continue
            try:
                self.check_grammar(spec.contract.grammar)
            except InvalidRequestError as exc:
                problems.append(f"entry '{spec.name}' field 'response_format': {exc.message}")
        if problems:
            raise RegistryFileError(path, problems)

    def _check_tenants(self, specs: list[PrefixSpec], path: Path) -> None:
        """Each entry's `tenants:` must name API keys the server has: a name that matches no
        key (a typo, a key since renamed) fails the file, old registry kept, instead of leaving
        the entry silently unreachable for the tenant meant."""
        if self.tenant_names is None:
            return
        known = set(self.tenant_names)
        have = (
            f"the API keys' names: {', '.join(sorted(known))}"
            if known
            else "the server has no API keys: --api-key NAME=KEY names a tenant"
        )
        problems = [
            f"entry '{spec.name}' field 'tenants': no API key is named "
            f"{', '.join(repr(n) for n in unknown)} ({have})"
            for spec in specs
            if (unknown := [n for n in spec.tenants or () if n not in known])
        ]
        if problems:
            raise RegistryFileError(path, problems)


def _digest(content: bytes) -> bytes:
    return hashlib.sha256(content).digest()
