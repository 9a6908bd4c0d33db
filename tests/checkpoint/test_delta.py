import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from fleetrl.checkpoint.delta import (
    apply_delta,
    apply_deltas,
    export_from_deltas,
    load_delta,
    make_delta,
    save_delta,
)
from fleetrl.models.hf import load_causal_lm, load_tokenizer

Q = "model.layers.0.self_attn.q_proj.weight"  # [64, 64]
NORM = "model.norm.weight"  # [64]


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_causal_lm("tiny:").state_dict().items()}


def _step(state: dict[str, torch.Tensor], names: list[str], seed: int, scale: float = 0.01) -> dict:
    """`state` with the tensors `names` nudged by seeded noise (everything else shared)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) if k in names else v for k, v in state.items()}


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _full_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _expected_errors(base, new, rebuilt_name, rebuilt):
    err = (rebuilt.double() - new[rebuilt_name].double())
    update = new[rebuilt_name].double() - base[rebuilt_name].double()
    return float(err.abs().max()), float(err.norm() / update.norm())


def test_only_changed_tensors_are_stored(base):
    new = _step(base, [Q, NORM], seed=1)
    delta = make_delta(base, new)
    assert set(delta.entries) == {Q, NORM}
    assert delta.nbytes == (64 * 64 + 64) * 4
    assert delta.nbytes < _full_nbytes(new)


def test_exact_mode_rebuilds_bit_for_bit(base):
    new = _step(base, [Q, NORM, "lm_head.weight"], seed=2, scale=1e-7)  # changes far below one ulp of many weights
    new[NORM] = torch.nextafter(base[NORM], torch.full_like(base[NORM], math.inf))  # one ulp up
    assert _bitwise_equal(apply_delta(base, make_delta(base, new)), new)
    # Why exact mode stores new values, not new - base: the float difference does not invert.
    b, n = torch.tensor([1.0]), torch.tensor([1e-8])
    assert not torch.equal(b + (n - b), n)


def test_exact_mode_tells_negative_zero_from_zero():
    base = {"w": torch.zeros(3)}
    new = {"w": torch.tensor([0.0, -0.0, 0.0])}
    delta = make_delta(base, new)
    assert set(delta.entries) == {"w"}
    assert torch.equal(apply_delta(base, delta)["w"].view(torch.int32), new["w"].view(torch.int32))


def test_diff_mode_stores_the_difference_within_an_ulp(base):
    new = _step(base, [Q], seed=3)
    delta = make_delta(base, new, mode="diff")
    assert delta.entries[Q].kind == "dense"
    torch.testing.assert_close(apply_delta(base, delta)[Q], new[Q], atol=1e-7, rtol=0)


def test_sparse_delta_keeps_the_largest_tenth_and_reports_its_error(base):
    new = _step(base, [Q, NORM], seed=4)
    delta = make_delta(base, new, mode="diff", density=0.1)
    assert delta.entries[Q].parts["indices"].numel() == math.ceil(0.1 * 64 * 64)
    assert delta.nbytes < make_delta(base, new).nbytes
    # Recompute: zero all but the 410 largest |Δ| of q_proj.
    diff = (new[Q] - base[Q]).flatten()
    keep = diff.abs().topk(410).indices
    sparse = torch.zeros_like(diff)
    sparse[keep] = diff[keep]
    max_abs, rel_l2 = _expected_errors(base, new, Q, base[Q] + sparse.reshape(64, 64))
    report = delta.error_report(base, new)
    assert report[f"{Q}/max_abs"] > 0 and report["overall/rel_l2"] > 0
    assert report[f"{Q}/max_abs"] == pytest.approx(max_abs, rel=1e-5)
    assert report[f"{Q}/rel_l2"] == pytest.approx(rel_l2, rel=1e-5)
    assert 0.5 < rel_l2 < 1  # Gaussian noise: the top 10% of entries hold under half the energy


def test_int8_quantises_per_row_and_reports_its_error(base):
    new = _step(base, [Q, NORM], seed=5)
    delta = make_delta(base, new, mode="diff", bits=8)
    q_entry = delta.entries[Q]
    assert q_entry.parts["q"].dtype == torch.int8 and q_entry.parts["scale"].shape == (64,)
    assert delta.nbytes < make_delta(base, new).nbytes / 3
    # Recompute: per-row scale = max|Δ_row| / 127, Δ ≈ round(Δ / scale) * scale.
    diff = new[Q] - base[Q]
    scale = diff.abs().amax(dim=1, keepdim=True) / 127
    max_abs, rel_l2 = _expected_errors(base, new, Q, base[Q] + torch.round(diff / scale) * scale)
    report = delta.error_report(base, new)
    assert report[f"{Q}/max_abs"] > 0
    assert report[f"{Q}/max_abs"] == pytest.approx(max_abs, rel=1e-4)
    assert report[f"{Q}/rel_l2"] == pytest.approx(rel_l2, rel=1e-4)
    assert report[f"{Q}/max_abs"] <= float(scale.max()) / 2 * 1.001  # rounding is at most half a step


def test_int8_by_hand():
    base = {"w": torch.zeros(1, 3)}
    new = {"w": torch.tensor([[0.5, -1.27, 0.0]])}
    entry = make_delta(base, new, mode="diff", bits=8).entries["w"]
    assert entry.parts["q"].tolist() == [[50, -127, 0]]  # scale = 1.27 / 127 = 0.01
    assert entry.parts["scale"].item() == pytest.approx(0.01)


def test_chained_deltas_rebuild_the_last_step(base):
    s1 = _step(base, [Q, NORM], seed=6)
    s2 = _step(s1, [Q, "lm_head.weight"], seed=7)
    d1 = make_delta(base, s1, base_model="tiny:", step=1)
    d2 = make_delta(s1, s2, base_model="tiny:", base_step=1, step=2)
    assert _bitwise_equal(apply_deltas(base, [d1, d2]), s2)
    d3 = make_delta(s2, _step(s2, [NORM], seed=12), base_step=2, step=3)
    with pytest.raises(ValueError, match=r"delta 1 \(step 3\) is relative to step 2.*rebuilds step 1.*none missing"):
        apply_deltas(base, [d1, d3])


@pytest.mark.parametrize("kwargs", [{}, {"mode": "diff", "density": 0.1}, {"mode": "diff", "bits": 8},
                                    {"mode": "diff", "density": 0.2, "bits": 8}])
def test_save_load_round_trip(base, tmp_path, kwargs):
    new = _step(base, [Q, NORM], seed=8)
    delta = make_delta(base, new, base_model="tiny:", base_step=4, step=5, **kwargs)
    loaded = load_delta(save_delta(delta, tmp_path / "d" / "step_5.safetensors"))
    assert (loaded.mode, loaded.density, loaded.bits, loaded.base_model, loaded.base_step, loaded.step) == (
        delta.mode, delta.density, delta.bits, "tiny:", 4, 5)
    assert loaded.nbytes == delta.nbytes and loaded.entries.keys() == delta.entries.keys()
    for name, entry in delta.entries.items():
        got = loaded.entries[name]
        assert (got.kind, got.shape, got.dtype) == (entry.kind, entry.shape, entry.dtype)
        assert all(torch.equal(got.parts[p], t) for p, t in entry.parts.items())
    assert _bitwise_equal(apply_delta(base, loaded), apply_delta(base, delta))


def test_export_from_deltas_gives_the_final_models_logits(base, tmp_path):
    s1 = _step(base, [Q, NORM], seed=9)
    s2 = _step(s1, [Q, "lm_head.weight"], seed=10)
    paths = [save_delta(make_delta(base, s1, base_model="tiny:", step=1), tmp_path / "step_1.safetensors"),
             save_delta(make_delta(s1, s2, base_model="tiny:", base_step=1, step=2), tmp_path / "step_2.safetensors")]
    out = export_from_deltas("tiny:", paths, tmp_path / "hf")
    final = load_causal_lm("tiny:")
    final.load_state_dict(s2)
    ids = load_tokenizer("tiny:")("user : add 1 2 assistant :", return_tensors="pt").input_ids
    with torch.no_grad():
        want = final(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"made against base model 'tiny:', not 'tiny:seed=1'.*check_base=False"):
        export_from_deltas("tiny:seed=1", paths, tmp_path / "hf2")


def test_bad_arguments_say_what_to_change(base, tmp_path):
    with pytest.raises(ValueError, match=r"pass mode='diff'"):
        make_delta(base, base, density=0.5)
    with pytest.raises(ValueError, match=r"density=0 must be in \(0, 1\]"):
        make_delta(base, base, mode="diff", density=0)
    with pytest.raises(ValueError, match=r"lacks \['lm_head.weight'\]"):
        make_delta(base, {k: v for k, v in base.items() if k != "lm_head.weight"})
    small = load_causal_lm("tiny:hidden=32,heads=2").state_dict()
    with pytest.raises(ValueError, match=r"does not fit this base.*lm_head.weight"):
        apply_delta(small, make_delta(base, _step(base, ["lm_head.weight"], seed=11)))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"not a fleetrl delta"):
        load_delta(tmp_path / "plain.safetensors")
