"""The DBA student exported as a Hugging Face folder with remote code (``models.dba_hf``): transformers opens it
with ``trust_remote_code=True`` and computes ``models.dba.apply``'s logits (random students with a shuffled
choice of RoPE pairs, tied and untied, windowed, with biases; a surgery student of a llama3-scaled teacher),
greedy ``generate`` through transformers' KV cache equals our decoder's, and the folder holds our tensors.
"""
import ast
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install purestep[reference]")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs the 'hf' extra: pip install purestep[hf]")

from purestep.core.config import UserError  # noqa: E402
from purestep.models import dba, llama, surgery  # noqa: E402
from purestep.models.dba_hf import export_dba_hf, state_dict  # noqa: E402
from purestep.models.sampling import generate  # noqa: E402

PAIRS = [[[7, 1, 3, 0], [2, 5, 6, 4]], [[0, 6, 1, 7], [3, 2, 4, 5]]]   # not the uniform default [0, 2, 4, 6]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}     # with head_dim 16 the pairs fall into all three bands
BIASES = {"q_s_bias": "sem_dim", "q_g_bias": "geo_dim", "k_s_bias": "sem_dim", "k_g_bias": "geo_dim", "v_bias": "v_dim"}


def student_config(**changes) -> dba.DBAConfig:
    return dba.DBAConfig(**{**dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                   sem_dim=8, geo_dim=8, v_dim=16, max_context=128, rope_pairs=PAIRS), **changes})


def student(cfg: dba.DBAConfig, seed=3) -> dict:
    """``dba.init`` with the scores and logits scaled up: peaky attention (a wrong pair, head or mask shows)."""
    params = dba.init(cfg, seed=seed)
    for name in ("wq_s", "wq_g", "wk_s", "wk_g"):
        params["layers"]["attn"][name] = params["layers"]["attn"][name] * 6
    params["embed"] = params["embed"] * 20
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"] * 20
    return params


def tokens(b=2, t=33, seed=0, vocab=96):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def open_hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__name__ == "PurestepDBAForCausalLM"
    return model


def logits_diff(params, cfg, folder, tok) -> float:
    export_dba_hf(params, cfg, folder)
    with torch.no_grad():
        theirs, ours = open_hf(folder)(tok).logits, dba.apply(params, tok, cfg)
    assert ours.std() > 1.0
    diff = (theirs - ours).abs().max().item()
    print(f"max |logit diff| = {diff:.2e}")
    return diff


@pytest.mark.parametrize("tied", [True, False])
def test_random_student_logits_match(tmp_path, tied):
    cfg = student_config(tie_embeddings=tied)
    params = student(cfg)
    assert ("lm_head" in params) != tied
    assert logits_diff(params, cfg, tmp_path / "out", tokens(t=37)) < 1e-4
    # the pair mapping matters: the uniform default pairs give other logits
    uniform = student_config(tie_embeddings=tied, rope_pairs=[])
    assert (dba.apply(params, tokens(t=37), cfg) - dba.apply(params, tokens(t=37), uniform)).abs().max() > 1e-2


def test_sliding_window_student_logits_match(tmp_path):
    cfg = student_config(sliding_window=8)
    params, tok = student(cfg), tokens(t=40)
    assert logits_diff(params, cfg, tmp_path / "out", tok) < 1e-4
    full = dba.apply(params, tok, student_config())
    assert (full - dba.apply(params, tok, cfg))[:, 8:].abs().max() > 1e-2    # the window changes the logits


def test_surgery_student_of_a_llama3_teacher_logits_match(tmp_path):
    teacher_cfg = llama.LlamaConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                    rope_scaling=dict(LLAMA3), max_context=256)
    teacher = llama.init(teacher_cfg, seed=1)
    attn = teacher["layers"]["attn"]
    attn["wq"], attn["wk"], attn["wv"] = attn["wq"] * 10, attn["wk"] * 10, attn["wv"] * 3
    teacher["embed"] = teacher["embed"] * 20
    params, cfg, _ = surgery.surgery(teacher, teacher_cfg, tokens(4, 32, seed=11), sem_dim=4, geo_dim=8, v_dim=12)
    assert cfg.rope_pairs != student_config(rope_pairs=[]).rope_pairs        # surgery chose its own pairs
    assert logits_diff(params, cfg, tmp_path / "out", tokens(t=24)) < 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3 and config["max_position_embeddings"] == 256


