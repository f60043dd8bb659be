"""How a LoRA adapter fares in the files it will be served in: its loss, and the KL of its
next-token distribution against the base it was trained on, with that base requantized to
each block type, and merged into the base at each export type.

>>> report = fidelity_report("base.gguf", "runs/x", sequences, masks,
...                          quants=("q8_0", "q6_k", "q4_k"))       # doctest: +SKIP
>>> print(report.table()); print(report.verdict())                  # doctest: +SKIP

The reference is the trained pair itself: the base file as trained, plus the adapter.
Each candidate is evaluated on the same sequences, in the same forward passes' shapes,
and compared position by position on the counted (target) tokens:

- ``<type> + adapter``: every matrix of the base (2-D tensors: the embedding, the head,
  the projections) decoded and encoded again as ``<type>`` by toygraph's own block
  encoders (gguf/block_encode.py), in memory; norms and biases keep theirs. A matrix whose
  rows are not whole blocks of ``<type>`` takes llama.cpp's fallback type (q4_k -> q5_0,
  ...), as ``llama-quantize`` does; the table counts them. The K-quant and IQ4 encoders
  are plain min/max quantizers, not llama.cpp's error-optimal search: their rows are
  likely to cost more than ``llama-quantize``'s files of the same type would.
- ``merged <type>``: what ``toygraph export --type <type>`` writes (adapters/merge.py's
  merge and encoding), built in memory and evaluated with no adapter.

No file is written unless asked (``write_requantized``). The loss of each row is the
graph's own summed cross-entropy (what ``toygraph eval`` prints for that file); the KL is
KL(reference || candidate) in nats, computed in float64 from the two logits and averaged
over the counted tokens.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toygraph.adapters.merge import OUT_TYPES, encode_weight, load_adapter, merged_weight
from toygraph.adapters.experts import per_base_tensor
from toygraph.errors import DataError
from toygraph.gguf import blocks
from toygraph.gguf.block_encode import quantize
from toygraph.gguf.file import WeightTensor
from toygraph.inference.language_model import LanguageModel
from toygraph.models.model import GGUFModel

#: Block types a base can be requantized to here (mxfp4 is gpt-oss's experts' own format).
QUANTS = tuple(t for t in blocks.BLOCK if t not in ("f32", "mxfp4"))
#: The types ``toygraph export --type`` writes, each a merged row of the report.
MERGED_TYPES = OUT_TYPES
#: A type "holds" while it costs at most this many nats: loss over the reference's, and KL.
TOLERANCE = 0.02
#: llama.cpp's type for a matrix whose rows are not whole blocks of the type asked
#: (llama-quant.cpp: the K-quants fall back to a 32-block type of about their size).
FALLBACK = {"q2_k": "iq4_nl", "q3_k": "iq4_nl", "iq4_xs": "iq4_nl", "q4_k": "q5_0",
            "q5_k": "q5_1", "q6_k": "q8_0"}
_ROWS = 4096   # rows encoded at a time: an embedding's encoder temporaries stay small
#: The logits a forward pass of the report may hold ([tokens, vocab] f32: its batch size).
LOGITS_BYTES = 64 << 20
#: The reference's logits at the counted tokens are kept across candidates up to this.
REFERENCE_BYTES = 512 << 20


def bits_per_weight(qtype: str) -> float:
    size, nbytes = blocks.BLOCK[qtype]
    return 8 * nbytes / size


class _Reweighted(GGUFModel):
    """A GGUFModel whose named tensors are replaced in memory, computed on first use and
    kept (every graph of a LanguageModel binds the same bytes); the rest read the file."""

    kind = ""   # the report's row kind

    def __init__(self, base: GGUFModel, qtype: str, label: str):
        self.__dict__.update(base.__dict__)   # the parsed header, config and mmap: shared
        self.qtype, self.label, self._replaced = qtype, label, {}
        self.kept: list[str] = []            # matrices no type fits, left as they are
        self.fallbacks: dict[str, str] = {}  # matrix -> the fallback type it took

    def replace(self, w: WeightTensor) -> WeightTensor | None:
        """The tensor in place of ``w``, or None to keep it."""
        raise NotImplementedError

    def tensor(self, name: str) -> WeightTensor:
        if name not in self._replaced:
            w = super().tensor(name)
            self._replaced[name] = self.replace(w) or w
        return self._replaced[name]


def _weight_tensor(name: str, qtype: str, shape, data: np.ndarray) -> WeightTensor:
    return WeightTensor(name=name, qtype=qtype, shape=tuple(shape),
                        raw=np.ascontiguousarray(data).view(np.uint8).reshape(-1))


def requantized_type(qtype: str, shape) -> str | None:
    """The type a matrix of ``shape`` gets when its base is requantized to ``qtype``: that,
    else llama.cpp's fallback, else None (kept as it is)."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and shape[-1] % blocks.BLOCK[t][0] == 0:
            return t
    return None


