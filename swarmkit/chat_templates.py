"""Chat templates shipped with swarmkit, and ``model.chat_template`` resolution.

- ``TINY_CHAT_TEMPLATE``: the built-in tiny model's ChatML template (tools in
  the system turn, Hermes-style ``<tool_call>`` turns).
- ``SMOLLM2_TOOLS_TEMPLATE``: SmolLM2-Instruct's own template, made tool-aware.
  Without ``tools``, ``tool_calls`` or ``tool`` messages it renders byte for
  byte what SmolLM2's template renders (the main job's prompts do not change);
  with them it writes a short Hermes-style tool preamble in the system turn,
  assistant tool calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  (arguments verbatim when they are a string, JSON otherwise) and tool results
  as a ``user`` turn of ``<tool_response>`` blocks. SmolLM2's own template drops
  ``tools`` silently and fails on ``content: null``.

- ``QWEN3_THINK_TEMPLATE``: a thinking model's template in the way of Qwen3's:
  ChatML, Qwen-style tools, and ``<think>`` reasoning kept only for the
  assistant turns after the last user query (a tool loop); earlier turns are
  rendered without it (their ``reasoning_content``, or the ``<think>`` part of
  their content, is dropped). ``enable_thinking=False`` (a template kwarg)
  prefills an empty think block. Built here so the thinking path runs on the
  tiny model; it is not Qwen3's file.

``model.chat_template`` takes ``auto`` (the shipped tool-aware template for
``builtin:smollm2``, the model's own otherwise), ``model`` (always the model's
own), ``builtin:<name>`` (a template of this module), a path to a ``.jinja``
file, or the template text itself.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN_TEMPLATES", "QWEN3_THINK_TEMPLATE", "SMOLLM2_TOOLS_TEMPLATE", "TINY_CHAT_TEMPLATE",
           "resolve_chat_template"]

TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call tools. Tools: {{ tools | tojson }}\n"
    "Reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> to call one.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.get('content') %}{{ message['content'] }}{% endif %}"
    "{% for tc in message.get('tool_calls') or [] %}"
    "<tool_call>{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": "
    "{{ tc['function']['arguments'] if tc['function']['arguments'] is string else tc['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + _SMOLLM2_DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\nYou can call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one, write:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and not tools and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + _SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' and (tools and loop.first) %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}{{- message['content'] or '' }}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc.get('function') else tc %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- f['name'] }}{{- '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message['content'] }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_THINK_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function else tc %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

#: ``model.chat_template=builtin:<name>``
BUILTIN_TEMPLATES = {"tiny": TINY_CHAT_TEMPLATE, "smollm2_tools": SMOLLM2_TOOLS_TEMPLATE,
                     "qwen3_think": QWEN3_THINK_TEMPLATE}


def resolve_chat_template(value: str | None, model_path: str = "") -> str | None:
    """The template text ``model.chat_template`` asks for; ``None`` = the model's own.

    :raises ValueError: an unknown ``builtin:`` name or a missing file.
    """
    value = (value or "auto").strip()
    if value == "auto":
        return SMOLLM2_TOOLS_TEMPLATE if model_path == "builtin:smollm2" else None
    if value == "model":
        return None
    if value.startswith("builtin:"):
        name = value[len("builtin:"):]
        if name not in BUILTIN_TEMPLATES:
            raise ValueError(f"model.chat_template: unknown built-in template {name!r}; "
                             f"choose one of {', '.join(sorted(BUILTIN_TEMPLATES))}")
        return BUILTIN_TEMPLATES[name]
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"model.chat_template: {value!r} is neither auto, model, builtin:<name>, template text "
                         "nor an existing .jinja file")
    return path.read_text(encoding="utf-8")
