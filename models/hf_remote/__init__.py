"""Remote code for Hugging Face folders of purestep models (``trust_remote_code=True``).

The files here are **not imported by purestep**: ``models.dba_hf.export_dba_hf`` copies them verbatim next to
``config.json``, whose ``auto_map`` points transformers at them, the way DeepSeek-V2 (MLA, DeepSeek-AI 2024,
arXiv 2405.04434) ships ``configuration_deepseek.py`` + ``modeling_deepseek.py`` with its checkpoints. They import
only torch and transformers (never purestep), so an exported folder works without purestep installed.

- ``configuration_purestep_dba.py``: ``PurestepDBAConfig`` (model_type ``purestep_dba``).
- ``modeling_purestep_dba.py``: ``PurestepDBAForCausalLM``, the DBA student of ``models/dba.py`` written as
  nn.Modules after transformers' ``models/llama/modeling_llama.py``.
"""
