"""The MLA student (``models.mla``) and its DeepSeek-V2 exports: the forward against a per-head float64 computation
of DeepSeek-V2's formula, the absorbed latent-cache decode against the full forward token by token, the cache's
size, the config's refusals; against transformers' ``DeepseekV2ForCausalLM`` opened from the exported folder
without remote code (``models.mla_hf``), the folder read back bit-equal; the ``deepseek2`` GGUF
(``models.mla_gguf``) read back by the ``gguf`` package's reader. llama.cpp itself runs the GGUF in
``recipe=bench.llamacpp`` (docs/export.md), not here."""
import importlib.util
import json
import math

import pytest
import torch

from purestep.core.config import UserError
from purestep.core.io import checkpoint as ckpt
from purestep.models import dba, llama, mla
from purestep.models.loading import arch_of, load_model, model_entry

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}     # with qk_rope_head_dim 8 the pairs fall into all three bands


def config(**changes) -> mla.MLAConfig:
    return mla.MLAConfig(**{**dict(vocab_size=96, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10,
                                   max_context=128, norm_eps=1e-5), **changes})


def peaky(cfg: mla.MLAConfig, seed=3) -> dict:
    """``mla.init`` with the scores and logits scaled up, a random latent norm and a latent whose mean square
    (~1e-5) is of the order of RMSNorm's eps: a wrong pair, head, scale, mask or eps shows in the logits."""
    params = mla.init(cfg, seed=seed)
    attn = params["layers"]["attn"]
    attn["wq"], attn["wkv_a"] = attn["wq"] * 6, attn["wkv_a"] * 6
    attn["wkv_a"][:, :cfg.kv_lora_rank] *= 0.005
    attn["kv_norm"] = 1 + 0.5 * torch.randn(attn["kv_norm"].shape, generator=torch.Generator().manual_seed(seed))
    for name in ("embed", "lm_head"):
        if name in params:
            params[name] = params[name] * 10
    return params


def tokens(b=2, t=29, seed=0, vocab=96):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def by_hand(params: dict, tok: torch.Tensor, cfg: mla.MLAConfig) -> torch.Tensor:
    """DeepSeek-V2's equations (arXiv 2405.04434, sec. 2.1) in float64, one head and one query at a time, RoPE as
    explicit 2x2 rotations of the pairs (i, i + d_r/2)."""
    H, dn, dr, dv, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    inv_freq = cfg.rope_theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)

    def rope(v, pos):
        a, b = v[:dr // 2], v[dr // 2:]
        c, s = torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)
        return torch.cat([a * c - b * s, a * s + b * c])

    def norm(v, w, eps):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    x = params["embed"].double()[tok]
    L = params["layers"]
    for i in range(cfg.n_layers):
        a = {k: v[i].double() for k, v in L["attn"].items()}
        h = norm(x, L["attn_norm"][i].double(), cfg.norm_eps)
        q = (h @ a["wq"].T).view(*h.shape[:2], H, dn + dr)
        kv_a = h @ a["wkv_a"].T
        c = norm(kv_a[..., :r], a["kv_norm"], 1e-6)
        kv = (c @ a["wkv_b"].T).view(*h.shape[:2], H, dn + dv)
        out = torch.zeros(*h.shape[:2], H, dv, dtype=torch.float64)
        for bi in range(tok.shape[0]):
            for hd in range(H):
                for t in range(tok.shape[1]):
                    scores = torch.stack([q[bi, t, hd, :dn] @ kv[bi, j, hd, :dn]
                                          + rope(q[bi, t, hd, dn:], t) @ rope(kv_a[bi, j, r:], j)
                                          for j in range(t + 1)]) / math.sqrt(dn + dr)
                    out[bi, t, hd] = scores.softmax(0) @ kv[bi, :t + 1, hd, dn:]
        x = x + out.flatten(2) @ a["wo"].T
        m = {k: v[i].double() for k, v in L["mlp"].items()}
        h = norm(x, L["mlp_norm"][i].double(), cfg.norm_eps)
        x = x + (torch.nn.functional.silu(h @ m["w_gate"].T) * (h @ m["w_up"].T)) @ m["w_down"].T
    head = params.get("lm_head", params["embed"]).double()
    return norm(x, params["norm"].double(), cfg.norm_eps) @ head.T


@pytest.mark.parametrize("changes", [{}, {"qk_nope_head_dim": 0, "tie_embeddings": False}])
def test_forward_is_deepseek_v2s_equations(changes):
    cfg = config(**changes)
    params, tok = peaky(cfg), tokens(1, 7)
    ours = mla.apply(params, tok, cfg)
    assert ours.std() > 1.0
    assert (ours.double() - by_hand(params, tok, cfg)).abs().max() < 1e-4


