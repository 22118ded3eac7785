#!/usr/bin/env python3
"""Builds the tokenizer reference data for the C++ tokenizer tests from the HF `tokenizers` library.

The SmolLM2 vocabulary, merges and token types are read from the GGUF (with the `gguf` package) and
turned into a `tokenizers.Tokenizer` shaped like the SmolLM2 tokenizer.json: BPE, pre-tokenizer
Sequence[Digits(individual), ByteLevel(regex)], ByteLevel decoder and the control tokens as added
special tokens. Where transformers is importable, its own GGUF->tokenizer conversion is built too
and must agree on every case.

Writes
  testdata/tokenizer/smollm2/tokenizer.json  the reference tokenizer (exercises our json loader)
  testdata/tokenizer/smollm2/tokenizer_config.json  its bos/eos tokens (from the GGUF ids)
  testdata/tokenizer/smollm2_cases.json      seeded strings with reference ids, decodes and the
                                             Qwen2 / Llama 3 regex pre-tokenizer splits
  testdata/tokenizer/tiny/tokenizer.json     a small BPE trained here, shaped like Llama 3's
                                             (Split regex, ignore_merges, BOS/EOS template) with
                                             added tokens using lstrip/rstrip/single_word
  testdata/tokenizer/tiny_cases.json         its reference ids and decodes

Invalid UTF-8 inputs: HF tokenizers only sees Rust strings, so the reference is given
`raw.decode("utf-8", "replace")`; the case stores the raw bytes (text_hex) and the replaced text
(sanitized_hex) so the C++ test feeds the raw bytes and checks our replacement too.

Usage: scripts/make_tokenizer_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
The model is looked up in $PAGEDLM_CACHE, else $HOME/.cache/pagedlm (scripts/fetch_model.sh).
"""
import importlib.metadata
import json
import os
import random
import sys
import unicodedata

import gguf
import tokenizers
import tokenizers.trainers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO, "testdata", "tokenizer")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED = 20240611
NUM_CASES_PER_CATEGORY = 160

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def find_model():
    if len(sys.argv) > 1:
        return sys.argv[1]
    default_cache = os.path.join(os.path.expanduser("~"), ".cache", "pagedlm")
    cache = os.environ.get("PAGEDLM_CACHE", default_cache)
    path = os.path.join(cache, MODEL_FILE)
    if not os.path.exists(path):
        sys.exit(f"{path} not found; run scripts/fetch_model.sh first")
    return path


def read_gguf_tokenizer(path):
    reader = gguf.GGUFReader(path)

    def field(key):
        if key not in reader.fields:
            sys.exit(f"{path} has no {key}")
        return reader.fields[key]

    def strings(key):
        f = field(key)
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(key):
        f = field(key)
        return [int(f.parts[i][0]) for i in f.data]

    def scalar_str(key):
        f = field(key)
        return bytes(f.parts[f.data[0]]).decode("utf-8")

    info = {
        "model": scalar_str("tokenizer.ggml.model"),
        "pre": scalar_str("tokenizer.ggml.pre"),
        "tokens": strings("tokenizer.ggml.tokens"),
        "token_type": ints("tokenizer.ggml.token_type"),
        "merges": strings("tokenizer.ggml.merges"),
        "bos": ints("tokenizer.ggml.bos_token_id")[0],
        "eos": ints("tokenizer.ggml.eos_token_id")[0],
    }
    assert info["model"] == "gpt2" and info["pre"] == "smollm", (info["model"], info["pre"])
    return info