def requantize_tensor(w: WeightTensor, qtype: str) -> WeightTensor:
    """``w`` decoded and encoded as ``qtype`` (a type ``requantized_type`` allows), _ROWS
    rows at a time: never the whole matrix in f32 (Gemma 3's embedding: 672 MB, Llama 3
    8B's: 2.1 GB), only the encoded result and one chunk."""
    n_rows = int(np.prod(w.shape[:-1]))
    row_bytes = w.raw.nbytes // max(n_rows, 1)
    raw = np.concatenate([
        quantize(blocks.dequantize(w.raw[i * row_bytes:min(i + _ROWS, n_rows) * row_bytes],
                                   w.qtype, (min(_ROWS, n_rows - i), w.shape[-1])), qtype)
        for i in range(0, n_rows, _ROWS)])
    return _weight_tensor(w.name, qtype, w.shape, raw)


class RequantizedModel(_Reweighted):
    """The base with every matrix requantized to ``qtype`` (module docstring)."""
    kind = "requantized"

    def __init__(self, base: GGUFModel, qtype: str):
        if qtype not in QUANTS:
            raise DataError(f"--quants {qtype!r}: choose among {', '.join(QUANTS)}")
        super().__init__(base, qtype, f"{qtype} + adapter")
        # what each matrix becomes, from the shapes alone (no tensor is encoded yet)
        self.types = {name: requantized_type(qtype, shape)
                      for name, shape in base._shapes.items() if len(shape) >= 2}
        self.kept = [name for name, t in self.types.items() if t is None]
        self.fallbacks = {name: t for name, t in self.types.items() if t not in (None, qtype)}

    def replace(self, w: WeightTensor) -> WeightTensor | None:
        # norms, biases, rope factors (vectors) are not in types: llama-quantize keeps them too
        t = self.types.get(w.name)
        return None if t is None else requantize_tensor(w, t)


class MergedModel(_Reweighted):
    """What ``toygraph export --type out_type`` writes, in memory: the adapter's targets
    merged and encoded as the export encodes them; every other tensor the base's."""
    kind = "merged"

    def __init__(self, base: GGUFModel, adapter, out_type: str):
        if out_type not in MERGED_TYPES:
            raise DataError(f"--merged-types {out_type!r}: choose among {', '.join(MERGED_TYPES)}")
        super().__init__(base, out_type, f"merged {out_type}")
        lora, _, _, self.scaling, _ = load_adapter(adapter, base.config)
        self.lora = per_base_tensor(lora)

    def replace(self, w: WeightTensor) -> WeightTensor | None:
        if w.name not in self.lora:
            return None
        a, b, *m = self.lora[w.name]
        data, _ = encode_weight(merged_weight(w.dequantize(), a, b, self.scaling, *m),
                                self.qtype, w.name)
        return _weight_tensor(w.name, self.qtype, w.shape, data)


@dataclass
class FidelityRow:
    """One row of the report: a candidate's loss, its cost over the reference's, the mean
    KL(reference || candidate) per counted token, and what requantizing changed."""
    label: str
    kind: str            # "reference", "requantized" or "merged"
    qtype: str
    loss: float
    kl: float = 0.0
    fallbacks: int = 0   # matrices that took llama.cpp's fallback type
    kept: int = 0        # matrices left in their own type (no block type fits their rows)
    cost: float = 0.0    # loss - the reference's loss, in nats

    def holds(self, tolerance: float) -> bool:
        return self.cost <= tolerance and self.kl <= tolerance