@pytest.mark.parametrize("changes", [{}, {"rope_scaling": LLAMA3, "tie_embeddings": False}, {"qk_nope_head_dim": 0}])
def test_absorbed_latent_decode_equals_the_full_forward_token_by_token(changes):
    cfg = config(**changes)
    params, tok = peaky(cfg), tokens(2, 21)
    full = mla.apply(params, tok, cfg)
    forward = mla.decoder(params, cfg, 2, 24)
    steps = [forward(tok[:, :6], 0)] + [forward(tok[:, t:t + 1], t) for t in range(6, 21)]
    assert full.abs().max() > 5 and (torch.cat(steps, dim=1) - full).abs().max() < 1e-5    # fp32, absolute
    layer = forward.cache[0]
    assert sorted(layer) == ["k_rope", "latent"] and len(forward.cache) == cfg.n_layers
    assert layer["latent"].shape == (2, 24, cfg.kv_lora_rank) and layer["k_rope"].shape == (2, 24, 8)


def test_packed_documents_attend_within_themselves_with_positions_from_zero():
    cfg = config()
    params, tok = peaky(cfg), tokens(1, 20)
    doc = torch.tensor([[0] * 8 + [1] * 12])
    packed = mla.apply(params, tok, cfg, doc=doc)
    alone = torch.cat([mla.apply(params, tok[:, :8], cfg), mla.apply(params, tok[:, 8:], cfg)], dim=1)
    assert (packed - alone).abs().max() < 1e-5 * alone.abs().max()
    assert (mla.loss(params, {"x": tok, "y": tok, "doc": doc}, cfg)
            - torch.nn.functional.cross_entropy(alone[0], tok[0])).abs() < 1e-5


def test_kv_bytes_per_token_is_the_caches_size():
    cfg = config()
    assert mla.kv_bytes_per_token(cfg) == 2 * (24 + 8) * 2 and mla.kv_bytes_per_token(cfg, 4) == 2 * 32 * 4
    cache = mla.new_cache(cfg, 3, 10, dtype=torch.bfloat16)
    measured = sum(t.numel() * t.element_size() for layer in cache for t in layer.values()) / (3 * 10)
    assert measured == mla.kv_bytes_per_token(cfg)
    assert llama.kv_bytes_per_token(cfg) == 2 * 2 * 2 * 12 * 2     # the teacher's GQA cache, for comparison


@pytest.mark.parametrize("changes, message", [
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even and >= 2"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim=0 must be even and >= 2"),
    ({"kv_lora_rank": 0}, "need kv_lora_rank >= 1"),
    ({"v_head_dim": 0}, "v_head_dim >= 1"),
    ({"qk_nope_head_dim": -1}, "qk_nope_head_dim >= 0"),
    ({"sliding_window": 16}, "sliding_window=16: MLA attends to the whole causal context"),
    ({"qkv_bias": True}, "qkv_bias=true: MLA has no attention biases"),
    ({"rope_scaling": {"rope_type": "factors", "factors": [1.0] * 6}}, "rope_scaling.factors has 6 entries"),
])
def test_the_config_refuses_what_mla_does_not_compute(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**changes)


def test_from_teacher_keeps_the_teachers_numbers_and_the_arch_is_known_everywhere(tmp_path):
    teacher = llama.LlamaConfig(vocab_size=96, d_model=48, n_heads=4, n_kv_heads=2, rope_scaling=LLAMA3)
    cfg = mla.MLAConfig.from_teacher(teacher, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=4, v_head_dim=12)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.rope_scaling, cfg.kv_lora_rank) == (2, 12, LLAMA3, 16)
    student = dba.DBAConfig(vocab_size=96, d_model=48, n_heads=4, sem_dim=4, geo_dim=4, v_dim=8)
    assert [arch_of(c) for c in (teacher, cfg, student)] == ["llama", "mla", "dba"]
    params = mla.init(cfg)
    ckpt.save(tmp_path / "mla.msgpack", {"params": params}, step=0, extra={"model": model_entry(cfg)})
    back = load_model(str(tmp_path / "mla.msgpack"))
    assert (back.arch, back.module, back.config) == ("mla", mla, cfg)
    assert "purestep checkpoint (mla)" in back.format


# ----------------------------------------------------------------------------------------------------------
# DeepSeek-V2's formats

