"""Models other programs keep: Ollama's store, the Hugging Face hub cache, LM Studio's folder.

``--model`` takes, besides a path and the catalog names (catalog.py):

- ``ollama:NAME[:TAG]``: a model Ollama pulled. Its store is ``$OLLAMA_MODELS``, else
  ``~/.ollama/models`` (else ``/usr/share/ollama/.ollama/models``, the Linux service's).
  ``NAME`` is ``name``, ``namespace/name`` or ``host/namespace/name`` (registry
  ``registry.ollama.ai``, namespace ``library`` and tag ``latest`` by default); its manifest
  is ``manifests/HOST/NAMESPACE/NAME/TAG``, a JSON list of layers, each a blob
  ``blobs/sha256-<hex>`` with a media type. The ``model`` layer is the GGUF we train.
- ``hf:ORG/REPO/FILE.gguf``: a file the hub client downloaded into its cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), at
  ``models--ORG--REPO/snapshots/REV/FILE`` with REV the one ``refs/main`` names. Nothing is
  downloaded.
- ``lmstudio:PUBLISHER/REPO/FILE.gguf``, or any part of that path that names one GGUF:
  LM Studio's models folder (``$LMSTUDIO_MODELS``, else ``~/.lmstudio/models``, else the
  older ``~/.cache/lm-studio/models``).

Ollama's other layers, and what we do with each (the decision is in docs/design.md too):
``template`` (a Go template), ``system`` and ``params`` (JSON generation parameters) are
read and kept on the :class:`Source`: training renders conversations with the GGUF's own
Jinja chat template (we never execute Go templates), and ``--to-ollama`` hands the
system message and the parameters back in the Modelfile (adapters/modelfile.py), which
says which template the adapter was trained with. An ``adapter`` layer is refused (the
model already carries a LoRA that training from its GGUF would leave out); a
``projector`` (a vision encoder) is left out with a warning, as text training never uses
it; ``license`` is not needed; ``messages`` (a canned conversation) is kept by Ollama
through ``FROM``. A layer type we do not know is a warning too: none changes the GGUF.

Blob checks: every blob's size must be the manifest's; the small layers (template,
system, params) are read whole and their sha256 checked; the GGUF's sha256 is checked
only up to ``HASH_LIMIT`` bytes (a fixture, a 135M model: well under a second) — a
multi-GB blob is trusted by its size, as Ollama checked its digest when it pulled it.
Every error is one line naming the store path and what is missing.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from toygraph import environment
from toygraph.atomic import file_sha256
from toygraph.bounded import excerpt, load_json, parse_json, path_inside, printable, read_text
from toygraph.errors import ToygraphError

MEDIA = "application/vnd.ollama.image."
#: Bounds on what a store's small files may hold: a manifest lists a few layers, a
#: template, system or params layer is text of a few KB.
MANIFEST_BYTES, LAYER_BYTES = 1 << 20, 16 << 20
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_HOST_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,254}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{1,64}")
DEFAULT_REGISTRY, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
#: Model blobs up to this size get their sha256 checked on every resolve (about 0.2 s).
HASH_LIMIT = 256 * 2**20
#: Ollama's layers we read, and the ones we pass over knowingly (with why, when it matters).
READ_LAYERS = ("model", "template", "prompt", "system", "params")
PASSED_OVER = {"license": None, "messages": None, "embed": None,
               "projector": "a vision projector, which text training does not use, is left out"}


@dataclass
class Source:
    """Where a ``--model`` string led: the GGUF ``path`` and what the store said about it."""
    path: Path
    spec: str                        # the --model string as given
    store: str = "file"              # file, catalog, ollama, hf, lmstudio
    ollama_name: str | None = None   # the name Ollama knows it by (ollama: only)
    template: str | None = None      # Ollama's Go template layer, as text
    system: str | None = None        # Ollama's system layer
    params: dict = field(default_factory=dict)   # Ollama's params layer (stop, temperature, ...)
    warnings: list[str] = field(default_factory=list)


class StoreError(ToygraphError):
    """A --model name its store cannot resolve (one line: the store path, what is missing)."""


# --- Ollama -------------------------------------------------------------------------------

def ollama_root() -> Path:
    """Ollama's store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``, else the Linux
    service's ``/usr/share/ollama/.ollama/models`` when only that one exists."""
    given = environment.get("OLLAMA_MODELS")
    if given is not None:
        return given
    home = Path("~/.ollama/models").expanduser()
    service = Path("/usr/share/ollama/.ollama/models")
    return service if not home.is_dir() and service.is_dir() else home


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """``[host/][namespace/]name[:tag]`` as (host, namespace, name, tag), with Ollama's
    defaults. The tag is after the last ``:`` of the last part (a host may have a port).
    Each part is made of Ollama's name characters and starts with a letter, digit or
    ``_`` (so ``..`` is no part, and a name never leads out of the store)."""
    parts = name.split("/")
    tag = DEFAULT_TAG
    if ":" in parts[-1]:
        parts[-1], tag = parts[-1].rsplit(":", 1)
    host_ok = len(parts) < 3 or _HOST_PART.fullmatch(parts[0])
    if len(parts) > 3 or not host_ok or not all(_NAME_PART.fullmatch(p) for p in parts[-2:]) \
            or not _NAME_PART.fullmatch(tag):
        raise StoreError(f"--model ollama:{printable(name)}: not an Ollama model name "
                         "(NAME, NAMESPACE/NAME or HOST/NAMESPACE/NAME, each optionally :TAG; "
                         "letters, digits, '_', '-' and '.', not first)")
    parts = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE][:3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag


def ollama_display_name(host: str, namespace: str, name: str, tag: str) -> str:
    """The short name ``ollama list`` shows: the defaults left out."""
    prefix = "" if host == DEFAULT_REGISTRY else f"{host}/"
    if host == DEFAULT_REGISTRY and namespace == DEFAULT_NAMESPACE:
        return f"{name}:{tag}"
    return f"{prefix}{namespace}/{name}:{tag}"


def _blob(root: Path, digest: str) -> Path:
    hexdigest = digest.split(":", 1)[-1]
    for candidate in (root / "blobs" / f"sha256-{hexdigest}", root / "blobs" / f"sha256:{hexdigest}"):
        if candidate.is_file():
            return candidate
    return root / "blobs" / f"sha256-{hexdigest}"


def _checked_blob(root: Path, layer: dict, what: str, hash_limit: int | None) -> Path:
    """The blob of ``layer``, its size checked against the manifest's, its sha256 too when it
    is at most ``hash_limit`` bytes (None: always). The digest must be sha256 in hex, and
    the blob a file inside the store's blobs/."""
    digest = layer.get("digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise StoreError(f"{what}: layer {excerpt(layer.get('mediaType'))} has no sha256 digest "
                         f"(found {excerpt(digest)})")
    path = _blob(root, digest)
    if not path.is_file():
        raise StoreError(f"{what}: blob {path} is missing (the model is not fully pulled: "
                         f"`ollama pull` it again)")
    if not path_inside(path, root / "blobs"):
        raise StoreError(f"{what}: blob {path} leads outside the store's blobs folder")
    size = path.stat().st_size
    if "size" in layer and size != layer["size"]:
        raise StoreError(f"{what}: blob {path} has {size} bytes, the manifest says {excerpt(layer['size'])} "
                         "(a partial or damaged pull: `ollama pull` it again)")
    if (hash_limit is None or size <= hash_limit) and file_sha256(path) != digest[7:]:
        raise StoreError(f"{what}: blob {path} does not have the sha256 its name says "
                         "(damaged: `ollama pull` it again)")
    return path


def resolve_ollama(name: str) -> Source:
    """The Source of ``ollama:NAME[:TAG]`` (``name`` without the prefix)."""
    root = ollama_root()
    host, namespace, model, tag = parse_ollama_name(name)
    manifest_path = root / "manifests" / host / namespace / model / tag
    what = f"ollama:{name} ({manifest_path})"
    if not manifest_path.is_file():
        have = [n for n, _ in ollama_models(root)]
        listing = f"; the store has {', '.join(have)}" if have else "; the store has no models"
        raise StoreError(f"--model ollama:{name}: no manifest {manifest_path}{listing}")
    layers = ollama_layers(manifest_path, what, root)
    kinds = [layer["mediaType"] for layer in layers]
    source = Source(path=Path(), spec=f"ollama:{name}", store="ollama",
                    ollama_name=ollama_display_name(host, namespace, model, tag))
    models = [layer for layer, kind in zip(layers, kinds) if kind == MEDIA + "model"]
    if "adapter" in [k.removeprefix(MEDIA) for k in kinds]:
        raise StoreError(f"{what}: the model has an adapter layer (a LoRA applied on top of its "
                         "GGUF); training from the GGUF would leave it out, so it is refused")
    if len(models) != 1:
        raise StoreError(f"{what}: {len(models)} model layers; toygraph reads a model stored as "
                         "one GGUF layer")
    source.path = _checked_blob(root, models[0], what, HASH_LIMIT)
    for layer, kind in zip(layers, kinds):
        short = kind.removeprefix(MEDIA)
        if short in ("template", "prompt", "system", "params"):
            blob = _checked_blob(root, layer, what, None)
            text = read_text(blob, f"{what}: the {short} layer", LAYER_BYTES, StoreError)
            if short == "params":
                params = parse_json(text, f"{what}: the params layer", error=StoreError)
                if not isinstance(params, dict):
                    raise StoreError(f"{what}: the params layer is not a JSON object")
                source.params = params
            elif short == "system":
                source.system = text
            else:
                source.template = text
        elif short in PASSED_OVER:
            if PASSED_OVER[short]:
                source.warnings.append(f"ollama:{name}: {PASSED_OVER[short]}")
        elif short != "model":
            source.warnings.append(f"ollama:{name}: layer {printable(kind)[:100]} is not one "
                                   "toygraph knows; left out (the GGUF is the model layer)")
    return source


def ollama_layers(manifest: Path, what: str, root: Path | None = None) -> list[dict]:
    """The layers of an Ollama manifest, each a dict with a text ``mediaType``: read within
    bounds (toygraph/bounded.py), the manifest a file inside the store's manifests/."""
    root = ollama_root() if root is None else root
    if not path_inside(manifest, root / "manifests"):
        raise StoreError(f"{what}: the manifest leads outside the store's manifests folder")
    doc = load_json(manifest, what, MANIFEST_BYTES, error=StoreError)
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list) or not all(
            isinstance(layer, dict) and isinstance(layer.get("mediaType"), str) for layer in layers):
        raise StoreError(f"{what}: not an Ollama manifest (no list of layers, each with a "
                         "mediaType)")
    return layers


