"""PurestepDBAConfig: the configuration of purestep's DBA student (decoupled bottleneck attention) for transformers.

Self-contained remote code (imports only transformers): purestep's ``export_dba_hf`` copies this file next to
``config.json`` and names it in ``auto_map``, as DeepSeek-V2 (MLA, arXiv 2405.04434) ships
``configuration_deepseek.py``; load with ``AutoConfig.from_pretrained(folder, trust_remote_code=True)``.

The fields are transformers' ``LlamaConfig`` ones (``models/llama/configuration_llama.py``) plus the student's:

- ``sem_dim``: per-head width of the semantic (no-RoPE) query/key part; 0 = none.
- ``geo_dim``: per-head width of the geometric (RoPE) part; even, <= ``head_dim``; 0 = none.
- ``v_dim``: per-KV-head value width (the output projection reads ``num_attention_heads * v_dim``).
- ``rope_pairs``: [num_hidden_layers][num_key_value_heads][geo_dim / 2] indices of the teacher's rotary pairs
  (of ``head_dim / 2``) that stay geometric; pair j of KV head g rotates at the teacher's frequency of pair
  ``rope_pairs[l][g][j]``.
- ``rope_theta``, ``rope_scaling``: the teacher's RoPE (``rope_scaling``: None or llama3's dict).
- ``sliding_window``: None, or each token sees at most this many positions, itself included (Mistral's).
- ``qkv_bias``: the five query/key/value projections carry biases.

The 1/sqrt(d) attention scale is folded into the query weights: attention uses scale 1.
"""
from transformers import PretrainedConfig

ROPE_TYPES = ("default", "llama3")


class PurestepDBAConfig(PretrainedConfig):
    model_type = "purestep_dba"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # a plain attribute, not transformers 5's ``rope_scaling -> rope_parameters`` property: this model reads
    # ``rope_theta`` and ``rope_scaling`` itself (its frequencies are the teacher's at the kept pairs)
    rope_scaling = None

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, head_dim=None, sem_dim=16, geo_dim=16, v_dim=32,
                 rope_pairs=None, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, sliding_window=None, qkv_bias=False, hidden_act="silu",
                 initializer_range=0.02, use_cache=True, tie_word_embeddings=True, bos_token_id=None,
                 eos_token_id=None, pad_token_id=None, **kwargs):
        rope_parameters = kwargs.pop("rope_parameters", None)   # a transformers 5 save_pretrained spelling
        if rope_parameters and not rope_scaling:
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            rope_scaling = None if kind == "default" else {k: v for k, v in rope_parameters.items()
                                                           if k != "rope_theta"}
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.sem_dim, self.geo_dim, self.v_dim = sem_dim, geo_dim, v_dim
        self.rope_pairs = rope_pairs if rope_pairs is not None else self._uniform_pairs()
        self.rope_theta = float(rope_theta)
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.sliding_window = sliding_window or None          # None, not 0: a cache layer of width 0 is no cache
        self.qkv_bias = qkv_bias
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
        self._check()

    def _uniform_pairs(self):
        """The default kept pairs (purestep's ``DBAConfig``): spread evenly over the teacher's spectrum."""
        n_pairs, n_keep = self.head_dim // 2, self.geo_dim // 2
        uniform = [i * n_pairs // n_keep for i in range(n_keep)]
        return [[list(uniform) for _ in range(self.num_key_value_heads)] for _ in range(self.num_hidden_layers)]

    def _check(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.sem_dim < 0 or self.geo_dim < 0 or self.v_dim < 1 or self.sem_dim + self.geo_dim == 0:
            raise ValueError(f"need sem_dim, geo_dim >= 0 with a positive sum and v_dim >= 1 (got {self.sem_dim}, "
                             f"{self.geo_dim}, {self.v_dim})")
        if self.geo_dim % 2 or self.geo_dim > self.head_dim:
            raise ValueError(f"geo_dim={self.geo_dim} must be even and <= head_dim={self.head_dim}")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        n_pairs, n_keep = self.head_dim // 2, self.geo_dim // 2
        pairs = self.rope_pairs
        if len(pairs) != self.num_hidden_layers or any(len(layer) != self.num_key_value_heads for layer in pairs) \
                or any(len(p) != n_keep or not all(0 <= int(i) < n_pairs for i in p) for layer in pairs for p in layer):
            raise ValueError(f"rope_pairs must be [num_hidden_layers][num_key_value_heads][geo_dim/2] indices in "
                             f"[0, {n_pairs})")
