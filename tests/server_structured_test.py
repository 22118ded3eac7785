"""Structured output through the official openai client against `pagedlm serve` on the SmolLM2
GGUF (CPU): 50+ JSON schemas (nested objects, arrays with min/max items, enums, number ranges,
string patterns, formats alone and with minLength/maxLength, anyOf/oneOf, $ref, required vs
optional), each answered with JSON that parses and validates against its schema with the
`jsonschema` package, formats included (its FormatChecker, with the packages it checks date-time,
time and uri with); json_object;
tool_choice "required" and a named function (always a given tool, arguments valid against its
parameters); the regex, choice and grammar extensions; max_tokens cutting a constrained reply
(finish_reason "length"); and bad schemas and grammars refused with 400 while the server keeps
serving."""

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from server_harness import Server, install_pinned, parse_args, post_json, run_checks
from server_openai_test import import_openai

# jsonschema 4.26.0 and what it imports, as wheels for CPython 3.11 to 3.13 on x86-64 Linux,
# installed into the build folder when the interpreter lacks them; rfc3339-validator (with six)
# and rfc3986-validator are what jsonschema checks the formats date-time, time and uri with
# (without them it passes any string as those formats).
REQUIREMENTS = """\
jsonschema==4.26.0 \
    --hash=sha256:d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce
jsonschema-specifications==2025.9.1 \
    --hash=sha256:98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe
referencing==0.37.0 \
    --hash=sha256:381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231
attrs==26.1.0 \
    --hash=sha256:c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309
typing-extensions==4.16.0 \
    --hash=sha256:481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8
rpds-py==2026.9.1 \
    --hash=sha256:136a1c3fe4402b7008bc81cb62ee538481795b61a7e83df88dff3b3f02b726ff \
    --hash=sha256:addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab \
    --hash=sha256:7868b85224291c6cb6759f9b5adb9745f486d226f62b16a614dd5a2a5ab2b35b
rfc3339-validator==0.1.4 \
    --hash=sha256:24f6ec1eda14ef823da9e36ec7113124b39c04d50a4d3d3a3c2859577e7791fa
rfc3986-validator==0.1.1 \
    --hash=sha256:2f235c432ef459970b4306369336b9d5dbdda31b510ca1e327636e01f528bfa9
six==1.17.0 \
    --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274
"""

# The formats the schemas below use: each must have a checker, or jsonschema lets any string by.
CHECKED_FORMATS = {"email", "date", "time", "date-time", "uuid", "ipv4", "ipv6", "uri"}

MAX_TOKENS = 160
WORKERS = 8  # concurrent requests: they share the engine's batch


def import_jsonschema(target):
    if target.is_dir():
        sys.path.insert(0, str(target))
    modules = ("jsonschema", "rfc3339_validator", "rfc3986_validator")
    if not all(importlib.util.find_spec(m) for m in modules):
        install_pinned(REQUIREMENTS, target, "jsonschema and its format checkers are")
    import jsonschema
    missing = CHECKED_FORMATS - set(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    assert not missing, f"jsonschema has no checker for the formats {sorted(missing)}"
    return jsonschema


def s(maxlen=24, **kw):
    return {"type": "string", "maxLength": maxlen, **kw}


def obj(props, required=None, **kw):
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **kw}


def arr(items, lo=0, hi=3):
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}

