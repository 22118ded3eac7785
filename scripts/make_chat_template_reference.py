#!/usr/bin/env python3
"""Writes testdata/chat_templates/cases.json: what transformers renders for each chat template in
testdata/chat_templates/ on a set of conversations, and what Jinja2 renders for small templates
that exercise one interpreter feature each. tests/chat_template_test.cc checks that pagedlm
renders every case byte for byte the same (or fails with the same message).

Rendering goes through transformers' own render_jinja_template / _compile_jinja_template, so the
environment is exactly apply_chat_template's: ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, loopcontrols), HF's tojson (ensure_ascii=False), raise_exception,
strftime_now, namespace.

    pip install transformers jinja2     # torch is not needed
    python3 scripts/make_chat_template_reference.py
"""

import copy
import json
import pathlib
import sys

import jinja2
import transformers
from transformers.utils import chat_template_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE_DIR = ROOT / "testdata" / "chat_templates"

TEMPLATES = {
    "smollm2": {"file": "smollm2.jinja", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "qwen2.5": {"file": "qwen2.5.jinja", "bos_token": "", "eos_token": "<|im_end|>"},
    "qwen3": {"file": "qwen3.jinja", "bos_token": "", "eos_token": "<|im_end|>"},
    "llama3.1": {"file": "llama3.1.jinja", "bos_token": "<|begin_of_text|>",
                 "eos_token": "<|eot_id|>"},
    "mistral-v0.3": {"file": "mistral-v0.3.jinja", "bos_token": "<s>", "eos_token": "</s>"},
    # More public templates, for breadth: macros, loop.previtem/nextitem, full-width tokens.
    "gemma2": {"file": "gemma2.jinja", "bos_token": "<bos>", "eos_token": "<eos>"},
    "phi3.5": {"file": "phi3.5.jinja", "bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "hermes3-tool-use": {"file": "hermes3-tool-use.jinja", "bos_token": "<|begin_of_text|>",
                         "eos_token": "<|im_end|>"},
    "deepseek-r1-distill-qwen": {"file": "deepseek-r1-distill-qwen.jinja",
                                 "bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                                 "eos_token": "<\uff5cend\u2581of\u2581sentence\uff5c>"},
}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


SINGLE = [user("Hello! What is the capital of France?")]
WITH_SYSTEM = [system("You are a terse assistant."), user("Name three primes.")]
MULTI_TURN = [
    user("Hi there"),
    assistant("Hello! How can I help?"),
    user("  What is 2+2?  "),
    assistant("4"),
    user("And 3+3?"),
]
MULTI_TURN_SYSTEM = [system("Answer in one word.")] + MULTI_TURN[:4]
UNICODE = [
    system("Réponds en français. 日本語もOK。"),
    user("Ça va? 🌍 \"quotes\" and 'single' \\ backslash\nsecond line\n\n\tindented\n"),
    assistant("Très bien! ✓\n- point one\n- point two"),
    user("Ünïcödé ☃ — em dash…"),
]
EMPTY = [user(""), assistant(""), user("   ")]
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
    {"role": "user", "content": [{"type": "text", "text": "First part."},
                                 {"type": "text", "text": "Second part."}]},
]
NOT_ALTERNATING = [user("one"), user("two")]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                       "required": ["tz"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_CALL = {"type": "function", "id": "call12345",
                "function": {"name": "get_weather",
                             "arguments": {"city": "Paris", "unit": "celsius"}}}
TOOL_CONVERSATION = [
    user("What's the weather in Paris?"),
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
     "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    assistant("It is 21 °C and clear in Paris."),
    user("Thanks!"),
]


def families():
    """(template, name, messages, add_generation_prompt, extra) for every case."""
    common = [
        ("single turn", SINGLE, True, {}),
        ("single turn without generation prompt", SINGLE, False, {}),
        ("system message", WITH_SYSTEM, True, {}),
        ("multi turn", MULTI_TURN, True, {}),
        ("multi turn with system, ends on assistant", MULTI_TURN_SYSTEM, False, {}),
        ("unicode and newlines", UNICODE, True, {}),
        ("empty contents", EMPTY, True, {}),
        ("text content parts", PARTS, True, {}),
        ("message without content", [{"role": "user"}], True, {}),
        ("null content", [user("hi"), assistant(None), user("again")], True, {}),
    ]
    # Variables a template cannot do without, added to each of its common cases.
    template_extra = {"hermes3-tool-use": {"tools": TOOLS}}
    for name in TEMPLATES:
        for case_name, messages, gen, extra in common:
            yield name, case_name, messages, gen, {**template_extra.get(name, {}), **extra}

    yield "smollm2", "assistant first", [assistant("I start."), user("ok")], True, {}
    yield "smollm2", "roles do not need to alternate", NOT_ALTERNATING, True, {}

    yield "qwen2.5", "tools and tool calls", TOOL_CONVERSATION, True, {"tools": TOOLS}
    yield "qwen2.5", "tools with system message", [system("Use tools wisely.")] + SINGLE, True, {
        "tools": TOOLS}
    yield "qwen2.5", "two tool results in a row", [
        user("Weather and time in Paris?"),
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [WEATHER_CALL, {"type": "function", "function": {
             "name": "get_time", "arguments": {"tz": "Europe/Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "14:05"},
    ], True, {"tools": TOOLS}

    yield "qwen3", "thinking in history is dropped", [
        user("Hi"),
        assistant("<think>\nThe user greets me.\n</think>\n\nHello!"),
        user("And?"),
        assistant("<think>\nagain\n</think>\n\nMore."),
    ], False, {}
    yield "qwen3", "enable_thinking false", SINGLE, True, {"enable_thinking": False}
    yield "qwen3", "enable_thinking true", SINGLE, True, {"enable_thinking": True}
    yield "qwen3", "reasoning_content field", [
        user("2+2?"),
        {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
    ], False, {}
    yield "qwen3", "tools, tool calls and responses", [
        system("You can call tools."),
        user("What's the weather in Paris?"),
        {"role": "assistant", "content": "<think>\nNeed weather.\n</think>\n\n",
         "tool_calls": [WEATHER_CALL, {"type": "function", "function": {
             "name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "14:05"},
    ], True, {"tools": TOOLS}

    yield "llama3.1", "custom date string", WITH_SYSTEM, True, {"date_string": "01 Jan 2025"}
    yield "llama3.1", "tools in the first user message", TOOL_CONVERSATION, True, {
        "tools": TOOLS}
    yield "llama3.1", "tools in the system message", [system("Be helpful.")] + SINGLE, True, {
        "tools": TOOLS, "tools_in_user_message": False}
    yield "llama3.1", "builtin tools", [
        system("Use search if needed."),
        user("Who won the match?"),
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "brave_search", "arguments": {"query": "match winner"}}}]},
        {"role": "ipython", "content": {"result": "Team A"}},
    ], True, {"builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]}
    yield "llama3.1", "two tool calls raise", [
        user("Do two things."),
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL, WEATHER_CALL]},
    ], True, {}
    yield "llama3.1", "tools without a user message raise", [], True, {"tools": TOOLS}

    yield "mistral-v0.3", "roles must alternate", NOT_ALTERNATING, True, {}
    yield ("mistral-v0.3", "system message in the middle raises",
           [user("a"), assistant("b"), system("c")], True, {})
    yield "mistral-v0.3", "tools, tool calls and results", [
        system("You are a weather bot."),
        user("What's the weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call12345",
         "content": {"content": {"temperature": 21, "ok": True, "note": None}}},
        assistant("21 degrees."),
        user("Thanks"),
    ], True, {"tools": TOOLS}
    yield "hermes3-tool-use", "tool calls and responses", TOOL_CONVERSATION + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function",
             "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]},
        {"role": "tool", "content": "12:00"},
        {"role": "tool", "content": "again"},
    ], True, {"tools": TOOLS + [{"type": "function", "function": {
        "name": "plot", "description": "Plot values. ",
        "parameters": {"type": "object", "properties": {
            "values": {"type": "array", "items": {"type": "number"}, "description": " data "},
            "style": {"type": ["string", "integer"], "description": "line style"},
            "opts": {"type": "object", "additionalProperties": {"type": "boolean"},
                     "description": "flags"}}},
        "return": {"type": "string", "description": "an image path"}}}]}
    # A "null" in a type union makes the template's macro recurse on the string's characters
    # forever (a string is iterable).
    yield "hermes3-tool-use", "endless macro recursion raises", SINGLE, True, {
        "tools": [{"type": "function", "function": {
            "name": "f", "description": "d", "parameters": {"type": "object", "properties": {
                "x": {"type": ["string", "null"], "description": "x"}}}}}]}
    yield "deepseek-r1-distill-qwen", "thinking and tool calls", [
        system("You are DeepSeek."),
        user("Weather?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": "{\"city\": \"Paris\"}"}},
            {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "noon"},
        assistant("<think>\nok\n</think>\n\nSunny at noon."),
        user("Thanks"),
    ], True, {}

    yield "mistral-v0.3", "bad tool call id raises", [
        user("Weather?"),
        {"role": "assistant", "tool_calls": [dict(WEATHER_CALL, id="short")]},
    ], True, {}


# Small templates that each exercise an interpreter feature: (name, source, context).
FEATURES = [
    # Whitespace control and HF's trim_blocks / lstrip_blocks.
    ("minus trims both sides", "a  \n {%- if true -%} \n b \n {%- endif -%}\n  c", {}),
    ("output tags trim with minus", "x\n  {{- 'y' -}}  \nz", {}),
    ("trim_blocks eats one newline", "{% if true %}\nx\n{% endif %}\n\ny", {}),
    ("lstrip_blocks strips indentation", "a\n    {% if true %}\n    b\n    {% endif %}\nc", {}),
    ("lstrip does not touch output tags", "a\n    {{ 'b' }}\n  c", {}),
    ("plus disables lstrip", "a\n    {%+ if true %}b{% endif %}", {}),
    ("plus disables trim", "{% if true +%}\nb{% endif %}", {}),
    ("comments vanish with their line", "a\n  {# note #}\nb{#- x -#}  c", {}),
    ("trailing newline dropped", "x\n", {}),
    ("crlf normalized", "a\r\nb{% if true %}\r\nc{% endif %}", {}),
    ("raw blocks", "a {% raw %}\n{{ x }} {% if %}\n  {% endraw %}\nb"
     "{%- raw -%}  {{ y }}  {%- endraw -%}  c\n  {% raw %}z{% endraw +%}\nd", {}),
    ("tag with text before on its line", "x {% if true %}\ny{% endif %}", {}),
    # Loops.
    ("loop variables",
     "{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
     "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
     {"items": ["a", "b", "c"]}),
    ("loop previtem nextitem cycle",
     "{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}-"
     "{{ loop.cycle('odd', 'even') }} {% endfor %}", {}),
    ("filtered loop counts kept items",
     "{% for x in range(10) if x % 3 == 0 %}{{ loop.index }}/{{ loop.length }}:{{ x }} "
     "{% endfor %}", {}),
    ("for else", "{% for x in [] %}x{% else %}empty{% endfor %}", {}),
    ("break and continue",
     "{% for n in range(10) %}{% if n == 2 %}{% continue %}{% endif %}"
     "{% if n == 5 %}{% break %}{% endif %}{{ n }}{% endfor %}", {}),
    ("nested loops", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }} "
     "{% endfor %}{{ loop.index }}|{% endfor %}", {}),
    ("dict iteration", "{% for k in d %}{{ k }}{% endfor %} {% for k, v in d.items() %}"
     "{{ k }}={{ v }};{% endfor %} {% for k, v in d | items %}{{ k }}{% endfor %} "
     "{% for k, v in d | dictsort %}{{ k }}{% endfor %}",
     {"d": {"zeta": 1, "alpha": [2], "mid": None}}),
    ("loop over reversed messages",
     "{% for m in messages[::-1] %}{{ (messages | length - 1) - loop.index0 }}{{ m.role }} "
     "{% endfor %}", {"messages": MULTI_TURN}),
    # Assignment and scope.
    ("set scope", "{% set a = 1 %}{% for x in [1, 2] %}{{ a }}{% set a = a + 10 %}{{ a }} "
     "{% endfor %}{{ a }}{% if true %}{% set b = 3 %}{% endif %}{{ b }}", {}),
    ("namespace carries values out of loops",
     "{% set ns = namespace(total=0, found=false, last=none) %}{% for x in [3, 4, 5] %}"
     "{% set ns.total = ns.total + x %}{% if x == 4 %}{% set ns.found = true %}{% endif %}"
     "{% set ns.last = x %}{% endfor %}{{ ns.total }} {{ ns.found }} {{ ns.last }}", {}),
    ("namespace without arguments", "{% set ns = namespace() %}{% set ns.i = 0 %}"
     "{% for x in 'abc' %}{% set ns.i = ns.i + 1 %}{% endfor %}{{ ns.i }}", {}),
    ("set block", "{% set x %}Hello {{ name }}{% endset %}{{ x | upper }}", {"name": "you"}),
    ("tuple unpacking", "{% set a, b = [1, 2] %}{{ b }}{{ a }}"
     "{% for i, c in [[1, 'x'], [2, 'y']] %}{{ i }}{{ c }}{% endfor %}", {}),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
     "{{ greet('a') }} {{ greet('b', punct='?') }} {{ greet(name='c') }}", {}),
    # Literals and expressions.
    ("string escapes", "{{ 'a\\nb\\t\"c\"\\\\' }}|{{ \"it's\" }}|{{ '\\u00e9\\x41' }}|"
     "{{ 'adj' 'acent' }}", {}),
    ("delimiters inside strings and dicts", "{{ '}}' }}{{ \"%}\" }}{{ {'a': {'b': 1}}['a'] }}"
     "{% if '%}' %}ok{% endif %}", {}),
    ("numbers", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 / 2 }} "
     "{{ 4 / 2 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 3 * 1.0 }} {{ 10 - 2.5 }} "
     "{{ 1_000 + 1 }} {{ true + 1 }} {{ -(3) }} {{ 2 * 3 ** 2 }}", {}),
    ("float formatting", "{{ x }} {{ y }} {{ z }} {{ w }} {{ [x, y] }}",
     {"x": 1.0, "y": 123456789012345678.0, "z": 0.0001, "w": 0.00001}),
    ("concatenation", "{{ 'n=' ~ 3 ~ none ~ true ~ missing }}|{{ 'a' + 'b' }}|{{ [1] + [2] }}|"
     "{{ 'ab' * 3 }}", {}),
    ("concatenation chains", "{{ 'a' + 'b' + 'c' }}|{{ 1 ~ 2 + 'x' }}|{{ none ~ 'a' + 'b' ~ none }}|"
     "{{ [1] + [2] + [3] }}|{{ 1 + 2 + 3.5 }}|{{ 'ab' + 'c' * 2 + 'd' }}|{{ ([1] + [2]) ~ 'x' }}|"
     "{{ 'x' ~ 1 + 2 ~ 'y' }}|{{ s + '-' + s }}|{{ 'a' + ('b' ~ 'c' + 'd') + 'e' }}",
     {"s": "é"}),
    ("comparisons", "{{ 1 < 2 }}{{ 2 <= 1 }}{{ 'a' == 'a' }}{{ 'a' != 'a' }}{{ 3 > 2 }}"
     "{{ 1 >= 1 }}{{ 1 == 1.0 }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 5 }}{{ 'abc' < 'abd' }}"
     "{{ [1, 2] == [1, 2] }}{{ {'a': 1} == {'a': 1} }}{{ none == none }}", {}),
    ("logic returns operands", "{{ 0 or 'x' }}|{{ 'a' and 'b' }}|{{ '' and 'b' }}|"
     "{{ not 0 }}|{{ not (1 == 1) }}|{{ none or [] }}", {}),
    ("membership", "{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in d }}{{ 'q' not in d }}"
     "{{ 'tool_calls' in m }}{{ 'x' in missing }}", {"d": {"k": 1}, "m": {"role": "user"}}),
    ("conditional expression", "{{ 'yes' if flag else 'no' }}|{{ 'a' if false }}|"
     "{{ 'x' if 0 else 'y' if 1 else 'z' }}", {"flag": True}),
    ("subscripts and slices",
     "{{ xs[0] }}{{ xs[-1] }}{{ xs[1:] }}{{ xs[:2] }}{{ xs[::-1] }}{{ xs[::2] }}"
     "{{ xs[-2:] }}{{ xs[:-1] }}{{ xs[1:-1] }}{{ xs[10] }}{{ xs[5:9] }}|{{ s[1:3] }}{{ s[-2:] }}"
     "{{ s[::-1] }}{{ s[0] }}|{{ d['k'] }}{{ d.k }}{{ d.missing }}{{ d['missing'] }}",
     {"xs": [1, 2, 3, 4], "s": "héllo→", "d": {"k": "v"}}),
    ("attribute and item on mixed data",
     "{{ m.role }} {{ m['content'] }} {{ m.tool_calls[0].function.name }} "
     "{{ m.tool_calls[0]['function']['arguments'].city }}",
     {"m": TOOL_CONVERSATION[1] | {"role": "assistant"}}),
    ("list and dict literals", "{{ [1, 'a', none, true, 2.5] }}{{ {'k': 'v', 'n': [1]} }}"
     "{{ ('t', 1) | list }}{{ [] }}{{ {} }}", {}),
    ("undefined is quiet", "[{{ missing }}]{{ missing is defined }}{{ missing is undefined }}"
     "{% if missing %}yes{% else %}no{% endif %}{{ missing | default('dflt') }}"
     "{{ missing | length }}{{ missing | trim }}|{% for x in missing %}x{% endfor %}"
     "{{ d.nope is defined }}{{ d.nope is none }}{{ none.attr is defined }}", {"d": {}}),
    ("python str of values", "{{ none }} {{ true }} {{ false }} {{ [1, 'it\\'s', none] }} "
     "{{ {'a': \"q\"} }} {{ d }} {{ 'x' | string }}{{ [1] | string }}",
     {"d": {"b": [True, None, 1.5], "s": "it's \"both\""}}),
    # Tests.
    ("tests", "{{ 'a' is string }}{{ 1 is number }}{{ 1.5 is float }}{{ 1 is integer }}"
     "{{ true is boolean }}{{ true is integer }}{{ none is none }}{{ d is mapping }}"
     "{{ 'a' is iterable }}{{ [1] is iterable }}{{ d is iterable }}{{ 1 is iterable }}"
     "{{ none is iterable }}{{ [1] is sequence }}{{ d is mapping }}{{ [] is mapping }}"
     "{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 4 is divisibleby 2 }}"
     "{{ 3 is odd }}{{ 3 is even }}{{ 'ab' is lower }}{{ 'AB' is upper }}"
     "{{ 'x' is equalto 'x' }}{{ 1 is eq 2 }}{{ 1 is not eq 2 }}{{ 2 is in [1, 2] }}"
     "{{ range is callable }}{{ none is sameas none }}", {"d": {"a": 1}}),
    # Filters.
    ("string filters", "[{{ '  x y \\n' | trim }}][{{ 'xxaxx' | trim('x') }}]{{ 'Ab' | upper }}"
     "{{ 'Ab' | lower }}{{ 'hello wORLD' | capitalize }} {{ 'hello wORLD-x(y' | title }} "
     "{{ 'aaa' | replace('a', 'b', 2) }}{{ 'héllo' | length }}{{ 'abc' | first }}"
     "{{ 'abc' | last }}{{ 'abc' | reverse }}{{ '12' | int + 1 }}{{ '3.7' | int }}"
     "{{ 'x' | int(5) }}{{ 2.9 | int }}{{ 'x' | safe }}{{ -3 | abs }}{{ '1.5' | float }}", {}),
    ("list filters", "{{ xs | length }} {{ xs | first }} {{ xs | last }} {{ xs | join('-') }} "
     "{{ xs | join }} {{ xs | reverse | list }} {{ xs | sum }} {{ 'ab' | list }} "
     "{{ xs | select('odd') | list }} {{ xs | reject('equalto', 2) | list }} "
     "{{ xs | map('string') | join('+') }} {{ xs | count }}", {"xs": [1, 2, 3]}),
    ("attribute filters",
     "{{ msgs | selectattr('role', 'equalto', 'user') | list | length }} "
     "{{ (msgs | selectattr('role', 'equalto', 'user') | list)[-1].content }} "
     "{{ msgs | rejectattr('role', 'equalto', 'user') | map(attribute='content') | join('|') }} "
     "{{ msgs | selectattr('tool_calls', 'undefined') | list | length }} "
     "{{ msgs | map(attribute='role') | join(',') }} {{ msgs | join(', ', attribute='role') }} "
     "{{ msgs | selectattr('content') | list | length }}",
     {"msgs": MULTI_TURN + [{"role": "assistant", "content": "", "tool_calls": []}]}),
    ("default filter", "{{ none | default('d') }}|{{ '' | default('d') }}|"
     "{{ '' | default('d', true) }}|{{ missing | d('x') }}|{{ 0 | default(1, boolean=true) }}",
     {}),
    ("tojson", "{{ data | tojson }}\n{{ data | tojson(indent=2) }}\n{{ [] | tojson(indent=4) }}"
     "{{ 'é\"\\\\\\n\\t' | tojson }}{{ none | tojson }}{{ 'é' | tojson(ensure_ascii=true) }}",
     {"data": {"b": [1, 2.5, None, True], "a": {"nested": "ü→\u0001", "empty": {}},
               "z": "last"}}),
    ("indent filter", "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|"
     "{{ 'a\\n\\nb' | indent(width=1, blank=true) }}", {}),
    # Methods.
    ("string methods",
     "[{{ ' x '.strip() }}][{{ '\\n\\nx\\n'.strip('\\n') }}][{{ 'xxay'.lstrip('x') }}]"
     "[{{ 'ayyx'.rstrip('xy') }}][{{ ' a '.lstrip() }}][{{ ' a '.rstrip() }}]"
     "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('x') }}{{ 'abc'.startswith(('x', 'a')) }}"
     "{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'hello world-x'.title() }}"
     "{{ 'hi there'.capitalize() }}"
     "{{ 'a.b.c'.replace('.', '/') }}{{ 'abcb'.find('b') }}{{ ', '.join(['x', 'y']) }}", {}),
    ("split", "{{ 'a<b>c<b>'.split('<b>') }}{{ ' a  b \\n c '.split() }}{{ 'x'.split(',') }}"
     "{{ 'a,b,c'.split(',', 1) }}{{ 'r</think>a'.split('</think>')[-1] }}"
     "{{ 'r</think>a'.split('</think>')[0] }}", {}),
    ("dict methods", "{{ d.get('k') }}{{ d.get('q', 'dflt') }}{{ d.get('q') }}{{ d.keys() | list }}"
     "{{ d.values() | list }}{{ d.items() | list }}", {"d": {"k": "v", "n": 1}}),
    ("range", "{% for i in range(3) %}{{ i }}{% endfor %}{{ range(1, 8, 3) | list }}"
     "{{ range(3, -1, -1) | list }}{{ range(0) | list }}", {}),
    ("dict global", "{{ dict(a=1, b='x') }}{{ dict(a=1).a }}", {}),
    ("lstrip at template start and after output tags",
     "   {% if true %}a{% endif %}\n{{ 'b' }}   {% if true %}c{% endif %}\n\t {# x #}d", {}),
    ("nested blocks on their own lines",
     "{% for m in ms %}\n    {% if m %}\n        {{ m }}\n    {% endif %}\n{% endfor %}\nend",
     {"ms": ["x", "", "y"]}),
    ("set in a loop iteration does not reach the next",
     "{% for i in [1, 2] %}{% if loop.first %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}"
     "[{{ y }}]", {}),
    ("macro sees template variables", "{% set sep = '|' %}{% macro wrap(x) %}{{ sep }}{{ x }}"
     "{{ sep }}{% endmacro %}{% for v in [1, 2] %}{{ wrap(v) }}{% endfor %}", {}),
    ("attributes of none and strings", "[{{ n.x }}][{{ s.content }}][{{ n.x is defined }}]"
     "[{{ s.content is defined }}]", {"n": None, "s": "text"}),
    ("negation and precedence", "{{ not x is none }}{{ x is not none and y }}{{ -2 ** 2 }}"
     "{{ 1 + 2 * 3 }}{{ (1 + 2) * 3 }}{{ 'a' ~ 1 * 2 }}{{ 10 - 2 - 3 }}{{ 2 ** 3 ** 2 }}",
     {"x": 1, "y": "yes"}),
    ("json of unicode and control characters", "{{ s | tojson }}",
     {"s": "tab\t nul\u0000 del\u007f é ☃ 🌍 \\ \" /"}),
    ("raise_exception", "{% if bad %}{{ raise_exception('Bad input: ' ~ bad) }}{% endif %}ok",
     {"bad": "yes"}),
    # Errors the template author makes; the C++ side reports their line.
    ("syntax error: unclosed if", "line one\n{% if x %}\nno end", {}),
    ("syntax error: unknown tag", "a\nb\n{% frobnicate %}", {}),
    ("syntax error: bad expression", "{{ 1 + }}", {}),
    ("syntax error: unterminated tag", "ok\n{{ 'x' ", {}),
    ("runtime error: attribute of undefined", "a\n{{ missing.attr }}", {}),
    ("runtime error: add string and number", "{{ 'a' + 1 }}", {}),
    ("runtime error: string chain then number", "{{ 'a' + 'b' ~ 'c' + 1 + 'd' }}", {}),
]


