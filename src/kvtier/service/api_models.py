"""OpenAI-compatible request and response bodies of the router (the schema /openapi.json publishes).

The router validates what it routes on (model, prompt/messages, max_tokens, sampling bounds) and passes
any other OpenAI/vLLM field through to the engine, which validates it again. `tier` is kvtier's own
field (also accepted as the `x-kvtier-tier` header); callers cannot set `kvtier_*` engine arguments.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16
TIER_PATTERN = r"^[A-Za-z0-9_.-]+$"


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=256)
    tier: str | None = Field(default=None, max_length=128, pattern=TIER_PATTERN,
                             description="kvtier: serve in this memory tier (must be allowed for the API key)")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = Field(default=None, max_length=256)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @field_validator("vllm_xargs")
    @classmethod
    def _no_kvtier_xargs(cls, v):
        if v and (keys := sorted(k for k in v if k.startswith("kvtier_"))):
            raise ValueError(f"{keys}: eviction settings come from the tier; choose a tier with `tier`")
        return v


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A prompt, a batch of prompts, or token ids (one list or a batch of lists)")
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            if any(isinstance(t, int) and t < 0 for t in (v if isinstance(v[0], int) else ())):
                raise ValueError("token ids must be non-negative")
            if len(v) > 64 and not isinstance(v[0], int):
                raise ValueError("at most 64 prompts per request")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvtier"
    tiers: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
