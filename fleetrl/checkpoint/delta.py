"""Delta checkpoints: the change from a base model, stored compactly.

RL post-training moves weights little and often leaves whole tensors (embeddings under a frozen-embedding
setup, norms) untouched, so a run's checkpoints compress well as differences from the base model:

  mode="exact"  each changed tensor stored whole (its new values). Lossless, bit for bit. We do not store the
                float difference here: `base + (new - base)` is not `new` in floating point (base=1.0, new=1e-8
                in fp32 gives new - base = -1.0 after rounding, and base + that = 0.0).
  mode="diff"   Δ = new - base per changed tensor, in the tensor's dtype (about one ulp of error), optionally
                `density < 1`: only the largest-|Δ| fraction of each tensor's entries (indices + values), and/or
                `bits=8`: Δ quantised to symmetric int8 with one fp32 scale per row (per tensor when sparse).

Unchanged tensors (bitwise equal) are never stored, in either mode. Non-floating tensors that changed are
always stored whole. Deltas chain: `apply_deltas(base, [d1, d2, ...])` applies them in step order, each
relative to the state the previous ones rebuilt (so lossy errors do not compound when each delta is made
against that rebuilt state rather than against the true previous weights).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from fleetrl.checkpoint.export import write_hf_folder
from fleetrl.models.hf import load_causal_lm, load_tokenizer

MODES = ("exact", "diff")
QUANT_BITS = (8,)
FORMAT = "fleetrl-delta/1"
_QMAX = 127  # symmetric int8: -127..127, so +x and -x quantise to opposite codes
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """One changed tensor. `kind` and its `parts`:
      "replace"  values: the new tensor
      "dense"    values: Δ (shape of the tensor), or q (int8, [R, numel/R]) + scale (fp32, [R])
      "sparse"   indices (int32/int64 into the flattened tensor, [k]) + values ([k]) or q ([1, k]) + scale ([1])
    """

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: dict[str, Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


@dataclass(frozen=True, slots=True)
class Delta:
    """The tensors that changed between two state dicts, plus where the change starts from.

    `base_model` names the base model (a load_causal_lm path) and `base_step` the step of the state this delta
    is relative to (None: the base model itself); `step` is the step it rebuilds.
    """

    mode: str
    entries: dict[str, TensorDelta]
    density: float = 1.0
    bits: int | None = None
    base_model: str | None = None
    base_step: int | None = None
    step: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payload (what a save writes, less the small header)."""
        return sum(entry.nbytes for entry in self.entries.values())

    def error_report(self, base: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, float]:
        """Reconstruction error of `apply_delta(base, self)` against `new`, per stored tensor and "overall".

        Keys `NAME/max_abs` (max |rebuilt - new|) and `NAME/rel_l2` (||rebuilt - new|| / ||new - base||: the
        fraction of the update that was lost). Tensors the delta omits were unchanged and rebuild exactly.
        """
        rebuilt = apply_delta(base, self)
        report: dict[str, float] = {}
        err_sq = update_sq = 0.0
        overall_max = 0.0
        for name in self.entries:
            err = rebuilt[name].double() - new[name].double()
            update = new[name].double() - base[name].double()
            e2, u2 = float(err.square().sum()), float(update.square().sum())
            report[f"{name}/max_abs"] = float(err.abs().max()) if err.numel() else 0.0
            report[f"{name}/rel_l2"] = _ratio(e2, u2)
            err_sq, update_sq = err_sq + e2, update_sq + u2
            overall_max = max(overall_max, report[f"{name}/max_abs"])
        report["overall/max_abs"] = overall_max
        report["overall/rel_l2"] = _ratio(err_sq, update_sq)
        return report


