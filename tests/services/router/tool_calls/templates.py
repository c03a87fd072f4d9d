"""Chat templates that show tool calls as each model family does, written for these tests:
Qwen2.5's Hermes tags, Llama 3.1's JSON objects with ``parameters``, Mistral v3's
``[TOOL_CALLS]`` array. Each renders an assistant's ``tool_calls`` (arguments as objects, as
Hugging Face templates get them) the way its family's models were trained to write them."""

from __future__ import annotations

HERMES = """
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""
HERMES_END = "<|im_end|>\n"

LLAMA3_JSON = """
{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{%- if message.tool_calls is defined and message.tool_calls %}
{%- for call in message.tool_calls %}
{%- if not loop.first %}{{ '; ' }}{% endif %}
{{- '{"name": "' + call.function.name + '", "parameters": ' }}
{{- call.function.arguments | tojson }}{{ '}' }}
{%- endfor %}
{%- else %}{{ message.content }}{% endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_JSON_END = "<|eot_id|>"

MISTRAL = """
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{ ', "id": "' + call.id + '"}' }}
{%- if not loop.last %}{{ ', ' }}{% endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- else %}{{ message.content + eos_token }}{% endif %}
{%- endfor %}
"""
MISTRAL_END = "</s>"
