"""A model directory whose chat template reads variables a request may set: a message's ``name``
and ``enable_thinking`` (as Qwen3's template does), to show both reach the template."""

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


def with_thinking_template(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` (weights linked, not copied) with THINKING_TEMPLATE."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.name == "chat_template.jinja":
            continue
        if item.suffix == ".safetensors":
            (dest / item.name).symlink_to(item.resolve())
        else:
            shutil.copy(item, dest / item.name)
    (dest / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return dest