def flatten_content(messages):
    """Mirror of ChatTemplate::render's documented preprocessing: text-only content parts are
    joined with newlines (vLLM does the same for templates that read string content)."""
    out = copy.deepcopy(messages)
    for m in out:
        c = m.get("content")
        if isinstance(c, list) and c and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in c):
            m["content"] = "\n".join(p["text"] for p in c)
    return out


def render_family(template, messages, gen, extra):
    info = TEMPLATES[template]
    source = (TEMPLATE_DIR / info["file"]).read_text(encoding="utf-8")
    kwargs = dict(extra)
    tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[flatten_content(messages)], tools=tools, documents=documents,
        chat_template=source, add_generation_prompt=gen, bos_token=info["bos_token"],
        eos_token=info["eos_token"], **kwargs)
    return rendered[0]


def outcome(render):
    try:
        return {"expected": render()}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"expected_error": "syntax error at line %d" % e.lineno}
    except jinja2.exceptions.TemplateError as e:
        kind = type(e).__name__
        if kind == "TemplateError":  # raise_exception(message)
            return {"expected_error": str(e)}
        return {"expected_error": "chat template error"}
    except (TypeError, RecursionError):
        return {"expected_error": "chat template error"}


def main():
    cases = []
    for template, name, messages, gen, extra in families():
        case = {"template": template, "name": name, "messages": messages,
                "add_generation_prompt": gen, "extra": extra}
        case.update(outcome(lambda: render_family(template, messages, gen, extra)))
        cases.append(case)
    features = []
    for name, source, context in FEATURES:
        feature = {"name": name, "source": source, "context": context}
        compile_ = chat_template_utils._compile_jinja_template
        feature.update(outcome(lambda: compile_(source).render(**context)))
        features.append(feature)
    doc = {
        "provenance": {
            "generator": "scripts/make_chat_template_reference.py",
            "renderer": "transformers.utils.chat_template_utils.render_jinja_template "
                        "(features: _compile_jinja_template(source).render(**context))",
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
            "python": sys.version.split()[0],
        },
        "templates": TEMPLATES,
        "cases": cases,
        "features": features,
    }
    out = TEMPLATE_DIR / "cases.json"
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    errors = sum("expected_error" in c for c in cases + features)
    print(f"wrote {out.relative_to(ROOT)}: {len(cases)} template cases, {len(features)} "
          f"feature cases, {errors} expecting errors")


if __name__ == "__main__":
    main()