def test_transformers_computes_the_exported_folder_and_it_reads_back_bit_equal(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install "
                                                              "purestep[reference]")
    pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.core.tree import flatten_dict
    from purestep.models.mla_hf import export_mla_hf
    tok = tokens()
    for i, changes in enumerate([{}, {"rope_scaling": LLAMA3, "tie_embeddings": False}, {"qk_nope_head_dim": 0}]):
        cfg, folder = config(**changes, n_kv_heads=4), tmp_path / f"mla{i}"
        params = peaky(cfg)
        export_mla_hf(params, cfg, folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()      # no trust_remote_code
        assert type(model).__name__ == "DeepseekV2ForCausalLM"
        with torch.no_grad():
            theirs, ours = model(tok).logits, mla.apply(params, tok, cfg)
        assert ours.std() > 1.0 and (theirs - ours).abs().max() < 1e-4, changes
        conf = json.loads((folder / "config.json").read_text())
        assert (conf["model_type"], conf["q_lora_rank"], conf["first_k_dense_replace"], conf["n_routed_experts"],
                conf["num_key_value_heads"], conf["attention_bias"]) == ("deepseek_v2", None, 2, 0, 4, False)
        back = load_model(str(folder))
        assert (back.arch, back.config) == ("mla", cfg)
        assert {k: v for k, v in flatten_dict(params).items()}.keys() == flatten_dict(back.params).keys()
        assert all(torch.equal(v, flatten_dict(back.params)[k]) for k, v in flatten_dict(params).items())


def test_a_folder_of_another_deepseek_v2_is_refused_by_name(tmp_path):
    pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.models.mla_hf import config_to_hf
    base = config_to_hf(config(n_kv_heads=4), torch.float32, 128)
    for changes, message in [({"q_lora_rank": 32}, "q_lora_rank=32: a compressed query"),
                             ({"n_routed_experts": 8, "first_k_dense_replace": 1}, "mixture-of-experts"),
                             ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'")]:
        (tmp_path / "config.json").write_text(json.dumps({**base, **changes}))
        with pytest.raises(UserError, match=message):
            load_model(str(tmp_path))


def test_the_deepseek2_gguf_holds_llama_cpps_keys_and_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.models import gguf_export
    from purestep.models.mla_gguf import check_gguf, export_mla_gguf
    tok = tokens()
    for i, changes in enumerate([{}, {"qk_nope_head_dim": 0, "tie_embeddings": False, "norm_eps": 1e-6}]):
        cfg = config(**changes, n_kv_heads=4)
        params = peaky(cfg)
        path = export_mla_gguf(params, cfg, tmp_path / f"m{i}.gguf")
        reader = gguf.GGUFReader(str(path))
        keys = {k: f.contents() for k, f in reader.fields.items() if k.startswith("deepseek2.")}
        assert (keys["deepseek2.attention.q_lora_rank"], keys["deepseek2.attention.head_count_kv"],
                keys["deepseek2.leading_dense_block_count"], keys["deepseek2.attention.key_length_mla"]) == \
            (0, 1, 2, max(cfg.qk_nope_head_dim, 1) + 8)
        assert "deepseek2.expert_count" not in keys
        names = {t.name for t in reader.tensors}
        assert {"blk.0.attn_q.weight", "blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= names
        assert ("output.weight" in names) != cfg.tie_embeddings and "blk.0.attn_kv_b.weight" not in names
        back = load_model(str(path))
        assert back.arch == "mla" and back.format == "GGUF (deepseek2, F32)"
        assert (back.module.apply(back.params, tok, back.config) - mla.apply(params, tok, cfg)).abs().max() < 1e-4
    with pytest.raises(UserError, match="llama.cpp's deepseek2 applies no per-pair RoPE factors"):
        check_gguf(peaky(config(rope_scaling=LLAMA3)), config(rope_scaling=LLAMA3))
    with pytest.raises(UserError, match="an MLA model is llama.cpp's deepseek2"):
        gguf_export.gguf_arch(config())


def test_recipe_export_writes_an_mla_checkpoint_in_deepseek_v2s_formats(tmp_path, capsys):
    pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
    pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.recipes import main
    cfg = config(n_kv_heads=4)
    ckpt.save(tmp_path / "mla.msgpack", {"params": peaky(cfg)}, step=0, extra={"model": model_entry(cfg)})
    assert main(["recipe=export", f"init={tmp_path / 'mla.msgpack'}", "format=gguf", f"out={tmp_path / 'g'}"]) == 0
    assert "verified with purestep's loader: max |logit diff|" in capsys.readouterr().err
    assert (tmp_path / "g" / "model-F32.gguf").is_file()
    assert main(["recipe=export", f"init={tmp_path / 'g' / 'model-F32.gguf'}", "format=hf", f"out={tmp_path / 'h'}",
                 f"verify={importlib.util.find_spec('transformers') is not None}"]) == 0
    assert load_model(str(tmp_path / "h")).arch == "mla"
    assert main(["recipe=standard", f"init={tmp_path / 'mla.msgpack'}", "steps=1", f"out={tmp_path / 's'}"]) == 2
    assert capsys.readouterr().err.endswith("its architecture is mla (models.mla); recipe=standard runs a Llama "
                                            "(models.llama) only\n")
