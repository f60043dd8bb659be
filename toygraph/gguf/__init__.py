"""The GGUF file: the bounded reader, the file's metadata and tensors, the block formats
(decode and encode), and the tokenizer and chat template a file carries.

This is the lowest layer above errors and environment: it knows the container and its
encodings, nothing about decoder families (toygraph.models reads a file as a model).
"""
