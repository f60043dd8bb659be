"""LoRA adapters after training: their files (PEFT directories, llama.cpp GGUF adapters),
merging one into a GGUF (``toygraph export``), and Ollama's Modelfile.

>>> from toygraph.adapters import load_peft, save_peft     # doctest: +SKIP
"""
from toygraph.adapters.files import (CONFIG_FILE, WEIGHTS_FILE, PeftAdapter,  # noqa: F401
                                     check_gguf_adapter, hf_row_order, load_gguf_adapter,
                                     load_lora, load_peft, read_peft, save_gguf_adapter,
                                     save_peft)