def make_delta(
    base: dict[str, Tensor], new: dict[str, Tensor], *, mode: str = "exact", density: float = 1.0,
    bits: int | None = None, base_model: str | None = None, base_step: int | None = None, step: int | None = None,
) -> Delta:
    """The change from `base` to `new` (same keys, shapes and dtypes), storing only tensors that differ."""
    if mode not in MODES:
        raise ValueError(f"delta mode {mode!r} is not supported; expected one of {MODES}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"delta density={density} must be in (0, 1]: the fraction of each tensor's entries kept")
    if bits is not None and bits not in QUANT_BITS:
        raise ValueError(f"delta bits={bits} is not supported; expected None (no quantisation) or one of {QUANT_BITS}")
    if mode == "exact" and (density < 1.0 or bits is not None):
        raise ValueError(f"density={density}, bits={bits} make a lossy delta, but mode='exact' stores changed "
                         "tensors whole; pass mode='diff' to sparsify or quantise")
    _check_same_layout(base, new, "new")
    entries: dict[str, TensorDelta] = {}
    for name, new_t in new.items():
        base_t = base[name]
        if _same_bits(base_t, new_t):
            continue
        if mode == "exact" or not new_t.is_floating_point():
            entries[name] = TensorDelta("replace", tuple(new_t.shape), new_t.dtype, {"values": new_t.detach().clone()})
        else:
            entries[name] = _encode_diff(base_t.detach(), new_t.detach(), density, bits)
    return Delta(mode, entries, density, bits, base_model, base_step, step)


def apply_delta(base: dict[str, Tensor], delta: Delta) -> dict[str, Tensor]:
    """`base` with `delta` applied. Tensors the delta does not touch are shared with `base`, not copied."""
    out = dict(base)
    for name, entry in delta.entries.items():
        base_t = base.get(name)
        if base_t is None or tuple(base_t.shape) != entry.shape or base_t.dtype != entry.dtype:
            found = "missing" if base_t is None else f"{tuple(base_t.shape)} {base_t.dtype}"
            raise ValueError(f"delta (step {delta.step}) does not fit this base: {name} is {found}, the delta "
                             f"expects {entry.shape} {entry.dtype}; apply it to the model it was made against "
                             f"({delta.base_model or 'not recorded'}), loaded in that dtype")
        if entry.kind == "replace":
            out[name] = entry.parts["values"].clone()
        else:
            compute = _compute_dtype(entry.dtype)
            out[name] = (base_t.to(compute) + _decode(entry, compute).reshape(entry.shape)).to(entry.dtype)
    return out


def apply_deltas(base: dict[str, Tensor], deltas: list[Delta]) -> dict[str, Tensor]:
    """Applies `deltas` in order (ascending step), each to the state the previous ones rebuilt."""
    state = base
    for i, delta in enumerate(deltas):
        prev = deltas[i - 1] if i else None
        if prev is not None and None not in (delta.base_step, prev.step) and delta.base_step != prev.step:
            raise ValueError(f"delta {i} (step {delta.step}) is relative to step {delta.base_step}, but the delta "
                             f"before it rebuilds step {prev.step}; pass the deltas in step order with none missing")
        state = apply_delta(state, delta)
    return state


def save_delta(delta: Delta, path: str | Path) -> Path:
    """One safetensors file: tensors `NAME/PART`, and the header (mode, steps, kinds, shapes, dtypes) as metadata."""
    path = Path(path)
    header = {"mode": delta.mode, "density": delta.density, "bits": delta.bits, "base_model": delta.base_model,
              "base_step": delta.base_step, "step": delta.step,
              "tensors": {name: {"kind": e.kind, "shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch.")}
                          for name, e in delta.entries.items()}}
    tensors = {f"{name}/{part}": t.contiguous() for name, e in delta.entries.items() for part, t in e.parts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a reader never sees a half-written delta
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "header": json.dumps(header)})
    os.replace(tmp, path)
    return path