@pytest.mark.parametrize("window", [0, 6])
def test_greedy_generate_equals_our_decoder(tmp_path, window):
    """transformers' generate (prefill, then one token at a time through its DynamicCache; with a window the
    cache drops old positions) picks the tokens our KV-cache decoder picks."""
    cfg = student_config(sliding_window=window, tie_embeddings=False)   # tied, this student repeats one token
    params, prompt = student(cfg), tokens(2, 10, seed=5)
    export_dba_hf(params, cfg, tmp_path / "out")
    model = open_hf(tmp_path / "out")
    lengths = []                                                             # tokens fed per forward
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
        assert lengths == [10] + [1] * 15                                    # prefill, then the cache
        out = model(prompt, use_cache=True)
    ours = generate(dba.decoder(params, cfg, 2, 26), prompt, 16, temperature=0)
    assert torch.equal(theirs[:, 10:], ours)
    assert len(set(ours[0].tolist())) > 2                                    # not one token repeated
    cache = out.cache if "cache" in out else out.past_key_values
    assert cache is not None and cache.get_seq_length() == 10
    k, v = cache.layers[0].keys, cache.layers[0].values                      # [B, G, S, width]
    assert k.shape[-1] == cfg.sem_dim + cfg.geo_dim and v.shape[-1] == cfg.v_dim


def test_right_padding_and_labels(tmp_path):
    cfg = student_config()
    params, tok = student(cfg), tokens(2, 30, seed=7)
    export_dba_hf(params, cfg, tmp_path / "out")
    mask = torch.ones_like(tok)
    mask[1, 20:] = 0
    model = open_hf(tmp_path / "out")
    with torch.no_grad():
        padded = model(tok, attention_mask=mask).logits
        loss = model(tok, labels=tok).loss                                  # labels shifted inside, as transformers
    assert (padded[1, :20] - dba.apply(params, tok[1:, :20], cfg)[0]).abs().max() < 1e-4
    assert torch.isfinite(padded).all()
    assert abs(loss - dba.loss(params, {"x": tok[:, :-1], "y": tok[:, 1:]}, cfg)) < 1e-5


def _has_bias_leaves() -> bool:
    cfg = student_config(qkv_bias=True)
    return "q_s_bias" in dba.init(cfg)["layers"]["attn"]


@pytest.mark.skipif(not _has_bias_leaves(), reason="models.dba here has no q/k/v bias leaves yet (another branch "
                                                   "adds them); runs once both land")
def test_biases_match(tmp_path):
    cfg = student_config(qkv_bias=True)
    params = student(cfg)
    g = torch.Generator().manual_seed(9)
    heads = {"q_s_bias": cfg.n_heads, "q_g_bias": cfg.n_heads}
    for name, width in BIASES.items():
        rows = heads.get(name, cfg.n_kv_heads) * getattr(cfg, width)
        params["layers"]["attn"][name] = torch.randn(cfg.n_layers, rows, generator=g)
    assert logits_diff(params, cfg, tmp_path / "out", tokens(t=30)) < 1e-4
    without = {**params, "layers": {**params["layers"], "attn": {k: v for k, v in params["layers"]["attn"].items()
                                                                 if k not in BIASES}}}
    assert (dba.apply(params, tokens(t=30), cfg) - dba.apply(without, tokens(t=30), student_config())).abs().max() \
        > 1e-2


def test_bias_leaves_are_exported_by_name(tmp_path):
    """Whatever dba.init does, hand-made bias leaves land under the nn.Linear bias names."""
    cfg = student_config(qkv_bias=True)
    params = dba.init(student_config())
    for name, width in BIASES.items():
        rows = (cfg.n_heads if name.startswith("q") else cfg.n_kv_heads) * getattr(cfg, width)
        params["layers"]["attn"][name] = torch.full((cfg.n_layers, rows), 0.5)
    export_dba_hf(params, cfg, tmp_path / "out")
    stored = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(stored["model.layers.1.self_attn.k_g_proj.bias"], torch.full((cfg.n_kv_heads * 8,), 0.5))
    assert sum(k.endswith(".bias") for k in stored) == 5 * cfg.n_layers


