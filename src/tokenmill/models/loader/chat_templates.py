"""Chat templates for GGUF files that do not carry one, by GGUF architecture.

llama.cpp keeps such built-in templates too (src/llama-chat.cpp). A file's own template always wins;
these are used only where `tokenizer.chat_template` is absent.
"""

from __future__ import annotations

from typing import Optional

# Gemma's turn format (the template of google/gemma-3-*-it, text parts only): a system message is
# prepended to the first user turn; the assistant's role is "model"; turns end with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_BUILT_IN = {"gemma3": GEMMA_CHAT_TEMPLATE}


def built_in_chat_template(gguf_architecture: str) -> Optional[str]:
    """The chat template of `gguf_architecture`'s instruction-tuned models, if tokenmill knows one."""
    return _BUILT_IN.get(gguf_architecture)