@dataclass
class FidelityReport:
    rows: list[FidelityRow]
    tokens: int
    tolerance: float = TOLERANCE
    reference_type: str = ""

    @property
    def reference(self) -> FidelityRow:
        return self.rows[0]

    def of(self, kind: str) -> list[FidelityRow]:
        return [r for r in self.rows if r.kind == kind]

    def table(self) -> str:
        head = f"{'weights':<26} {'loss':>9} {'vs trained':>11} {'KL (nats)':>10}  notes"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            if r.kind == "reference":
                lines.append(f"{r.label:<26} {r.loss:9.4f} {'':>11} {'':>10}  the trained pair")
                continue
            notes = []
            if r.fallbacks:
                notes.append(f"{r.fallbacks} matrices as {FALLBACK[r.qtype]} (rows not whole "
                             f"{r.qtype} blocks)")
            if r.kept:
                notes.append(f"{r.kept} matrices kept as they are")
            lines.append(f"{r.label:<26} {r.loss:9.4f} {r.cost:+11.4f} {r.kl:10.5f}  "
                         f"{'; '.join(notes)}")
        if self.of("requantized") and self.reference_type not in ("f32", "f16", "bf16"):
            lines.append(f"(requantized from the trained base's own {self.reference_type} blocks, "
                         f"as any requantization of this file would be; a file quantized from "
                         f"the original f16 weights rounds differently)")
        return "\n".join(lines)

    def verdict(self) -> str:
        """One plain sentence per kind of row, e.g. "holds up to q5_k; q4_k costs 0.09 nats
        (KL 0.07)"."""
        parts = []
        quants = sorted(self.of("requantized"), key=lambda r: -bits_per_weight(r.qtype))
        if quants:
            parts.append(_holds_text(quants, self.tolerance))
        merged = self.of("merged")
        if merged:
            held = [r.qtype for r in merged if r.holds(self.tolerance)]
            costs = [f"{r.qtype} {_cost_text(r)}" for r in merged if not r.holds(self.tolerance)]
            parts.append("merged " + "; merged ".join(
                ([f"{', '.join(held)} hold{'s' if len(held) == 1 else ''}"] if held else [])
                + costs))
        return "; ".join(parts) + (f" (a type holds while its loss and its KL rise at most "
                                   f"{self.tolerance:g} nats, over {self.tokens} tokens)")


def _cost_text(r: FidelityRow) -> str:
    """What a row that does not hold costs, naming the measure that broke the tolerance."""
    if r.cost >= r.kl:
        return f"costs {r.cost:.4f} nats of loss (KL {r.kl:.4f})"
    return f"costs {r.kl:.4f} nats of KL (loss {r.cost:+.4f})"


def _holds_text(quants: list[FidelityRow], tolerance: float) -> str:
    """quants from most to fewest bits per weight."""
    held = 0
    while held < len(quants) and quants[held].holds(tolerance):
        held += 1
    if held == len(quants):
        return (f"holds up to {quants[-1].qtype}, the coarsest asked (loss at most "
                f"{max(r.cost for r in quants):+.4f} nats, KL at most "
                f"{max(r.kl for r in quants):.4f})")
    cost = f"{quants[held].qtype} {_cost_text(quants[held])}"
    if held == 0:
        return f"holds at no type asked: {cost}"
    return f"holds up to {quants[held - 1].qtype}; {cost}"


