"""OpenAI's completion and chat-completion requests, checked into one :class:`GenerationRequest`, and the replies.

A request names only fields kvq can honour. A field that changes the output in a way kvq cannot reproduce
(``n`` > 1, ``logprobs``, ``presence_penalty``, tools, ...) is refused with a 400 naming it, never ignored; such a
field sent at the value that means "off" (``n: 1``, ``presence_penalty: 0``) is accepted, since it asks for
nothing. ``top_k`` and ``repetition_penalty`` are accepted as extensions (``extra_body`` in the ``openai`` client):
kvq's sampler supports both. ``temperature`` defaults to 0 (greedy), as in ``kvq generate``.

Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvq_export.errors import KVQError
from kvq_export.runtime.sampling import SamplingConfig

#: Sampling fields both endpoints read (None = not given).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "repetition_penalty")
COMMON_FIELDS = ("model", "max_tokens", "stop", "stream", "stream_options", "user", "cache_prompt", *SAMPLING_FIELDS)
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "max_completion_tokens")
#: Fields accepted only at the value that asks for nothing (anything else is refused by name).
NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
           "best_of": (1,), "echo": (False,), "suffix": ("",), "top_logprobs": (0,), "parallel_tool_calls": (False,)}
CHAT_ROLES = ("system", "user", "assistant")
#: OpenAI's limit on stop sequences.
MAX_STOP = 4
#: OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat defaults to the rest of the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: What onnxruntime-genai's sampler holds (float32 temperature and top_p, int32 top_k): a request kvq serve accepts
#: is one the same export also runs under onnxruntime-genai, and no value overflows on the way
FLOAT32_TINY, FLOAT32_MAX, INT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38, 2**31 - 1


class RequestError(KVQError):
    """A request the server refuses: its HTTP status, OpenAI error type, the field at fault and an error code."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request. ``prompt``: text or token ids (completions) or the chat ``messages`` (chat)."""

    chat: bool
    model: str
    prompt: str | tuple[int, ...] | tuple[dict[str, str], ...]
    max_tokens: int | None
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    #: reuse a cached prefix and leave this prompt's codes for later requests (llama-server's field); the answer is
    #: the same either way
    cache_prompt: bool = True


def parse_completion(body: Any, *, served: str) -> GenerationRequest:
    """Check a ``/v1/completions`` body; raises :class:`RequestError` naming the first bad field."""
    fields = _fields(body, COMPLETION_FIELDS, required=("model", "prompt"))
    return _request(fields, served, chat=False, prompt=_prompt(fields["prompt"]), max_tokens=fields.get("max_tokens"),
                    max_name="max_tokens")


