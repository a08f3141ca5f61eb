"""Request bodies of the inference routes as pydantic models: the OpenAPI schema (``/openapi.json``) declares
them, and each route validates its body against its model, so a wrong type is a 400 naming the field.

The models type the fields the engine reads and allow every other field (routers and SDKs forward upstream
fields this engine ignores). Checks that need the engine (token ids against the vocabulary, lengths against
the context, sampling values) stay in the routes and in ``SamplingParams``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.scheduler.sampling_params import SamplingParams
from engine.server.http_utils import HTTPError

_BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

# A request's cache key space (upstream's ``cache_salt``): requests with different salts share no cached KV.
CacheSalt = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class GenerateReqInput(_Body):
    """SGLang's ``POST /generate`` body (one prompt or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    cache_salt: CacheSalt | list[CacheSalt] | None = None
    # Upstream's name of the same key space on /generate; the only salt field sglang-router 0.3.2 passes on
    # for this route (it rebuilds the body and drops ``cache_salt``). Equal to ``cache_salt`` if both given.
    extra_key: CacheSalt | list[CacheSalt] | None = None
    image_data: str | list[str] | list[list[str]] | None = None


class _OpenAIRequest(_Body):
    """Fields shared by the completion and chat bodies."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    cache_salt: CacheSalt | None = None


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: a prompt as text or token ids, or a list of prompts (strings or id lists)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False


class TextContentPart(_Body):
    type: Literal["text"]
    text: str = ""


class ImageURL(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageContentPart(_Body):
    """An image: ``image_url.url`` is a ``data:`` URL with base64 (``engine/server/images.py``)."""

    type: Literal["image_url"]
    image_url: ImageURL


# Upstream's ChatCompletionMessageGenericParam roles (matched case-insensitively, lowercased); "user"
# (ChatCompletionMessageUserParam) is matched exactly.
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder")


_ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class ChatMessage(_Body):
    """A chat message; ``content`` is a string or a list of text and image parts, null only in an assistant
    turn that carries ``tool_calls``. ``role`` is upstream's: ``user``, or one of ``_GENERIC_ROLES`` in any
    case (lowercased); others are refused."""

    role: str
    tool_calls: list[dict[str, Any]] | None = None  # before content: its check reads them
    content: str | list[Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]] | None = (
        Field(default=None, validate_default=True)
    )

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, content: object, info: ValidationInfo) -> object:
        if content is None and not info.data.get("tool_calls"):
            raise PydanticCustomError("content", "required (null only in a turn with tool_calls)")
        return content

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, role: object) -> object:
        if role == "user":
            return role
        if isinstance(role, str) and role.lower() in _GENERIC_ROLES:
            return role.lower()
        allowed = ", ".join(repr(r) for r in ("user", *_GENERIC_ROLES))
        raise PydanticCustomError(
            "role",
            "must be one of {allowed} (all but 'user' case-insensitive), got {role}",
            {"allowed": allowed, "role": repr(role)},
        )


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


MODELS = (GenerateReqInput, CompletionRequest, ChatCompletionRequest)
_REF = "#/components/schemas/{model}"


def _requested_n(body: dict) -> list[tuple[dict, object]]:
    """The ``n`` values a body asks for, each with the names its errors use: OpenAI's top-level ``n``,
    ``/generate``'s ``sampling_params.n``."""
    raw = body.get("sampling_params")
    params = raw if isinstance(raw, list) else [raw]
    return [({"n": "n"}, body.get("n")), *(({}, p.get("n")) for p in params if isinstance(p, dict))]


def _bad_n_first(body: dict) -> None:
    """sglang-router in PD mode turns a request's ``n > 1`` into lists of ``n`` bootstrap hosts/ports/rooms;
    a bad ``n`` is then reported first, as a non-PD worker words it (the lists themselves are checked
    against n by ``Engine.bootstrap``). Raises ``HTTPError(400)``."""
    if not any(isinstance(body.get(field), list) for field in _BOOTSTRAP_FIELDS):
        return
    for names, n in _requested_n(body):
        if n is not None:
            try:
                SamplingParams.from_dict({"n": n}, names)
            except ValueError as exc:
                raise HTTPError(400, str(exc)) from None


def validated(model: type[_Body], body: dict) -> dict:
    """``body`` checked against ``model``, as a dict of the fields it set (coerced per the model).

    Raises ``HTTPError(400)`` whose message names each bad field (``messages.0.content: ...``); an
    unsupported ``n`` that came with the bootstrap lists sglang-router's PD mode makes of it is named first.
    """
    _bad_n_first(body)
    try:
        return model.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise HTTPError(400, problems) from None


def request_body(model: type[_Body]) -> dict:
    """``openapi_extra`` for a route whose body is ``model`` (the route reads the body itself)."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def component_schemas() -> dict:
    """JSON schemas of every request model and the models they nest, for ``components.schemas``."""
    out: dict = {}
    for model in MODELS:
        schema = model.model_json_schema(ref_template=_REF)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out