def load_delta(path: str | Path) -> Delta:
    """A delta written by `save_delta`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"delta file {str(path)!r} does not exist; expected a file written by save_delta")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is a safetensors file but not a fleetrl delta (format "
                             f"{metadata.get('format')!r}, expected {FORMAT!r}); pass a file written by save_delta")
        header = json.loads(metadata["header"])
        parts: dict[str, dict[str, Tensor]] = {name: {} for name in header["tensors"]}
        for key in f.keys():
            name, _, part = key.rpartition("/")
            parts[name][part] = f.get_tensor(key)
    entries = {name: TensorDelta(info["kind"], tuple(info["shape"]), getattr(torch, info["dtype"]), parts[name])
               for name, info in header["tensors"].items()}
    return Delta(header["mode"], entries, header["density"], header["bits"], header["base_model"],
                 header["base_step"], header["step"])


def export_from_deltas(
    base_model_path: str, delta_paths: list[str | Path], out_dir: str | Path, *,
    tokenizer_path: str | None = None, dtype: str | None = None, check_base: bool = True,
) -> Path:
    """Rebuilds base + deltas (in the order given: ascending step) and writes it as a Hugging Face folder.

    The tokenizer comes from `tokenizer_path` (default: the base model's); `dtype` converts the exported weights.
    `check_base` refuses a base other than the one the first delta records (exact deltas omit unchanged
    tensors, so a wrong base of the same shapes would export silently wrong weights).
    """
    if not delta_paths:
        raise ValueError("export_from_deltas needs at least one delta file; to export the base model itself, "
                         "load it with load_causal_lm and save_pretrained")
    deltas = [load_delta(p) for p in delta_paths]
    recorded = deltas[0].base_model
    if check_base and recorded is not None and not _same_model(recorded, base_model_path):
        raise ValueError(f"{str(delta_paths[0])!r} was made against base model {recorded!r}, not "
                         f"{base_model_path!r}; pass that base, or check_base=False if it is the same model "
                         "stored elsewhere")
    model = load_causal_lm(base_model_path, dtype=_base_dtype(deltas))
    model.load_state_dict(apply_deltas(model.state_dict(), deltas), strict=True)
    tokenizer = load_tokenizer(tokenizer_path or base_model_path)
    return write_hf_folder(model, tokenizer, out_dir, dtype=dtype)


def _encode_diff(base_t: Tensor, new_t: Tensor, density: float, bits: int | None) -> TensorDelta:
    compute = _compute_dtype(new_t.dtype)
    diff = (new_t.to(compute) - base_t.to(compute)).flatten()
    shape = tuple(new_t.shape)
    if density < 1.0:
        k = max(1, math.ceil(density * diff.numel()))
        indices = diff.abs().topk(k, sorted=False).indices.sort().values
        index_dtype = torch.int32 if diff.numel() <= torch.iinfo(torch.int32).max else torch.int64
        parts = {"indices": indices.to(index_dtype)}
        values, rows = diff[indices], 1
        kind = "sparse"
    else:
        parts, values, kind = {}, diff, "dense"
        rows = shape[0] if len(shape) >= 2 else 1  # per-row scales: rows of a weight matrix differ in scale
    if bits is None:
        parts["values"] = values.to(new_t.dtype).reshape(shape if kind == "dense" else (-1,))
    else:
        parts.update(_quantise(values.reshape(rows, -1)))
    return TensorDelta(kind, shape, new_t.dtype, parts)


def _quantise(x_RC: Tensor) -> dict[str, Tensor]:
    """Symmetric int8 per row: q = round(x / scale), scale = max|x_row| / 127 (1 for an all-zero row)."""
    amax_R = x_RC.abs().amax(dim=1).float()
    scale_R = torch.where(amax_R > 0, amax_R / _QMAX, torch.ones_like(amax_R))
    q_RC = torch.round(x_RC.float() / scale_R[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
    return {"q": q_RC, "scale": scale_R}


def _decode(entry: TensorDelta, compute: torch.dtype) -> Tensor:
    """The flattened Δ of a "dense" or "sparse" entry, in `compute`."""
    p = entry.parts
    if "q" in p:
        values = (p["q"].to(compute) * p["scale"].to(compute)[:, None]).flatten()
    else:
        values = p["values"].to(compute).flatten()
    if entry.kind == "dense":
        return values
    out = torch.zeros(math.prod(entry.shape), dtype=compute)
    out[p["indices"].long()] = values
    return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp64 stays fp64; half types do their math in fp32


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality: unlike torch.equal, tells -0.0 from 0.0 and a NaN from itself, as exact mode needs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _check_same_layout(base: dict[str, Tensor], new: dict[str, Tensor], what: str) -> None:
    extra, missing = sorted(set(new) - set(base)), sorted(set(base) - set(new))
    bad = [f"{k}: base {tuple(base[k].shape)} {base[k].dtype}, {what} {tuple(new[k].shape)} {new[k].dtype}"
           for k in new if k in base and (base[k].shape != new[k].shape or base[k].dtype != new[k].dtype)]
    if extra or missing or bad:
        raise ValueError(f"cannot diff state dicts of different models: {what} adds {extra[:3]}, lacks "
                         f"{missing[:3]}, changes {bad[:3]}; load the base in the same architecture and dtype")


def _base_dtype(deltas: list[Delta]) -> str:
    """The dtype name to load the base in: that of the tensors the deltas were made against (else float32)."""
    for delta in deltas:
        for entry in delta.entries.values():
            if entry.dtype in _DTYPE_NAMES:
                return _DTYPE_NAMES[entry.dtype]
    return "float32"


def _same_model(a: str, b: str) -> bool:
    """Equal names, or two spellings of the same local folder."""
    if a == b:
        return True
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _ratio(num_sq: float, den_sq: float) -> float:
    if den_sq == 0.0:
        return 0.0 if num_sq == 0.0 else math.inf
    return math.sqrt(num_sq / den_sq)