def _kl_sum(p_logits: np.ndarray, q_logits: np.ndarray, rows: int = 32) -> float:
    """Sum over rows of KL(softmax(p) || softmax(q)), in float64, ``rows`` at a time (a
    block's float64 temporaries stay a few MiB at any vocabulary)."""
    total = 0.0
    for i in range(0, len(p_logits), rows):
        lp = _log_softmax(p_logits[i:i + rows].astype(np.float64))
        lq = _log_softmax(q_logits[i:i + rows].astype(np.float64))
        total += float((np.exp(lp) * (lp - lq)).sum())
    return total


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(reference: LanguageModel, candidates, sequences, masks=None,
            progress=None) -> tuple[float, list[tuple[float, float]], int]:
    """(the reference's loss, (loss, mean KL(reference || candidate)) per candidate, the
    counted tokens) over ``sequences`` and ``masks`` (as ``LanguageModel.loss`` takes them).

    ``candidates`` are LanguageModels, or (label, function making one): made one at a time
    and dropped after their passes, so one candidate's weights and graphs are alive at
    once. The reference's logits at the counted positions are kept between candidates
    when they fit in REFERENCE_BYTES, else its passes rerun beside each candidate's.
    ``progress(text)`` hears which candidate is being evaluated."""
    say = progress or (lambda text: None)
    per_batch = max(1, LOGITS_BYTES // (4 * reference.cfg.n_vocab))

    def passes(lm):
        return lm.target_logits(sequences, masks, tokens_per_batch=per_batch)

    fits = _counted(sequences, masks) * reference.cfg.n_vocab * 4 <= REFERENCE_BYTES
    ref_chunks = list(passes(reference)) if fits else None

    def reference_passes():
        return ref_chunks if ref_chunks is not None else passes(reference)

    sums = []   # per candidate: the reference's loss sum and count, its loss sum and KL sum
    for i, candidate in enumerate(candidates):
        label, make = candidate if isinstance(candidate, tuple) else ("", lambda: candidate)
        say(f"evaluating {label or 'candidate'} ({i + 1} of {len(candidates)}) ...")
        total = np.zeros(4)
        for ref, chunk in zip(reference_passes(), passes(make())):
            total += (ref.loss_sum, ref.count, chunk.loss_sum, _kl_sum(ref.logits, chunk.logits))
        sums.append(total)
        gc.collect()   # the candidate's sessions and weights go before the next one's come
    ref_sum, count = (sums[0][:2] if sums else
                      np.sum([(c.loss_sum, c.count) for c in reference_passes()], axis=0))
    if count == 0:
        raise DataError("the target masks select no predictable token")
    return ref_sum / count, [(t[2] / count, t[3] / count) for t in sums], int(count)


def _counted(sequences, masks) -> int:
    """The tokens ``LanguageModel.loss`` would count (before its checks)."""
    single = len(sequences) and np.isscalar(sequences[0])
    seqs = [sequences] if single else sequences
    if masks is None:
        return sum(max(len(s) - 1, 0) for s in seqs)
    masks = [masks] if single else masks
    return sum(int(np.count_nonzero(np.asarray(m, bool)[1:])) for m in masks)


def fidelity_report(model_path, adapter_dir, sequences, masks=None, *,
                    quants=("q8_0", "q6_k", "q5_k", "q4_k"), merged_types=MERGED_TYPES,
                    tolerance: float = TOLERANCE, backend: str = "cpu",
                    precision: str = "f32", template: str | None = None,
                    progress=None) -> FidelityReport:
    """The report of ``adapter_dir`` (a run or PEFT directory) trained on the GGUF at
    ``model_path``, over ``sequences`` (token id lists) with their target ``masks`` (as
    ``LanguageModel.loss`` takes them; the validation split's examples, say).
    ``progress(text)`` hears which model is being prepared."""
    quants, merged_types = list(dict.fromkeys(quants)), list(dict.fromkeys(merged_types))
    base = GGUFModel(model_path)
    say = progress or (lambda text: None)
    kwargs = dict(backend=backend, precision=precision, template=template)
    reference = LanguageModel(base, adapter_dir=adapter_dir, **kwargs)
    # each candidate's model is made (requantized, merged) when its turn comes and dropped
    # after it: the instances listed here only describe the rows (no tensor encoded)
    def make(kind, qtype):
        if kind == "requantized":
            return LanguageModel(RequantizedModel(base, qtype), adapter_dir=adapter_dir, **kwargs)
        return LanguageModel(MergedModel(base, adapter_dir, qtype), **kwargs)

    models = ([RequantizedModel(base, q) for q in quants]
              + [MergedModel(base, adapter_dir, t) for t in merged_types])
    candidates = [(m.label, lambda m=m: make(m.kind, m.qtype)) for m in models]
    ref_loss, measured, count = compare(reference, candidates, sequences, masks, progress)
    if not np.isfinite(ref_loss):   # nothing to compare against: as toygraph eval says it
        raise DataError(f"the loss of {model_path} with its adapter is {ref_loss}: the trained "
                        "pair computes values that are not finite numbers")
    ref_type = _main_type(base)
    rows = [FidelityRow(f"trained ({ref_type}) + adapter", "reference", ref_type, ref_loss)]
    for m, (loss, kl) in zip(models, measured):
        rows.append(FidelityRow(m.label, m.kind, m.qtype, loss, kl, fallbacks=len(m.fallbacks),
                                kept=len(m.kept), cost=loss - ref_loss))
    return FidelityReport(rows, count, tolerance, ref_type)


def _main_type(model: GGUFModel) -> str:
    """The block type most of the model's matrix bytes are in (its "Q4_K_M"-like name is
    not recorded reliably; this is what the file holds)."""
    sizes: dict[str, int] = {}
    for name in model.tensor_names():
        w = GGUFModel.tensor(model, name)
        if len(w.shape) >= 2:
            sizes[w.qtype] = sizes.get(w.qtype, 0) + w.raw.nbytes
    return max(sizes, key=sizes.get) if sizes else "?"


def _writable(w: WeightTensor) -> tuple[np.ndarray, int]:
    """(array, ggml type) as gguf.GGUFWriter takes a tensor: f32 and f16 as their floats
    in the numpy shape, block types as [rows, bytes per row] of uint8."""
    if w.qtype in ("f32", "f16"):
        data = w.raw.view(np.float32 if w.qtype == "f32" else np.float16).reshape(w.shape)
    else:
        data = w.raw.reshape(*w.shape[:-1], -1)
    return np.asarray(data), blocks.GGML_TYPE[w.qtype]


def write_requantized(model_path, qtype: str, out_path) -> Path:
    """Write the base requantized to ``qtype`` (RequantizedModel's tensors) as a GGUF at
    ``out_path``, every metadata key carried over: the file the report's row describes."""
    import gguf

    from toygraph.adapters.merge import _copy_metadata
    from toygraph.atomic import atomic_write

    base = GGUFModel(model_path)
    model = RequantizedModel(base, qtype)
    reader = base.reader
    if reader.endianess != gguf.GGUFEndian.LITTLE:   # the new blocks are little-endian bytes
        raise DataError(f"{model_path}: a big-endian GGUF; requantized files are written "
                        "little-endian only")

    def write(tmp):
        w = gguf.GGUFWriter(tmp, base.config.arch, endianess=reader.endianess)
        w.data_alignment = int(base.metadata("general.alignment", w.data_alignment))
        _copy_metadata(reader, w, skip=set())
        arrays = [_writable(model.tensor(t.name)) for t in reader.tensors]
        for t, (data, qt) in zip(reader.tensors, arrays):
            w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for data, _ in arrays:
            w.write_tensor_data(data)
        w.close()

    atomic_write(Path(out_path), write)
    return Path(out_path)


@dataclass
class MergeCheck:
    """A merged file against the pair it was merged from: both losses and the mean KL."""
    loss: float
    reference_loss: float
    kl: float
    tokens: int
    tolerance: float = TOLERANCE

    @property
    def holds(self) -> bool:
        return self.loss - self.reference_loss <= self.tolerance and self.kl <= self.tolerance

    def text(self) -> str:
        said = (f"merged loss {self.loss:.4f}, base + adapter {self.reference_loss:.4f} "
                f"({self.loss - self.reference_loss:+.4f} nats), KL {self.kl:.5f} nats over "
                f"{self.tokens} tokens")
        if self.holds:
            return f"{said}: the merge holds"
        return (f"{said}: warning: the merged model departs from base + adapter by more than "
                f"{self.tolerance:g} nats; check the export before serving it")


def merge_check(model_path, adapter_dir, merged_path, sequences, masks=None, *,
                template: str | None = None, tolerance: float = TOLERANCE,
                backend: str = "cpu") -> MergeCheck:
    """The merged GGUF at ``merged_path`` evaluated against ``model_path`` + the PEFT
    adapter ``adapter_dir`` on ``sequences``: what ``toygraph export`` prints."""
    reference = LanguageModel(model_path, adapter_dir=adapter_dir, template=template,
                              backend=backend)
    merged = LanguageModel(merged_path, template=template, backend=backend)
    ref_loss, [(loss, kl)], count = compare(reference, [merged], sequences, masks)
    return MergeCheck(loss, ref_loss, kl, count, tolerance)
