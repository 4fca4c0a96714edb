"""The target's tokenizer and chat template: what every stage that turns conversations into token ids shares."""

from __future__ import annotations


def load_tokenizer(target_dir, chat_template: str | None = None):
    """The target's tokenizer; `chat_template` (a template file's text) replaces the target's own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                generation_prompt: bool = True) -> list[int]:
    """Token ids of the conversation in the target's chat template, by default with the generation prompt."""
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer.name_or_path} has no chat template; set config key target.chat_template "
                         "to a Jinja template file")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
