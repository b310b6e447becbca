"""Instruction data: render a conversation with the tokenizer's chat template and mark which tokens carry loss.

Only assistant turns are trained on (those a message's `train` flag keeps: trainer/data/sources.py sets it from
the record's loss weight). The character span of each trained turn is found by rendering the conversation up to
that turn with the generation prompt (the prompt) and up to its end (prompt + response); tokens whose characters
start inside a response span are targets. A record's tool schemas go to the template on every render (each
prefix too, so prefixes stay consistent). Tokenizers without a chat template get DEFAULT_CHAT_TEMPLATE below
(documented in docs/data.md).
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from tessera.errors import DataError

# The version of how chat records become tokens and masks (shapes, tools, per-message weights), in the caches' and
# token stores' identity: a cache built by an older rendering is not reused (2: tools, tool calls and per-message
# weights reach the template; before, a record's `tools` and `weight` fields were ignored).
RENDER_VERSION = 2

# Without tools and tool calls it renders exactly what it did before they existed (plain conversations give the
# same tokens and masks; the cache key, a hash of the template's text, changed once): `<|tools|>` + the schemas'
# JSON first, each tool call as `<|tool_call|>` + its JSON inside the assistant turn, tool results as `<|tool|>`.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<|tool_call|>\n"
    "{{ (call['function'] if call['function'] is defined else call) | tojson }}\n{% endfor %}"
    "{{ eos_token }}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def ensure_chat_template(tokenizer, override=None) -> str:
    if override:
        tokenizer.chat_template = override
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer.chat_template


def _render(tokenizer, messages, add_generation_prompt: bool, tools=None) -> str:
    extra = {"tools": tools} if tools else {}  # no tools: the very call made before tools existed
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)


def _render_prompt(tokenizer, messages, tools=None) -> str:
    """What precedes a response: the conversation so far plus the template's generation prompt. Chat
    templates refuse an empty conversation, so for an opening assistant turn the prompt is what the template
    renders before a placeholder response."""
    if messages:
        return _render(tokenizer, messages, add_generation_prompt=True, tools=tools)
    marker = "\x00tessera-response\x00"
    rendered = _render(tokenizer, [{"role": "assistant", "content": marker}], add_generation_prompt=False,
                       tools=tools)
    return rendered[: rendered.index(marker)] if marker in rendered else ""


def _trained(message: dict) -> bool:
    return message.get("train", message["role"] == "assistant")


def response_spans(tokenizer, messages, tools=None) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character span of each trained turn. `messages` may carry a `train`
    flag each (default: assistant turns); it is not passed to the template."""
    trained = [_trained(m) for m in messages]
    messages = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    full = _render(tokenizer, messages, add_generation_prompt=False, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if not trained[i]:
            continue
        prompt = _render_prompt(tokenizer, messages[:i], tools)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if not full.startswith(upto) or not upto.startswith(prompt):
            raise DataError("the chat template does not render conversations prefix by prefix, so prompt "
                            "tokens cannot be masked; set data.chat_template to a template that does")
        end = len(upto)
        # The response ends with its EOS: template text after it (a newline, say) is not trained on.
        eos = tokenizer.eos_token
        if eos and eos in upto[len(prompt):]:
            end = upto.rindex(eos, len(prompt)) + len(eos)
        spans.append((len(prompt), end))
    return full, spans


def encode_conversation(tokenizer, messages, tools=None) -> Tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and a 0/1 mask: 1 where the token is part of a trained response."""
    text, spans = response_spans(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return ids, mask
