"""`pagedlm serve --reasoning-parser`: a chat reply's <think> block comes back as the message's
reasoning_content, read through the official openai client. SmolLM2 writes no <think> tags, so:
with its own template the reply is all content (and equals the reply of a server without the
parser); with a template whose generation prompt opens the block (as DeepSeek-R1's does, given
by --chat-template) the reply is all reasoning, and equals the plain completion of the same
prompt tokens. Streaming deltas add up to the same fields."""

import os
import tempfile

from server_harness import Server, parse_args, post_json, run_checks
from server_openai_test import import_openai

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's ChatML turns, with the reply's <think> block opened by the generation prompt.
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                          temperature=0, **kw)


def streamed(client, model):
    """Concatenated reasoning_content and content deltas of a streamed chat reply."""
    reasoning, content = "", ""
    for chunk in chat(client, model, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    return reasoning, content


def main():
    args = parse_args()
    openai = import_openai()

    def client_of(server):
        return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                             timeout=120)

    with Server(args.pagedlm, args.model) as plain:
        expected = chat(client_of(plain), plain.model).choices[0].message.content

    with tempfile.TemporaryDirectory() as tmp:
        template = os.path.join(tmp, "think.jinja")
        with open(template, "w") as f:
            f.write(THINK_TEMPLATE)

        with Server(args.pagedlm, args.model, ["--reasoning-parser", "qwen3"]) as server:
            client = client_of(server)

            def check_no_block_is_content():
                msg = chat(client, server.model).choices[0].message
                assert msg.content == expected, (msg.content, expected)
                assert (msg.model_extra or {}).get("reasoning_content", "absent") is None, msg
                assert streamed(client, server.model) == ("", expected)

            run_checks([("reply without a block: all content, as without the parser",
                         check_no_block_is_content)])

        with Server(args.pagedlm, args.model,
                    ["--reasoning-parser", "deepseek_r1", "--chat-template", template]) as server:
            client = client_of(server)

            def check_opened_block_is_reasoning():
                status, tok = post_json(server, "/tokenize", {"messages": MESSAGES})
                assert status == 200, tok
                status, plain_reply = post_json(server, "/v1/completions", {
                    "prompt": tok["tokens"], "max_tokens": 24, "temperature": 0})
                assert status == 200, plain_reply
                text = plain_reply["choices"][0]["text"]
                assert "</think>" not in text and text.strip("\n"), text
                msg = chat(client, server.model).choices[0].message
                reasoning = (msg.model_extra or {}).get("reasoning_content")
                assert reasoning == text.strip("\n"), (reasoning, text)
                assert msg.content is None, msg
                assert streamed(client, server.model) == (reasoning, ""), reasoning

            run_checks([("block opened by the prompt: all reasoning, as the plain completion",
                         check_opened_block_is_reasoning)])


if __name__ == "__main__":
    main()
