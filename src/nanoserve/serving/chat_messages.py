"""Chat messages as OpenAI clients send them, and the conversation the chat template takes.

Introduced with stage 10's server. A message's content is a string or a list of parts; only
`text` parts exist for nanoserve's models (an image is a 400 naming the part), and they are
joined with newlines, as vLLM joins them. Roles: `system`, `developer` (OpenAI's newer name for
system, so the template sees "system"), `user`, `assistant` (whose content may be null when it
made tool calls) and `tool`. It renders nothing itself: the template is the model's (llm.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from nanoserve.serving.openai_fields import OpenAIModel, one_of


class ContentPart(OpenAIModel):
    """One part of a message's content: {"type": "text", "text": "..."}."""

    type: str
    text: Annotated[str | None, Field(validate_default=True)] = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(
                f"content parts of type {kind!r} are unsupported: nanoserve's models take text "
                "only (parts of type 'text')"
            )
        return kind

    @field_validator("text")
    @classmethod
    def _has_text(cls, text: str | None, info: ValidationInfo) -> str | None:
        if text is None and info.data.get("type") == "text":
            raise PydanticCustomError("missing", "a 'text' part needs its `text`")
        return text


def _content_shape(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


if TYPE_CHECKING:  # what the type checker sees; pydantic sees the tagged union
    Content = str | list[ContentPart]
else:
    Content = one_of(
        _content_shape,
        "expected a string or a list of content parts",
        text=str,
        parts=list[ContentPart],
    )


class ChatMessage(OpenAIModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Content | None, Field(validate_default=True)] = None
    name: str | None = None  # passed to the template, which may use it (most ignore it)
    tool_call_id: str | None = None  # a tool message's answer to this call
    tool_calls: list[dict] | None = None  # an assistant message's calls, as the client sent them

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role not in ("assistant", None):  # None: the role was invalid
            raise PydanticCustomError(
                "missing", "a {role} message needs its content", {"role": role}
            )
        return content

    @property
    def text(self) -> str:
        """The content as one string: parts joined with newlines; null is ""."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """This message as the chat template takes it."""
        message: dict = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.text
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message
