"""The field types of OpenAI's requests, as clients really send them (stage 10's server).

Introduced with stage 10's server, after the official `openai` client was pointed at it. Clients
send `null` for "the default", fields this server has never heard of, a prompt as a string or a
batch, and message content as a list of parts; vLLM takes all of it, so this does too. The base
`OpenAIModel` keeps unknown fields (`unknown_fields` lists them, to log) and reads `null` as the
default; unions pick their branch by the value's shape, so a bad value gets the error of the
branch the client meant; `client_param` names a field as the client wrote it: `messages[1].content`.
It holds no sampling: the request models that use these types are protocol.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class OpenAIModel(BaseModel):
    """A request object: unknown fields are kept (and logged by the server), `null` is the
    field's default, and a required field stays required."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None
            or key not in fields
            or fields[key].is_required()
            or fields[key].default is None
        }


def one_of(pick, expected: str, **branches):
    """A union that validates only the branch `pick(value)` names (by the value's shape), so
    its errors are that branch's; a value no branch fits is "expected <expected>"."""
    tagged = tuple(Annotated[kind, Tag(tag)] for tag, kind in branches.items())
    return Annotated[
        Union[tagged],  # noqa: UP007 (a union built at run time)
        Discriminator(pick, custom_error_type="invalid_type", custom_error_message=expected),
    ]


def _prompt_shape(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "batch" if isinstance(first, list) else "ids"


def _text_or_list(value: Any) -> str | None:
    return "one" if isinstance(value, str) else "list" if isinstance(value, list) else None


if TYPE_CHECKING:  # what the type checker sees; pydantic sees the tagged unions below
    Prompt = str | list[str] | list[int] | list[list[int]]
    Stop = str | list[str]
else:
    Prompt = one_of(
        _prompt_shape,
        "expected a string, a list of strings, a list of token ids or a list of lists of token ids",
        text=NonEmptyText,
        texts=Annotated[list[NonEmptyText], Field(min_length=1)],
        ids=Annotated[list[TokenId], Field(min_length=1)],
        batch=Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    )
    Stop = one_of(
        _text_or_list,
        "expected a string or a list of strings",
        one=NonEmptyText,
        list=list[NonEmptyText],
    )


def client_param(loc: tuple, body: Any, error_type: str) -> str | None:
    """A pydantic error's location as the client wrote the field: `messages[1].content`.

    The location also holds the union branches pydantic tried (`prompt.texts.1`); a part is
    kept only if the body has it, or if it is the name of a missing field (the last part)."""
    parts: list[str | int] = []
    node = body
    for i, part in enumerate(loc):
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            parts.append(part)
            node = node[part]
        elif error_type == "missing" and i == len(loc) - 1 and isinstance(part, str):
            parts.append(part)
    return field_path(parts) or None


def field_path(parts) -> str:
    """["messages", 1, "content"] -> "messages[1].content"."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def unknown_fields(model: BaseModel, path: tuple = ()) -> list[str]:
    """Every field of `model`, and of the models inside it, that no model declares, as paths."""
    found = [field_path((*path, key)) for key in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                where = (*path, name) if index is None else (*path, name, index)
                found += unknown_fields(item, where)
    return found
