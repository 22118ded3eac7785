#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets that read binary files or raw protocol bytes
(tests/fuzz/seeds/<target>/). Text formats also start from the repo's own test data
(scripts/fuzz.sh passes testdata/ folders as extra seed folders). Standard library only.

Files named regression_* are inputs that once broke a property, kept so that every run replays
them first; this script leaves them alone.

Run from anywhere: python3 tests/fuzz/make_seeds.py
"""
import json
import os
import struct

SEEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")


def write(target, name, data):
    folder = os.path.join(SEEDS, target)
    os.makedirs(folder, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# ---- GGUF (v3, little-endian; the layout of llama.cpp's gguf.md) ----
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K, GGML_BF16 = (
    0, 1, 2, 3, 8, 12, 14, 30)
BLOCK = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_BF16: (1, 2), GGML_Q4_0: (32, 18),
         GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34), GGML_Q4_K: (256, 144),
         GGML_Q6_K: (256, 210)}


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, v):
    scalar = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
              BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
    if vtype == STRING:
        return gguf_string(v)
    if vtype == ARRAY:
        elem_type, items = v
        return struct.pack("<IQ", elem_type, len(items)) + b"".join(
            gguf_value(elem_type, x) for x in items)
    return struct.pack(scalar[vtype], v)


def gguf(metadata, tensors, alignment=32):
    """metadata: [(key, type, value)]; tensors: [(name, dims (ne0 first), ggml type)]."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, vtype, v in metadata:
        out += gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, v)
    offset, blobs = 0, []
    for name, dims, ttype in tensors:
        elems, nbytes = BLOCK[ttype]
        n = 1
        for d in dims:
            n *= d
        size = n // elems * nbytes
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, offset)
        # Arbitrary but fixed bytes; the F16 scales of quant blocks stay small and finite.
        blobs.append(bytes((i * 7 + 3) % 60 for i in range(size)))
        offset += (size + alignment - 1) // alignment * alignment
    out += b"\0" * (-len(out) % alignment)
    for blob in blobs:
        out += blob + b"\0" * (-len(blob) % alignment)
    return out