def test_folder_reloads_and_holds_exactly_our_tensors(tmp_path):
    cfg = student_config(tie_embeddings=True, sem_dim=0, geo_dim=8)     # width 0: no q_s/k_s tensors at all
    params = dba.init(cfg, seed=4)
    folder = export_dba_hf(params, cfg, tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.model_type == "purestep_dba" and config.rope_pairs == PAIRS and config.tie_word_embeddings
    assert (config.sem_dim, config.geo_dim, config.v_dim, config.sliding_window) == (0, 8, 16, None)
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    ours = state_dict(params, cfg)
    assert set(stored) == set(ours) and "lm_head.weight" not in stored and not any("q_s_proj" in k for k in stored)
    for name, tensor in ours.items():
        assert stored[name].dtype == torch.float32 and torch.equal(stored[name], tensor), name
    assert torch.equal(stored["model.layers.1.self_attn.q_g_proj.weight"], params["layers"]["attn"]["wq_g"][1])
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["config.json", "configuration_purestep_dba.py", "generation_config.json", "model.safetensors",
                     "modeling_purestep_dba.py"]
    with torch.no_grad():
        assert (open_hf(folder)(tokens(t=24)).logits - dba.apply(params, tokens(t=24), cfg)).abs().max() < 1e-4


def test_refusals_and_re_export(tmp_path):
    cfg = student_config()
    params = dba.init(cfg)
    factors = student_config(rope_scaling={"rope_type": "factors", "factors": [1.0] * 8})
    with pytest.raises(UserError, match="factors"):
        export_dba_hf(params, factors, tmp_path / "a")
    with pytest.raises(UserError, match="missing k_g_bias, .*q_s_bias"):
        export_dba_hf(params, student_config(qkv_bias=True), tmp_path / "a")
    with pytest.raises(UserError, match="lm_head"):
        export_dba_hf(params, student_config(tie_embeddings=False), tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        export_dba_hf(params, cfg, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    export_dba_hf(params, cfg, tmp_path / "b")
    export_dba_hf(params, student_config(sliding_window=4), tmp_path / "b")           # an earlier export: replaced
    assert json.loads((tmp_path / "b" / "config.json").read_text())["sliding_window"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "mine"]                  # no staging folders left


def test_remote_code_is_self_contained():
    """The copied files import only torch, transformers and each other (so an exported folder works without
    purestep), and purestep never imports them (they are data to ``export_dba_hf``, not code it runs)."""
    from tests.test_layout import REPO, import_graph, imported_names
    for path in (REPO / "models" / "hf_remote").glob("*_purestep_dba.py"):
        for name, _ in imported_names("models.hf_remote." + path.stem, ast.parse(path.read_text()), False):
            assert name.split(".")[0] in ("torch", "transformers", "typing", "models"), (path.name, name)
            assert not name.startswith("models.") or name.startswith("models.hf_remote."), (path.name, name)
    assert not [m for m, edges in import_graph().items()
                if not m.startswith("purestep.models.hf_remote") and any(t.startswith("purestep.models.hf_remote") for t in edges)]


def test_tokenizer_files_travel(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.core.data.tokenizers import BPETokenizer
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()[:60]
    bpe.train_from_iterator(["the quick brown fox"] * 4, tokenizers.trainers.BpeTrainer(
        vocab_size=96, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet))
    tok = BPETokenizer(bpe.to_str(), chat_template="{{ messages }}")
    assert tok.eos_id == 0
    cfg = student_config()
    folder = export_dba_hf(dba.init(cfg), cfg, tmp_path / "out", tokenizer=tok)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 0
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 0
    loaded = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert loaded.eos_token == "<|endoftext|>" and loaded.chat_template == "{{ messages }}"
    assert loaded.model_max_length == 128
