"""``recipe=export``: trained models out to Hugging Face folders (read by transformers) and GGUF files (read back by
our loader and the ``gguf`` package), byte/char tokenizers included, and every refusal a one-line error, exit 2."""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")
pytest.importorskip("tokenizers", reason="needs the 'hf' extra: pip install purestep[hf]")

from purestep.core.io import checkpoint as ckpt  # noqa: E402
from purestep.core.data.tokenizers import ByteTokenizer  # noqa: E402
from purestep.models import dba  # noqa: E402
from purestep.models.loading import load_model, model_entry  # noqa: E402
from purestep.recipes import main  # noqa: E402
from purestep.recipes.export import Config, run  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour" / "step_000000030.msgpack"   # a char-level tiny run
TINY = ["recipe=standard", "preset=tiny", "compile=false", "steps=2", "warmup_steps=1", "sample_tokens=0",
        "eval_batches=1", "eval_every=0", "save_every=0", "log_every=1", "tokenizer=byte"]


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("byte-run")
    assert main([*TINY, f"data={corpus}", f"out={out}"]) == 0
    return out


def equal_params(a: dict, b: dict) -> bool:
    from purestep.core.tree import flatten_dict
    fa, fb = flatten_dict(a), flatten_dict(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_char_run_to_hf_folder_that_transformers_reads(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference implementation: "
                                                              "pip install purestep[reference]")
    result = run(Config(init=str(FIXTURE), format="hf", out=str(tmp_path / "hf")))
    assert result["max_logit_diff"] < 1e-4                      # transformers' logits against ours
    source, back = load_model(str(FIXTURE)), load_model(str(tmp_path / "hf"))
    assert equal_params(source.params, back.params) and back.config.vocab_size == source.config.vocab_size
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(text, add_special_tokens=False)["input_ids"] == source.tokenizer.encode(text)
    assert tok.decode(source.tokenizer.encode(text)) == text


def test_byte_run_to_gguf_and_back_bitwise(byte_run, tmp_path):
    import gguf
    result = run(Config(init=str(byte_run), format="gguf", out=str(tmp_path / "g")))
    assert result["max_logit_diff"] == 0.0 and list(result["files"]) == ["model-F32.gguf"]
    source, back = load_model(str(byte_run)), load_model(str(tmp_path / "g" / "model-F32.gguf"))
    assert equal_params(source.params, back.params)
    text = "naïve café, 3 × 4 = 12\n\tdef f(): pass"
    assert back.tokenizer.encode(text) == ByteTokenizer().encode(text)
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model-F32.gguf"))
    assert reader.fields["general.architecture"].contents() == "llama"


def test_byte_run_to_hf_bf16_tokenizer_for_transformers(byte_run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference implementation: "
                                                              "pip install purestep[reference]")
    result = run(Config(init=str(byte_run), format="hf", dtype="bf16", out=str(tmp_path / "hf")))
    assert result["max_logit_diff"] < 0.1                       # bf16 weights, fp32 compute
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "naïve café ✓ 日本"
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)


def user_error(capsys, *args: str) -> str:
    assert main(["recipe=export", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: "), lines
    return lines[-1]


def test_refusals_name_the_reason_and_write_nothing(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    message = user_error(capsys, f"init={tmp_path / 'gpt2'}", f"out={tmp_path / 'x'}")
    assert "gpt2" in message and "'llama'" in message and "'qwen2'" in message and "'mistral'" in message
    assert "format=gguf" in user_error(capsys, f"init={FIXTURE}", "dtype=q8_0", f"out={tmp_path / 'x'}")
    assert "format=hf" in user_error(capsys, f"init={FIXTURE}", "format=gguf", f"out={tmp_path / 'x'}")  # char
    assert "needs out=" in user_error(capsys, f"init={FIXTURE}")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "overwrite=true" in user_error(capsys, f"init={FIXTURE}", f"out={tmp_path / 'full'}")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "gpt2"]     # no out folder, no temporary left


@pytest.fixture
def student(tmp_path):
    """A DBA student checkpoint with q/k/v biases (what upcycling a Qwen2 teacher gives), biases non-zero."""
    cfg = dba.DBAConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, sem_dim=8,
                        geo_dim=8, v_dim=16, qkv_bias=True)
    params = dba.init(cfg, seed=0)
    for name, leaf in params["layers"]["attn"].items():
        if name.endswith("_bias"):
            leaf.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ckpt.save(tmp_path / "student.msgpack", {"params": params}, step=0, extra={"model": model_entry(cfg)})
    return tmp_path / "student.msgpack"


def test_dba_student_to_hf_remote_code(student, tmp_path):
    pytest.importorskip("transformers", reason="the reference implementation: pip install purestep[reference]")
    result = run(Config(init=str(student), format="hf", out=str(tmp_path / "hf")))
    assert result["max_logit_diff"] < 1e-4 and "modeling_purestep_dba.py" in result["files"]


def test_dba_student_to_gguf_is_refused_with_the_reason(student, tmp_path, capsys):
    message = user_error(capsys, f"init={student}", "format=gguf", f"out={tmp_path / 'x'}")
    assert "format=hf" in message and not (tmp_path / "x").exists()


def test_bench_export_fine_tunes_exports_and_measures(byte_run, corpus, tmp_path):
    """``bench.export`` (docs/export.md's SmolLM2 figures) on a tiny byte-level run: the fp32 exports keep the NLL,
    q8_0 moves it a little."""
    from purestep.recipes.bench.export import Config as Bench, run as bench
    rows = bench(Bench(init=str(byte_run), data=str(corpus), steps=1, block_size=32, gguf_dtypes=("fp32", "q8_0"),
                       out=str(tmp_path / "bench")))
    assert [r["export"] for r in rows[1:]] == ["hf fp32", "gguf fp32", "gguf q8_0"]
    tuned, hf_row, f32, q8 = rows
    assert hf_row["max_logit_diff"] < 1e-4 and f32["max_logit_diff"] == 0.0
    assert abs(hf_row["nll"] - tuned["nll"]) < 1e-5 and f32["nll"] == tuned["nll"]
    assert 0 < abs(q8["nll"] - tuned["nll"]) < 0.05
    assert (tmp_path / "bench" / "results.md").read_text().count("\n| ") == 4
