"""The tokenizer a GGUF carries (`tokenizer.ggml.*`) as a `tokenizers` tokenizer.json plus
tokenizer_config.json and generation_config.json, after transformers' GGUF tokenizer
(`integrations/gguf/gguf_tokenizer_mapping.py`) and llama.cpp's pre-tokenizer table
(src/llama-vocab.cpp) for the pre-types transformers lacks."""
from __future__ import annotations

from pathlib import Path

from colibri.errors import ColibriError

# Split regexes for `tokenizer.ggml.pre`, as transformers' GGUF tokenizer uses them; any other
# value keeps the GPT-2 byte-level regex (SmolLM2's "smollm" among them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's own (src/llama-vocab.cpp; transformers has none for these): a sequence of splits,
# each applied to the pieces the previous one left, as the models' tokenizer.json have them.
_DEEPSEEK_LLM_SPLITS = (
    '[\r\n]',
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    '\\s+$',
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    '\\p{N}+',
)
_DEEPSEEK_V3_SPLITS = (
    '\\p{N}{1,3}',
    '[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
    '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
)
_DEEPSEEK_CODER_SPLITS = (
    '[\r\n]',
    '\\s?\\p{L}+',
    '\\s?\\p{P}+',
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    '\\p{N}',
)

_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), (_QWEN2_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_SPLIT,)),
    # GLM-4 / 4.5 (llama.cpp's CHATGLM4 pre-type: llama3's regex, merges ignored for whole words)
    **dict.fromkeys(("glm4", "glm5"), (_LLAMA3_SPLIT,)),
    "deepseek-v3": _DEEPSEEK_V3_SPLITS,
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
}
# llama.cpp tokenizes a word that is itself a token as that token, merges or not (BPE ignore_merges)
_IGNORE_MERGES = ("glm4", "glm5")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Tokens that end generation beyond the file's eos / eot / eom ids, per architecture, as llama.cpp
# finds them by text (llama-vocab.cpp's end-of-generation list): gpt-oss's harmony format ends an
# answer with <|return|> and a tool call with <|call|>, and <|end|> is left out because the
# analysis message ends with it and the answer follows (gpt-oss's generation_config.json stops on
# the same three).
_END_OF_GENERATION = {"gpt-oss": ("<|return|>", "<|call|>", "<|endoftext|>")}


# ---------------------------------------------------------------- tokenizer

def tokenizer_files(path: Path, meta: dict) -> tuple[str, dict, dict]:
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise ColibriError(f"{path.name}: GGUF carries no tokenizer (tokenizer.ggml.model / tokens missing)")
    if model != "gpt2":
        raise ColibriError(
            f"{path.name}: GGUF tokenizer model {model!r} is not supported yet (supported: gpt2 byte-level BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or []

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    backend = _byte_level_bpe(tokens, token_types, meta.get("tokenizer.ggml.merges") or [],
                              meta.get("tokenizer.ggml.pre"), special, bool(add_bos), bool(add_eos))

    tokenizer_config = {
        # not "GPT2Tokenizer"/"LlamaTokenizer": those rebuild their own pipeline in transformers 5;
        # this one takes tokenizer.json as written
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length", 1 << 30),
    }
    if add_bos is not None:
        tokenizer_config["add_bos_token"] = bool(add_bos)
    if add_eos is not None:
        tokenizer_config["add_eos_token"] = bool(add_eos)
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]

    # llama.cpp also stops on end-of-turn / end-of-message tokens when the file names them
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and i not in eos_ids:
            eos_ids.append(i)
    ends = _END_OF_GENERATION.get(meta.get("general.architecture"), ())
    eos_ids += [i for i, tok in enumerate(tokens) if tok in ends and i not in eos_ids]
    generation_config = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation_config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return backend.to_str(), tokenizer_config, generation_config


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_bpe(tokens, token_types, merges, pre, special, add_bos, add_eos):
    """transformers' `byte_level_tokenizer` + `add_gguf_special_tokens` + `set_split_regex` +
    the special tokens and post-processor its TokenizersBackend adds."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import BPE

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (raw UTF-8 in the file) is respelled into it.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False,
                            ignore_merges=pre in _IGNORE_MERGES))
    splits = _PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()

    # As special added tokens: GPT2Tokenizer's default "<|endoftext|>" (only when in the vocabulary;
    # transformers would append it as a new id), the file's CONTROL tokens (one spelled outside the
    # byte alphabet is a llama.cpp mislabel and stays ordinary) and the named special tokens.
    # USER_DEFINED tokens (e.g. <think>) become plain added tokens: matched whole, not special.
    named = ["<|endoftext|>"] + [t for t in special.values() if t is not None]
    control = [tok for tok, ty in zip(tokens, token_types) if ty == _CONTROL and set(tok) <= alphabet]
    added_special = []
    for tok in control + [t for t in named if t in vocab]:
        if tok not in added_special:
            added_special.append(tok)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in added_special])
    user_defined = [tok for tok, ty in zip(tokens, token_types) if ty == _USER_DEFINED and tok in vocab]
    if user_defined:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    bos, eos = special["bos_token"], special["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return backend
