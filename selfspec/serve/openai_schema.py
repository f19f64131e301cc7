"""The OpenAI wire format the server speaks: request bodies (validated), responses, stream chunks,
and errors. Field names and shapes follow the OpenAI API reference; `selfspec` is our one
extension key, in requests (how to speculate) and in `usage` (what speculation achieved).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from selfspec.core.speculation import AUTO, TAKES, Speculation
from selfspec.core.stats import GenerationStats


# The options a request may set under `selfspec` (selfspec.core.speculation.Speculation defines
# them): the ones that name no file on the server's disk.
REQUEST_OPTIONS = ("method", "exit_layer", "draft_len", "threshold", "ngram")
MAX_DRAFT_LEN = 16  # a request's γ: each round's verify holds γ + 1 rows of every active request


def request_speculation(value: dict | None) -> dict | None:
    """The `selfspec` field, checked: only REQUEST_OPTIONS, each valid as a Speculation's. Unset
    options take the server's defaults (its command line, else method "auto"); the server lays
    this over them with `Speculation.override`, which checks the options suit the method."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(REQUEST_OPTIONS))
    if unknown:
        raise ValueError(f"unrecognized speculation option(s) {', '.join(unknown)}; a request may set "
                         f"{', '.join(REQUEST_OPTIONS)}")
    given = {k: v for k, v in value.items() if v is not None}
    if "method" in given and not isinstance(given["method"], str):
        raise ValueError(f"method must be a string, got {given['method']!r}")
    Speculation.from_options(**{**given, "method": AUTO})  # types and ranges; the method is checked on override
    if given.get("draft_len", 0) > MAX_DRAFT_LEN:
        raise ValueError(f"draft_len must be at most {MAX_DRAFT_LEN} in a request, got {given['draft_len']}")
    if "method" in given and given["method"] not in TAKES:
        raise ValueError(f"unknown method {given['method']!r}; choose one of: {', '.join(TAKES)}")
    return given


class _Common(BaseModel):
    """Fields shared by chat and text completions. Unknown fields are refused (as OpenAI does),
    so a typo is an error rather than silently ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: dict | None = None
    # Accepted so that clients sending their defaults work; values that would change the output
    # in ways selfspec does not implement are refused in `unsupported`.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None
    selfspec: dict | None = None  # how to speculate: see request_speculation

    @field_validator("selfspec")
    @classmethod
    def _selfspec(cls, v):
        return request_speculation(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    def unsupported(self) -> str | None:
        """A message naming the first requested feature the server does not implement, or None."""
        if self.n != 1:
            return "n must be 1: selfspec returns one choice per request (send several requests instead)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported; leave them at 0"
        if self.logprobs:
            return "logprobs are not supported"
        return None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool fields: ignored, they do not change the text
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise ValueError("one prompt per request: send several requests for several prompts")
            return self.prompt[0]
        if self.echo:
            raise ValueError("echo is not supported")
        return self.prompt


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(stats: GenerationStats) -> dict:
    """OpenAI usage plus, under `selfspec`, how speculation went for this request."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prefix_tokens},  # read from a prefix store
        "selfspec": {
            "method": stats.method,
            "exit_layer": stats.exit_layer,
            "draft_len": stats.draft_len,
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "alpha": stats.alpha,
            "mean_accepted_length": stats.mean_accepted_length,
            "tokens_per_s": stats.tokens_per_s,
            "sources": stats.by_source,  # rounds, drafted, accepted by the drafter of each round
        },
    }


class Reply:
    """Builds one request's response objects: the same id and timestamp in every chunk."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage(stats)
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, stats: GenerationStats) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage(stats)
        return out