def parse_chat(body: Any, *, served: str) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body; raises :class:`RequestError` naming the first bad field."""
    fields = _fields(body, CHAT_FIELDS, required=("model", "messages"))
    both = [name for name in ("max_tokens", "max_completion_tokens") if fields.get(name) is not None]
    if len(both) == 2 and fields["max_tokens"] != fields["max_completion_tokens"]:
        raise RequestError("max_tokens and max_completion_tokens differ; send one of them", param="max_tokens")
    name = both[-1] if both else "max_tokens"
    return _request(fields, served, chat=True, prompt=_messages(fields["messages"]), max_tokens=fields.get(name),
                    max_name=name)


def _fields(body: Any, allowed: tuple[str, ...], *, required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = sorted(name for name, value in body.items()
                     if name not in allowed and not (name in NEUTRAL and _is_neutral(name, value)))
    if refused:
        raise RequestError(f"unsupported field(s): {', '.join(refused)}; kvq serve reads: {', '.join(allowed)}"
                           f" (and {', '.join(NEUTRAL)} only at their neutral values)", param=refused[0],
                           code="unsupported_field")
    fields = {name: value for name, value in body.items() if name in allowed and value is not None}
    for name in required:
        if name not in fields:
            raise RequestError(f"missing required field {name!r}", param=name)
    return fields


def _is_neutral(name: str, value: Any) -> bool:
    # a bool is never a number here: logprobs=false is neutral, logprobs=0 is not the same request
    return value is None or any(isinstance(value, bool) == isinstance(ok, bool) and value == ok
                                for ok in NEUTRAL[name])


def _request(fields: dict[str, Any], served: str, *, chat: bool, prompt, max_tokens: Any,
             max_name: str) -> GenerationRequest:
    model = fields["model"]
    if model != served:
        raise RequestError(f"model {model!r} is not served here; allowed: {served!r}", status=404, param="model",
                           code="model_not_found")
    if max_tokens is not None and (not _integer(max_tokens) or max_tokens < 1):
        raise RequestError(f"invalid {max_name}={max_tokens!r}: allowed: an integer >= 1", param=max_name)
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"invalid stream={stream!r}: allowed: true or false", param="stream")
    options = fields.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise RequestError(f"invalid stream_options={options!r}: allowed: {{\"include_usage\": true|false}}",
                               param="stream_options")
        include_usage = options.get("include_usage", False)
    if "user" in fields and not isinstance(fields["user"], str):
        raise RequestError("invalid user: allowed: a string", param="user")
    cache_prompt = fields.get("cache_prompt", True)
    if not isinstance(cache_prompt, bool):
        raise RequestError(f"invalid cache_prompt={cache_prompt!r}: allowed: true or false", param="cache_prompt")
    return GenerationRequest(chat=chat, model=model, prompt=prompt, max_tokens=max_tokens,
                             sampling=_sampling(fields), stop=_stop(fields.get("stop")), stream=stream,
                             include_usage=include_usage, cache_prompt=cache_prompt)


def _sampling(fields: dict[str, Any]) -> SamplingConfig:
    for name in SAMPLING_FIELDS:
        value = fields.get(name)
        integral = name in ("top_k", "seed")
        if value is not None and not (_integer(value) if integral else _number(value)):
            raise RequestError(f"invalid {name}={value!r}: allowed: {'an integer' if integral else 'a number'}",
                               param=name)
    temperature, top_p, top_k = (fields.get(name) for name in ("temperature", "top_p", "top_k"))
    if temperature is not None and temperature != 0 and not FLOAT32_TINY <= temperature <= FLOAT32_MAX:
        raise RequestError(f"invalid temperature={temperature!r}: allowed: 0 (greedy) or a number from "
                           f"{FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g} (float32)", param="temperature")
    if top_p is not None and 0 < top_p < FLOAT32_TINY:
        raise RequestError(f"invalid top_p={top_p!r}: allowed: a probability from {FLOAT32_TINY:.4g} (float32) to 1",
                           param="top_p")
    if top_k is not None and top_k > INT32_MAX:
        raise RequestError(f"invalid top_k={top_k!r}: allowed: an integer from 1 to {INT32_MAX}", param="top_k")
    try:
        return SamplingConfig(temperature=fields.get("temperature", 0.0), top_k=fields.get("top_k"),
                              top_p=fields.get("top_p"), seed=fields.get("seed"),
                              repetition_penalty=fields.get("repetition_penalty", 1.0))
    except KVQError as err:
        param = next((name for name in SAMPLING_FIELDS if f"invalid {name}=" in str(err)), None)
        raise RequestError(str(err), param=param) from None


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"invalid stop={value!r}: allowed: a non-empty string or a list of at most {MAX_STOP}",
                           param="stop")
    return tuple(stops)


def _prompt(value: Any) -> str | tuple[int, ...]:
    """One prompt: a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise RequestError("prompt is empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(_integer(t) for t in value):
        return tuple(value)
    raise RequestError("invalid prompt: allowed: one non-empty string or one non-empty list of token ids "
                       "(one prompt per request)", param="prompt")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise RequestError("invalid messages: allowed: a non-empty list of {role, content}", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}]: expected an object with role and content", param="messages")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise RequestError(f"messages[{i}]: unsupported field(s): {', '.join(extra)}; allowed: role, content",
                               param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role={role!r}: allowed: {', '.join(CHAT_ROLES)}", param="messages")
        out.append({"role": role, "content": _content(message.get("content"), i)})
    return tuple(out)


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{index}].content: allowed: a string or a list of text parts "
                       "({\"type\": \"text\", \"text\": ...})", param="messages")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def bounded_max_tokens(request: GenerationRequest, prompt_tokens: int, positions: int) -> int:
    """The tokens a request may generate (so that no request holds a batch slot past its context).

    What it asked for, refused (400, with the numbers) when the prompt plus that exceeds the model's positions;
    unset: 16 for completions (OpenAI's default), the rest of the context for chat.
    """
    room = positions - prompt_tokens
    if room < 1:
        raise RequestError(f"the prompt has {prompt_tokens} tokens; this model has {positions} positions, so it "
                           "leaves no room for a generated token", param="messages" if request.chat else "prompt",
                           code="context_length_exceeded")
    wanted = request.max_tokens
    if wanted is None:
        return room if request.chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if prompt_tokens + wanted > positions:
        raise RequestError(f"the prompt ({prompt_tokens} tokens) plus max_tokens ({wanted}) is "
                           f"{prompt_tokens + wanted} tokens, beyond the {positions} positions of this model; "
                           f"allowed: max_tokens <= {room}", param="max_tokens", code="context_length_exceeded")
    return wanted


class Reply:
    """The response objects of one request (completion or chat), sharing its id and creation time."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        """OpenAI's usage block."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def full(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        """A non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        """One streamed event: a text delta, or the last one carrying ``finish_reason``."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The streamed usage event (``stream_options.include_usage``): no choices."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}
