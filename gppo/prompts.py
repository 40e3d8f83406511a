"""One prompt builder for train, eval, probe and sweep: a problem's prompt -> the text the engine tokenizes.

A prompt is text or a conversation (a list of `{"role", "content"}` messages, as TRL accepts).
`PromptConfig` holds the three options every command shares:

- `prompt_template` (default `"{prompt}"`) formats the problem text; for a conversation it
  formats the content of the last user message (earlier turns are context, left as they are).
- `system_prompt` adds a system message first, unless the conversation already starts with one
  (the data's own system message wins).
- `chat_template`: `"true"` renders the conversation with the tokenizer's chat template and
  `add_generation_prompt=True`, so the text ends with the assistant header the model continues;
  `"false"` renders without one; `"auto"` (the default) uses the template when the tokenizer has
  one (the embedded character tokenizer has none). YAML booleans `true`/`false` are accepted.
  Without a template the text is the system prompt (if any), a blank line, then the user message;
  a conversation with assistant turns cannot be rendered without a template and is refused.

The engines tokenize the text as the tokenizer does by default; when that already adds the BOS
token and the template writes it too (Llama 3, Gemma), the template's is dropped, so the prompt
has one BOS, as with `apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Formatter

Message = dict
Prompt = str | list  # text, or a list of {"role", "content"} messages
CHAT_TEMPLATE_CHOICES = ("auto", "true", "false")
ROLES = ("system", "user", "assistant")


def _chat_choice(value) -> str:
    """`value` as one of CHAT_TEMPLATE_CHOICES (bools and their spellings accepted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    text = {"yes": "true", "1": "true", "no": "false", "0": "false"}.get(text, text)
    if text not in CHAT_TEMPLATE_CHOICES:
        raise ValueError(f"chat_template must be auto, true or false, got {value!r}")
    return text


def check_prompt_template(template: str) -> None:
    """A ValueError saying what is wrong unless `template` is a format string whose only field is
    {prompt} (literal braces doubled: {{ }}); the message continues "prompt_template '...' "."""
    if not isinstance(template, str):
        raise ValueError("is not text; give a string containing {prompt}")
    try:
        names = {name for _, name, _, _ in Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"is not a valid template ({err}); write literal braces as {{{{ and }}}}") from None
    if names != {"prompt"}:
        other = sorted(names - {"prompt"})
        problem = f"has fields {other} that gppo does not fill" if other else "has no {prompt} field"
        raise ValueError(f"{problem}; the only field is {{prompt}}, the problem text, e.g. 'Q: {{prompt}}\\nA:'")


def check_messages(messages, where: str = "prompt") -> list[Message]:
    """`messages` if it is a non-empty list of {"role", "content"} dicts with a user turn; else a clear error."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where} must be text or a non-empty list of {{'role', 'content'}} messages, got {str(messages)[:80]}"
        )
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise ValueError(
                f"{where} message {i} must be {{'role': one of {list(ROLES)}, 'content': text}}, "
                f"got {str(message)[:80]}"
            )
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where} has no user message (roles: {[m['role'] for m in messages]})")
    return messages


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptConfig:
    """The prompt options shared by every command (see the module docstring)."""

    chat_template: str = "auto"
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"

    def __post_init__(self):
        object.__setattr__(self, "chat_template", _chat_choice(self.chat_template))
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt must be text, got {self.system_prompt!r}")
        try:
            check_prompt_template(self.prompt_template)
        except ValueError as err:
            raise ValueError(f"prompt_template {self.prompt_template!r} {err}") from None


class PromptBuilder:
    """`builder(prompt) -> str`: the prompt formatted by `config` for `tokenizer`.

    `chat_template="auto"` is resolved here, once: `uses_chat_template` says what was chosen.
    """

    def __init__(self, tokenizer, config: PromptConfig = PromptConfig()):
        self.tokenizer, self.config = tokenizer, config
        available = has_chat_template(tokenizer)
        if config.chat_template == "true" and not available:
            raise ValueError(
                "chat_template=true, but the tokenizer has no chat template: use chat_template auto "
                "or false, or a model whose tokenizer_config.json has a 'chat_template'"
            )
        self.uses_chat_template = available if config.chat_template == "auto" else config.chat_template == "true"
        bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
        adds_bos = bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]
        self._added_bos = bos if adds_bos and self.uses_chat_template else None

    def messages(self, prompt: Prompt) -> list[Message]:
        """The conversation to render: system prompt first (unless present), template on the last user turn."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in check_messages(prompt)]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] = self.config.prompt_template.format(prompt=messages[last_user]["content"])
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def __call__(self, prompt: Prompt) -> str:
        messages = self.messages(prompt)
        if self.uses_chat_template:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as err:  # jinja2's TemplateError, or what the template's own raise_exception gives
                roles = [m["role"] for m in messages]
                raise ValueError(
                    f"the tokenizer's chat template failed on a prompt with roles {roles} "
                    f"({type(err).__name__}: {err}): use --chat_template false, leave out "
                    f"--system_prompt if the template refuses a system role, or fix the template "
                    f"in the model's tokenizer_config.json"
                ) from None
            if self._added_bos and text.startswith(self._added_bos):
                text = text[len(self._added_bos) :]  # the tokenizer adds it again
            return text
        if any(m["role"] == "assistant" for m in messages):
            has = "one" if has_chat_template(self.tokenizer) else "none"
            raise ValueError(
                f"a conversation with assistant turns needs a chat template, but none is used "
                f"(chat_template={self.config.chat_template}, the tokenizer has {has}): use "
                "chat_template true with a tokenizer that has one"
            )
        return "\n\n".join(m["content"] for m in messages)


__all__ = [
    "CHAT_TEMPLATE_CHOICES",
    "Prompt",
    "PromptBuilder",
    "PromptConfig",
    "check_messages",
    "check_prompt_template",
    "has_chat_template",
]
