"""What the tests against transformers share: a tiny config, and a purestep model exported to a Hugging Face
folder that transformers opens as ``architecture`` with logits equal to ours."""
import torch

from purestep.models import hf, llama
from purestep.models.loading import LoadedModel, load_model


def tiny_config(**changes) -> llama.LlamaConfig:
    return llama.LlamaConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                             tie_embeddings=False, norm_eps=1e-6, max_context=128, **changes)


def random_qwen2(tie: bool = False):
    """A random tiny ``transformers.Qwen2ForCausalLM`` (GQA 4/2) whose q/k/v biases are drawn from N(0, 0.5)
    (transformers initializes them to zero, which would hide a bias bug)."""
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model


def export_and_read_back(params: dict, cfg: llama.LlamaConfig, folder, architecture: str) -> LoadedModel:
    """Export, open with ``AutoModelForCausalLM`` (checking the class and the logits to 1e-5), then reload here."""
    import transformers
    hf.export_hf(params, cfg, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == architecture
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model(tokens).logits - llama.apply(params, tokens, cfg)).abs().max() < 1e-5
    return load_model(str(folder))
