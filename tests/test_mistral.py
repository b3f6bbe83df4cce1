"""Mistral against transformers' own implementation: a random tiny ``MistralForCausalLM`` whose sliding
window (8) is shorter than the sequence loads into ``models.llama`` with logits equal to transformers' and
the same greedy tokens, decoded with our KV cache past the window; a windowed model exports as Mistral.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install purestep[reference]")
pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")

from purestep.models import llama  # noqa: E402
from purestep.models.llama_module import LlamaModule, load_params  # noqa: E402
from purestep.models.loading import load_model  # noqa: E402
from purestep.models.sampling import generate  # noqa: E402
from tests.hf_reference import export_and_read_back, tiny_config  # noqa: E402

WINDOW = 8


def mistral():
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     sliding_window=WINDOW, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).eval()


def test_mistral_window_shorter_than_the_sequence_matches_transformers(tmp_path):
    model = mistral()
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    params, cfg = loaded.params, loaded.config
    assert cfg.sliding_window == WINDOW
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        assert (llama.apply(params, tokens, cfg) - theirs).abs().max() < 1e-5
        full = llama.apply(params, tokens, llama.LlamaConfig(**{**vars(cfg), "sliding_window": 0}))
        assert (full - theirs)[:, WINDOW:].abs().max() > 1e-3       # the window really changes the logits
        reference = load_params(LlamaModule(cfg), params)            # the nn.Module written the ordinary way
        assert (reference(tokens) - theirs).abs().max() < 1e-5
        prompt = tokens[:1, :6]
        ours = generate(llama.decoder(params, cfg, 1, 6 + 32), prompt, 32, temperature=0)   # KV cache
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(ours, out[:, 6:])


def test_windowed_model_exports_as_mistral(tmp_path):
    cfg = tiny_config(sliding_window=WINDOW)
    params = llama.init(cfg, seed=2)
    assert export_and_read_back(params, cfg, tmp_path, "MistralForCausalLM").config == cfg
