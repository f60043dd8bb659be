"""``toygraph demo``: a short LoRA fine-tune of SmolLM2 on the capitals set shipped here
(``capitals.jsonl``, written by ``make_capitals.py``), with the answers before and after."""