def ollama_model_size(manifest: Path, root: Path | None = None) -> int:
    """The bytes of the model layer an Ollama manifest lists (StoreError when unreadable)."""
    layers = ollama_layers(manifest, str(manifest), root)
    sizes = [layer.get("size", 0) for layer in layers if layer["mediaType"] == MEDIA + "model"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        raise StoreError(f"{manifest}: a model layer's size is not a byte count")
    return sum(sizes)


def ollama_models(root: Path | None = None) -> list[tuple[str, Path]]:
    """(short name, manifest path) of every model in Ollama's store, sorted."""
    root = ollama_root() if root is None else root
    found = []
    base = root / "manifests"
    if base.is_dir():
        for manifest in base.glob("*/*/*/*"):
            if manifest.is_file() and not manifest.name.startswith("."):
                host, namespace, model, tag = manifest.relative_to(base).parts
                found.append((ollama_display_name(host, namespace, model, tag), manifest))
    return sorted(found)


# --- the Hugging Face hub cache ------------------------------------------------------------

def hf_root() -> Path:
    """The hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    given = environment.get("HF_HUB_CACHE")
    if given is not None:
        return given
    return environment.get("HF_HOME") / "hub"


def _hf_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` names (a commit hash), else the only one there is; a
    snapshot must lie inside the repository's folder (StoreError when it leads out)."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = read_text(ref, str(ref), 4096, StoreError).strip()
        if not _HEX.fullmatch(rev):
            raise StoreError(f"{ref}: holds {excerpt(rev)}, not a commit hash")
        snaps = [repo_dir / "snapshots" / rev]
    else:
        snaps = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()]
    if len(snaps) != 1 or not snaps[0].is_dir():
        return None
    if not path_inside(snaps[0], repo_dir):
        raise StoreError(f"{snaps[0]}: the snapshot leads outside {repo_dir}")
    return snaps[0]


def resolve_hf(spec: str) -> Source:
    """The Source of ``hf:ORG/REPO/FILE.gguf`` (``spec`` without the prefix)."""
    root = hf_root()
    parts = spec.split("/")
    if len(parts) < 3 or not all(parts) or any(p in (".", "..") for p in parts):
        raise StoreError(f"--model hf:{printable(spec)}: give hf:ORG/REPO/FILE.gguf (a file in the "
                         f"hub cache {root}; no '.' or '..' parts)")
    repo_dir = root / f"models--{parts[0]}--{parts[1]}"
    if not repo_dir.is_dir():
        have = sorted({f"{org}/{repo}" for org, repo, _, _ in hf_ggufs(root)})
        listing = f"; GGUF repos there: {', '.join(have)}" if have else "; it holds no GGUF repos"
        raise StoreError(f"--model hf:{spec}: no {repo_dir.name} in the hub cache {root}{listing}")
    snap = _hf_snapshot(repo_dir)
    if snap is None:
        raise StoreError(f"--model hf:{spec}: {repo_dir} has no snapshot that refs/main names")
    path = snap.joinpath(*parts[2:])
    if not path.is_file():
        have = sorted(str(p.relative_to(snap)) for p in snap.rglob("*.gguf"))
        listing = f"; its GGUFs: {', '.join(have)}" if have else "; it holds no GGUF"
        raise StoreError(f"--model hf:{spec}: no {'/'.join(parts[2:])} in {snap}{listing}")
    if not path_inside(path, root):   # the snapshot's links lead to the repo's blobs/
        raise StoreError(f"--model hf:{spec}: {path} leads outside the hub cache {root}")
    return Source(path=path, spec=f"hf:{spec}", store="hf")


def hf_ggufs(root: Path | None = None, skipped: list | None = None
             ) -> list[tuple[str, str, str, Path]]:
    """(org, repo, file, path) of every .gguf in the hub cache's main snapshots, sorted; a
    repository or file that leads outside the cache is left out, and (path, why) goes to
    ``skipped`` when given."""
    root = hf_root() if root is None else root
    found = []
    for repo_dir in sorted(root.glob("models--*--*")) if root.is_dir() else ():
        org, _, repo = repo_dir.name.removeprefix("models--").partition("--")
        try:
            snap = _hf_snapshot(repo_dir)
        except StoreError as e:
            if skipped is not None:
                skipped.append((repo_dir, str(e)))
            continue
        for path in sorted(snap.rglob("*.gguf")) if snap is not None else ():
            if not path.is_file():
                continue
            if not path_inside(path, root):
                if skipped is not None:
                    skipped.append((path, f"{path} leads outside the hub cache {root}"))
                continue
            found.append((org, repo, str(path.relative_to(snap)), path))
    return found


# --- LM Studio ------------------------------------------------------------------------------

def lmstudio_roots() -> list[Path]:
    """LM Studio's models folders: ``$LMSTUDIO_MODELS``, else those of these two that exist:
    ``~/.lmstudio/models`` and the older ``~/.cache/lm-studio/models``."""
    given = environment.get("LMSTUDIO_MODELS")
    if given is not None:
        return [given]
    return [p for p in (Path("~/.lmstudio/models").expanduser(),
                        Path("~/.cache/lm-studio/models").expanduser()) if p.is_dir()]


def lmstudio_ggufs() -> list[tuple[str, Path]]:
    """(PUBLISHER/REPO/FILE.gguf, path) of every GGUF in LM Studio's folders, sorted."""
    found = []
    for root in lmstudio_roots():
        for path in sorted(root.rglob("*.gguf")):
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return found


def resolve_lmstudio(spec: str) -> Source:
    """The Source of ``lmstudio:PUBLISHER/REPO/FILE.gguf`` or of a part of that path naming one
    GGUF (vision projectors, ``mmproj*.gguf``, are not matched by a part)."""
    roots = lmstudio_roots()
    where = ", ".join(str(r) for r in roots) or "~/.lmstudio/models (absent)"
    ggufs = lmstudio_ggufs()
    exact = [p for rel, p in ggufs if rel == spec]
    hits = exact or [p for rel, p in ggufs if spec.lower() in rel.lower()
                     and not Path(rel).name.lower().startswith("mmproj")]
    if len(hits) == 1:
        return Source(path=hits[0], spec=f"lmstudio:{spec}", store="lmstudio")
    names = [rel for rel, p in ggufs if p in hits] if hits else [rel for rel, _ in ggufs]
    if hits:
        raise StoreError(f"--model lmstudio:{spec}: {len(hits)} GGUFs in {where} match: "
                         f"{', '.join(names)}")
    listing = f"; there: {', '.join(names)}" if names else "; it holds no GGUF"
    raise StoreError(f"--model lmstudio:{spec}: no GGUF in {where} matches{listing}")


#: The --model prefixes of the stores, and their resolvers.
STORES = {"ollama": resolve_ollama, "hf": resolve_hf, "lmstudio": resolve_lmstudio}


def store_of(spec: str) -> str | None:
    """The store a --model string names (``ollama``, ``hf``, ``lmstudio``), or None; a path
    that exists is a path even if it looks like one of these."""
    prefix, colon, rest = str(spec).partition(":")
    if colon and prefix in STORES and rest and not os.path.exists(spec):
        return prefix
    return None


def resolve_store(spec: str) -> Source:
    """The Source of a --model string in one of the stores (see :func:`store_of`)."""
    store = store_of(spec)
    assert store is not None, spec
    return STORES[store](str(spec).split(":", 1)[1])
