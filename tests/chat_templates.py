"""Model directories with another chat template: one that reads variables a request may set (a
message's ``name`` and ``enable_thinking``, as Qwen3's template does), to show both reach the
template; one in Llama 3.1's style, which renders tools and takes calls as JSON objects."""

from __future__ import annotations

import shutil
from pathlib import Path

THINKING_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{%- if message['name'] is defined %} ({{ message['name'] }}){% endif %}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


# Llama 3.1's way with tools, written for the tests: the tools as JSON in the first user turn,
# a call as {"name": ..., "parameters": ...}, results as "ipython" turns.
LLAMA3_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- system_message }}<|eot_id|>
{%- if tools is not none %}
{{- "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with "
    "a JSON for a function call with its proper arguments.\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    'and its value}.\n' }}
{%- for t in tools %}{{- t | tojson }}{{- "\n" }}{%- endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", '
    '"parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim
    + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def with_thinking_template(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` (weights linked, not copied) with THINKING_TEMPLATE."""
    return with_template(model_dir, dest, THINKING_TEMPLATE)


def with_template(model_dir: Path, dest: Path, template: str) -> Path:
    """A copy of ``model_dir`` (weights linked, not copied) with this chat template."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.name == "chat_template.jinja":
            continue
        if item.suffix == ".safetensors":
            (dest / item.name).symlink_to(item.resolve())
        else:
            shutil.copy(item, dest / item.name)
    (dest / "chat_template.jinja").write_text(template)
    return dest
