"""Training data: JSONL examples (``examples``), one example to training rows with the
model's chat template (``encoding``), datasets, splits and static-shape batches
(``batches``), sample packing (``packing``) and preference pairs (``preference``).

The names most callers want are re-exported here:

>>> from toygraph.data import load_examples, encode_dataset, batches   # doctest: +SKIP
"""
from toygraph.data.batches import (Batch, DataReport, EncodedDataset, batches,  # noqa: F401
                                   data_hash, encode_dataset, pad_id_for, split_train_val,
                                   steps_per_epoch)
from toygraph.data.examples import Example, load_examples  # noqa: F401
