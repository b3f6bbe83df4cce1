"""The upcycled student in standard formats (``models.dba_llama``, issue 34): surgery with shared RoPE pairs gives
a DBA student that is a plain GQA Llama; ``recipe=export`` writes it as a Llama Hugging Face folder that transformers
opens without remote code and as a ``llama`` GGUF with ``rope_freqs``, both with ``dba.apply``'s logits."""
import json

import pytest
import torch

from purestep.core.config import UserError
from purestep.core.io import checkpoint as ckpt
from purestep.models import dba, dba_llama, llama, surgery
from purestep.models.loading import load_model, model_entry

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}     # with head_dim 16 the kept pairs fall into all three bands


def teacher(**changes) -> tuple[dict, llama.LlamaConfig]:
    """A tiny random GQA Llama with peaky attention and logits (a wrong pair, scale or head shows)."""
    cfg = llama.LlamaConfig(**{**dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                      max_context=128, rope_scaling=dict(LLAMA3)), **changes})
    params = llama.init(cfg, seed=5)
    attn = params["layers"]["attn"]
    attn["wq"], attn["wk"] = attn["wq"] * 6, attn["wk"] * 6
    for name in ("q_bias", "k_bias", "v_bias"):
        if name in attn:
            attn[name].normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    params["embed"] = params["embed"] * 20
    return params, cfg


def tokens(t=40, seed=0):
    return torch.randint(0, 96, (2, t), generator=torch.Generator().manual_seed(seed))


def plain_student(**changes) -> tuple[dict, dba.DBAConfig]:
    params, cfg = teacher(**changes)
    student, scfg, report = surgery.surgery(params, cfg, tokens(64, seed=1), sem_dim=0, geo_dim=8, v_dim=8,
                                            shared_pairs=True)
    assert report["shared_pairs"] and len({tuple(p) for layer in scfg.rope_pairs for p in layer}) == 1
    return student, scfg


def test_shared_pairs_make_a_plain_llama_with_the_same_logits():
    params, cfg = teacher()
    per_head = surgery.surgery(params, cfg, tokens(64, seed=1), sem_dim=0, geo_dim=8, v_dim=8)[1]
    assert dba_llama.why_not_llama(per_head) == "RoPE pairs chosen per layer and KV head"
    student, scfg = plain_student()
    assert dba_llama.why_not_llama(scfg) == ""
    lparams, lcfg = dba_llama.as_llama(student, scfg)
    assert lcfg.head_dim == 8 and lcfg.rope_scaling["rope_type"] == "factors"
    assert torch.allclose(llama.rope_frequencies(lcfg), dba.pair_frequencies(scfg)[0, 0], rtol=1e-12)
    ours = dba.apply(student, tokens(), scfg)
    assert ours.std() > 1.0
    assert (llama.apply(lparams, tokens(), lcfg) - ours).abs().max() < 1e-4
    every_pair = surgery.surgery(params, cfg, tokens(64, seed=1), sem_dim=0, geo_dim=16, v_dim=16,
                                 shared_pairs=True)[1]
    assert dba_llama.llama_config(every_pair).rope_scaling == LLAMA3    # all pairs kept: the teacher's RoPE
    assert "sem_dim=8" in dba_llama.why_not_llama(dba.DBAConfig.from_teacher(cfg, sem_dim=8, geo_dim=8, v_dim=8))


def test_plain_dims_from_kv_reduction():
    assert dba.dims_for_reduction(64, 2, plain=True) == (0, 32, 32) == dba.dims_for_reduction(64, 2)
    assert dba.dims_for_reduction(64, 4, plain=True) == (0, 16, 16)
    assert dba.dims_for_reduction(64, 3, plain=True) == (0, 20, 20)      # budget 42: the halves floored to even
    with pytest.raises(ValueError, match="need at least 4"):
        dba.dims_for_reduction(16, 10, plain=True)


@pytest.fixture
def checkpoint(tmp_path):
    def save(**changes):
        student, scfg = plain_student(**changes)
        path = tmp_path / "student.msgpack"
        ckpt.save(path, {"params": student}, step=0, extra={"model": model_entry(scfg)})
        return path, student, scfg
    return save


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2"])
def test_plain_student_to_hf_without_remote_code(checkpoint, tmp_path, bias):
    transformers = pytest.importorskip("transformers", reason="the reference implementation: "
                                                              "pip install purestep[reference]")
    pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.recipes.export import Config, run
    path, student, scfg = checkpoint(qkv_bias=bias)
    result = run(Config(init=str(path), format="hf", out=str(tmp_path / "hf")))
    assert result["max_logit_diff"] < 1e-4 and not any(name.endswith(".py") for name in result["files"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == ("qwen2" if bias else "llama") and "auto_map" not in config
    assert config["head_dim"] == 8 and config["rope_scaling"]["rope_type"] == "longrope"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs, ours = model(tokens(48, seed=2)).logits, dba.apply(student, tokens(48, seed=2), scfg)
    assert ours.std() > 1.0 and (theirs - ours).abs().max() < 1e-4
    back = load_model(str(tmp_path / "hf"))          # purestep reads the longrope factors back
    assert (back.module.apply(back.params, tokens(48, seed=2), back.config) - ours).abs().max() < 1e-4


def test_plain_student_to_gguf_reads_back(checkpoint, tmp_path, capsys):
    gguf = pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.recipes.export import Config, run
    path, student, scfg = checkpoint()
    result = run(Config(init=str(path), format="gguf", out=str(tmp_path / "g")))
    assert result["max_logit_diff"] < 1e-4
    file = tmp_path / "g" / "model-F32.gguf"
    reader = gguf.GGUFReader(str(file))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.rope.dimension_count"].contents() == 8
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert torch.allclose(torch.tensor(freqs.data.tolist(), dtype=torch.float64),
                          torch.tensor(dba_llama.rope_factors(scfg), dtype=torch.float64), rtol=1e-6)
    back = load_model(str(file))
    ours = dba.apply(student, tokens(48, seed=2), scfg)
    assert (back.module.apply(back.params, tokens(48, seed=2), back.config) - ours).abs().max() < 1e-4


def test_other_students_keep_remote_code_and_gguf_refuses_them(tmp_path):
    pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.models.gguf_export import export_gguf
    params, cfg = teacher()
    student, scfg, _ = surgery.surgery(params, cfg, tokens(64, seed=1), sem_dim=0, geo_dim=8, v_dim=8)
    with pytest.raises(UserError, match=r"DBA student .*with RoPE pairs chosen per layer and KV head has no GGUF "
                                        r"form: llama.cpp has no such attention. .*rope_pairs_shared=true"):
        export_gguf(student, scfg, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())
