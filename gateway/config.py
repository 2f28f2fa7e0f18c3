"""Gateway settings: one frozen dataclass; `prefixgate serve` flags map onto it one-to-one."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import EngineConfig


@dataclass(frozen=True)
class GatewayConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # protects every route but /health and /metrics
    admin_api_key: str | None = None  # additionally required by the registry admin routes
    max_waiting: int = 256  # requests accepted but not yet started; beyond it: 429
    shutdown_grace: float = 30.0  # seconds in-flight requests get after SIGTERM
    served_model_name: str | None = None  # default: the model's own name
    max_request_bytes: int = 8 << 20  # request bodies above it: 413
    request_read_timeout: float = 30.0  # seconds to receive a whole body, else 408
    metrics_api_key: str | None = None  # when set, /metrics needs it (or the admin key)
    allowed_origins: tuple[str, ...] = ()  # CORS
    default_max_tokens: int = 2048  # chat length when the client sends no max_tokens
    max_prompts: int = 64  # prompts one /v1/completions list may carry
    tokenizer_workers: int = 2  # threads that parse, render and tokenize off the event loop

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.shutdown_grace < 0:
            raise ValueError("shutdown_grace must be >= 0")
