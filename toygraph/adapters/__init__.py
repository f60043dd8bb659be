"""LoRA adapters after training: their files (PEFT directories, llama.cpp GGUF adapters),
merging one into a GGUF (``toygraph export``), and Ollama's Modelfile.

>>> from toygraph.adapters import load_peft, save_peft     # doctest: +SKIP
"""
from toygraph.adapters.files import (CONFIG_FILE, WEIGHTS_FILE, check_gguf_adapter,  # noqa: F401
                                     hf_row_order, load_gguf_adapter, load_lora, load_peft,
                                     save_gguf_adapter, save_peft)