def byte_symbols():
    """GPT-2's byte-level alphabet: byte -> printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(
        range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def gguf_seeds():
    tokens = ["<|endoftext|>"] + byte_symbols() + ["he", "ll", "hell", "\u0120w"]
    types = [3] + [1] * (len(tokens) - 1)
    tokenizer = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, 32),
        ("llama.context_length", U32, 128),
        ("llama.rope.freq_base", F32, 10000.0),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "smollm"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["h e", "l l", "he ll", "\u0120 w"])),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 0),
        ("tokenizer.ggml.add_bos_token", BOOL, True),
    ]
    tensors = [("token_embd.weight", [32, 4], GGML_Q8_0),
               ("blk.0.attn_q.weight", [32, 4], GGML_Q4_0),
               ("blk.0.attn_k.weight", [32, 2], GGML_Q4_1),
               ("blk.0.ffn_down.weight", [256, 1], GGML_Q4_K),
               ("blk.0.ffn_up.weight", [256, 1], GGML_Q6_K),
               ("output_norm.weight", [8], GGML_F32),
               ("blk.0.attn_norm.weight", [8], GGML_F16),
               ("blk.0.ffn_norm.weight", [8], GGML_BF16),
               ("blk.0.ffn_up_exps.weight", [32, 2, 3], GGML_Q8_0)]  # experts: 3-D
    write("fuzz_gguf", "tokenizer_and_tensors.gguf", gguf(tokenizer, tensors))
    # ne0 = 0 is legal: gguf_tensor_blocks once divided by it.
    write("fuzz_gguf", "regression_empty_quantized_tensor.gguf",
          gguf([], [("e", [0, 4, 2], GGML_Q8_0), ("f", [0, 3], GGML_Q4_1)]))
    every_type = [("u8", U8, 1), ("i8", I8, -1), ("u16", U16, 2), ("i16", I16, -2),
                  ("u32", U32, 3), ("i32", I32, -3), ("f32", F32, 0.5), ("bool", BOOL, False),
                  ("str", STRING, "x"), ("u64", U64, 2**63), ("i64", I64, -4),
                  ("f64", F64, 1e300),
                  ("nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["a"]), (ARRAY, [])])),
                  ("empty", ARRAY, (F64, []))]
    write("fuzz_gguf", "every_value_type.gguf", gguf(every_type, []))


# ---- safetensors: u64 header length, JSON header, data ----
def safetensors(entries, metadata=None, pad=0):
    header, data = {}, b""
    for name, dtype, shape, size in entries:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + size]}
        data += bytes(range(size % 256)) + bytes(size - size % 256)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    write("fuzz_safetensors", "two_tensors.safetensors",
          safetensors([("a", "F32", [2, 3], 24), ("b", "BF16", [4], 8)], {"format": "pt"}))
    write("fuzz_safetensors", "every_dtype.safetensors",
          safetensors([("f16", "F16", [1], 2), ("i32", "I32", [2], 8), ("u8", "U8", [3], 3),
                       ("scalar", "F32", [], 4), ("empty", "F32", [0, 5], 0)], pad=5))


# ---- HTTP/1.1 requests as a client sends them on one connection ----
def http_seeds():
    body = '{"prompt": "hi", "max_tokens": 2}'
    seeds = {
        "get.http": "GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "post.http": f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}",
        "chunked.http": "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                        "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: t\r\n\r\n",
        "pipelined.http": "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                          "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"
                          "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
        "expect_continue.http": "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                "Content-Length: 4\r\n\r\nabcd",
        "refused.http": "POST /refuse HTTP/1.1\r\nContent-Length: 2000\r\n\r\n" + "x" * 40,
        "too_large.http": "POST /echo HTTP/1.1\r\nContent-Length: 1100\r\n\r\n" + "y" * 1100,
        "no_colon.http": "GET /health HTTP/1.1\r\nHost x\r\n\r\n",
        "ranges.http": "GET /health?a=1&b=%20 HTTP/1.1\r\nRange: bytes=0-1,3-\r\n"
                       "Accept-Encoding: gzip, br\r\n\r\n",
        "multipart.http": "POST /echo HTTP/1.1\r\nContent-Type: multipart/form-data; boundary=B"
                          "\r\nContent-Length: 44\r\n\r\n--B\r\nContent-Disposition: form-data; "
                          "name=a\r\n\r\n1\r\n--B--\r\n",
        "http10.http": "GET /health HTTP/1.0\r\n\r\n",
    }
    for name, text in seeds.items():
        write("fuzz_http_request", name, text)


# ---- OpenAI request bodies ----
def openai_seeds():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    bodies = {
        "completion.json": {"model": "fuzz-model", "prompt": "Hello", "max_tokens": 8,
                            "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                            "stop": ["\n", "."], "logprobs": 2, "seed": 3, "n": 2,
                            "logit_bias": {"5": -100, "7": 2.5}, "stream": True,
                            "stream_options": {"include_usage": True}},
        "token_prompts.json": {"prompt": [[1, 2, 3], "text"], "max_tokens": 1,
                               "stop_token_ids": [4], "presence_penalty": 1,
                               "frequency_penalty": -1, "repetition_penalty": 1.1,
                               "ignore_eos": True, "cache_salt": "s"},
        "chat.json": {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                      "max_completion_tokens": 16, "logprobs": True, "top_logprobs": 3,
                      "tools": [tool], "tool_choice": "auto",
                      "chat_template_kwargs": {"enable_thinking": False},
                      "response_format": {"type": "text"}},
        "chat_tool_turns.json": {"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
             "id": "c1", "function": {"name": "get_weather", "arguments": "{\"city\": \"P\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21"}], "tools": [tool]},
        "tokenize.json": {"prompt": "Hello world", "add_special_tokens": False},
        "detokenize.json": {"tokens": [1, 2, 3, 800]},
    }
    for name, body in bodies.items():
        write("fuzz_openai_request", name, json.dumps(body))


# ---- fuzz_json_shapes: field byte, container | endpoint << 1, repeat count / 32, unit ----
def json_shape_seeds():
    fields = ["x", "logit_bias", "chat_template_kwargs", "messages", "tools", "stop", "prompt",
              "response_format", "tokens"]
    completions, chat, tokenize, detokenize = 0, 1, 2, 3
    # name: (field, container (1: object), endpoint, unit)
    shapes = {
        "empty_objects": (0, 0, completions, b"{}"), "empty_arrays": (0, 0, chat, b"[]"),
        "values_objects": (0, 1, tokenize, b"{}"), "values_numbers": (0, 1, detokenize, b"1"),
        "logit_bias": (1, 1, completions, b"5"), "kwargs": (2, 1, chat, b'{"a":[]}'),
        "messages": (3, 0, chat, b'{"role":"user","content":"hi"}'),
        "messages_tokenize": (3, 0, tokenize, b'{"role":"user","content":"hi"}'),
        "tools": (4, 0, chat, b'{"type":"function","function":{"name":"f"}}'),
        "stop": (5, 0, completions, b'"x"'), "prompt_ids": (6, 0, completions, b"7"),
        "detokenize_ids": (8, 0, detokenize, b"7"), "format": (7, 1, chat, b'"json_object"'),
    }
    for name, (field, container, endpoint, unit) in shapes.items():
        assert fields[field]
        # 2047 x 32 repeats: as many as fit in the target's 2 MB.
        write("fuzz_json_shapes", name, bytes([field, container | endpoint << 1, 0x07, 0xff]) + unit)
    # 11 x 32 + 1 messages of 5.7 KB each, as many as the target's model takes (384 tokens of
    # context): a 2 MB chat that is rendered and tokenized in full.
    long_message = b'{"role":"user","content":"' + b"lorem ipsum " * 475 + b'"}'
    write("fuzz_json_shapes", "long_messages", bytes([3, chat << 1, 0x00, 0x0b]) + long_message)


# ---- model replies: first byte = tool-call form | 4 if the prompt opened <think> ----
def reply_seeds():
    replies = {
        "tags.txt": (1, "Sure.\x01<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n"
                        "</tool_ca\x01ll>\nand <tool_call>not json</tool_call>"),
        "json_reply.txt": (2, "  \x01{\"name\": \"f\", \"parameters\": {\"x\": [1, 2]}}"),
        "marker.txt": (3, "Calling [TOOL_\x01CALLS] [{\"name\": \"f\", \"arguments\": {}}]"),
        "think.txt": (0, "\n<thi\x01nk>\n\nreasoning here\n</thi\x01nk>\n\nanswer"),
        "opened.txt": (4 | 1, "still thinking\n\n</think>\n<tool_call>{\"name\": \"g\"}"
                              "</tool_call>"),
    }
    for name, (head, text) in replies.items():
        write("fuzz_reply_parsers", name, bytes([head]) + text.encode())


# ---- fuzz_quant_config: config.json quantization_config of each FP8 writer ----
def quant_config_seeds():
    f8 = lambda strategy, dynamic: {"num_bits": 8, "type": "float", "strategy": strategy,
                                    "symmetric": True, "dynamic": dynamic}
    configs = {
        "autofp8.json": {"quant_method": "fp8", "activation_scheme": "static",
                         "ignored_layers": ["lm_head"]},
        "blocks.json": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"]},
        "compressed_tensors.json": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*layers\\.1\\..*"], "kv_cache_scheme": f8("tensor", False),
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": f8("channel", False),
                            "input_activations": f8("token", True)},
                "group_1": {"targets": ["re:.*self_attn\\.(q|k|v)_proj$"], "weights": f8("tensor", False),
                            "input_activations": f8("tensor", False)},
                "group_2": {"targets": ["model.layers.0.self_attn.k_proj"],
                            "weights": dict(f8("block", False), block_structure=[64, 32])}}},
        "fbgemm.json": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                        "modules_to_not_convert": ["lm_head"]},
    }
    for name, q in configs.items():
        write("fuzz_quant_config", name, json.dumps({"hidden_size": 64, "quantization_config": q}))


if __name__ == "__main__":
    gguf_seeds()
    safetensors_seeds()
    http_seeds()
    openai_seeds()
    json_shape_seeds()
    reply_seeds()
    quant_config_seeds()
