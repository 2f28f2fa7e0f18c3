"""Gateway settings: one frozen dataclass; `prefixgate serve` flags map onto it one-to-one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine import EngineConfig, default_cache_dir, option


@dataclass(frozen=True)
class GatewayConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_keys: tuple[str, ...] = option(
        (),
        "an API key, KEY or NAME=KEY (repeatable): each is a tenant with its own prefix-cache "
        "scope; every route but /health and /metrics then needs one (default: "
        "$PREFIXGATE_API_KEY)",
        env="PREFIXGATE_API_KEY",
        flag="--api-key",
        repeat=True,
    )
    api_key_file: str | None = option(None, "more API keys, one 'NAME: KEY' per line")
    admin_api_key: str | None = option(
        None,
        "key of the registry admin routes, valid on every route; without it those routes are "
        "closed when --api-key is set (default: $PREFIXGATE_ADMIN_API_KEY)",
        env="PREFIXGATE_ADMIN_API_KEY",
    )
    keep_alive_timeout: float = option(
        75.0,
        "seconds an idle HTTP connection stays open; longer than clients' and load balancers' "
        "own idle timeouts (httpx and the OpenAI SDK: 5 s, AWS ALB: 60 s), so that no client "
        "reuses a connection the server is closing at that moment",
    )
    max_waiting: int = option(256, "sequences accepted but not yet started; beyond it: 429")
    shutdown_grace: float = option(30.0, "seconds in-flight requests get after SIGTERM")
    served_model_name: str | None = option(None, "model id clients use (default: the model's)")
    max_request_bytes: int = option(8 << 20, "request bodies above it get 413", size=True)
    request_read_timeout: float = option(30.0, "seconds to receive a whole body, else 408")
    metrics_api_key: str | None = option(
        None, "when set, /metrics needs it (or the admin key)", env="PREFIXGATE_METRICS_API_KEY"
    )
    allowed_origins: tuple[str, ...] = option((), "origins allowed by CORS (* for any)")
    default_max_tokens: int = option(
        2048, "chat completion length when the client sends no max_tokens (capped by the context)"
    )
    max_prompts: int = option(64, "prompts one /v1/completions list may carry")
    response_store: str = option(
        "sqlite",
        "Responses API: where kept responses live: sqlite:PATH (a database file; it survives "
        "restarts and servers on one host may share it), sqlite (responses.sqlite3 in the "
        "cache dir), or memory (this process only) (default: $PREFIXGATE_RESPONSE_STORE, else "
        "sqlite)",
        env="PREFIXGATE_RESPONSE_STORE",
    )
    response_store_entries: int = option(
        1024, "Responses API: responses kept for previous_response_id and GET (0: none)"
    )
    response_store_bytes: int = option(
        256 << 20, "Responses API: bytes the kept responses may take in all", size=True
    )
    response_store_ttl: float = option(
        3600.0, "Responses API: seconds a kept response stays retrievable"
    )
    tokenizer_workers: int = option(
        2, "threads that parse, render and tokenize requests off the event loop"
    )
    replicas: int = option(
        1,
        "engine replicas; above 1 the server runs on Ray Serve, an ingress in front of N "
        "engines (needs the extra: pip install 'prefixgate[ray]')",
    )
    ray_address: str | None = option(
        None, "Ray Serve: join this Ray cluster ('auto': the local one) instead of starting Ray"
    )
    replica_cpus: float = option(
        0.0, "Ray Serve: CPUs each engine replica reserves, so Ray spreads them over nodes"
    )
    replica_timeout: float = option(
        60.0, "Ray Serve: seconds for a replica to take a request, else 503 (all restarting)"
    )
    stream_interval: int = option(
        1,
        "Ray Serve: completion tokens a replica gathers into one message to the ingress (the "
        "first goes at once): fewer messages and less CPU, streams in bursts",
    )
    affinity_slack: int = option(
        4,
        "Ray Serve: requests a conversation's replica may hold beyond the least loaded one "
        "before the conversation moves",
    )

    @property
    def uses_ray(self) -> bool:
        return self.replicas > 1 or self.ray_address is not None

    @property
    def response_db_path(self) -> Path | None:
        """The kept responses' SQLite file; None: kept in memory. `sqlite` is resolved where
        the gateway runs, not where the flags were read: a Ray ingress on another host uses
        its own cache dir."""
        if self.response_store == "memory":
            return None
        _, _, path = self.response_store.partition(":")
        return Path(path).expanduser() if path else default_response_db()

    @property
    def has_api_keys(self) -> bool:
        return bool(self.api_keys) or self.api_key_file is not None

    def __post_init__(self) -> None:
        if self.keep_alive_timeout <= 0:
            raise ValueError("keep_alive_timeout must be > 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.shutdown_grace < 0:
            raise ValueError("shutdown_grace must be >= 0")
        if self.replicas < 1 or self.replica_timeout <= 0 or self.affinity_slack < 0:
            raise ValueError("replicas must be >= 1, replica_timeout > 0, affinity_slack >= 0")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.response_store_entries < 0 or self.response_store_ttl <= 0:
            raise ValueError("response_store_entries must be >= 0 and response_store_ttl > 0")
        kind, _, path = self.response_store.partition(":")
        if self.response_store not in ("memory", "sqlite") and (kind != "sqlite" or not path):
            raise ValueError(
                f"response_store must be memory, sqlite or sqlite:PATH, not {self.response_store!r}"
            )


def default_response_db() -> Path:
    """Where `--response-store sqlite` keeps responses: beside the other things this machine
    keeps between runs."""
    return default_cache_dir() / "responses.sqlite3"
