"""Qwen2 against transformers' own implementation: a random tiny ``Qwen2ForCausalLM`` (biases made
non-zero), saved with ``save_pretrained``, loads into ``models.llama`` with equal logits and greedy tokens,
and a purestep model with q/k/v biases exports to a folder transformers loads as Qwen2.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install purestep[reference]")
pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")

from purestep.core.config import UserError  # noqa: E402
from purestep.models import hf, llama  # noqa: E402
from purestep.models.loading import load_model  # noqa: E402
from tests.hf_reference import export_and_read_back, random_qwen2 as qwen2, tiny_config  # noqa: E402


def greedy(step, tokens: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        tokens = torch.cat([tokens, step(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_folder_loads_with_transformers_logits_and_greedy_tokens(tie, tmp_path):
    model = qwen2(tie)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    params, cfg = loaded.params, loaded.config
    assert cfg.qkv_bias and cfg.tie_embeddings == tie and cfg.n_kv_heads == 2
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = llama.apply(params, tokens, cfg)
        assert (ours - theirs).abs().max() < 1e-5
        prompt = tokens[:1, :8]
        assert torch.equal(greedy(lambda t: llama.apply(params, t, cfg), prompt, 32),
                           greedy(lambda t: model(t).logits, prompt, 32))


def test_biased_windowed_model_exports_as_qwen2_sliding_on_every_layer(tmp_path):
    cfg = tiny_config(qkv_bias=True, sliding_window=8)         # export_and_read_back compares 24 tokens
    params = llama.init(cfg, seed=2)
    for leaf in ("q_bias", "k_bias", "v_bias"):
        params["layers"]["attn"][leaf].normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    assert export_and_read_back(params, cfg, tmp_path, "Qwen2ForCausalLM").config == cfg


def test_biased_model_exports_as_qwen2_and_transformers_reads_it(tmp_path):
    cfg = tiny_config(qkv_bias=True)
    params = llama.init(cfg, seed=2)
    for leaf in ("q_bias", "k_bias", "v_bias"):
        params["layers"]["attn"][leaf].normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    loaded = export_and_read_back(params, cfg, tmp_path, "Qwen2ForCausalLM")
    assert loaded.config == cfg and all(torch.equal(a, b) for a, b in zip(hf.state_dict(loaded.params, cfg).values(),
                                                                          hf.state_dict(params, cfg).values()))


def qwen2_sliding(max_window_layers: int):
    model = qwen2(False)
    cfg = model.config.to_dict()
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=max_window_layers)
    cfg.pop("layer_types", None)                              # recomputed from max_window_layers
    sliding = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).eval()
    sliding.load_state_dict(model.state_dict())
    return sliding


def test_qwen2_sliding_on_every_layer_is_honoured(tmp_path):
    model = qwen2_sliding(max_window_layers=0)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.sliding_window == 8
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (llama.apply(loaded.params, tokens, loaded.config) - model(tokens).logits).abs().max() < 1e-5


def test_qwen2_sliding_on_some_layers_is_refused_by_name(tmp_path):
    qwen2_sliding(max_window_layers=1).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="max_window_layers=1 slides on layers 1-1 only"):
        load_model(str(tmp_path))