def build_reference(info):
    vocab = {token: i for i, token in enumerate(info["tokens"])}
    merges = [tuple(m.split(" ")) for m in info["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(info["tokens"], info["token_type"]) if kind == 3]
    tok.add_special_tokens(special)
    return tok


def build_transformers_reference(info):
    """transformers' own GGUF conversion, or None when transformers is not importable."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except Exception as e:  # transformers missing or too old: the check is optional
        print(f"transformers GGUF conversion unavailable ({type(e).__name__}: {e}); skipped")
        return None
    tokenizer_dict = {
        "tokenizer_type": info["model"], "pre_tokenizer_type": info["pre"],
        "tokens": info["tokens"], "token_type": info["token_type"], "merges": info["merges"],
        "bos_token_id": info["bos"], "eos_token_id": info["eos"],
    }
    tok, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    # transformers has no split regex for "smollm" and keeps GPT2Tokenizer's plain ByteLevel, so
    # multi-digit numbers could merge; llama.cpp and the SmolLM2 tokenizer.json split digits first.
    # Prepending that step makes the comparison check its vocabulary, merges and special tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    return tok


# ---------------------------------------------------------------------------------------------
# Seeded test strings.

WORDS = ("the of and to in is was for on that with as it by at from his an were are which this "
         "be or has had not but first one their its new after who they have her she two been "
         "other when there all during into school time may years more most only over city some "
         "world would where later up such used many can state about national out known "
         "university united then made Hello World Python tokenizer engine attention cache page "
         "prefix batch GPU kernel").split()
CONTRACTIONS = ["I'm", "you're", "it's", "they've", "we'll", "he'd", "don't", "can't", "won't",
                "I'M", "DON'T", "IT'S", "We'RE", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
                "O'Neil", "rock'n'roll", "'tis", "y'all", "shouldn't've", "'S", "'LL", "'D"]
PUNCT = list(".,;:!?-—–()[]{}\"'`~@#$%^&*_+=|\\/<>…«»“”‘’")
CODE_SNIPPETS = [
    'def {f}(x, y=2):\n    """Doc."""\n    if x > {n}:\n        return x * y\n    return None\n',
    'class {F}:\n\tdef __init__(self):\n\t\tself.{f} = [{n}, {n}]\n',
    '#include <vector>\nint {f}(const std::vector<int>& v) {{\n  int s = 0;\n'
    '  for (int x : v) s += x;\n'
    '  return s + {n};\n}}\n',
    'template <typename T>\nT {f}(T a, T b) {{ return a < b ? b : a; }}  // max\n',
    '{{\n  "{f}": {n},\n  "items": [1, 2.5, null, true],\n  "nested": {{"k": "v\\n"}}\n}}\n',
    'for i in range({n}):\n    print(f"{{i:>4}} {f}")\n',
    'SELECT {f}, COUNT(*) FROM t WHERE id >= {n} GROUP BY {f};\n',
    '<div class="{f}">\n  <p>{n}&nbsp;items</p>\n</div>\n',
    'fn {f}(x: &str) -> Result<u32, Error> {{\n    x.parse::<u32>().map_err(|e| e.into())\n}}\n',
    '    if (ptr == nullptr) {{\n        throw std::runtime_error("{f}");\n    }}\r\n',
]
NUMBERS = ["0", "7", "42", "123", "2024", "3.14159", "1,234,567.89", "-17", "+1 (555) 010-9999",
           "0xDEADBEEF", "1e-10", "6.02e23", "12:30:45", "2024-06-11", "100%", "$9.99", "v1.2.3",
           "١٢٣", "٣.١٤", "１２３", "²³", "½", "⅓", "Ⅻ", "৩", "೭", "一二三", "10⁶", "①②", "𝟙𝟚𝟛"]
EMOJI = ["😀", "👍", "👍🏽", "❤️", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "🇺🇸🇬🇧", "1️⃣", "🧑🏿‍💻", "🙂🙃",
         "👩‍❤️‍💋‍👨", "✨", "🚀", "🐍", "©", "™", "☃", "🫠", "🤌🏻", "#️⃣"]
SCRIPTS = {
    "cjk": ["你好，世界！", "我们正在测试分词器。", "東京は日本の首都です。", "ひらがなとカタカナ",
            "한국어 텍스트입니다.", "漢字かな交じり文", "中文、日本語、한국어", "「引用」『二重』"],
    "arabic": ["مرحبا بالعالم", "اللغة العربية جميلة.", "٢٠٢٤ سنة", "السَّلَامُ عَلَيْكُمْ"],
    "cyrillic": ["Привет, мир!", "Съешь же ещё этих мягких французских булок.", "ЁЛКИ-ПАЛКИ"],
    "greek": ["Γειά σου Κόσμε", "αβγδε ΑΒΓΔΕ"],
    "hebrew": ["שלום עולם", "עִבְרִית"],
    "indic": ["नमस्ते दुनिया", "தமிழ் மொழி", "বাংলা ভাষা"],
    "thai": ["สวัสดีชาวโลก"],
    "latin": ["café", "naïve", "Ångström", "façade", "jalapeño", "Straße", "Œuvre", "ÉCOLE",
              "e\u0301", "n\u0303o", "Ł ódź", "İstanbul ışık", "ǅ ǈ", "ﬁ ﬂ", "Ǆemal"],
}
WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", " \t ",
              "\u00a0", "\u3000", "\u2028", "\u0085", "\u2009", "\u200b", "\x0b", "\x0c", "    "]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<repo_name>",
            "<jupyter_code>", "<empty_output>"]
SPECIAL_NEAR_MISSES = ["<|im_start", "im_end|>", "<|im_start |>", "< |endoftext|>", "<|IM_END|>",
                       "<|", "|>", "<<", ">>", "<filename", "<|im_end|"]


def words(rng, n):
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.1:
            w = w.capitalize()
        elif r < 0.13:
            w = w.upper()
        out.append(w)
        if rng.random() < 0.15:
            out[-1] += rng.choice(PUNCT)
    return " ".join(out)


def gen_prose(rng):
    s = words(rng, rng.randint(1, 40))
    return s[0].upper() + s[1:] + rng.choice([".", "!", "?", "", "\n"])


def gen_code(rng):
    snippet = rng.choice(CODE_SNIPPETS).format(
        f=rng.choice(["foo", "bar_baz", "compute", "x1", "value", "_private", "CamelCase"]),
        F=rng.choice(["Foo", "Engine", "KVCache"]), n=rng.randint(0, 10**rng.randint(1, 9)))
    if rng.random() < 0.3:
        snippet = snippet.replace("    ", rng.choice(["\t", "  ", "        "]))
    return snippet * rng.randint(1, 2)


def gen_numbers(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(NUMBERS))
        elif r < 0.7:
            parts.append(str(rng.randint(0, 10**rng.randint(1, 15))))
        else:
            parts.append(f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}")
        parts.append(rng.choice([" ", "", ", ", "+", " apples ", "\n", "x"]))
    return "".join(parts)


def gen_emoji(rng):
    pool = EMOJI + [" ", " ", "wow", "!", "\n"]
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 10)))


def gen_script(rng):
    pool = sum(SCRIPTS.values(), [])
    return rng.choice([" ", "", "\n", ", "]).join(
        rng.choice(pool) for _ in range(rng.randint(1, 5)))


def gen_whitespace(rng):
    parts = []
    for _ in range(rng.randint(1, 10)):
        parts.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 4))))
        if rng.random() < 0.7:
            parts.append(rng.choice(WORDS + NUMBERS[:5] + PUNCT[:5]))
    return "".join(parts)


def gen_contractions(rng):
    parts = []
    for _ in range(rng.randint(1, 10)):
        parts.append(rng.choice(CONTRACTIONS + WORDS[:20]))
        parts.append(rng.choice([" ", " ", "", "\n", "  "]))
    return "".join(parts)


def gen_specials(rng):
    r = rng.random()
    if r < 0.3:  # the chat template shape
        msgs = []
        for role in rng.sample(["system", "user", "assistant"], rng.randint(1, 3)):
            msgs.append(f"<|im_start|>{role}\n{words(rng, rng.randint(1, 12))}<|im_end|>\n")
        return "".join(msgs) + rng.choice(["", "<|im_start|>assistant\n"])
    parts = []
    for _ in range(rng.randint(1, 8)):
        c = rng.random()
        if c < 0.45:
            parts.append(rng.choice(SPECIALS))
        elif c < 0.6:
            parts.append(rng.choice(SPECIAL_NEAR_MISSES))
        else:
            parts.append(words(rng, rng.randint(0, 4)))
        parts.append(rng.choice(["", " ", "\n", "  "]))
    return "".join(parts)


def random_printable_char(rng):
    while True:
        r = rng.random()
        if r < 0.5:
            cp = rng.randint(0x20, 0x2FFF)
        elif r < 0.8:
            cp = rng.randint(0x3000, 0xFFFF)
        else:
            cp = rng.randint(0x10000, 0x3FFFF)
        c = chr(cp)
        if 0xD800 <= cp <= 0xDFFF or not c.isprintable():
            continue
        return c


def gen_random_unicode(rng):
    return "".join(random_printable_char(rng) if rng.random() < 0.8 else rng.choice(" \n\t")
                   for _ in range(rng.randint(1, 30)))


def gen_mixed(rng):
    gens = [gen_prose, gen_code, gen_numbers, gen_emoji, gen_script, gen_whitespace,
            gen_contractions, gen_specials, gen_random_unicode]
    return "".join(rng.choice(gens)(rng) for _ in range(rng.randint(2, 4)))


INVALID_PIECES = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80",
                  b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xfe",
                  b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xf0\x9f", b"\xe2\x28\xa1", b"\xc3\x28",
                  b"\xf8\x88\x80\x80\x80", b"\xe0\xa0", b"\xf0\x90\x80"]


def gen_invalid_bytes(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(INVALID_PIECES))
        elif r < 0.6:
            parts.append(bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice([gen_prose, gen_emoji, gen_script, gen_numbers])(rng)
                         .encode("utf-8")[: rng.randint(1, 40)])
    return b"".join(parts)


def fixed_cases():
    """Edge cases that must be present whatever the seed does."""
    texts = ["", "Hello world! 123", "\n", " ", "  ", "a", "Ġ", "ĊĠ", "<|im_start|>",
             "<|im_start|><|im_end|>", "<|endoftext|>hi<|endoftext|>", " <|im_end|> ",
             "x" * 3000, " " * 2000, "\n" * 500, "ab " * 1000, "1234567890" * 50,
             "\t \t \n", "hello  world", "hello   \n  world", "a\u00a0b", "'s", "I'M HERE"]
    texts += [chr(i) for i in range(0, 128)]
    raw = [t.encode("utf-8") for t in texts]
    raw += [bytes([b]) for b in range(128, 256)]
    raw += INVALID_PIECES
    return raw


def make_cases():
    rng = random.Random(SEED)
    generators = [
        ("prose", gen_prose), ("code", gen_code), ("numbers", gen_numbers), ("emoji", gen_emoji),
        ("scripts", gen_script), ("whitespace", gen_whitespace),
        ("contractions", gen_contractions), ("specials", gen_specials),
        ("random_unicode", gen_random_unicode), ("mixed", gen_mixed),
    ]
    cases = [("fixed", raw) for raw in fixed_cases()]
    for name, gen in generators:
        cases += [(name, gen(rng).encode("utf-8")) for _ in range(NUM_CASES_PER_CATEGORY)]
    cases += [("invalid_utf8", gen_invalid_bytes(rng)) for _ in range(NUM_CASES_PER_CATEGORY)]
    return cases


TINY_EXTRA_TEXTS = [
    "a <mask> b", "a<mask>b", "  <mask>  ", "<mask>", "<mask><mask>", " <mask>\n\nword",
    "x \u3000<mask>\u3000 y", "hello world", "sayhello", "hello_", "hellohello", "hello",
    "(hello)", "hello2", "élan hello", "<|end|>", "<|end|>!", "<|end|>!!", "<|end|>!!!",
    "wor world", "sword", "<|begin|>hi<|end|>", "<|begin|> <|end|>", "<|end",
    "I'M DON'T we'Re", "12345678 1234", "  \n\n  x\r\n\ty",
]


def build_tiny_reference(texts):
    """A small BPE trained here, shaped like Llama 3's tokenizer.json: Split(regex) then
    ByteLevel(use_regex=false), ignore_merges, TemplateProcessing with BOS/EOS, and added tokens
    exercising lstrip/rstrip, single_word, normalized and leftmost-longest matching."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=800, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = True
    tok = Tokenizer.from_str(json.dumps(doc))
    tok.add_special_tokens([AddedToken("<|begin|>", special=True, normalized=False),
                            AddedToken("<|end|>", special=True, normalized=False),
                            AddedToken("<|end|>!!", special=True, normalized=False),
                            AddedToken("<mask>", special=True, normalized=False, lstrip=True,
                                       rstrip=True)])
    tok.add_tokens([AddedToken("hello", special=False, normalized=False, single_word=True),
                    AddedToken("wor", special=False, normalized=True)])
    begin, end = tok.token_to_id("<|begin|>"), tok.token_to_id("<|end|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A <|end|>", special_tokens=[("<|begin|>", begin), ("<|end|>", end)])
    return tok


def tiny_cases(tok, texts):
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True).ids
        tok.encode_special_tokens = True
        ids_no_special = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        out.append({
            "text": text,
            "ids": ids,
            "ids_no_add": tok.encode(text, add_special_tokens=False).ids,
            "ids_no_special": ids_no_special,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def split_pieces(pre, text):
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def main():
    info = read_gguf_tokenizer(find_model())
    tok = build_reference(info)
    tf_tok = build_transformers_reference(info)
    qwen2 = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
    llama3 = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")

    # Bytes whose symbol is not in the vocabulary are dropped by HF (unk_token is null).
    vocab = tok.get_vocab()
    missing = sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab)
    print(f"{len(missing)} byte symbols missing from the vocabulary: {missing}")

    os.makedirs(os.path.join(OUT_DIR, "smollm2"), exist_ok=True)
    json_path = os.path.join(OUT_DIR, "smollm2", "tokenizer.json")
    tok.save(json_path, pretty=False)
    reloaded = Tokenizer.from_file(json_path)
    # bos/eos are not part of tokenizer.json; HF keeps them in tokenizer_config.json.
    with open(os.path.join(OUT_DIR, "smollm2", "tokenizer_config.json"), "w") as f:
        config = {"bos_token": info["tokens"][info["bos"]],
                  "eos_token": info["tokens"][info["eos"]]}
        json.dump(config, f, indent=2)
        f.write("\n")

    out_cases = []
    tf_compared = 0
    for category, raw in make_cases():
        text = raw.decode("utf-8", "replace")
        enc = tok.encode(text, add_special_tokens=True)
        ids = enc.ids
        assert reloaded.encode(text).ids == ids, text
        if tf_tok is not None:
            tf_ids = tf_tok.encode(text, add_special_tokens=False).ids
            assert tf_ids == ids, f"transformers GGUF conversion disagrees on {text!r}"
            tf_compared += 1
        case = {
            "category": category,
            "text_hex": raw.hex(),
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            "qwen2_pieces": split_pieces(qwen2, text),
            "llama3_pieces": split_pieces(llama3, text),
        }
        if text.encode("utf-8") != raw:
            case["sanitized_hex"] = text.encode("utf-8").hex()
        if any(s in text for s in SPECIALS):
            # Special tokens treated as plain text, as with parse_special = false.
            tok.encode_special_tokens = True
            case["ids_no_special"] = tok.encode(text).ids
            tok.encode_special_tokens = False
        out_cases.append(case)

    doc = {
        "provenance": {
            "script": "scripts/make_tokenizer_reference.py",
            "tokenizers_version": tokenizers.__version__,
            "gguf_version": importlib.metadata.version("gguf"),
            "model": MODEL_FILE,
            "seed": SEED,
            "transformers_gguf_conversion_agreed_on": tf_compared,
            "qwen2_pattern": QWEN2_PATTERN,
            "llama3_pattern": LLAMA3_PATTERN,
            "notes": "text_hex is the raw input; the reference saw it decoded with "
                     "bytes.decode('utf-8', 'replace') (sanitized_hex where that differs). "
                     "ids use add_special_tokens=True (SmolLM2 adds nothing).",
        },
        "cases": out_cases,
    }
    valid_texts = [raw.decode("utf-8") for category, raw in make_cases()
                   if category != "invalid_utf8" and raw.decode("utf-8", "replace").encode() == raw]
    tiny = build_tiny_reference(valid_texts)
    os.makedirs(os.path.join(OUT_DIR, "tiny"), exist_ok=True)
    tiny.save(os.path.join(OUT_DIR, "tiny", "tokenizer.json"), pretty=False)
    tiny_doc = {
        "provenance": {"script": "scripts/make_tokenizer_reference.py",
                       "tokenizers_version": tokenizers.__version__, "seed": SEED},
        "cases": tiny_cases(tiny, valid_texts[::4] + TINY_EXTRA_TEXTS),
    }
    with open(os.path.join(OUT_DIR, "tiny_cases.json"), "w", encoding="utf-8") as f:
        json.dump(tiny_doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")

    cases_path = os.path.join(OUT_DIR, "smollm2_cases.json")
    with open(cases_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"{len(out_cases)} cases -> {cases_path} ({os.path.getsize(cases_path)} bytes); "
          f"tokenizer.json {os.path.getsize(json_path)} bytes; "
          f"transformers agreed on {tf_compared}")


if __name__ == "__main__":
    main()