# (description for the prompt, schema)
SCHEMAS = [
    ("a person", obj({"name": s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": s(), "country": s()})),
    ("a flag", obj({"enabled": BOOL})),
    ("a count", obj({"count": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("a status", obj({"status": {"type": "string", "enum": ["open", "closed", "pending"]}})),
    ("a priority", obj({"priority": {"enum": [1, 2, 3]}})),
    ("a constant", obj({"kind": {"const": "fruit"}, "name": s()})),
    ("a list of fruits", obj({"fruits": arr(s(12), 1, 3)})),
    ("exactly two numbers", obj({"pair": arr(INT, 2, 2)})),
    ("up to four tags", obj({"tags": arr(s(10), 0, 4)})),
    ("at least one score", obj({"scores": arr({"type": "integer", "minimum": 0,
                                               "maximum": 100}, 1, 3)})),
    ("an address", obj({"address": obj({"street": s(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("a book", obj({"title": s(), "author": obj({"first": s(), "last": s()}),
                    "year": {"type": "integer", "minimum": 1500, "maximum": 2030}})),
    ("an order", obj({"id": INT, "items": arr(obj({"sku": s(8), "qty": {"type": "integer",
                                                                       "minimum": 1,
                                                                       "maximum": 5}}), 1, 2)})),
    ("a point", obj({"x": NUM, "y": NUM})),
    ("a rectangle", obj({"top_left": obj({"x": INT, "y": INT}),
                         "bottom_right": obj({"x": INT, "y": INT})})),
    ("optional nickname", obj({"name": s(), "nickname": s()}, required=["name"])),
    ("all optional", obj({"a": INT, "b": s()}, required=[])),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}})),
    ("a code", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}})),
    ("a hex color", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("an email", obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("a timestamp", obj({"at": {"type": "string", "format": "date-time"}})),
    ("an IPv4 address", obj({"ip": {"type": "string", "format": "ipv4"}})),
    ("a UUID", obj({"id": {"type": "string", "format": "uuid"}})),
    ("a short word", obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}})),
    ("an id or a name", obj({"key": {"anyOf": [INT, s()]}})),
    ("a shape", obj({"shape": {"oneOf": [obj({"circle": {"type": "number", "minimum": 0}}),
                                         obj({"square": {"type": "number", "minimum": 0}})]}})),
    ("a nullable note", obj({"note": {"anyOf": [s(), {"type": "null"}]}})),
    ("a value of several types", obj({"v": {"type": ["integer", "boolean"]}})),
    ("a reference", {"$defs": {"pet": obj({"name": s(), "legs": {"type": "integer",
                                                                  "minimum": 0,
                                                                  "maximum": 8}})},
                     **obj({"pet": {"$ref": "#/$defs/pet"}})}),
    ("two references", {"$defs": {"p": obj({"x": INT})},
                        **obj({"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}})}),
    ("definitions", {"definitions": {"c": {"enum": ["x", "y"]}},
                     **obj({"c": {"$ref": "#/definitions/c"}})}),
    ("a matrix", obj({"rows": arr(arr(INT, 2, 2), 2, 2)})),
    ("a team", obj({"team": s(), "members": arr(obj({"name": s(12), "role": {
        "enum": ["dev", "ops", "pm"]}}), 1, 2)})),
    ("a product", obj({"name": s(), "price": {"type": "number", "minimum": 0,
                                              "maximum": 1000},
                       "in_stock": BOOL})),
    ("a weather report", obj({"city": s(), "temp": {"type": "integer", "minimum": -40,
                                                   "maximum": 50},
                              "sky": {"enum": ["sunny", "cloudy", "rain"]}})),
    ("a rating", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                      "comment": s(40)}, required=["stars"])),
    ("an exclusive range", obj({"p": {"type": "integer", "exclusiveMinimum": 0,
                                      "exclusiveMaximum": 10}})),
    ("an exclusive number range", obj({"p": {"type": "number", "exclusiveMinimum": 0,
                                             "exclusiveMaximum": 1}}, required=["p"])),
    ("a multiple of 7", obj({"week_days": {"type": "integer", "multipleOf": 7, "minimum": 7,
                                           "maximum": 70}}, required=["week_days"])),
    ("a negative number", obj({"n": {"type": "integer", "minimum": -999, "maximum": -1}})),
    ("a big number", obj({"n": {"type": "integer", "minimum": 1000000, "maximum": 9999999}})),
    ("a version", obj({"version": {"type": "string",
                                   "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}})),
    ("a yes/no answer", obj({"answer": {"enum": ["yes", "no"]}, "why": s(30)})),
    ("a tree", {"$defs": {"node": obj({"label": s(8), "children": arr({"$ref": "#/$defs/leaf"},
                                                                     0, 2)}),
                          "leaf": obj({"label": s(8)})},
                **obj({"root": {"$ref": "#/$defs/node"}})}),
    ("an event", obj({"title": s(), "date": {"type": "string", "format": "date"},
                      "attendees": arr(s(12), 0, 2)})),
    ("coordinates", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                         "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("a key-value map", {"type": "object", "additionalProperties": INT, "maxProperties": 3}),
    ("a config", obj({"debug": BOOL, "level": {"enum": ["low", "high"]},
                      "retries": {"type": "integer", "minimum": 0, "maximum": 3}},
                     required=["debug"])),
    ("a list of points", obj({"points": arr(obj({"x": INT, "y": INT}), 1, 2)})),
    ("a top-level array", arr(INT, 1, 3)),
    ("a top-level enum", {"enum": ["alpha", "beta", "gamma"]}),
    ("a top-level integer", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("a top-level string", {"type": "string", "maxLength": 16}),
    ("a user with an optional address",
     obj({"user": obj({"name": s(), "address": obj({"city": s()})}, required=["name"])})),
    ("an int32 count", obj({"n": {"type": "integer", "format": "int32", "minimum": 0,
                                  "maximum": 99}})),
    ("an email", obj({"email": {"type": "string", "format": "email", "maxLength": 64}})),
    ("an email of at most 40 characters", {"type": "string", "format": "email", "maxLength": 40}),
    ("a contact", obj({"name": s(), "email": {"type": "string", "format": "email",
                                              "minLength": 6, "maxLength": 24}})),
    ("a meeting", obj({"title": s(), "start": {"type": "string", "format": "date-time",
                                               "maxLength": 25}})),
    ("a UTC timestamp", {"type": "string", "format": "date-time", "minLength": 20,
                         "maxLength": 20}),
    ("a request id", obj({"id": {"type": "string", "format": "uuid", "minLength": 36,
                                 "maxLength": 36}})),
    ("a birthday", obj({"birthday": {"type": "string", "format": "date", "maxLength": 10}})),
    ("an alarm time", obj({"at": {"type": "string", "format": "time", "maxLength": 14}})),
    ("a server address", obj({"host": {"type": "string", "format": "ipv4", "maxLength": 15}})),
    ("an IPv6 address", obj({"ip": {"type": "string", "format": "ipv6", "maxLength": 39}})),
    ("a homepage", obj({"url": {"type": "string", "format": "uri", "maxLength": 40}})),
    ("a short link", obj({"url": {"type": "string", "format": "uri", "minLength": 12,
                                  "maxLength": 24}})),
    ("a user profile", obj({"email": {"type": "string", "format": "email", "maxLength": 32},
                            "joined": {"type": "string", "format": "date"},
                            "id": {"type": "string", "format": "uuid"},
                            "ip": {"type": ["string", "null"], "format": "ipv4",
                                   "maxLength": 15}})),
    ("a payment", obj({"amount": {"type": "number", "minimum": 0.01, "maximum": 999},
                       "currency": {"enum": ["USD", "EUR", "JPY"]},
                       "method": {"oneOf": [{"const": "card"}, {"const": "cash"}]}})),
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": obj({"city": s(), "unit": {"enum": ["celsius", "fahrenheit"]}})}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": obj({"a": INT, "b": INT})}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": obj({"query": s(40), "limit": {"type": "integer", "minimum": 1,
                                                      "maximum": 10}}, required=["query"])}},
]
TOOL_PROMPTS = ["What is the weather in Paris?", "What is 2 plus 3?", "Find news about cats.",
                "Is it raining in Tokyo?", "Sum 10 and 32.", "Look up the tallest mountain."]


def main():
    args = parse_args()
    openai = import_openai()
    jsonschema = import_jsonschema(Path(args.pagedlm).parent / "python-deps")

    def validate(schema, value):
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        validator.validate(value)

    with Server(args.pagedlm, args.model) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               max_retries=0, timeout=300)

        def chat(content, max_tokens=MAX_TOKENS, **kw):
            return client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens, temperature=0, **kw)

        def one_schema(item):
            try:
                return check_schema(item)
            except Exception as e:  # noqa: BLE001: every failure is listed at the end
                return e

        def check_schema(item):
            i, (what, schema) = item
            reply = chat(f"Reply with JSON describing {what}.", response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
            choice = reply.choices[0]
            text = choice.message.content
            assert choice.finish_reason == "stop", (what, choice.finish_reason, text)
            value = json.loads(text)
            validate(schema, value)
            return text

        def json_schemas():
            assert len(SCHEMAS) >= 50
            with ThreadPoolExecutor(WORKERS) as pool:
                outputs = list(pool.map(one_schema, enumerate(SCHEMAS)))
            for (what, _), text in zip(SCHEMAS, outputs):
                print(f"     {what}: {text!r}")
            failed = [(what, out) for (what, _), out in zip(SCHEMAS, outputs)
                      if isinstance(out, Exception)]
            assert not failed, f"{len(failed)} of {len(SCHEMAS)} failed: {failed}"

        def json_object():
            reply = chat("Reply with a JSON object holding a cat's name and age, nothing else.",
                         max_tokens=400, response_format={"type": "json_object"})
            assert reply.choices[0].finish_reason == "stop", reply
            assert isinstance(json.loads(reply.choices[0].message.content), dict)

        def completions_endpoint():
            reply = client.completions.create(
                model=server.model, prompt="Three colors:", max_tokens=40, temperature=0,
                extra_body={"choice": ["red green blue", "cyan magenta yellow"]})
            assert reply.choices[0].text in ("red green blue", "cyan magenta yellow"), reply
            assert reply.choices[0].finish_reason == "stop"

        def sampled_outputs_hold_too():
            for seed, schema in enumerate(
                    [obj({"n": {"type": "integer", "minimum": 0, "maximum": 50}, "w": s(10)})] * 4 +
                    [obj({"email": {"type": "string", "format": "email", "maxLength": 24},
                          "at": {"type": "string", "format": "date-time", "maxLength": 25},
                          "ip": {"type": "string", "format": "ipv6", "maxLength": 20}})] * 4):
                reply = client.chat.completions.create(
                    model=server.model, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                    messages=[{"role": "user", "content": "Give me JSON."}],
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "n", "schema": schema,
                                                     "strict": True}})
                assert reply.choices[0].finish_reason == "stop", reply
                validate(schema, json.loads(reply.choices[0].message.content))

        def tool_required():
            by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

            def call(prompt):
                return chat(prompt, tools=TOOLS, tool_choice="required")

            with ThreadPoolExecutor(WORKERS) as pool:
                replies = list(pool.map(call, TOOL_PROMPTS))
            for prompt, reply in zip(TOOL_PROMPTS, replies):
                message = reply.choices[0].message
                assert reply.choices[0].finish_reason == "tool_calls", (prompt, reply)
                assert message.tool_calls, (prompt, message)
                for c in message.tool_calls:
                    assert c.function.name in by_name, c
                    validate(by_name[c.function.name], json.loads(c.function.arguments))
                print(f"     {prompt} -> {[(c.function.name, c.function.arguments) for c in message.tool_calls]}")

        def tool_named():
            reply = chat("What is the weather in Paris?", tools=TOOLS,
                         tool_choice={"type": "function", "function": {"name": "add"}})
            calls = reply.choices[0].message.tool_calls
            assert calls and all(c.function.name == "add" for c in calls), reply
            validate(TOOLS[1]["function"]["parameters"], json.loads(calls[0].function.arguments))

        def extensions():
            r = chat("Give a phone number.", extra_body={"regex": "[0-9]{3}-[0-9]{4}"})
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
            assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit(), text
            r = chat("Is the sky blue?", extra_body={"choice": ["yes", "no", "maybe"]})
            assert r.choices[0].message.content in ("yes", "no", "maybe"), r
            grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9]\nop ::= "+" | "-"'
            r = chat("Write a small sum.", extra_body={"grammar": grammar})
            text = r.choices[0].message.content
            assert (len(text) == 7 and text[0] == "(" and text[1] in "123456789" and
                    text[3] in "+-" and text[5] in "123456789" and text[6] == ")"), text

        def cut_by_max_tokens():
            schema = obj({"story": {"type": "string"}})
            reply = chat("Tell a long story as JSON.", max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "story", "schema": schema}})
            assert reply.choices[0].finish_reason == "length", reply
            assert reply.usage.completion_tokens == 4

        def refused():
            deep = {"type": "integer"}
            for _ in range(40):  # 80 JSON levels: under the server's 128, over the schema's 32
                deep = {"type": "object", "properties": {"a": deep}}
            cases = [
                ("schema not an object", {"response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
                 "must be a JSON schema object"),
                ("no schema", {"response_format": {"type": "json_schema", "json_schema": {}}},
                 "needs an object with a 'schema'"),
                ("unknown type", {"response_format": {"type": "xml"}}, "'response_format.type'"),
                ("unsupported keyword", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": obj({"a": {"not": {"type": "string"}}})}}},
                 "the keyword 'not' is not supported"),
                ("unknown format", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "string", "format": "credit-card"}}}},
                 "format \"credit-card\" is not supported"),
                ("a length no uuid has", {"response_format": {"type": "json_schema",
                 "json_schema": {"name": "x", "schema": {"type": "string", "format": "uuid",
                                                         "maxLength": 20}}}},
                 "no \"uuid\" string has a length from 0 to 20 characters"),
                ("format and pattern", {"response_format": {"type": "json_schema",
                 "json_schema": {"name": "x", "schema": {"type": "string", "format": "email",
                                                         "pattern": "@"}}}},
                 "'pattern' together with 'format' is not supported"),
                ("a length beside a format xgrammar alone enforces", {"response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {
                        "type": "string", "format": "hostname", "maxLength": 20}}}},
                 "together with 'minLength' or 'maxLength' is not supported"),
                ("multipleOf on a number", {"response_format": {"type": "json_schema",
                 "json_schema": {"name": "x", "schema": {"type": "number", "multipleOf": 7}}}},
                 "'multipleOf' is supported on integers only"),
                ("remote $ref", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"$ref": "https://example.com/a.json"}}}},
                 "only local '$ref'"),
                ("deep nesting", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": deep}}}, "nests deeper than"),
                ("huge enum", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"enum": list(range(5000))}}}}, "enum values"),
                ("bad pattern", {"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "string", "pattern": "(ab"}}}},
                 "cannot be compiled"),
                ("bad regex", {"regex": "[a-"}, "cannot be compiled"),
                ("bad grammar", {"grammar": "root ::= missing"}, "cannot be compiled"),
                ("grammar not a string", {"grammar": 3}, "'grammar' must be a string"),
                ("empty choice", {"choice": []}, "at least one"),
                ("two constraints", {"regex": "a", "choice": ["a"]}, "cannot be combined"),
                ("unknown tool", {"tools": TOOLS, "tool_choice": {
                    "type": "function", "function": {"name": "nope"}}}, "not among the 'tools'"),
                ("required without tools", {"tool_choice": "required"}, "non-empty 'tools'"),
            ]
            for name, extra, fragment in cases:
                body = {"model": server.model, "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}], **extra}
                status, reply = post_json(server, "/v1/chat/completions", body)
                assert status == 400, (name, status, reply)
                message = reply["error"]["message"]
                assert fragment in message, (name, message)
                print(f"     {name}: 400 {message[:100]}")
            assert server.alive()
            reply = chat("Say yes or no.", extra_body={"choice": ["yes", "no"]})
            assert reply.choices[0].message.content in ("yes", "no")

        run_checks([
            ("json_schema x%d" % len(SCHEMAS), json_schemas),
            ("json_object", json_object),
            ("completions with choice", completions_endpoint),
            ("sampled outputs hold to the schema", sampled_outputs_hold_too),
            ("tool_choice required", tool_required),
            ("tool_choice named", tool_named),
            ("regex, choice, grammar", extensions),
            ("max_tokens cuts: finish_reason length", cut_by_max_tokens),
            ("bad schemas and grammars: 400, still serving", refused),
        ])


if __name__ == "__main__":
    main()
