"""Llama against transformers' own implementation: a random tiny ``LlamaForCausalLM`` (GQA, untied head, Llama 3.1
rope scaling), saved with ``save_pretrained``, loads into ``models.llama`` with logits equal to transformers' and
the same 32 greedy tokens, decoded with our KV cache; exported back it reopens in transformers with equal logits.
(Real weights are pinned by the SmolLM2 tests in ``test_hf_gguf.py``; Qwen2 and Mistral have their own files.)
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install purestep[reference]")
pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")

from purestep.models import llama  # noqa: E402
from purestep.models.loading import load_model  # noqa: E402
from purestep.models.sampling import generate  # noqa: E402
from tests.hf_reference import export_and_read_back  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def test_llama3_folder_matches_transformers_logits_and_greedy_tokens(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=500000.0, rope_scaling=LLAMA3, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "in")
    loaded = load_model(str(tmp_path / "in"))
    params, ours_cfg = loaded.params, loaded.config
    assert ours_cfg.rope_scaling["rope_type"] == "llama3" and ours_cfg.n_kv_heads == 2 and ours_cfg.max_context == 256
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (llama.apply(params, tokens, ours_cfg) - model(tokens).logits).abs().max() < 1e-5
        prompt = tokens[:1, :6]
        ours = generate(llama.decoder(params, ours_cfg, 1, 6 + 32), prompt, 32, temperature=0)   # KV cache
        theirs = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(ours, theirs[:, 6:])
    assert export_and_read_back(params, ours_cfg, tmp_path / "out", "LlamaForCausalLM").config == ours_cfg
